"""Pipeline parallel: ``torch.distributed.pipelining`` (GPipe and 1F1B), two stages on gloo, blocks remat'd.

A float64 chain of four residual blocks (LayerNorm, Linear, tanh, Linear) is cut
into two stages of two blocks, one per process; each stage's blocks are
``remat_module``'d (or not: the baselines); a schedule runs four microbatches per
step, two steps. Per case the tests check:

- every stage's gradients equal one process running the whole chain on the same
  microbatches (the mean of their losses, as the schedule scales them), 1e-10;
- and bitwise those of the same pipeline without remat;
- the backward pass recomputes: it runs every ATen op the pipeline without remat's
  backward pass runs, and more (seen from outside by a dispatch mode that logs the
  ops run while an autograd backward pass is running), among them each block's
  LayerNorm as often as under ``torch.utils.checkpoint`` (which re-runs every block
  in the backward pass) under save-nothing and ``dots_saveable``; each
  block's Python forward runs as often as without remat (the replay engine replays
  the recorded ops, not the Python);
- the peak bytes a stage's ops hold during a step, counted from outside by a
  dispatch mode around the schedule (``LiveCensus``, which weighs every storage an
  op allocates while it lives), fall under remat: the activations GPipe holds for
  every microbatch until its backward passes are the blocks' inputs only.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from remat import policies, remat_module
from remat.bench.measure import LiveCensus

from .helpers import CountCalls, assert_tree_close
from .spawned import result, spawn

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed or its gloo backend is not available in this torch build",
)

WORLD, BLOCKS, DIM, HIDDEN, BATCH, MICRO, STEPS = 2, 4, 16, 256, 256, 4, 2
POLICIES: dict[str, Any] = {"none": None, "save-nothing": "save-nothing", "dots_saveable": policies.dots_saveable,
                            "memory_budget": policies.memory_budget(0.3)}


@dataclasses.dataclass(frozen=True)
class Case:
    schedule: str  # "gpipe" or "1f1b"
    policy: str

    @property
    def id(self) -> str:
        return f"{self.schedule}-{self.policy}"


CASES = [Case(s, p) for s in ("gpipe", "1f1b") for p in (*POLICIES, "torch-checkpoint")]
LAYER_NORM = "aten.native_layer_norm.default"


class BackwardOps(TorchDispatchMode):
    """The ATen ops run while an autograd backward pass runs (a schedule runs forward and backward passes in one
    ``step``), seen from outside remat; ``aten.detach`` left out (autograd's own unpacking of saved tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if torch._C._current_graph_task_id() != -1 and func is not torch.ops.aten.detach.default:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.count = CountCalls()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(self.count(x)))))


class _TorchCheckpointed(nn.Module):
    def __init__(self, block: Block) -> None:
        super().__init__()
        self.block = block
        self.count = block.count

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


def make_chain() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(BLOCKS)]).double()


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(BATCH, DIM, generator=g, dtype=torch.float64),
            torch.randn(BATCH, DIM, generator=g, dtype=torch.float64))


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def run_case(case: Case, rank: int, group: dist.ProcessGroup) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    per = BLOCKS // WORLD
    stage_mod = nn.Sequential(*list(make_chain())[rank * per:(rank + 1) * per])
    if case.policy == "torch-checkpoint":  # the peer, alongside
        stage_mod = nn.Sequential(*[_TorchCheckpointed(b) for b in stage_mod])
    elif POLICIES[case.policy] is not None:
        for block in stage_mod:
            remat_module(block, policy=POLICIES[case.policy])
    stage = PipelineStage(stage_mod, rank, WORLD, torch.device("cpu"), group=group)
    schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[case.schedule](stage, n_microbatches=MICRO,
                                                                              loss_fn=loss_fn)
    x, y = make_data()
    out: dict[str, Any] = {"grads": [], "calls": [], "peak": [], "backward_ops": []}
    names = {n: n.replace(".block.", ".") for n, _ in stage_mod.named_parameters()}
    for _ in range(STEPS):
        before = [b.count.calls for b in stage_mod]
        with LiveCensus() as census, BackwardOps() as backward:
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y)
        out["peak"].append(census.peak)
        out["backward_ops"].append(backward.ops)
        out["calls"].append([b.count.calls - c for b, c in zip(stage_mod, before)])
        out["grads"].append({names[n]: p.grad.clone() for n, p in stage_mod.named_parameters()})
        for p in stage_mod.parameters():
            p.grad = None
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn(run_case, CASES, tmp_path_factory.mktemp("pipeline"), WORLD, timeout_s=150)


@pytest.fixture(scope="module")
def single_process() -> dict[str, torch.Tensor]:
    """The whole chain in one process, on the same microbatches; the mean of their losses."""
    chain = make_chain()
    x, y = make_data()
    loss = sum(loss_fn(chain(xm), ym) for xm, ym in zip(x.chunk(MICRO), y.chunk(MICRO))) / MICRO
    loss.backward()
    return {n: p.grad.clone() for n, p in chain.named_parameters()}


def stage_names(rank: int) -> dict[str, str]:
    per = BLOCKS // WORLD
    return {f"{i}.{rest}": f"{rank * per + i}.{rest}" for i in range(per)
            for rest in ("norm.weight", "norm.bias", "up.weight", "up.bias", "down.weight", "down.bias")}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_one_process(runs, single_process, case):
    for rank in range(WORLD):
        got = result(runs, case, rank)
        for step in got["grads"]:
            want = {k: single_process[full] for k, full in stage_names(rank).items()}
            assert_tree_close(step, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", [c for c in CASES if c.policy not in ("none", "torch-checkpoint")], ids=lambda c: c.id)
def test_matches_the_pipeline_without_remat_bitwise_and_recomputes(runs, case):
    for rank in range(WORLD):
        got, want = result(runs, case, rank), result(runs, Case(case.schedule, "none"), rank)
        peer = result(runs, Case(case.schedule, "torch-checkpoint"), rank)
        assert_tree_close(got["grads"], want["grads"], rtol=0, atol=0)
        per = BLOCKS // WORLD
        # the recompute, counted from outside: every op of the backward pass without remat, and more
        for ops, plain, checkpointed in zip(got["backward_ops"], want["backward_ops"], peer["backward_ops"]):
            assert not plain - ops and (ops - plain).total() > 0, (dict(ops - plain), dict(plain - ops))
            if case.policy in ("save-nothing", "dots_saveable"):  # both drop LayerNorm's mean and rstd
                # (once per block and microbatch, MICRO * per; on the last stage the first step recomputes one
                # microbatch more, under torch.utils.checkpoint too)
                assert plain[LAYER_NORM] == 0 and ops[LAYER_NORM] == checkpointed[LAYER_NORM] >= MICRO * per, ops
        # the Python of each block ran as often as without remat (the first step's stage also runs each block
        # once to learn the shapes, with or without remat); a memory budget measures its first call on the engine
        # that re-runs the Python (NOTE [memory budget]): once per block at most, in the first step
        extra = [[g - w for g, w in zip(gs, ws)] for gs, ws in zip(got["calls"], want["calls"])]
        first = (0, 1) if case.policy == "memory_budget" else (0,)
        assert all(e in first for e in extra[0]) and extra[1:] == [[0] * per] * (STEPS - 1), extra
        assert want["calls"][-1] == [MICRO] * per


@pytest.mark.parametrize("case", [c for c in CASES if c.policy in ("save-nothing", "memory_budget")],
                         ids=lambda c: c.id)
def test_a_stage_holds_less_at_its_peak(runs, case):
    """Counted from outside: under save-nothing a stage's peak during a step is under half the pipeline's without
    remat under GPipe (which holds every microbatch's activations); under 1F1B, and under a memory budget, it is
    below it too (by less: 1F1B holds fewer microbatches)."""
    for rank in range(WORLD):
        got, want = result(runs, case, rank), result(runs, Case(case.schedule, "none"), rank)
        # (1F1B holds at most as many microbatches as there are stages after it, the last stage one: its peak is
        # mostly the backward pass's own; GPipe holds every microbatch's activations)
        limit = 0.5 if case.policy == "save-nothing" and case.schedule == "gpipe" else 0.9
        assert max(got["peak"]) < limit * min(want["peak"]), (got["peak"], want["peak"])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_peer_alongside(runs, schedule):
    """torch.utils.checkpoint on the same stages: the same gradients, bitwise."""
    for rank in range(WORLD):
        got, want = result(runs, Case(schedule, "torch-checkpoint"), rank), result(runs, Case(schedule, "none"), rank)
        assert_tree_close(got["grads"], want["grads"], rtol=0, atol=0)
