"""``policies.memory_budget``: keep what fits a byte budget, recompute the rest at the least cost.

NOTE [memory budget]: a remat'd function keeps, between its forward and its
backward pass, the outputs of the ops its policy saves that are *needed*: saved by
autograd, or read by an op that runs again in the recompute. Every other needed
value is recomputed, and recomputing an op makes what it reads needed in turn
(dropping ``gelu(x @ w)`` and ``x @ w`` costs the matmul; dropping only the gelu
costs a gelu and keeps ``x @ w``). So the choice is not a knapsack over values:
it is a cut of the op graph. The model, over the op graph of one call:

* a *value* is a storage an op of the call allocated (views share it), of
  ``size`` bytes; ``saved`` are those autograd keeps for the backward pass;
* an op costs ``max(FLOPs, elements it writes)``: torch's FLOP formulas
  (``torch.utils.flop_counter``) for matmuls, convolutions and attention, and one
  per output element for the rest, which no formula counts but which is not free;
* keeping op ``i`` costs the bytes of its needed outputs; recomputing it costs
  its ``cost`` and makes its inputs needed. Random ops and in-place writes always
  run again (remat never replays them), so they cannot be kept.

Minimising ``recompute + lam * kept bytes`` for a fixed ``lam`` is a minimum cut
(``_min_cut``: a node "op i runs again" per op and "value k is needed" per
value; ``S -> op`` costs the op, ``op -> value`` costs ``lam * size``, and an
infinite edge says that a recomputed op needs its inputs and that saved values are
needed), solved exactly by max-flow. :func:`solve` searches ``lam`` for the
cheapest cut within the budget, then keeps more ops greedily while they fit.
With few ops that matter (at most ``EXHAUSTIVE`` ops the recompute could run) it
tries every subset instead, which is exact; ``tests/test_budget.py`` checks both
against brute force.
The policy that measures a call, solves it and follows the plan is in ``_budgets/budget_policy.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

__all__ = ["Graph", "Solution", "evaluate", "solve", "full_bytes", "needed", "EXHAUSTIVE"]

EXHAUSTIVE = 12  # up to this many ops that the recompute could run, try every subset


# ---- the model ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Graph:
    """The op graph of one call: ops (cost, whether they can be kept, values they read and allocate) and values
    (size, the op that allocated them, whether autograd saved them)."""

    cost: list[float]
    keepable: list[bool]
    reads: list[list[int]]  # per op: the values it reads (made in the call)
    outs: list[list[int]]  # per op: the values it allocates
    size: list[int]  # per value: bytes
    producer: list[int]  # per value: its op
    saved: list[int]  # values autograd keeps for the backward pass

    def relevant(self) -> list[int]:
        """The ops the recompute could run: those a save-nothing recompute runs."""
        return sorted(_closure(self, frozenset())[2])


@dataclasses.dataclass(frozen=True)
class Solution:
    keep: frozenset[int]  # ops whose outputs are kept (when needed)
    bytes: int  # kept between the forward and the backward pass
    cost: float  # of the recompute


def _closure(g: Graph, keep: frozenset[int]) -> tuple[int, float, set[int], set[int]]:
    """Walk back from the saved values: (bytes kept, recompute cost, ops run again, values needed)."""
    seen: set[int] = set()
    ran: set[int] = set()
    kept = 0
    cost = 0.0
    stack = list(g.saved)
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        p = g.producer[v]
        if p in keep and g.keepable[p]:
            kept += g.size[v]
        elif p not in ran:
            ran.add(p)
            cost += g.cost[p]
            stack.extend(g.reads[p])
    return kept, cost, ran, seen


def evaluate(g: Graph, keep: frozenset[int]) -> Solution:
    """Bytes kept and recompute cost when the ops in ``keep`` are kept (NOTE [memory budget])."""
    kept, cost, _, _ = _closure(g, keep)
    return Solution(frozenset(keep), kept, cost)


def full_bytes(g: Graph) -> int:
    """What plain autograd keeps of the values made in the call."""
    return sum(g.size[v] for v in set(g.saved))


def solve(g: Graph, budget: int, exhaustive: int = EXHAUSTIVE) -> Solution:
    """The least-recompute choice of ops to keep within ``budget`` bytes (NOTE [memory budget]).

    Example:
        >>> from remat._budgets.budget import Graph, solve
        >>> # x -> a (matmul, 100 FLOPs, 8 bytes) -> b (tanh, 2, 8 bytes); autograd saves a and b
        >>> g = Graph(cost=[100.0, 2.0], keepable=[True, True], reads=[[], [0]], outs=[[0], [1]],
        ...           size=[8, 8], producer=[0, 1], saved=[0, 1])
        >>> sorted(solve(g, budget=8).keep)  # keep the matmul's output, recompute the tanh
        [0]
    """
    ops = g.relevant()
    keepable = [i for i in ops if g.keepable[i]]
    if len(keepable) <= exhaustive:
        best = evaluate(g, frozenset())
        for r in range(1, len(keepable) + 1):
            for keep in itertools.combinations(keepable, r):
                s = evaluate(g, frozenset(keep))
                if s.bytes <= budget and (s.cost, s.bytes) < (best.cost, best.bytes):
                    best = s
        return best
    everything = evaluate(g, frozenset(keepable))
    if everything.bytes <= budget:
        return everything
    fits, over = _lagrangian(g, ops, budget)
    best = _fill(g, fits, keepable, budget)
    if over is not None:
        trimmed = _trim(g, over, budget)
        if trimmed.bytes <= budget:
            trimmed = _fill(g, trimmed, keepable, budget)
            if (trimmed.cost, trimmed.bytes) < (best.cost, best.bytes):
                best = trimmed
    return best


def _lagrangian(g: Graph, ops: list[int], budget: int) -> tuple[Solution, Solution | None]:
    """Minimum cuts around the budget, over the price ``lam`` of a byte: the cheapest that fits, and the one
    just over the budget (None when every cut fits)."""
    sizes = [s for s in g.size if s > 0]
    total = sum(g.cost[i] for i in ops) + 1.0
    hi = total / (min(sizes) if sizes else 1) * 2  # every byte costs more than the whole recompute
    best = evaluate(g, frozenset())  # keeps nothing: within any budget
    over: Solution | None = None
    s = evaluate(g, _min_cut(g, ops, hi))
    if s.bytes <= budget and s.cost < best.cost:
        best = s
    lo = hi / 2.0 ** 60
    for _ in range(48):  # bisect log(lam): the smallest price whose cut fits
        mid = math.sqrt(lo * hi)
        s = evaluate(g, _min_cut(g, ops, mid))
        if s.bytes <= budget:
            hi = mid
            if (s.cost, s.bytes) < (best.cost, best.bytes):
                best = s
        else:
            lo, over = mid, s
        if hi / lo < 1.0 + 1e-9:
            break
    return best, over


def _trim(g: Graph, sol: Solution, budget: int) -> Solution:
    """Keep less until it fits: kept ops by recompute added per byte freed, least first."""
    needed_ = needed(g, sol.keep)

    def price(i: int) -> float:
        return g.cost[i] / max(1, sum(g.size[v] for v in g.outs[i] if v in needed_))

    for i in sorted(sol.keep, key=price):
        if sol.bytes <= budget:
            break
        s = evaluate(g, sol.keep - {i})
        if s.bytes < sol.bytes:
            sol = s
    return sol


def _fill(g: Graph, sol: Solution, keepable: list[int], budget: int) -> Solution:
    """Keep more ops while they fit: recomputed ops by recompute saved per byte kept, in passes until none helps."""
    for _ in range(4):
        improved = False
        _, _, ran, _ = _closure(g, sol.keep)
        needed_ = needed(g, sol.keep)

        gain = {i: g.cost[i] / max(1, sum(g.size[v] for v in g.outs[i] if v in needed_))
                for i in ran if g.keepable[i] and i not in sol.keep}
        for i in sorted(gain, key=gain.__getitem__, reverse=True):
            s = evaluate(g, sol.keep | {i})
            if s.bytes <= budget and (s.cost, s.bytes) < (sol.cost, sol.bytes):
                sol, improved = s, True
        if not improved:
            return sol
    return sol


def _min_cut(g: Graph, ops: list[int], lam: float) -> frozenset[int]:
    """The ops to keep minimising ``recompute + lam * kept bytes``: a minimum S-T cut (NOTE [memory budget])."""
    node = {i: k for k, i in enumerate(ops)}  # "op i runs again": on the T side
    values = sorted({v for i in ops for v in (*g.outs[i], *g.reads[i])} | set(g.saved))
    vnode = {v: len(ops) + k for k, v in enumerate(values)}  # "value v is needed": on the T side
    S, T = len(ops) + len(values), len(ops) + len(values) + 1
    inf = sum(g.cost[i] for i in ops) + lam * sum(g.size[v] for v in values) + 1.0
    flow = _MaxFlow(T + 1)
    for i in ops:
        flow.edge(S, node[i], g.cost[i])
        for v in g.outs[i]:
            if v in vnode:
                flow.edge(node[i], vnode[v], lam * g.size[v] if g.keepable[i] else inf)
        for v in g.reads[i]:
            flow.edge(vnode[v], node[i], inf)  # recomputed: what it reads is needed
    for v in values:
        p = g.producer[v]
        if p not in node:  # made by an op no recompute runs: needed only when saved, then kept
            continue
        if v in set(g.saved):
            flow.edge(vnode[v], T, inf)
    source_side = flow.run(S, T)
    return frozenset(i for i in ops if g.keepable[i] and node[i] in source_side)


class _MaxFlow:
    """Dinic's max-flow on a small graph; ``run`` returns the nodes on the source side of a minimum cut."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.adj: list[list[int]] = [[] for _ in range(n)]
        self.to: list[int] = []
        self.cap: list[float] = []

    def edge(self, u: int, v: int, c: float) -> None:
        self.adj[u].append(len(self.to))
        self.to.append(v)
        self.cap.append(c)
        self.adj[v].append(len(self.to))
        self.to.append(u)
        self.cap.append(0.0)

    def _levels(self, s: int) -> list[int]:
        level = [-1] * self.n
        level[s] = 0
        queue = [s]
        for u in queue:
            for e in self.adj[u]:
                if self.cap[e] > 1e-12 and level[self.to[e]] < 0:
                    level[self.to[e]] = level[u] + 1
                    queue.append(self.to[e])
        return level

    def run(self, s: int, t: int) -> set[int]:
        while True:
            level = self._levels(s)
            if level[t] < 0:
                return {u for u in range(self.n) if level[u] >= 0}
            it = [0] * self.n
            while self._push(s, t, math.inf, level, it) > 0:
                pass

    def _push(self, u: int, t: int, f: float, level: list[int], it: list[int]) -> float:
        if u == t:
            return f
        while it[u] < len(self.adj[u]):
            e = self.adj[u][it[u]]
            v = self.to[e]
            if self.cap[e] > 1e-12 and level[v] == level[u] + 1:
                got = self._push(v, t, min(f, self.cap[e]), level, it)
                if got > 0:
                    self.cap[e] -= got
                    self.cap[e ^ 1] += got
                    return got
            it[u] += 1
        return 0.0


def needed(g: Graph, keep: frozenset[int]) -> set[int]:
    """The values the backward pass needs when the ops in ``keep`` are kept: saved, or read by a recomputed op."""
    return _closure(g, keep)[3]
