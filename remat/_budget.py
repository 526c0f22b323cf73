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

The graph is measured by the engine, not traced apart: the first call of a
remat'd function with given input shapes (its signature, as the fast path's)
runs with nothing saved, which fits any budget, while the recorder records every
op (its inputs, outputs, shapes) and the engine's observer interface
(``_context.INSPECTOR``) reports what autograd saved. The solved plan, the
decision for each op by its position in the call, is used from the second call
on; the second call records the fast path's plan, so later calls cost what a
fixed policy costs. A call whose ops differ from the plan's (a data-dependent
branch), or whose kept ops read other shapes (a size set by a Python value the
signature does not see), saves nothing from the first difference on: it stays
within the budget. When an op's output size depends on values (``nonzero``, a
boolean mask; torch's ``dynamic_output_shape`` tag) the fast path, which holds
what the recorded call held whatever its size, is not used: every call runs the
full engine, where ``_Planned`` checks the shapes.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
import time
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch.utils.flop_counter import flop_registry

from . import _torch_internals as ti
from ._context import INSPECTOR, internal
from ._errors import RematError
from ._naming import checkpoint_name
from ._policies import Saveable

__all__ = ["MemoryBudget", "BudgetPlan", "Graph", "memory_budget", "evaluate", "solve", "EXHAUSTIVE"]

EXHAUSTIVE = 12  # up to this many ops that the recompute could run, try every subset
MAX_SIGNATURES = 32


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
        >>> from remat._budget import Graph, solve
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
    needed = _needed(g, sol.keep)

    def price(i: int) -> float:
        return g.cost[i] / max(1, sum(g.size[v] for v in g.outs[i] if v in needed))

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
        needed = _needed(g, sol.keep)

        gain = {i: g.cost[i] / max(1, sum(g.size[v] for v in g.outs[i] if v in needed))
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


# ---- measuring a call --------------------------------------------------------------------------------------------


class _Measure:
    """The policy of a signature's first call: saves nothing, and notes each op and its arguments' shapes."""

    __name__ = "memory_budget(measuring)"

    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any]] = []
        self.shapes: list[tuple[Any, ...]] = []  # of each op's tensor arguments: a planned call checks them

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        if op is checkpoint_name:
            self.calls.append((op, None))
        else:
            self.calls.append((op, optree.tree_map(_shape, (args, kwargs), none_is_leaf=True)))  # type: ignore[arg-type]
        self.shapes.append(_arg_shapes(args))
        return False


def _shape(x: Any) -> Any:
    return x.shape if isinstance(x, torch.Tensor) else x


def _arg_shapes(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.shape for a in args if isinstance(a, torch.Tensor))


class _Saved:
    """An observer of the engine (``INSPECTOR``): which storages autograd saved, and when."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous
        self.frame: Any = None
        self.saved: list[tuple[int, int, int]] = []  # (storage key, ops recorded so far, bytes)

    def on_save(self, t: torch.Tensor, decision: str, frame: Any) -> None:
        if frame is self.frame:
            with internal():
                s = ti.storage_of(ti.unwrap_all(t))
                if s is not None:
                    self.saved.append((int(s.data_ptr()), len(frame.recorder.ops), int(s.nbytes())))
        if self.previous is not None:
            self.previous.on_save(t, decision, frame)


def _graph(ops: Sequence[Any], calls: list[tuple[Any, Any]], saved: list[tuple[int, int, int]]) -> Graph:
    """The model (NOTE [memory budget]) of a recorded call: ``ops`` the recorder's records."""
    g = Graph([], [], [], [], [], [], [])
    current: dict[int, int] = {}  # storage key -> the value living there now
    pending = sorted(saved, key=lambda s: s[1])
    j = 0
    for i, rec in enumerate(ops):
        while j < len(pending) and pending[j][1] <= i:
            _save(g, current, pending[j])
            j += 1
        reads = [current[k] for k in rec.in_keys if k in current]
        fresh = [(k, m) for k, m in zip(rec.out_keys, rec.out_meta) if k and m is not None and k not in rec.in_keys]
        mutable = hasattr(rec.func, "_schema") and rec.func._schema.is_mutable
        g.cost.append(0.0 if rec.random else float(_cost(rec, calls[i][1])))
        g.keepable.append(bool(rec.skippable))
        g.reads.append(sorted(set(reads)))
        g.outs.append([])
        if mutable:
            # a write changes the value it writes: making that value now also takes this op and what it reads
            for k in set(rec.in_keys) & set(rec.out_keys):
                v = current.get(k)
                if v is not None:
                    p = g.producer[v]
                    g.reads[p] = sorted(set(g.reads[p]) | (set(reads) - {v}))
                    g.cost[p] += g.cost[i]
                    g.keepable[p] = False
            continue
        for k, m in fresh:
            v = len(g.size)
            g.size.append(_bytes(m))
            g.producer.append(i)
            g.outs[i].append(v)
            current[k] = v
    for s in pending[j:]:
        _save(g, current, s)
    return g


def _save(g: Graph, current: dict[int, int], entry: tuple[int, int, int]) -> None:
    v = current.get(entry[0])
    if v is not None:  # else an input, a parameter: held anyway
        g.size[v] = max(g.size[v], entry[2])
        g.saved.append(v)


def _bytes(meta: tuple[Any, ...]) -> int:
    if len(meta) > 4:  # a wrapper subclass: the bytes of its inner tensors on this process (a DTensor's shard)
        return sum(_bytes(m) for _, m in meta[5] if type(m) is tuple)
    shape, dtype, _, stride = meta[:4]
    if any(d == 0 for d in shape):
        return 0
    return (1 + sum((d - 1) * abs(st) for d, st in zip(shape, stride))) * dtype.itemsize


def _cost(rec: Any, shapes: Any) -> int:
    """An op's cost: its FLOPs by torch's formula, at least one per element it writes."""
    return max(_flops(rec, shapes), sum(math.prod(m[0]) for m in rec.out_meta if m is not None))


def _flops(rec: Any, shapes: Any) -> int:
    """An op's FLOPs by torch's formulas (``torch.utils.flop_counter``); 0 for ops without one."""
    formula = flop_registry.get(getattr(rec.func, "_overloadpacket", None))
    if formula is None or shapes is None:
        return 0
    args, kwargs = shapes
    outs = [torch.Size(m[0]) if m is not None else None for m in rec.out_meta]
    try:
        return int(formula(*args, **kwargs, out_val=outs[0] if len(outs) == 1 else tuple(outs)))
    except Exception:  # a formula that wants more than the shapes: count the elements
        return 0


# ---- the policy --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BudgetPlan:
    """What ``memory_budget`` chose for one input signature (bytes and FLOPs as its model predicts them).

    ``full_bytes`` is what plain autograd keeps of the values the call makes,
    ``budget_bytes`` the budget in bytes, ``kept_bytes`` what the plan keeps,
    ``recompute_flops`` the FLOPs the recompute runs by torch's formulas (matrix
    products, convolutions, attention) and ``recompute_cost`` the model's cost,
    which also counts one per element of every other op. ``kept`` names the ops
    whose outputs are kept, in call order; ``solve_seconds`` is how long building
    the model and solving it took.

    Example:
        >>> import torch
        >>> from remat import remat, policies
        >>> budget = policies.memory_budget(1.0)  # keep everything autograd would
        >>> w = torch.randn(32, 32, requires_grad=True)
        >>> remat(lambda w: torch.tanh(w @ w).sum(), policy=budget)(w).backward()
        >>> plan = next(iter(budget.plans.values()))
        >>> plan.kept_bytes == plan.full_bytes == 32 * 32 * 4, plan.recompute_flops
        (True, 0)
    """

    decisions: tuple[tuple[Any, bool, tuple[Any, ...]], ...] = dataclasses.field(repr=False)
    full_bytes: int
    budget_bytes: int
    kept_bytes: int
    recompute_flops: int
    recompute_cost: float
    kept: tuple[str, ...]
    solve_seconds: float = 0.0
    dynamic: bool = False  # an op's output size depends on values (nonzero, a boolean mask): no fast path


class _Planned:
    """The policy of a planned call: the plan's decision for each op by its position, saving nothing from the
    first op that is not the plan's or reads other shapes (a data-dependent branch or size, a Python setting the
    signature does not see): less is kept, never more."""

    __slots__ = ("decisions", "n", "diverged")
    __name__ = "memory_budget(planned)"

    def __init__(self, decisions: tuple[tuple[Any, bool, tuple[Any, ...]], ...]) -> None:
        self.decisions = decisions
        self.n = 0
        self.diverged = False

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> Any:
        i = self.n
        self.n = i + 1
        if self.diverged or i >= len(self.decisions):
            self.diverged = True
            return False
        planned, keep, shapes = self.decisions[i]
        if planned is not op or (keep and shapes != _arg_shapes(args)):
            self.diverged = True
            return False
        return Saveable if keep else False


class MemoryBudget:
    """What :func:`memory_budget` returns: a policy solved per input signature (NOTE [memory budget]).

    ``plans`` maps each signature seen to its :class:`BudgetPlan` (None when the
    measuring call could not be told op from op: that signature saves nothing);
    ``solves`` counts how many times the solver ran.

    Example:
        >>> import torch
        >>> from remat import remat, policies
        >>> budget = policies.memory_budget(0)  # keep nothing: the same as nothing_saveable
        >>> f = remat(lambda x: x.sin().exp().sum(), policy=budget)
        >>> x = torch.randn(16, requires_grad=True)
        >>> f(x).backward(); f(x).backward()
        >>> budget.solves, next(iter(budget.plans.values())).kept_bytes
        (1, 0)
    """

    def __init__(self, budget: int | float) -> None:
        self.budget = budget
        self.plans: dict[Any, BudgetPlan | None] = {}
        self.solves = 0
        self.__name__ = f"memory_budget({budget!r})"

    def __repr__(self) -> str:
        return self.__name__

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> Any:
        raise RematError(
            f"remat: {self!r} decides per call of a remat'd function, by the position of each op in the call; "
            "it cannot answer for a lone op. Pass it as remat(f, policy=policies.memory_budget(...)) or "
            "remat_module(block, policy=...). Under torch.compile, use torch's own budget instead: "
            "its activation_memory_budget (in the functorch config, docs/budgets.md)."
        )

    def bind(self, key: Any) -> tuple[Callable[..., Any], _Saved | None, bool]:
        """The policy for one call of signature ``key``, the observer to install when the call measures, and
        whether the call may follow the fast path's plan (not when sizes depend on values: the fast path holds
        what the recorded call held, whatever its size; ``_Planned`` checks the shapes)."""
        plan = self.plans.get(key, _UNSEEN)
        if plan is _UNSEEN:
            return _Measure(), _Saved(INSPECTOR.get()), False
        if plan is None:
            return _nothing, None, True
        return _Planned(plan.decisions), None, not plan.dynamic  # type: ignore[union-attr]

    def learn(self, key: Any, policy: Any, saved: _Saved, ops: Sequence[Any]) -> None:
        """Solve for signature ``key`` from the measuring call's records."""
        if len(self.plans) >= MAX_SIGNATURES:
            self.plans.pop(next(iter(self.plans)))
        if len(policy.calls) != len(ops) or any(c[0] is not r.func and c[0] is not checkpoint_name
                                                 for c, r in zip(policy.calls, ops)):
            self.plans[key] = None  # cannot tell op from op: save nothing, which fits any budget
            return
        self.solves += 1
        t0 = time.perf_counter()
        g = _graph(ops, policy.calls, saved.saved)
        full = full_bytes(g)
        b = self.budget
        limit = int(b * full) if isinstance(b, float) else int(b)
        sol = solve(g, limit)
        _, _, ran, _ = _closure(g, sol.keep)
        flops = sum(_flops(ops[i], policy.calls[i][1]) for i in ran if not ops[i].random)
        decisions = tuple((c[0], i in sol.keep and g.keepable[i], policy.shapes[i]) for i, c in enumerate(policy.calls))
        needed = _needed(g, sol.keep)
        kept = tuple(str(ops[i].func) for i in sorted(sol.keep) if any(v in needed for v in g.outs[i]))
        dynamic = any(torch.Tag.dynamic_output_shape in getattr(r.func, "tags", ()) for r in ops)
        self.plans[key] = BudgetPlan(decisions, full, limit, sol.bytes, flops, sol.cost, kept,
                                     time.perf_counter() - t0, dynamic)


_UNSEEN: Any = object()


def _needed(g: Graph, keep: frozenset[int]) -> set[int]:
    return _closure(g, keep)[3]


def _nothing(op: Any, *args: Any, **kwargs: Any) -> bool:
    return False


def memory_budget(budget: int | float) -> MemoryBudget:
    """A policy that keeps what fits ``budget`` and recomputes the rest, choosing the least recompute.

    ``budget`` is in bytes (an ``int``) or a fraction of what the function would
    keep without remat (a ``float`` in ``[0, 1]``, as ``torch.compile``'s
    ``activation_memory_budget``): 0 keeps nothing (``nothing_saveable``), 1 keeps
    everything autograd would. The budget counts the values the call makes and
    keeps between the forward and the backward pass, per call; inputs and
    parameters are held anyway and are not counted.

    The first call of a remat'd function with given input shapes, dtypes and
    devices saves nothing (which fits any budget) while it records the call's ops,
    their sizes and FLOPs; the solver then picks which op outputs to keep so that
    the recompute, counted in FLOPs (torch's formulas, and one per element for
    ops without one), is least, knowing that what a recomputed op reads must be
    kept or recomputed too. The plan is cached per signature (``.plans``) and later
    calls cost what a fixed policy costs. The model and solver are explained in
    docs/budgets.md and NOTE [memory budget] in ``remat/_budget.py``. Works under
    plain autograd and the ``torch.func`` transforms like every policy; under
    ``torch.compile`` use torch's own ``activation_memory_budget`` (docs/budgets.md).

    Args:
        budget: bytes per call (``int`` >= 0) or a fraction (``float`` in [0, 1]).

    Returns:
        A :class:`MemoryBudget` policy. One object keeps one plan per signature;
        share it between the blocks that should share plans, or build one per block.

    Raises:
        TypeError, ValueError: for a budget that is not a non-negative int or a
            float in [0, 1].

    Example:
        >>> import torch
        >>> from remat import remat, policies
        >>> policy = policies.memory_budget(0.5)  # keep at most half of what autograd would
        >>> f = remat(lambda w, x: torch.tanh(torch.tanh(x @ w) @ w).sum(), policy=policy)
        >>> w = torch.randn(64, 64, requires_grad=True)
        >>> for _ in range(2):
        ...     f(w, torch.randn(32, 64)).backward()
        >>> plan = next(iter(policy.plans.values()))
        >>> plan.kept_bytes <= plan.budget_bytes == plan.full_bytes // 2
        True
    """
    if isinstance(budget, numbers.Integral) and not isinstance(budget, bool):
        budget = int(budget)
    elif isinstance(budget, numbers.Real) and not isinstance(budget, bool):
        budget = float(budget)
    if budget == 1 and isinstance(budget, int):
        raise ValueError(
            "memory_budget: budget=1 is one byte (an int budget counts bytes); to keep everything autograd would, "
            "pass the fraction 1.0"
        )
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(
            f"memory_budget: budget must be bytes (an int) or a fraction of what autograd keeps (a float in "
            f"[0, 1]), got {budget!r} ({type(budget).__name__})"
        )
    if isinstance(budget, float) and not 0.0 <= budget <= 1.0:
        raise ValueError(
            f"memory_budget: a float budget is a fraction of what autograd would keep and must lie in [0, 1], "
            f"got {budget!r}; pass bytes as an int (memory_budget({int(budget) if math.isfinite(budget) else 0}))"
        )
    if isinstance(budget, int) and budget < 0:
        raise ValueError(f"memory_budget: a byte budget must be >= 0, got {budget}")
    return MemoryBudget(budget)
