"""Three-way chain schedules: each block plain, offloaded to host memory, or in a remat'd segment, priced in
seconds by a :class:`~remat.DeviceModel` (``remat.sequential(blocks, budget=..., offload=...)``).

NOTE [offloading in a chain]: an *offloaded* block is a plain block whose saved
activations the offload engine copies to host memory as the forward pass leaves
it (its policy offloads every op, ``Offloadable(None, "cpu", defer=False)``), and
back in the backward pass. In the memory model of NOTE [chain schedules] it keeps
on the device only what it may save of its input (at most ``inp[i]``, held by
reference, as the offload policies hold inputs); the rest of ``act[i]`` is host
bytes. Time, on the model's device, as NOTE [three-way budget] times one call,
at block granularity:

* forward: the blocks in order (``flops / rate``); when an offloaded block ends
  its host bytes are queued on one device-to-host stream, and past
  ``max_inflight_bytes`` of copies in flight the compute waits for the oldest;
* backward: the blocks in reverse (``backward`` times their forward time); a
  remat'd segment is first run again (its FLOPs, as the recompute of NOTE [chain
  schedules] counts them); the engine's prefetch (NOTE [prefetch]) starts the
  reloads of the first two offloaded blocks the backward pass reaches when it
  starts, and of the next one each time it reaches an offloaded block, on one
  host-to-device stream, each no earlier than its copy out ended; a block waits
  for its own reload.

Plans are compared by (seconds, device bytes, host bytes). :func:`solve` is exact
up to ``EXACT`` blocks (every single-level schedule, every subset of its plain
blocks offloaded), checked against a brute force written apart in
``tests/test_sequential_offload.py``. Beyond, a heuristic: keep/recompute
schedules solved at the budget and at larger ones (up to what the host can take),
their plain blocks offloaded earliest first (most compute left to hide the copy)
until the budget holds, then every other plain block offloaded where that is no
slower. The keep/recompute schedule at the budget is a candidate, so the plan is
never slower in the model; with no link it is that schedule.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Sequence

from .device_model import DeviceModel
from .schedules import Schedule, cost
from .schedules import solve as solve_two_way

__all__ = ["ChainPlan", "seconds", "memory", "solve", "EXACT"]

EXACT = 6
_GRID = (0.1, 0.25, 0.5, 1.0)


@dataclasses.dataclass(frozen=True)
class ChainPlan:
    """A chain's schedule with its offloaded blocks, and what the model predicts for it."""

    schedule: Schedule
    device_bytes: int
    host_bytes: int
    seconds: float  # modelled step time
    two_way_seconds: float  # of the keep/recompute schedule at the same budget (inf: none fits)

    def key(self) -> tuple[float, int, int]:
        return (self.seconds, self.device_bytes, self.host_bytes)


def memory(schedule: Schedule, act: Sequence[int], inp: Sequence[int], flops: Sequence[float]) -> tuple[int, int]:
    """(device bytes, host bytes) of ``schedule`` with its offloaded blocks (NOTE [offloading in a chain])."""
    off = schedule.offloaded
    on_device = [min(act[i], inp[i]) if i in off else act[i] for i in range(len(act))]
    return cost(schedule, on_device, inp, flops)[0], sum(act[i] - min(act[i], inp[i]) for i in off)


def seconds(schedule: Schedule, act: Sequence[int], inp: Sequence[int], flops: Sequence[float],
            model: DeviceModel) -> float:
    """The modelled step time of ``schedule`` (NOTE [offloading in a chain])."""
    n = len(act)
    fwd = [model.compute_seconds(c) for c in flops]
    off = sorted(schedule.offloaded)
    host = {i: act[i] - min(act[i], inp[i]) for i in off}
    t = link = 0.0
    flight: collections.deque[tuple[float, int]] = collections.deque()
    inflight = 0
    out_end: dict[int, float] = {}
    for i in range(n):
        t += fwd[i]
        if i in host and host[i]:
            while flight and (flight[0][0] <= t or inflight + host[i] > model.max_inflight_bytes):
                end, b = flight.popleft()
                inflight -= b
                t = max(t, end)
            link = max(t, link) + model.copy_seconds(host[i])[0]
            flight.append((link, host[i]))
            inflight += host[i]
            out_end[i] = link
    order = [i for i in reversed(off) if i in out_end]  # the offloaded blocks as the backward pass reaches them
    back = {i: s for s, e, r in schedule.segments if r for i in [e - 1]}  # a remat'd segment's last block -> start
    recompute = {e - 1: sum(fwd[s:e]) for s, e, r in schedule.segments if r}
    arrive: dict[int, float] = {}
    h2d = t

    def reload(k: int, now: float) -> None:
        nonlocal h2d
        if k < len(order) and order[k] not in arrive:
            i = order[k]
            h2d = max(h2d, now, out_end[i]) + model.copy_seconds(host[i])[1]
            arrive[i] = h2d

    reload(0, t)
    reload(1, t)
    for i in range(n - 1, -1, -1):
        if i in back:
            t += recompute[i]
        if i in arrive or i in out_end:
            k = order.index(i)
            reload(k, t)
            reload(k + 1, t)
            t = max(t, arrive[i])
        t += model.backward * fwd[i]
    return t


def _plan(schedule: Schedule, act: Sequence[int], inp: Sequence[int], flops: Sequence[float], model: DeviceModel,
          two_way: float) -> ChainPlan:
    dev, host = memory(schedule, act, inp, flops)
    return ChainPlan(schedule, dev, host, seconds(schedule, act, inp, flops, model), two_way)


def _with(schedule: Schedule, offloaded: frozenset[int], act: Sequence[int], inp: Sequence[int],
          flops: Sequence[float]) -> Schedule:
    plain = {i for s, e, r in schedule.segments if not r for i in range(s, e)}
    off = frozenset(offloaded & plain)
    on_device = [min(act[i], inp[i]) if i in off else act[i] for i in range(len(act))]
    mem, rec = cost(schedule, on_device, inp, flops)
    return dataclasses.replace(schedule, offloaded=off, memory=mem, recompute=rec)


def solve(act: Sequence[int], inp: Sequence[int], flops: Sequence[float], budget: int, model: DeviceModel,
          host_budget: int | None = None, two_way: Schedule | None = None, exact: int = EXACT) -> ChainPlan | None:
    """The schedule and offloaded blocks of least modelled time within ``budget`` device bytes and ``host_budget``
    host bytes (NOTE [offloading in a chain]); ``two_way``: the keep/recompute schedule at the budget, a candidate
    (None: solved here, single-level). None when nothing fits.

    Example:
        >>> from remat import DeviceModel
        >>> from remat._budgets.chain_offload import solve
        >>> # four blocks of 1 GFLOP keeping 100 MB each; a slow device: copies hide behind the compute
        >>> plan = solve([10**8] * 4, [10**6] * 4, [1e9] * 4, budget=10**8, model=DeviceModel(1e12, 64e9, 64e9))
        >>> str(plan.schedule), plan.seconds < plan.two_way_seconds
        ('offload[0:4]', True)
    """
    host = math.inf if host_budget is None else host_budget
    n = len(act)
    if two_way is None:
        two_way = solve_two_way(act, inp, flops, budget)
    two_s = seconds(two_way, act, inp, flops, model) if two_way is not None else math.inf
    best = _plan(two_way, act, inp, flops, model, two_s) if two_way is not None else None
    if not model.can_copy or host <= 0:
        return best

    def offer(s: Schedule) -> None:
        nonlocal best
        p = _plan(s, act, inp, flops, model, two_s)
        if p.device_bytes <= budget and p.host_bytes <= host and (best is None or p.key() < best.key()):
            best = p

    if n <= exact:
        for cuts in itertools.product((False, True), repeat=n - 1):
            bounds = [0, *[i + 1 for i, c in enumerate(cuts) if c], n]
            spans = list(zip(bounds, bounds[1:]))
            for kinds in itertools.product((False, True), repeat=len(spans)):
                segs = tuple((s, e, r) for (s, e), r in zip(spans, kinds))
                plain = [i for s, e, r in segs if not r for i in range(s, e)]
                for k in range(len(plain) + 1):
                    for chosen in itertools.combinations(plain, k):
                        offer(_with(Schedule(segs), frozenset(chosen), act, inp, flops))
        return best
    total = sum(act)
    room = min(host, max(0, total - budget))
    for f in (0.0, *_GRID):
        s = solve_two_way(act, inp, flops, int(budget + f * room))
        if s is None:
            continue
        plain = [i for a, e, r in s.segments if not r for i in range(a, e)]
        off: set[int] = set()
        for i in plain:  # earliest first, until the budget holds
            if memory(_with(s, frozenset(off), act, inp, flops), act, inp, flops)[0] <= budget:
                break
            off.add(i)
        cand = _with(s, frozenset(off), act, inp, flops)
        offer(cand)
        for i in plain:  # more, where no slower
            if i not in off:
                more = _with(s, frozenset(off | {i}), act, inp, flops)
                if seconds(more, act, inp, flops, model) <= seconds(cand, act, inp, flops, model):
                    off.add(i)
                    cand = more
        offer(cand)
    return best
