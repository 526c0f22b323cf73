"""``remat.sequential(blocks, budget=..., offload=DeviceModel(...))``: each block plain, offloaded or in a remat'd
segment (NOTE [offloading in a chain] in remat/_budgets/chain_offload.py): the solver against brute force, the limits of
free and impossible copies, the budget measured from outside remat, gradients exact against the plain chain."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

import remat
from remat import DeviceModel, RematError
from remat._budgets.chain_offload import EXACT, memory, seconds, solve
from remat._budgets.schedules import Schedule
from remat._budgets.schedules import solve as solve_two_way
from remat.bench.measure import live_bytes_after
from remat.offload import OffloadEngine, use_engine

from .helpers import keeping_engine


def random_chain(n: int, seed: int) -> tuple[list[int], list[int], list[float]]:
    rng = random.Random(seed)
    act = [rng.choice([100, 400, 1000, 3000]) for _ in range(n)]
    inp = [rng.choice([10, 50, 100]) for _ in range(n)]
    flops = [float(rng.choice([1, 5, 20, 100])) for _ in range(n)]
    return act, inp, flops


def brute_force(act: list[int], inp: list[int], flops: list[float], budget: int, m: DeviceModel,
                host: float) -> tuple[float, int, int] | None:
    """Every single-level schedule with every block a choice of its own (plain, offloaded, remat'd, consecutive
    remat'd blocks cut anywhere), enumerated apart from the solver."""
    n = len(act)
    best = None
    for kinds in itertools.product("pox", repeat=n):  # plain, offloaded, in a remat'd segment
        runs = [list(g) for _, g in itertools.groupby(range(n), key=lambda i: kinds[i] == "x")]
        for cuts in itertools.product((False, True), repeat=n - 1):
            segs, off = [], frozenset(i for i in range(n) if kinds[i] == "o")
            for run in runs:
                if kinds[run[0]] != "x":
                    segs += [(i, i + 1, False) for i in run]
                    continue
                start = run[0]
                for i in run[1:]:
                    if cuts[i - 1]:
                        segs.append((start, i, True))
                        start = i
                segs.append((start, run[-1] + 1, True))
            sched = Schedule(tuple(segs), offloaded=off)
            dev, hb = memory(sched, act, inp, flops)
            if dev <= budget and hb <= host:
                k = (seconds(sched, act, inp, flops, m), dev, hb)
                if best is None or k < best:
                    best = k
    return best


def test_the_timeline_by_hand() -> None:
    """Two blocks of 1 s each (rate 1), the first offloaded, 10 bytes each way at 10 bytes/s: forward 2 s (the
    copy 1-2 s, hidden); backward starts at 2 with the reload (2-3 s); block 1's backward (2 s) hides it; block 0's
    (2 s) then starts at 4: 6 s in all, as without offloading."""
    sched = Schedule(((0, 1, False), (1, 2, False)), offloaded=frozenset({0}))
    m = DeviceModel(flops=1.0, d2h=10.0, h2d=10.0)
    assert memory(sched, [11, 11], [1, 1], [1.0, 1.0]) == (1 + 11, 10)
    assert math.isclose(seconds(sched, [11, 11], [1, 1], [1.0, 1.0], m), 6.0)
    slow = DeviceModel(flops=1.0, d2h=2.0, h2d=2.0)  # 5 s each way: out 1-6, back 6-11, block 0 waits to 11
    assert math.isclose(seconds(sched, [11, 11], [1, 1], [1.0, 1.0], slow), 13.0)


@pytest.mark.parametrize("seed", range(25))
def test_solver_equals_brute_force_on_short_chains(seed: int) -> None:
    rng = random.Random(seed)
    act, inp, flops = random_chain(rng.randint(2, 5), seed)
    m = DeviceModel(flops=rng.choice([1.0, 10.0]), d2h=rng.choice([20.0, 200.0, 2000.0]),
                    h2d=rng.choice([20.0, 200.0, 2000.0]), max_inflight_bytes=rng.choice([500, 10**6]))
    total = sum(act)
    for frac in (0.1, 0.3, 0.6):
        budget = int(frac * total)
        host = rng.choice([math.inf, total // 3])
        got = solve(act, inp, flops, budget, m, None if math.isinf(host) else int(host))
        want = brute_force(act, inp, flops, budget, m, host)
        assert len(act) <= EXACT
        if want is None:
            assert got is None
            continue
        assert got is not None and got.device_bytes <= budget and got.host_bytes <= host
        assert math.isclose(got.seconds, want[0], rel_tol=1e-9) and got.key()[1:] == want[1:], (seed, frac)


@pytest.mark.parametrize("seed", range(8))
def test_limits_and_the_heuristic(seed: int) -> None:
    for n in (5, 14):  # exact, heuristic
        act, inp, flops = random_chain(n, seed)
        total = sum(act)
        for frac in (0.2, 0.5):
            budget = int(frac * total)
            two = solve_two_way(act, inp, flops, budget)
            no_link = solve(act, inp, flops, budget, DeviceModel(1.0, 0.0, 0.0), two_way=two)
            if two is not None:
                assert no_link is not None and no_link.schedule == two
            free = solve(act, inp, flops, budget, DeviceModel(1.0, math.inf, math.inf))
            every = Schedule(tuple((i, i + 1, False) for i in range(n)), offloaded=frozenset(range(n)))
            if memory(every, act, inp, flops)[0] <= budget:  # free copies: nothing recomputed, every block offloaded
                assert free is not None and not any(r for _, _, r in free.schedule.segments)
                # every block that has anything to move (more than what it may save of its input)
                assert free.schedule.offloaded >= {i for i in range(n) if act[i] > inp[i]}
            m = DeviceModel(10.0, 300.0, 300.0)
            got = solve(act, inp, flops, budget, m)
            if two is not None:
                assert got is not None and got.seconds <= seconds(two, act, inp, flops, m)
            if got is not None:
                assert got.device_bytes <= budget


def chain(dtype: torch.dtype) -> tuple[list[torch.nn.Module], torch.Tensor]:
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.GELU(), torch.nn.Linear(128, 16)).to(dtype)
              for _ in range(6)]
    return blocks, torch.randn(32, 16, dtype=dtype, requires_grad=True)


def loss_of(fn: object, x: torch.Tensor) -> torch.Tensor:
    return fn(x).pow(2).sum()  # type: ignore[operator]


def grads(blocks: list[torch.nn.Module], fn: object, x: torch.Tensor) -> list[torch.Tensor]:
    params = [p for b in blocks for p in b.parameters()]
    return list(torch.autograd.grad(loss_of(fn, x), [x, *params]))


def plain(blocks: list[torch.nn.Module]) -> object:
    def run(x: torch.Tensor) -> torch.Tensor:
        for b in blocks:
            x = b(x)
        return x
    return run


SLOW = DeviceModel(flops=1e8, d2h=64e9, h2d=64e9)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("engine", ["copying", "keeping"])
def test_a_real_chain_offloads_within_the_budget_with_plain_gradients(dtype: torch.dtype, engine: str) -> None:
    blocks, x = chain(dtype)
    ref = grads(blocks, plain(blocks), x)
    _, full = live_bytes_after(lambda: loss_of(plain(blocks), x))
    seq = remat.sequential(blocks, budget=0.2, offload=SLOW)
    eng = OffloadEngine(pin_memory=False) if engine == "copying" else keeping_engine()
    with use_engine(eng):
        for _ in range(3):
            got = grads(blocks, seq, x)
            if dtype is torch.float64:
                torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
            else:
                assert all(torch.equal(a, b) for a, b in zip(got, ref))
        plan = next(iter(seq.plans.values()))
        assert plan.schedule.offloaded and plan.seconds < plan.two_way_seconds
        before = eng.stats["offloaded"]
        loss, held = live_bytes_after(lambda: loss_of(seq, x))
        assert eng.stats["offloaded"] > before and eng.stats["kept_on_device"] == 0
        # measured outside remat: what the forward pass left alive (less the chain's output, which the loss holds)
        assert held - 32 * 16 * x.element_size() <= 0.2 * full, (held, full, str(plan.schedule))
        loss.backward()


def test_errors_teach() -> None:
    blocks, x = chain(torch.float32)
    with pytest.raises(ValueError, match="budget"):
        remat.sequential(blocks, offload=SLOW)
    with pytest.raises(TypeError, match="offload must be"):
        remat.sequential(blocks, budget=0.5, offload="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="host_budget"):
        remat.sequential(blocks, budget=0.5, host_budget=10)
    with pytest.raises(RematError, match="DeviceModel"):
        remat.sequential(blocks, budget=0.5, offload=True)(x)
    assert "offload=DeviceModel" in repr(remat.sequential(blocks, budget=0.5, offload=SLOW))
