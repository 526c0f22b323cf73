"""Chain schedules and their solvers, for ``remat.sequential`` (NOTE [chain schedules] in ``_budgets/sequential.py``).

Pure functions over per-block numbers (bytes kept, input bytes, FLOPs): no tensors, no torch. A
:class:`Schedule` cuts a chain into segments, plain or remat'd, a remat'd one possibly with a schedule of its
own (multi-level); :func:`cost` is the model; :func:`solve` the exact single-level dynamic program;
:func:`solve_nested` the exact multi-level one, on a grid of memory units.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

__all__ = ["Schedule", "equal_segments", "nested_segments", "cost", "solve", "solve_nested"]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Segments ``(start, end, rematted)`` covering the chain, and what the cost model predicts for them."""

    segments: tuple[tuple[int, int, bool], ...]
    memory: int = 0  # predicted bytes: persistent + max transient
    recompute: float = 0.0  # predicted FLOPs recomputed
    # per segment, the schedule its recompute follows (a multi-level schedule); None or absent: its blocks plain
    inner: tuple[Schedule | None, ...] = ()
    # plain blocks whose activations go to host memory (NOTE [offloading in a chain] in _budgets/chain_offload.py)
    offloaded: frozenset[int] = frozenset()

    def sub(self, i: int) -> Schedule | None:
        return self.inner[i] if i < len(self.inner) else None

    def depth(self) -> int:
        """Levels of remat'd segments (1: single level)."""
        return max((1 + (0 if self.sub(i) is None else self.sub(i).depth())  # type: ignore[union-attr]
                    for i, (_, _, r) in enumerate(self.segments) if r), default=0)

    def __str__(self) -> str:
        parts = []
        for i, (s, e, r) in enumerate(self.segments):
            sub = self.sub(i)
            if not r and self.offloaded:  # runs of offloaded and plain blocks
                for off, run in itertools.groupby(range(s, e), key=lambda b: b in self.offloaded):
                    blocks = list(run)
                    parts.append(f"{'offload' if off else 'plain'}[{blocks[0]}:{blocks[-1] + 1}]")
                continue
            parts.append(f"{'remat' if r else 'plain'}[{s}:{e}]" + (f"{{{sub}}}" if sub is not None else ""))
        return " ".join(parts)


def equal_segments(n: int, k: int) -> Schedule:
    """``k`` contiguous segments of ``n`` blocks, as equal as possible; all remat'd but the last.

    Example:
        >>> from remat._budgets.sequential import equal_segments
        >>> str(equal_segments(5, 2))
        'remat[0:2] plain[2:5]'
    """
    if not 1 <= k:
        raise ValueError(f"remat.sequential: segments must be a positive int, got {k}")
    k = min(k, n)
    bounds = [round(i * n / k) for i in range(k + 1)]
    return Schedule(tuple((bounds[i], bounds[i + 1], i < k - 1) for i in range(k)))


def nested_segments(n: int, k: int, levels: int) -> Schedule:
    """``levels`` levels of ``k`` equal remat'd segments: the chain cut into ``k``, each segment longer than a
    block cut again into ``k``, ``levels`` times (NOTE [chain schedules]). With ``k = 2`` and
    ``levels = ceil(log2 n)`` memory grows like ``log n`` and a block is recomputed up to ``levels`` times.

    Example:
        >>> from remat._budgets.sequential import nested_segments
        >>> str(nested_segments(8, 2, 2))
        'remat[0:4]{remat[0:2] remat[2:4]} remat[4:8]{remat[4:6] remat[6:8]}'
    """
    if k < 2 or levels < 1:
        raise ValueError(f"remat.sequential: need segments >= 2 and levels >= 1 for nested segments, got {k}, {levels}")
    top = _split(0, n, k, levels)
    return top if top is not None else equal_segments(n, 1)


def _split(s: int, e: int, k: int, levels: int) -> Schedule | None:
    if levels < 1 or e - s < 2:
        return None
    k = min(k, e - s)
    bounds = [s + round(i * (e - s) / k) for i in range(k + 1)]
    segs = tuple((bounds[i], bounds[i + 1], True) for i in range(k))
    return Schedule(segs, inner=tuple(_split(a, b, k, levels - 1) for a, b, _ in segs))


def cost(schedule: Schedule, act: Sequence[int], inp: Sequence[int], flops: Sequence[float],
         start: int = 0) -> tuple[int, float]:
    """(memory, recompute) of ``schedule`` under the cost model of NOTE [chain schedules]; a segment with an
    inner schedule costs that schedule's memory as its transient, and its recompute on top of its own."""
    persistent, transient, recompute = 0, 0, 0.0
    for i, (s, e, rematted) in enumerate(schedule.segments):
        if rematted:
            persistent += inp[s] if s > start else 0  # (the first segment's input is the caller's)
            sub = schedule.sub(i)
            if sub is None:
                transient = max(transient, sum(act[s:e]))
                recompute += sum(flops[s:e])
            else:
                mem, rec = cost(sub, act, inp, flops, start=s)
                transient = max(transient, mem)
                # its recompute runs the inner segments forward but for a last remat'd one, whose output only
                # the segment returns (a dead op for the recompute, NOTE [dead ops]); then each inner one again
                ls, le, lr = sub.segments[-1]
                recompute += sum(flops[s:e]) - (sum(flops[ls:le]) if lr else 0.0) + rec
        else:
            persistent += sum(act[s:e])
    return persistent + transient, recompute


def solve(act: Sequence[int], inp: Sequence[int], flops: Sequence[float], budget: int) -> Schedule | None:
    """The schedule with the least recompute whose memory (NOTE [chain schedules]) is at most ``budget``.

    ``act[i]``: bytes block ``i`` allocates; ``inp[i]``: bytes of its input; ``flops[i]``: its cost.
    None when no schedule fits (not even every block remat'd alone).

    Example:
        >>> from remat._budgets.sequential import solve
        >>> str(solve(act=[10, 10, 10, 10], inp=[1, 1, 1, 1], flops=[1, 1, 1, 1], budget=22))
        'remat[0:1] remat[1:2] remat[2:3] plain[3:4]'
    """
    n = len(act)
    pre_a = [0, *itertools.accumulate(act)]
    pre_c = [0.0, *itertools.accumulate(flops)]
    best: tuple[float, int, tuple[tuple[int, int, bool], ...]] | None = None
    transients = sorted({pre_a[e] - pre_a[s] for s in range(n) for e in range(s + 1, n + 1)} | {0})
    for t in transients:
        if t > budget:
            break
        room = budget - t
        # front[i]: Pareto set {persistent: (recompute, segments)} over schedules of blocks [0, i)
        front: list[dict[int, tuple[float, tuple[tuple[int, int, bool], ...]]]] = [{} for _ in range(n + 1)]
        front[0][0] = (0.0, ())
        for e in range(1, n + 1):
            cand: dict[int, tuple[float, tuple[tuple[int, int, bool], ...]]] = {}

            def offer(p: int, c: float, segs: tuple[tuple[int, int, bool], ...]) -> None:
                if p <= room and (p not in cand or c < cand[p][0]):  # noqa: B023
                    cand[p] = (c, segs)  # noqa: B023

            for p, (c, segs) in front[e - 1].items():  # block e-1 plain
                offer(p + act[e - 1], c, (*segs, (e - 1, e, False)))
            for s in range(e):  # blocks [s, e) one remat'd segment
                if pre_a[e] - pre_a[s] > t:
                    continue
                keep = inp[s] if s > 0 else 0
                for p, (c, segs) in front[s].items():
                    offer(p + keep, c + pre_c[e] - pre_c[s], (*segs, (s, e, True)))
            pareto, low = {}, math.inf
            for p in sorted(cand):
                if cand[p][0] < low:
                    pareto[p] = cand[p]
                    low = cand[p][0]
            front[e] = pareto
        for p, (c, segs) in front[n].items():
            if best is None or (c, p + t) < (best[0], best[1]):
                best = (c, p + t, segs)
    if best is None:
        return None
    return Schedule(best[2], memory=best[1], recompute=best[0])


def solve_nested(act: Sequence[int], inp: Sequence[int], flops: Sequence[float], budget: int,
                 units: int = 48) -> Schedule | None:
    """The multi-level schedule with the least recompute whose memory (the model of :func:`cost`) fits ``budget``.

    Exact on a grid: bytes are counted in ``budget / units`` steps, rounded up, so what
    it returns fits the budget in bytes too; where nothing fits on the grid, the nested
    halves (:func:`nested_segments`) if they fit in bytes. Dynamic program over spans ``[s, e)``, the
    largest inner transient ``X`` and the persistent bytes ``P`` of a list of children:
    ``node(s, e, X)`` is the least recompute of a remat'd segment over ``[s, e)`` whose
    inner schedule fits ``X``; a children list is built left to right, each child a
    plain block or a remat'd segment (a strict sub-span) costing ``node`` at cap ``X``.
    The last remat'd child of a nested segment is not run by that segment's recompute
    (see :func:`cost`). O(n^3 units^2) with the inner loops over arrays.
    ``tests/test_sequential.py`` compares it with every nested schedule of short chains.

    Example:
        >>> from remat._budgets.schedules import solve_nested
        >>> # 4 blocks of 10 bytes, inputs of 1: 12 bytes fits nested halves, no single-level schedule
        >>> str(solve_nested(act=[10] * 4, inp=[1] * 4, flops=[1.0] * 4, budget=12, units=12))
        'remat[0:2]{remat[0:1] remat[1:2]} remat[2:4]{remat[2:3] remat[3:4]}'
    """
    import numpy as np

    n, K = len(act), units
    if budget <= 0:
        return None
    unit = budget / K
    a = [min(K + 1, math.ceil(x / unit - 1e-9)) for x in act]
    q = [min(K + 1, math.ceil(x / unit - 1e-9)) for x in inp]
    pre = [0.0, *itertools.accumulate(flops)]
    inf = math.inf

    def shift(arr: Any, by: int) -> Any:  # arr[..., P - by]
        out = np.full_like(arr, inf)
        if by <= K:
            out[..., by:] = arr[..., :K + 1 - by]
        return out

    # node[s][e]: over X, the least recompute of a remat'd segment [s, e) whose inner schedule fits X
    node: dict[tuple[int, int], Any] = {}
    G: dict[int, Any] = {}  # G[s][X, e, P]: children lists of [s, e) (a prefix), persistent P, cap X
    for s in range(n - 1, -1, -1):
        g = np.full((K + 1, n + 1, K + 1), inf)
        g[:, s, 0] = 0.0
        for e in range(s + 1, n + 1):
            excl, last = _children_ending_at(g, node, s, e, a, q, pre, shift)
            # the segment [s, e) remat'd: F(s, e) + its best list (its last remat'd child not run) within X'
            best = np.full(K + 1, inf)
            m = np.minimum.accumulate(last, axis=1)  # over P
            for x in range(K + 1):
                # lists with cap x and persistent <= X' - x, for every X' >= x
                best[x:] = np.minimum(best[x:], m[x, :K + 1 - x])
            node[(s, e)] = pre[e] - pre[s] + np.minimum.accumulate(best)
            g[:, e, :] = excl
            g[:, e, 0] = np.minimum(g[:, e, 0], node[(s, e)])  # the first child [s, e): its input is the caller's
        G[s] = g
    top = G[0][:, n, :]
    choice = None
    for x in range(K + 1):
        for p in range(K + 1 - x):
            if top[x, p] < inf and (choice is None or top[x, p] < choice[0] - 1e-9):
                choice = (top[x, p], x, p)
    if choice is None:  # (the grid rounds bytes up: nested halves that fit in bytes are missed on it)
        halves = nested_segments(n, 2, max(1, math.ceil(math.log2(n))))
        mem, rec = cost(halves, act, inp, flops)
        return dataclasses.replace(halves, memory=mem, recompute=rec) if mem <= budget else None
    children = _rebuild_list(G, node, 0, n, choice[1], choice[2], False, a, q, pre, shift)
    sched = _as_schedule(children)
    mem, rec = cost(sched, act, inp, flops)
    return dataclasses.replace(sched, memory=mem, recompute=rec)


def _children_ending_at(g: Any, node: dict[tuple[int, int], Any], s: int, e: int, a: list[int], q: list[int],
                        pre: list[float], shift: Any) -> tuple[Any, Any]:
    """Lists of children of [s, e) (not the single child [s, e)): their cost, and the cost with the last child's
    own FLOPs taken off when it is remat'd (what a nested segment's recompute runs)."""
    import numpy as np

    excl = shift(g[:, e - 1, :], a[e - 1])  # the last child: plain block e - 1
    last = excl.copy()
    for k in range(s + 1, e):  # the last child: remat'd [k, e), its input kept (not the first child)
        c = shift(g[:, k, :], q[k]) + node[(k, e)][:, None]
        np.minimum(excl, c, out=excl)
        np.minimum(last, c - (pre[e] - pre[k]), out=last)
    return excl, last


def _rebuild_list(G: dict[int, Any], node: dict[tuple[int, int], Any], s: int, e: int, x: int, p: int,
                  nested: bool, a: list[int], q: list[int], pre: list[float],
                  shift: Any) -> list[tuple[int, int, bool, Schedule | None]]:
    """The children of [s, e) with cap ``x`` and persistent ``p`` that reach the optimum (walking back)."""
    out: list[tuple[int, int, bool, Schedule | None]] = []
    g = G[s]
    want = None
    while e > s:
        excl, last = _children_ending_at(g, node, s, e, a, q, pre, shift)
        table = last if (nested and not out) else excl
        target = table[x, p] if want is None else want
        if not out and not nested and p == 0 and abs(node[(s, e)][x] - g[x, e, 0]) < 1e-6 * max(1.0, abs(target)) \
                and g[x, e, 0] < excl[x, 0] - 1e-9:
            out.append((s, e, True, _rebuild_node(G, node, s, e, x, a, q, pre, shift)))  # the single child [s, e)
            break
        tol = 1e-6 * max(1.0, abs(target))
        first = not out and nested
        if p >= a[e - 1] and abs(g[x, e - 1, p - a[e - 1]] - target) <= tol:
            out.append((e - 1, e, False, None))
            p -= a[e - 1]
            e -= 1
            want = None
            continue
        for k in range(s + 1, e):
            if p < q[k]:
                continue
            base = g[x, k, p - q[k]]
            c = base + node[(k, e)][x] - ((pre[e] - pre[k]) if first else 0.0)
            if abs(c - target) <= tol:
                out.append((k, e, True, _rebuild_node(G, node, k, e, x, a, q, pre, shift)))
                p -= q[k]
                e = k
                want = None
                break
        else:
            if p == 0 and abs(node[(s, e)][x] - target) <= tol:  # the first child [s, e), input free
                out.append((s, e, True, _rebuild_node(G, node, s, e, x, a, q, pre, shift)))
                break
            raise AssertionError("remat: solve_nested could not rebuild its schedule; this is a bug in remat")
    return out[::-1]


def _rebuild_node(G: dict[int, Any], node: dict[tuple[int, int], Any], s: int, e: int, cap: int, a: list[int],
                  q: list[int], pre: list[float], shift: Any) -> Schedule | None:
    """The inner schedule of the remat'd segment [s, e) at cap ``cap`` (None: its blocks plain)."""
    import numpy as np

    excl, last = _children_ending_at(G[s], node, s, e, a, q, pre, shift)
    m = np.minimum.accumulate(last, axis=1)
    target = node[(s, e)][cap] - (pre[e] - pre[s])
    for x in range(cap + 1):
        p_max = cap - x
        if m[x, p_max] <= target + 1e-6 * max(1.0, abs(target)):
            p = int(np.argmax(last[x, :p_max + 1] <= target + 1e-6 * max(1.0, abs(target))))
            children = _rebuild_list(G, node, s, e, x, p, True, a, q, pre, shift)
            if all(not r for _, _, r, _ in children):
                return None
            return _as_schedule(children)
    raise AssertionError("remat: solve_nested could not rebuild a segment; this is a bug in remat")


def _as_schedule(children: list[tuple[int, int, bool, Schedule | None]]) -> Schedule:
    return Schedule(tuple((s, e, r) for s, e, r, _ in children), inner=tuple(sub for _, _, _, sub in children))
