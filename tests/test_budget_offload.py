"""Three-way budgets (``memory_budget(b, offload=DeviceModel(...))``): the solver against brute force under a
timeline written apart from the library's, the limits of free and impossible copies, retained bytes measured from
outside remat, gradients exact against the function without remat."""

from __future__ import annotations

import collections
import itertools
import math
import random
from typing import Any

import pytest
import torch

import remat
from remat import DeviceModel, RematError, policies
from remat._budgets.budget import Graph
from remat._budgets.budget import solve as solve_two_way
from remat._budgets.budget_offload import EXHAUSTIVE, evaluate, solve
from remat.bench.measure import live_bytes_after
from remat.offload import OffloadEngine, use_engine

from .helpers import assert_tree_close, keeping_engine
from .test_budget import F64, grads, loss_of, random_graph, transformer

# ---- a timeline written apart from the library's ----------------------------------------------------------------


def brute_seconds(g: Graph, choice: dict[int, str], m: DeviceModel) -> tuple[float, int, int]:
    """(seconds, device bytes, host bytes) of a per-op choice ("keep", "offload", else recompute), by an event
    simulation that shares no code with ``remat._budgets.budget_offload``."""
    needed: set[int] = set()
    ran: set[int] = set()
    todo = list(g.saved)
    while todo:
        v = todo.pop()
        if v in needed:
            continue
        needed.add(v)
        op = g.producer[v]
        if choice.get(op) in ("keep", "offload") and g.keepable[op]:
            continue
        if op not in ran:
            ran.add(op)
            todo += g.reads[op]
    dev = sum(g.size[v] for v in needed if choice.get(g.producer[v]) == "keep" and g.keepable[g.producer[v]])
    off = [v for v in needed if choice.get(g.producer[v]) == "offload" and g.keepable[g.producer[v]]]
    host = sum(g.size[v] for v in off)
    secs = [c / m.flops for c in g.cost]
    if not off:
        return sum(secs) * (1 + m.backward) + sum(secs[i] for i in ran), dev, host
    # forward: copies leave in the order their ops end; the compute waits while too many bytes are in flight
    clock, stream_free, queue, done_at = 0.0, 0.0, [], {}
    for i in range(len(g.cost)):
        clock += secs[i]
        for v in sorted(v for v in off if g.producer[v] == i):
            queue = [(end, b) for end, b in queue if end > clock]
            while queue and sum(b for _, b in queue) + g.size[v] > m.max_inflight_bytes:
                clock = max(clock, queue[0][0])
                queue = [(end, b) for end, b in queue if end > clock] if queue[0][0] <= clock else queue[1:]
            begin = max(clock, stream_free)
            stream_free = begin + g.size[v] / m.d2h
            queue.append((stream_free, g.size[v]))
            done_at[v] = stream_free
    # backward: every reload at once, latest saved first, one stream
    ready, free = {}, clock
    for v in sorted(off, key=lambda v: (-g.producer[v], -v)):
        free = max(free, done_at[v]) + g.size[v] / m.h2d
        ready[v] = free
    for i in sorted(ran):
        clock = max([clock] + [ready[v] for v in g.reads[i] if v in ready]) + secs[i]
    last = {v: max([g.producer[v]] + [i for i in range(len(g.cost)) if v in g.reads[i]]) for v in off}
    for i in reversed(range(len(g.cost))):
        clock = max([clock] + [ready[v] for v in off if last[v] == i]) + m.backward * secs[i]
    return clock, dev, host


def brute_force(g: Graph, budget: int, m: DeviceModel, host: float = math.inf) -> tuple[float, int, int]:
    """The least (seconds, device bytes, host bytes) over every keep/offload/recompute choice of every op."""
    best = None
    for pick in itertools.product(("recompute", "keep", "offload"), repeat=len(g.cost)):
        s = brute_seconds(g, dict(enumerate(pick)), m)
        if s[1] <= budget and s[2] <= host and (best is None or s < best):
            best = s
    assert best is not None
    return best


def random_model(seed: int) -> DeviceModel:
    rng = random.Random(seed)
    return DeviceModel(flops=rng.choice([1.0, 4.0, 20.0]), d2h=rng.choice([2.0, 8.0, 64.0, 500.0]),
                       h2d=rng.choice([2.0, 8.0, 64.0, 500.0]), max_inflight_bytes=rng.choice([64, 300, 1 << 20]))


def close(a: tuple[float, int, int], b: tuple[float, int, int]) -> bool:
    return math.isclose(a[0], b[0], rel_tol=1e-9) and a[1:] == b[1:]


# ---- the model and the solver ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_library_timeline_equals_the_one_written_apart(seed: int) -> None:
    rng = random.Random(seed)
    g, m = random_graph(rng.randint(2, 9), seed), random_model(seed)
    for _ in range(20):
        choice = {i: rng.choice(["keep", "offload", "recompute"]) for i in range(len(g.cost))}
        keep = frozenset(i for i, c in choice.items() if c == "keep")
        off = frozenset(i for i, c in choice.items() if c == "offload")
        s = evaluate(g, keep, off, m)
        assert close(s.key(), brute_seconds(g, choice, m)), (choice, s)


@pytest.mark.parametrize("seed", range(30))
def test_solver_equals_brute_force_on_small_graphs(seed: int) -> None:
    rng = random.Random(1000 + seed)
    g, m = random_graph(rng.randint(2, 7), seed), random_model(seed)
    full = sum(g.size[v] for v in set(g.saved))
    for frac in (0.0, 0.2, 0.5):
        budget = int(frac * full)
        host = rng.choice([math.inf, full // 3])
        got = solve(g, budget, m, None if math.isinf(host) else int(host))
        assert len([i for i in g.relevant() if g.keepable[i]]) <= EXHAUSTIVE
        assert got.device_bytes <= budget and got.host_bytes <= host
        assert close(got.key(), brute_force(g, budget, m, host)), (seed, frac)


def test_the_engine_in_flight_bound_makes_the_compute_wait() -> None:
    """Two 100-byte copies, at most 150 bytes in flight: the second op's copy waits for the first, and so does
    the compute (by hand: forward ops end at 1 and 2; copies 1-11 and 11-21; the compute after op 1 waits to 11)."""
    g = Graph(cost=[1.0, 1.0], keepable=[True, True], reads=[[], [0]], outs=[[0], [1]], size=[100, 100],
              producer=[0, 1], saved=[0, 1])
    tight = DeviceModel(flops=1.0, d2h=10.0, h2d=1e9, max_inflight_bytes=150)
    loose = dataclasses_replace(tight, max_inflight_bytes=1000)
    both = frozenset({0, 1})
    # loose: forward ends at 2; copies end at 11 and 21; reloads (op 1's first) end at 21 + tiny each
    # tight: the second copy can start only once the first ended (11): the compute stalls to 11
    t_loose = evaluate(g, frozenset(), both, loose).seconds
    t_tight = evaluate(g, frozenset(), both, tight).seconds
    assert math.isclose(t_loose, 21 + 4 + 2e-7, rel_tol=1e-9)  # backward: 2 + 2 after the reloads
    assert math.isclose(t_tight, t_loose, rel_tol=1e-9)  # the link is the bottleneck either way...
    solo = DeviceModel(flops=1.0, d2h=10.0, h2d=1e9, max_inflight_bytes=100)
    g3 = Graph(cost=[1.0, 1.0, 50.0], keepable=[True, True, True], reads=[[], [0], [1]], outs=[[0], [1], [2]],
               size=[100, 100, 8], producer=[0, 1, 2], saved=[0, 1])
    # ...but when compute follows, a full bound stalls it: op 2 starts only when the first copy ends (at 11)
    assert math.isclose(evaluate(g3, frozenset(), both, solo).seconds - evaluate(g3, frozenset(), both, loose).seconds,
                        9.0, rel_tol=1e-9)
    assert close(evaluate(g3, frozenset(), both, solo).key(), brute_seconds(g3, {0: "offload", 1: "offload"}, solo))


def dataclasses_replace(m: DeviceModel, **kw: Any) -> DeviceModel:
    import dataclasses
    return dataclasses.replace(m, **kw)


@pytest.mark.parametrize("seed", range(12))
def test_free_copies_offload_everything_held_and_no_link_is_the_two_way_plan(seed: int) -> None:
    for n in (5, 20):  # the exact search and the heuristic
        g = random_graph(n, seed)
        full = sum(g.size[v] for v in set(g.saved))
        for frac in (0.0, 0.3, 0.7):
            budget = int(frac * full)
            free = solve(g, budget, DeviceModel(flops=10.0, d2h=math.inf, h2d=math.inf))
            # nothing recomputed but random ops, nothing on the device: everything it may hold is on the host
            assert free.device_bytes == 0
            assert free.recompute_cost == solve_two_way(g, full * 10).cost
            no_link = solve(g, budget, DeviceModel(flops=10.0, d2h=0.0, h2d=0.0))
            two = solve_two_way(g, budget)
            assert (no_link.keep, no_link.offload) == (two.keep, frozenset())
            assert (no_link.device_bytes, no_link.recompute_cost) == (two.bytes, two.cost)
            priced_out = solve(g, budget, DeviceModel(flops=10.0, d2h=1e-12, h2d=1e-12))
            assert priced_out.offload == frozenset() and priced_out.recompute_cost == two.cost


@pytest.mark.parametrize("seed", range(8))
def test_large_graphs_fit_and_are_never_slower_than_the_two_way_plan(seed: int) -> None:
    g, m = random_graph(40, seed), random_model(seed)
    full = sum(g.size[v] for v in set(g.saved))
    for frac in (0.0, 0.1, 0.3, 0.6):
        budget = int(frac * full)
        for host in (None, full // 4):
            s = solve(g, budget, m, host)
            assert s.device_bytes <= budget and (host is None or s.host_bytes <= host)
            two = evaluate(g, solve_two_way(g, budget).keep, frozenset(), m)
            assert s.seconds <= two.seconds
            assert close(s.key(), evaluate(g, s.keep, s.offload, m).key())


def test_host_budget_is_a_budget_too() -> None:
    g = random_graph(6, 3)
    m = DeviceModel(flops=1.0, d2h=math.inf, h2d=math.inf)
    full = sum(g.size[v] for v in set(g.saved))
    for host in (0, full // 5, full // 2, full):
        s = solve(g, 0, m, host)
        assert s.host_bytes <= host and s.device_bytes == 0
        assert close(s.key(), brute_force(g, 0, m, host))


# ---- the policy on a real block ---------------------------------------------------------------------------------


SLOW = DeviceModel(flops=1e9, d2h=64e9, h2d=64e9)  # compute slow next to copies: offloading pays
LINK = DeviceModel(flops=1e12, d2h=1e9, h2d=1e9)  # copies slow next to compute: recomputing pays


@pytest.mark.parametrize("model", [SLOW, LINK], ids=["slow-compute", "slow-link"])
@pytest.mark.parametrize("budget", [0.0, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gradients_equal_no_remat(model: DeviceModel, budget: float, dtype: torch.dtype) -> None:
    p, x, block = transformer(dtype)
    ref = grads(block, p, x)
    eng = OffloadEngine(pin_memory=False)
    pol = policies.memory_budget(budget, offload=model)
    f = remat.remat(block, policy=pol)
    with use_engine(eng):
        for _ in range(3):  # measuring (old engine), then the plan's calls (replay engine)
            got = grads(f, p, x)
            if dtype is torch.float64:
                assert_tree_close(got, ref, **F64)
            else:
                assert all(torch.equal(a, b) for a, b in zip(got, ref))
    plan = next(iter(pol.plans.values()))
    assert plan is not None and plan.kept_bytes <= plan.budget_bytes
    assert (eng.stats["offloaded"] > 0) == bool(plan.offloaded)
    if model is SLOW and budget < 1.0:
        assert plan.offloaded and plan.seconds < plan.two_way_seconds


def test_retained_bytes_measured_outside_are_the_plans_device_bytes() -> None:
    """A census of the storages the block's ops allocated (outside remat): after the forward pass, what is alive
    is the plan's device bytes (plus the output the loss keeps), within the budget; what the plan offloads is not
    alive on the "device" (its storages died once copied), and the keep/recompute plan at the same budget holds
    the same or more while the model says it is slower."""
    p, x, block = transformer(torch.float32)
    out_bytes = block(p, x).untyped_storage().nbytes()
    _, full = live_bytes_after(lambda: loss_of(block, p, x))
    for frac in (0.0, 0.1, 0.25, 0.5):
        eng = OffloadEngine(pin_memory=False)
        pol = policies.memory_budget(frac, offload=SLOW)
        f = remat.remat(block, policy=pol)
        with use_engine(eng):
            loss_of(f, p, x).backward()
            plan = next(iter(pol.plans.values()))
            assert plan is not None and plan.offloaded_bytes > 0
            for _ in range(2):  # the plan's calls (replay engine), each alike
                before = eng.stats["offloaded"]
                loss, held = live_bytes_after(lambda: loss_of(f, p, x))  # noqa: B023
                assert held - out_bytes == plan.kept_bytes <= frac * (full - out_bytes) + 1
                assert eng.stats["offloaded"] > before
                loss.backward()
        assert plan.kept_bytes + plan.offloaded_bytes >= plan.full_bytes * frac


def test_offload_true_on_the_cpu_says_to_give_a_model_and_bad_arguments_teach() -> None:
    p, x, block = transformer(torch.float32)
    pol = policies.memory_budget(0.5, offload=True)
    with pytest.raises(RematError, match="DeviceModel"):
        loss_of(remat.remat(block, policy=pol), p, x)
    with pytest.raises(ValueError, match="not a CUDA device"):
        DeviceModel.probe("cpu")
    with pytest.raises(TypeError, match="offload must be"):
        policies.memory_budget(0.5, offload="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="host_budget"):
        policies.memory_budget(0.5, host_budget=100)
    with pytest.raises(ValueError, match="host_budget"):
        policies.memory_budget(0.5, offload=SLOW, host_budget=-1)
    for bad in ({"flops": 0.0}, {"flops": math.inf}, {"d2h": -1.0}, {"h2d": math.nan}, {"max_inflight_bytes": 0}):
        kw: dict[str, Any] = {"flops": 1e12, "d2h": 1e9, "h2d": 1e9, **bad}
        with pytest.raises(ValueError, match="DeviceModel"):
            DeviceModel(**kw)
    assert "offload=DeviceModel" in repr(policies.memory_budget(0.5, offload=SLOW))


def test_a_host_budget_bounds_what_the_block_offloads() -> None:
    p, x, block = transformer(torch.float32)
    free = DeviceModel(flops=1e9, d2h=math.inf, h2d=math.inf)
    for host in (0, 20_000, 10**9):
        pol = policies.memory_budget(0.0, offload=free, host_budget=host)
        f = remat.remat(block, policy=pol)
        with use_engine(OffloadEngine(pin_memory=False)):
            loss_of(f, p, x).backward()
        plan = next(iter(pol.plans.values()))
        assert plan is not None and plan.offloaded_bytes <= host and plan.kept_bytes == 0
        if host == 0:
            assert plan.offloaded == ()
        if host == 10**9:
            assert plan.recompute_flops == 0  # free copies: every value goes to the host, nothing runs again


def test_counts_are_counted_once_per_value() -> None:
    """Two ops' outputs, both saved: the plan's host bytes are the sum of their sizes (a sanity check that a
    value read twice is not copied twice in the model)."""
    g = Graph(cost=[5.0, 5.0], keepable=[True, True], reads=[[], [0]], outs=[[0], [1]], size=[10, 20],
              producer=[0, 1], saved=[0, 1, 0])
    s = evaluate(g, frozenset(), frozenset({0, 1}), DeviceModel(flops=1.0, d2h=1.0, h2d=1.0))
    assert (s.device_bytes, s.host_bytes) == (0, 30)
    assert collections.Counter(g.saved)[0] == 2


def test_a_budget_copies_at_once_where_the_engine_would_keep_the_newest_call() -> None:
    """On CUDA the engine keeps the newest call's storages on the device until a later call offloads (NOTE [keep
    last]); a budget's offloaded values must leave the device all the same, or its device bytes would be the
    plan's plus everything it offloads. Run on the CPU with the engine keeping as it does on CUDA."""
    p, x, block = transformer(torch.float32)
    out_bytes = block(p, x).untyped_storage().nbytes()
    ref = grads(block, p, x)
    pol = policies.memory_budget(0.1, offload=SLOW)
    f = remat.remat(block, policy=pol)
    eng = keeping_engine()
    with use_engine(eng):
        loss_of(f, p, x).backward()
        plan = next(iter(pol.plans.values()))
        assert plan is not None and plan.offloaded_bytes > 0
        for _ in range(2):
            loss, held = live_bytes_after(lambda: loss_of(f, p, x))
            assert held - out_bytes == plan.kept_bytes
            loss.backward()
        assert eng.stats["kept_on_device"] == 0 and eng.stats["copies"] > 0
        assert all(torch.equal(a, b) for a, b in zip(grads(f, p, x), ref))
    # the same values under a plain offload policy (defer=True) stay on the device: the call is the newest
    eng = keeping_engine()
    with use_engine(eng):
        g = remat.remat(block, policy=policies.offload_to_cpu(min_bytes=0))
        loss, held = live_bytes_after(lambda: loss_of(g, p, x))
        assert eng.stats["kept_on_device"] > 0 and held - out_bytes > plan.kept_bytes
        loss.backward()


def test_defer_is_a_bool_and_not_in_the_repr() -> None:
    assert repr(policies.Offloadable("cuda", "cpu", defer=False)) == "Offloadable(src='cuda', dst='cpu', min_bytes=0)"
    assert policies.Offloadable("cuda", "cpu", defer=False) != policies.Offloadable("cuda", "cpu")
    with pytest.raises(TypeError, match="defer must be a bool"):
        policies.Offloadable("cuda", "cpu", defer=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("transform", ["grad", "vmap-grad"])
def test_under_torch_func(transform: str) -> None:
    """The plan is solved under the transform (its ops are the transform's) and offloads there too."""
    p, x, block = transformer(torch.float64)
    pol = policies.memory_budget(0.2, offload=SLOW)
    f = remat.remat(block, policy=pol)

    def loss(fn: Any) -> Any:
        return lambda p, x: fn(p, x).pow(2).sum()

    if transform == "grad":
        def run(fn: Any) -> Any:
            return torch.func.grad(loss(fn))(p, x)
    else:
        def run(fn: Any) -> Any:
            return torch.func.vmap(torch.func.grad(lambda p, x: loss(fn)(p, x[None])), in_dims=(None, 0))(p, x)
    ref = run(block)
    eng = OffloadEngine(pin_memory=False)
    with use_engine(eng):
        for _ in range(3):
            assert_tree_close(run(f), ref, **F64)
    plan = next(iter(pol.plans.values()))
    assert plan is not None and plan.offloaded and eng.stats["offloaded"] > 0
