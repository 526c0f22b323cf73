"""``remat.sequential``: chains of blocks in equal segments or under a byte budget (NOTE [chain schedules]).

Gradients are compared with the plain loop over the blocks (float64 to 1e-10, float32 bitwise), under
autograd and ``torch.func.grad``; the solver is compared with brute force on small chains; what a
schedule keeps is measured from outside (``live_bytes_after``) and its recompute with a FLOP counter.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
import random
import re
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat._budgets.sequential import Schedule, cost, equal_segments, nested_segments, solve, solve_nested
from remat.bench.measure import FlopCount, LiveCensus, live_bytes_after

from .helpers import assert_tree_close, run_benchmark_in_process

F64 = {"rtol": 1e-10, "atol": 1e-10}


def all_schedules(n: int) -> list[Schedule]:
    """Every cut of n blocks into segments, each remat'd or (one block at a time) plain."""
    out = []
    for cuts in itertools.product([False, True], repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        segs = list(zip(bounds, bounds[1:]))
        for flags in itertools.product([False, True], repeat=len(segs)):
            if any(not f and e - s > 1 for (s, e), f in zip(segs, flags)):
                continue
            out.append(Schedule(tuple((s, e, f) for (s, e), f in zip(segs, flags))))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_solver_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 7)
    act = [rng.randint(1, 50) for _ in range(n)]
    inp = [rng.randint(1, 10) for _ in range(n)]
    flops = [float(rng.randint(1, 20)) for _ in range(n)]
    scheds = all_schedules(n)
    for budget in sorted({rng.randint(0, sum(act) + 10) for _ in range(6)} | {0, sum(act)}):
        fits = [(cost(s, act, inp, flops)[1], s) for s in scheds if cost(s, act, inp, flops)[0] <= budget]
        got = solve(act, inp, flops, budget)
        if not fits:
            assert got is None
            continue
        assert got is not None
        mem, rec = cost(got, act, inp, flops)
        assert mem <= budget and (mem, rec) == (got.memory, got.recompute)
        assert rec == min(c for c, _ in fits)


def test_equal_segments_and_the_sqrt_default() -> None:
    assert str(equal_segments(9, 3)) == "remat[0:3] remat[3:6] plain[6:9]"
    assert str(equal_segments(4, 9)) == "remat[0:1] remat[1:2] remat[2:3] plain[3:4]"
    blocks = [nn.Linear(2, 2) for _ in range(10)]
    assert str(remat.sequential(blocks).schedule(torch.ones(1, 2))) == \
        "remat[0:2] remat[2:5] remat[5:8] plain[8:10]"  # ceil(sqrt(10)) = 4 segments


def chain(n: int = 6, d: int = 16, dtype: torch.dtype = torch.float64, seed: int = 0) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(d, 4 * d), nn.Tanh(), nn.Linear(4 * d, d), nn.Tanh()).to(dtype) for _ in range(n)]


def plain(blocks: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for b in blocks:
        x = b(x)
    return x


def grads(blocks: list[nn.Module], fn: Any, x: torch.Tensor) -> list[torch.Tensor]:
    params = [p for b in blocks for p in b.parameters()]
    return list(torch.autograd.grad(fn(x).pow(2).sum(), [x, *params]))


@pytest.mark.parametrize("how", [{}, {"segments": 2}, {"budget": 0.5}, {"budget": 1.0}, {"budget": 0.0001}])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gradients_equal_the_plain_loop(how: dict[str, Any], dtype: torch.dtype) -> None:
    blocks = chain(dtype=dtype)
    x = torch.randn(8, 16, dtype=dtype, requires_grad=True)
    ref = grads(blocks, functools.partial(plain, blocks), x)
    if how.get("budget") == 0.0001:
        with pytest.raises(remat.RematError, match="no schedule of these 6 blocks fits"):
            remat.sequential(blocks, **how)(x)
        return
    seq = remat.sequential(blocks, **how)
    for _ in range(2):  # the first call (measuring) and a call on the solved schedule
        got = grads(blocks, seq, x)
        if dtype == torch.float32:
            assert all(torch.equal(a, b) for a, b in zip(got, ref))
        else:
            assert_tree_close(got, ref, **F64)


@pytest.mark.parametrize("how", [{"segments": 3}, {"budget": 0.5}])
def test_under_torch_func_grad(how: dict[str, Any]) -> None:
    blocks = chain()
    params = {f"{i}.{k}": v.detach() for i, b in enumerate(blocks) for k, v in b.named_parameters()}
    x = torch.randn(8, 16, dtype=torch.float64)

    def loss(p: dict[str, torch.Tensor], x: torch.Tensor, use: bool) -> torch.Tensor:
        fs = [functools.partial(torch.func.functional_call, b, {k.split(".", 1)[1]: v for k, v in p.items()
                                                                if k.split(".", 1)[0] == str(i)})
              for i, b in enumerate(blocks)]
        h = remat.sequential(fs, **how)(x) if use else plain(fs, x)  # type: ignore[arg-type]
        return h.pow(2).sum()

    got = torch.func.grad(loss)(params, x, True)
    assert_tree_close(got, torch.func.grad(loss)(params, x, False), **F64)


def backward_flops(fn: Any, x: torch.Tensor, blocks: list[nn.Module]) -> int:
    loss = fn(x).pow(2).sum()
    with FlopCount() as fc:
        torch.autograd.grad(loss, [x, *[p for b in blocks for p in b.parameters()]])
    return fc.total


def test_budget_is_honoured_and_recompute_is_as_predicted() -> None:
    """Measured from outside: bytes kept after the forward pass fall with the budget and stay within it; the
    backward pass recomputes the FLOPs the schedule predicts."""
    blocks = chain(n=8, d=32, dtype=torch.float32)
    x = torch.randn(64, 32, requires_grad=True)
    _, full = live_bytes_after(lambda: plain(blocks, x).pow(2).sum())
    base = backward_flops(functools.partial(plain, blocks), x, blocks)
    kept = []
    for frac in (1.0, 0.7, 0.5, 0.35):
        seq = remat.sequential(blocks, budget=frac)
        seq(x)  # first call: measures and solves
        sched = seq.schedule(x)
        assert sched is not None and sched.memory <= int(frac * full) + 1024
        _, held = live_bytes_after(lambda: seq(x).pow(2).sum())  # noqa: B023
        kept.append(held)
        assert held <= max(frac * full, sched.memory) + 64 * 1024  # the loss's own saves: x * x
        assert backward_flops(seq, x, blocks) - base == pytest.approx(sched.recompute, rel=0.01)
    assert kept == sorted(kept, reverse=True) and kept[-1] < kept[0] / 2


def test_schedule_is_solved_once_per_input_signature() -> None:
    blocks = chain(n=4)
    seq = remat.sequential(blocks, budget=0.5)
    for _ in range(3):
        seq(torch.randn(8, 16, dtype=torch.float64, requires_grad=True)).sum().backward()
    assert seq.solves == 1
    seq(torch.randn(4, 16, dtype=torch.float64, requires_grad=True)).sum().backward()
    assert seq.solves == 2


def test_batchnorm_statistics_written_once_per_call() -> None:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh()).double() for _ in range(4)]
    ref = copy.deepcopy(blocks)
    seq = remat.sequential(blocks, budget=0.75)
    x = torch.randn(16, 8, dtype=torch.float64)
    for _ in range(2):
        seq(x).sum().backward()
        plain(ref, x).sum().backward()
    assert_tree_close([b for m in blocks for b in m.buffers()], [b for m in ref for b in m.buffers()], **F64)
    assert_tree_close([p.grad for m in blocks for p in m.parameters()], [p.grad for m in ref for p in m.parameters()],
                      **F64)


def test_bad_arguments() -> None:
    blocks = [nn.Linear(2, 2)]
    with pytest.raises(ValueError, match="segments or budget, not both"):
        remat.sequential(blocks, segments=2, budget=0.5)
    with pytest.raises(ValueError, match="segments must be a positive int"):
        remat.sequential(blocks, segments=0)
    with pytest.raises(ValueError, match=r"fractional budget must be in \[0, 1\]"):
        remat.sequential(blocks, budget=1.5)
    with pytest.raises(TypeError, match="budget must be bytes"):
        remat.sequential(blocks, budget="1GB")
    with pytest.raises(TypeError, match="non-empty sequence of callables"):
        remat.sequential([])


def test_chain_budget_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/chain_budget.py (docs/budgets.md) runs on a short chain and prints every configuration."""
    assert run_benchmark_in_process("chain_budget", ["--blocks", "3", "--budgets", "0.8,1.0", "--steps", "1",
                                                     "--threads", "1"]) == 0
    out = capsys.readouterr().out
    for label in ("no-remat", "budget 80%", "budget 100%", "equal 2 segments", "nested halves, 2 levels",
                  "checkpoint_sequential(2)"):
        assert label in out, (label, out)


# ---- multi-level schedules ------------------------------------------------------------------------------------


def test_nested_segments_and_their_cost() -> None:
    sched = nested_segments(8, 2, 3)
    assert str(sched) == ("remat[0:4]{remat[0:2]{remat[0:1] remat[1:2]} remat[2:4]{remat[2:3] remat[3:4]}} "
                          "remat[4:8]{remat[4:6]{remat[4:5] remat[5:6]} remat[6:8]{remat[6:7] remat[7:8]}}")
    assert sched.depth() == 3
    act, inp, flops = [10] * 8, [1] * 8, [1.0] * 8
    mem, rec = cost(sched, act, inp, flops)
    # persistent: the second half's input, then one input per level below, then one block recomputed
    assert mem == 1 + 1 + 1 + 10
    # each block once alone; each pair and each half recomputes its first half only (the last is dead there)
    assert rec == 8 + 4 * 1 + 2 * 2


@pytest.mark.parametrize("levels", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_nested_levels_give_the_plain_gradients(levels: int, dtype: torch.dtype) -> None:
    blocks = chain(n=8, dtype=dtype)
    x = torch.randn(8, 16, dtype=dtype, requires_grad=True)
    ref = grads(blocks, functools.partial(plain, blocks), x)
    seq = remat.sequential(blocks, levels=levels)
    assert seq.schedule(x).depth() == levels  # type: ignore[union-attr]
    got = grads(blocks, seq, x)
    if dtype is torch.float64:
        assert_tree_close(got, ref, rtol=1e-10, atol=1e-10)
    else:
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
    g = torch.func.grad(lambda x: seq(x).pow(2).sum())(x.detach())
    assert_tree_close(g, torch.func.grad(lambda x: plain(blocks, x).pow(2).sum())(x.detach()), rtol=1e-4,
                      atol=1e-5, exact_float32=False)


def backward_peak(fn: Any, x: torch.Tensor) -> int:
    """Peak bytes of storages ops allocate in the backward pass to ``x`` (a census outside remat)."""
    census = LiveCensus()
    try:
        with census:
            loss = fn(x).pow(2).sum()
            census.peak = census.live
            torch.autograd.grad(loss, x)
        return census.peak
    finally:
        census.close()


def test_memory_grows_like_log_n_with_log_n_levels() -> None:
    """Measured from outside: halving down to single blocks (ceil(log2 n) levels) peaks about one block input
    higher each time the chain doubles; sqrt(n) equal segments grow much faster; recompute is as predicted."""
    peaks, sqrt_peaks = {}, {}
    for n in (8, 16, 32, 64):
        blocks = chain(n=n, d=32, dtype=torch.float32)
        x = torch.randn(64, 32, requires_grad=True)
        act = x.numel() * 4
        seq = remat.sequential(blocks, levels=math.ceil(math.log2(n)), segments=2)
        peaks[n] = backward_peak(seq, x) / act
        sqrt_peaks[n] = backward_peak(remat.sequential(blocks), x) / act
    steps = [peaks[2 * n] - peaks[n] for n in (8, 16, 32)]
    assert all(0 <= s <= 2 for s in steps), (peaks, sqrt_peaks)
    assert sqrt_peaks[64] - sqrt_peaks[8] > 3 * (peaks[64] - peaks[8]), (peaks, sqrt_peaks)


def test_a_budget_below_one_input_per_block_nests() -> None:
    """Below the single-level floor (every block remat'd alone: 25% of what this chain keeps) a budget takes a
    nested schedule (15%: two levels fit); what stays alive after the forward pass is within it (a census outside
    remat), and its recompute is what the model predicts (each block recomputed once per level)."""
    blocks = chain(n=16, d=32, dtype=torch.float32)
    x = torch.randn(64, 32, requires_grad=True)
    base = backward_flops(functools.partial(plain, blocks), x, blocks)
    _, full = live_bytes_after(lambda: plain(blocks, x).pow(2).sum())
    seq = remat.sequential(blocks, budget=0.15)
    seq(x)
    sched = seq.schedule(x)
    assert sched is not None and sched.depth() >= 2, sched
    _, held = live_bytes_after(lambda: seq(x).pow(2).sum())
    assert held <= 0.15 * full
    assert backward_flops(seq, x, blocks) - base == pytest.approx(sched.recompute, rel=0.01)
    ref = grads(blocks, functools.partial(plain, blocks), x)
    assert all(torch.equal(a, b) for a, b in zip(grads(blocks, seq, x), ref))


def all_nested(s: int, e: int, top: bool) -> list[Schedule]:
    """Every children list of [s, e): plain blocks and remat'd strict sub-spans (the whole span too at the top),
    each remat'd one with any inner list (an all-plain inner list is a flat segment)."""
    out: list[Schedule] = []

    def rec(k: int, acc: list[tuple[int, int, bool, Schedule | None]]) -> None:
        if k == e:
            out.append(Schedule(tuple((a, b, r) for a, b, r, _ in acc), inner=tuple(x for *_, x in acc)))
            return
        rec(k + 1, [*acc, (k, k + 1, False, None)])
        for j in range(k + 1, e + 1):
            if (k, j) == (s, e) and not top:
                continue
            for sub in [None, *[x for x in all_nested(k, j, False) if any(r for _, _, r in x.segments)]]:
                rec(j, [*acc, (k, j, True, sub)])

    rec(s, [])
    return out


@pytest.mark.parametrize("seed", range(6))
def test_nested_solver_matches_brute_force(seed: int) -> None:
    """solve_nested against every nested schedule of random chains of 4 blocks (bytes on the solver's grid)."""
    rng = random.Random(seed)
    n = 4
    act = [rng.randint(2, 12) for _ in range(n)]
    inp = [rng.randint(1, 3) for _ in range(n)]
    flops = [float(rng.randint(1, 9)) for _ in range(n)]
    scheds = all_nested(0, n, True)
    costs = [cost(x, act, inp, flops) for x in scheds]
    for budget in sorted({rng.randint(min(m for m, _ in costs), sum(act)) for _ in range(5)}):
        best = min(r for m, r in costs if m <= budget)
        got = remat._budgets.sequential.solve_nested(act, inp, flops, budget, units=budget)
        assert got is not None and got.memory <= budget and got.recompute == pytest.approx(best), (budget, got)
        assert cost(got, act, inp, flops) == (got.memory, got.recompute)
    assert remat._budgets.sequential.solve_nested(act, inp, flops, min(m for m, _ in costs) - 1,
                                          units=max(1, min(m for m, _ in costs) - 1)) is None


@pytest.mark.parametrize("first", ["no_grad", "inference_mode", "input-needs-no-grad"])
def test_a_first_call_without_a_graph_plans_nothing(first: str) -> None:
    """Issue 39: a first call under no_grad or inference_mode (a validation pass, a warm-up) solved a schedule that
    kept everything (nothing is saved there), used by every training step of that shape after it. Such calls run
    the plain loop and solve nothing; a call whose input needs no grad has a signature of its own. Measured from
    outside: a training step after it keeps what the budget allows."""
    blocks = chain(n=8, d=32, dtype=torch.float32)
    x = torch.randn(64, 32, requires_grad=True)
    _, full = live_bytes_after(lambda: plain(blocks, x).pow(2).sum())
    seq = remat.sequential(blocks, budget=0.25)
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(first)
    if ctx is not None:
        with ctx():
            assert_tree_close(seq(x), plain(blocks, x), rtol=0, atol=0)
        assert seq.solves == 0
    else:
        seq(x.detach()).sum().backward()
    seq(x).pow(2).sum().backward()  # (the training signature's first call: measures and solves)
    _, held = live_bytes_after(lambda: seq(x).pow(2).sum())
    assert held <= 0.25 * full + 64 * 1024, (held, full)
    assert_tree_close(torch.autograd.grad(seq(x).pow(2).sum(), x), torch.autograd.grad(plain(blocks, x).pow(2).sum(), x),
                      rtol=0, atol=0)


class _NormedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn = nn.Linear(6, 6), nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.bn(self.lin(x)))
        h += x
        return h


def test_a_budget_that_nested_halves_just_fit_is_met_not_refused() -> None:
    """Six small blocks at the bytes nested halves take: the nested solver counts bytes on a grid, rounded up, and
    missed the halves that fit (a review: 1,776 of 1,828 bytes at budget=0.3); until the thirty-eighth session the
    call raised "no schedule fits". The halves are tried in bytes too: it runs, with plain autograd's gradients."""
    torch.manual_seed(0)
    blocks = nn.Sequential(*[_NormedBlock() for _ in range(6)]).double()
    ref = copy.deepcopy(blocks)
    torch.manual_seed(50)
    x = torch.randn(5, 6, dtype=torch.float64)
    with pytest.raises(remat.RematError, match="need") as info:  # (what the halves take, in this torch's bytes)
        remat.sequential(list(copy.deepcopy(blocks)), budget=1)(x)
    need = int(re.search(r"need (\d+) bytes", str(info.value)).group(1))  # type: ignore[union-attr]
    chain = remat.sequential(list(blocks), budget=need)
    (chain(x).tanh() ** 2).sum().backward()
    (ref(x).tanh() ** 2).sum().backward()
    for (name, p), q in zip(blocks.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-10, msg=name)
    assert chain.schedule(x).depth() >= 2  # (nested: no single-level schedule fits that budget)


def test_solve_nested_finds_the_halves_its_grid_rounds_out() -> None:
    """Seven blocks at the bytes the nested halves take by the cost model: the grid (bytes rounded up to a 48th of
    the budget) finds nothing and neither does the single-level solver; the halves fit in bytes and are returned."""
    act, inp, flops = [199, 113, 330, 220, 326, 154, 358], [80, 46, 66, 21, 59, 50, 40], [1.0] * 7
    halves = nested_segments(7, 2, 3)
    need = cost(halves, act, inp, flops)[0]
    assert solve(act, inp, flops, need) is None
    found = solve_nested(act, inp, flops, need)
    assert found is not None and found.memory <= need == cost(found, act, inp, flops)[0]
    assert solve_nested(act, inp, flops, need - 1) is None or solve_nested(act, inp, flops, need - 1).memory < need
