"""Three-way budgets: keep, offload or recompute each value, priced in seconds by a :class:`~remat.DeviceModel`.

NOTE [three-way budget]: ``policies.memory_budget(b, offload=model)`` extends the
keep/recompute cut of NOTE [memory budget] (``_budgets/budget.py``) with a third choice
per op: its needed outputs go to host memory in the forward pass and come back
in the backward pass (the offload engine, ``remat/_offload``). An assignment
``keep`` / ``offload`` (the held ops) / recompute (the rest) is priced on the
call's op graph by :func:`evaluate`:

* device bytes: the needed outputs of kept ops (the budget); host bytes: those of
  offloaded ops (``host_budget``, the pinned pool's cap);
* seconds, by a timeline of one call on the model's device. Forward: the ops in
  order, ``cost / flops`` each; when an offloaded op ends, its outputs are queued
  on one device-to-host stream (first in, first out, in the order the op returned
  them, ``bytes / d2h`` each); when
  the copies in flight would pass ``max_inflight_bytes`` the compute waits for the
  oldest. Backward: the engine starts every reload at once in the reverse of the
  order the values were saved (NOTE [prefetch] in ``_offload/schedule.py``), on
  one host-to-device stream, each no earlier than its own copy to the host ended;
  then the recompute runs (the ops the cut recomputes, in order, each waiting for
  the reloads it reads), then the backward pass of every op in reverse order
  (``backward * cost / flops``), each waiting for the reloads of the values whose
  last reader it is. The step time is when that ends: compute plus recompute plus
  the copy time the compute could not hide.

Plans are compared by (seconds, device bytes, host bytes): with free copies the
plan offloads everything it holds; with no link (``d2h == 0``) nothing, and the
plan is NOTE [memory budget]'s.

:func:`solve` is exact for up to ``EXHAUSTIVE`` ops the recompute could run: it
enumerates the held sets (as the two-way solver does), bounds each by its time
with no copy at all, and tries every split of the held ops between device and
host that fits both budgets (``tests/test_budget_offload.py`` checks it against
brute force over every assignment on random graphs). Beyond, a heuristic: the
two-way plan at the budget, and at larger device budgets (up to what the host can
take) with the held ops offloaded earliest first until the device budget holds,
then ops moved one at a time while the modelled time falls. The two-way plan is
always a candidate, so the three-way plan is never slower in the model.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math

from .budget import Graph, _closure
from .budget import solve as solve_two_way
from .device_model import DeviceModel

__all__ = ["Solution3", "evaluate", "solve", "EXHAUSTIVE"]

EXHAUSTIVE = 8  # up to this many ops the recompute could run, the exact search
_GRID = (0.05, 0.1, 0.25, 0.5, 1.0)  # heuristic: device budgets budget + f * (what the host can take)


@dataclasses.dataclass(frozen=True)
class Solution3:
    """An assignment and what the model predicts for it."""

    keep: frozenset[int]  # ops whose needed outputs stay on the device
    offload: frozenset[int]  # ops whose needed outputs go to host memory
    device_bytes: int
    host_bytes: int
    recompute_cost: float  # the recompute's cost (FLOPs, NOTE [memory budget])
    seconds: float  # the modelled step time (forward and backward of the call)

    def key(self) -> tuple[float, int, int]:
        return (self.seconds, self.device_bytes, self.host_bytes)


class _Prepared:
    """What :func:`evaluate` needs of a graph, computed once per solve."""

    def __init__(self, g: Graph, model: DeviceModel) -> None:
        self.g, self.model = g, model
        n = len(g.cost)
        self.fwd = [model.compute_seconds(c) for c in g.cost]
        self.forward_seconds = sum(self.fwd)
        self.backward_seconds = model.backward * self.forward_seconds
        last = list(g.producer)
        for i in range(n):
            for v in g.reads[i]:
                last[v] = max(last[v], i)
        self.last_reader = last  # per value: the op whose backward pass is the first to come to it


def evaluate(g: Graph, keep: frozenset[int], offload: frozenset[int], model: DeviceModel,
             prepared: _Prepared | None = None) -> Solution3:
    """Device bytes, host bytes and modelled seconds of an assignment (NOTE [three-way budget]).

    Example:
        >>> from remat import DeviceModel
        >>> from remat._budgets.budget import Graph
        >>> from remat._budgets.budget_offload import evaluate
        >>> # one matmul (1e9 FLOPs) whose 4 MB output autograd saves, on a 1 TFLOP/s device with 4 GB/s links
        >>> g = Graph(cost=[1e9], keepable=[True], reads=[[]], outs=[[0]], size=[4_000_000], producer=[0], saved=[0])
        >>> m = DeviceModel(flops=1e12, d2h=4e9, h2d=4e9)
        >>> s = evaluate(g, frozenset(), frozenset({0}), m)  # 1 ms each way; the forward hides none of it
        >>> s.device_bytes, s.host_bytes, round(s.seconds * 1e3, 6)  # 1 ms forward, 2 ms copies, 2 ms backward
        (0, 4000000, 5.0)
    """
    p = prepared if prepared is not None else _Prepared(g, model)
    held = keep | offload
    _, recompute, ran, needed = _closure(g, held)
    dev = host = 0
    moved: dict[int, list[int]] = collections.defaultdict(list)  # offloaded op -> its needed outputs
    for v in needed:
        op = g.producer[v]
        if op in held and g.keepable[op]:
            if op in offload:
                host += g.size[v]
                moved[op].append(v)
            else:
                dev += g.size[v]
    for vs in moved.values():
        vs.sort()  # an op's outputs leave in the order it returned them
    seconds = _timeline(p, ran, moved) if moved else (
        p.forward_seconds + model.compute_seconds(recompute) + p.backward_seconds)
    return Solution3(frozenset(keep), frozenset(offload), dev, host, recompute, seconds)


def _timeline(p: _Prepared, ran: set[int], moved: dict[int, list[int]]) -> float:
    g, m = p.g, p.model
    t = link = 0.0
    flight: collections.deque[tuple[float, int]] = collections.deque()
    flight_bytes = 0
    stored: dict[int, float] = {}  # value -> when its copy to the host ends
    for i, dt in enumerate(p.fwd):
        t += dt
        for v in moved.get(i, ()):
            size = g.size[v]
            while flight and (flight[0][0] <= t or flight_bytes + size > m.max_inflight_bytes):
                end, b = flight.popleft()
                flight_bytes -= b
                t = max(t, end)  # past the bound, the compute waits for the oldest copy
            start = max(t, link)
            link = start + m.copy_seconds(size)[0]
            flight.append((link, size))
            flight_bytes += size
            stored[v] = link
    back = t
    arrive: dict[int, float] = {}
    for v in sorted(stored, key=lambda v: (g.producer[v], v), reverse=True):  # reloads: the reverse of the saves
        back = max(back, stored[v]) + m.copy_seconds(g.size[v])[1]
        arrive[v] = back
    for i in sorted(ran):
        for v in g.reads[i]:
            if v in arrive:
                t = max(t, arrive[v])
        t += p.fwd[i]
    waits: dict[int, list[int]] = collections.defaultdict(list)
    for v in arrive:
        waits[p.last_reader[v]].append(v)
    for i in range(len(p.fwd) - 1, -1, -1):
        for v in waits.get(i, ()):
            t = max(t, arrive[v])
        t += m.backward * p.fwd[i]
    return t


def solve(g: Graph, budget: int, model: DeviceModel, host_budget: int | None = None,
          exhaustive: int = EXHAUSTIVE) -> Solution3:
    """The assignment of least modelled time within ``budget`` device bytes and ``host_budget`` host bytes.

    Example:
        >>> from remat import DeviceModel
        >>> from remat._budgets.budget import Graph
        >>> from remat._budgets.budget_offload import solve
        >>> # x -> a (matmul, 1e9 FLOPs, 4 MB) -> b (tanh, 1e6, 4 MB); autograd saves a and b; no device bytes to spare
        >>> g = Graph(cost=[1e9, 1e6], keepable=[True, True], reads=[[], [0]], outs=[[0], [1]],
        ...           size=[4_000_000, 4_000_000], producer=[0, 1], saved=[0, 1])
        >>> s = solve(g, budget=0, model=DeviceModel(flops=1e12, d2h=64e9, h2d=64e9))
        >>> sorted(s.offload), sorted(s.keep)  # the matmul's output goes to the host, the tanh runs again
        ([0], [])
        >>> round(s.seconds * 1e3, 3)  # 1 ms forward, 2 ms backward, the tanh again, 0.125 ms of copies not hidden
        3.128
    """
    host = math.inf if host_budget is None else host_budget
    p = _Prepared(g, model)
    two = solve_two_way(g, budget)
    best = evaluate(g, two.keep, frozenset(), model, p)
    if not model.can_copy or host <= 0:
        return best
    keepable = [i for i in g.relevant() if g.keepable[i]]
    if len(keepable) <= exhaustive:
        found = _exact(g, p, keepable, budget, host, model)
        return found if found.key() < best.key() else best
    for s in _candidates(g, p, budget, host, model):
        if s.key() < best.key():
            best = s
    return _improve(g, p, best, keepable, budget, host, model)


def _fits(s: Solution3, budget: int, host: float) -> bool:
    return s.device_bytes <= budget and s.host_bytes <= host


def _exact(g: Graph, p: _Prepared, keepable: list[int], budget: int, host: float, model: DeviceModel) -> Solution3:
    best: Solution3 | None = None
    for r in range(len(keepable) + 1):
        for held in itertools.combinations(keepable, r):
            hs = frozenset(held)
            plain = evaluate(g, hs, frozenset(), model, p)  # no copy: a bound on the time of every split
            if best is not None and plain.seconds > best.seconds:
                continue
            _, _, _, needed = _closure(g, hs)
            holding = [i for i in held if any(v in needed for v in g.outs[i])]
            for k in range(len(holding) + 1):
                for off in itertools.combinations(holding, k):
                    s = plain if not off else evaluate(g, hs - set(off), frozenset(off), model, p)
                    if _fits(s, budget, host) and (best is None or s.key() < best.key()):
                        best = s
    assert best is not None  # holding nothing fits any budget
    return best


def _candidates(g: Graph, p: _Prepared, budget: int, host: float, model: DeviceModel) -> list[Solution3]:
    """Two-way plans at larger device budgets, their held ops offloaded earliest first until the budget holds."""
    full = sum(g.size[v] for v in set(g.saved))
    room = min(host, max(0, full - budget))
    out = []
    for f in _GRID:
        two = solve_two_way(g, int(budget + f * room))
        _, _, _, needed = _closure(g, two.keep)
        keep, off = set(two.keep), set()
        dev = sum(g.size[v] for v in needed if g.producer[v] in keep and g.keepable[g.producer[v]])
        moved = 0
        for i in sorted(keep):
            if dev <= budget:
                break
            b = sum(g.size[v] for v in g.outs[i] if v in needed)
            if b and moved + b <= host:
                keep.discard(i)
                off.add(i)
                dev -= b
                moved += b
        s = evaluate(g, frozenset(keep), frozenset(off), model, p)
        if _fits(s, budget, host):
            out.append(s)
    return out


def _improve(g: Graph, p: _Prepared, s: Solution3, keepable: list[int], budget: int, host: float,
             model: DeviceModel, passes: int = 2) -> Solution3:
    """Move one op at a time between keep, offload and recompute while the plan gets better."""
    for _ in range(passes):
        better = False
        for i in keepable:
            keep, off = set(s.keep), set(s.offload)
            here = "keep" if i in keep else "offload" if i in off else "recompute"
            for to in ("offload", "keep", "recompute"):
                if to == here:
                    continue
                k2, o2 = keep - {i}, off - {i}
                if to == "keep":
                    k2.add(i)
                elif to == "offload":
                    o2.add(i)
                t = evaluate(g, frozenset(k2), frozenset(o2), model, p)
                if _fits(t, budget, host) and t.key() < s.key():
                    s, better = t, True
                    break
        if not better:
            break
    return s
