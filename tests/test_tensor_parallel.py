"""Tensor parallel: transformer blocks under ``parallelize_module`` (DTensor parameters), remat'd, on two gloo processes.

Each block is pre-norm attention then an MLP, float64; its attention's ``q``, ``k``,
``v`` and its MLP's ``up`` are ``ColwiseParallel``, ``o`` and ``down``
``RowwiseParallel`` (each rank holds half the heads and half the hidden units;
the row-wise products are all-reduced), as torchtitan shards a Llama block.
Every block is remat'd in place (``remat_module``, before or after
``parallelize_module``), or checkpointed with ``torch.utils.checkpoint``
(the peer), or neither (the baselines). Two SGD steps; per step the tests get
the loss, every parameter's full gradient (``full_tensor()``), the blocks'
forward calls and the matmuls the backward pass ran (counted from outside by a
dispatch mode around it, itself a user's mode around a remat'd call).

Before (issue 39): every row-wise weight's gradient was NaN in every element, no
error, under save-nothing and save-matmuls, and ``memory_budget`` raised from
its save hook: ``DTensor.from_local``/``to_local`` wrap and unwrap in Python,
which no dispatch mode sees, so the liveness walk found the GELU feeding
``down`` dead and handed its placeholder to the recompute (NOTE [wrapper
subclasses] in ``remat/_engine/dispatch.py``). And ``CommDebugMode`` around the call
raised a divergence: its module hooks run ``param.data`` (a ``detach``) and
``BackwardHookFunction`` views in the forward pass only (NOTE [hooks' aliases]).

The tests check, per case:

- loss and gradients equal one process without tensor parallel or remat
  (1e-10: the all-reduce sums halves in another order), on both ranks;
- and bitwise those of the same tensor-parallel run without remat;
- the policies decide on DTensor ops as on plain ones, measured from outside:
  under save-nothing the backward pass runs five more matmuls per block
  (``q``, ``k``, ``v``, ``o``, ``up``: not ``down``, whose product feeds only the
  block's residual add, which the backward pass does not read: NOTE [dead ops]),
  as many as ``torch.utils.checkpoint``; none more under ``dots_saveable`` or
  offloading; and each block's forward runs twice per step.

Then FSDP2 and tensor parallel together (a 2-D mesh, four processes: tensor parallel
within pairs, ``fully_shard`` across them): gradients equal one process and,
bitwise, the 2-D run without remat.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from remat import checkpoint_name, policies, remat_module
from remat.bench.measure import LiveCensus

from .helpers import CountCalls, OpCounter, assert_tree_close
from .spawned import result, spawn

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed or its gloo backend is not available in this torch build",
)

WORLD = 2
DIM, HEADS, HIDDEN, BLOCKS, BATCH, SEQ, STEPS, LR = 16, 4, 32, 2, 2, 5, 2, 0.1
POLICIES: dict[str, Any] = {
    "none": None,
    "save-nothing": "save-nothing",
    "dots_saveable": policies.dots_saveable,
    "names": policies.save_only_these_names("attn_out"),
    "memory_budget": policies.memory_budget(0.3),
    "offload": policies.offload_to_cpu(min_bytes=0),
}
# per block and step, beyond the plain backward pass, counted from outside
# (q, k, v, o and up: o's all-reduced product feeds norm2, whose backward reads its input; down's feeds only the
# block's residual add, whose backward reads nothing, so neither remat nor torch's early stop runs it again)
EXTRA_BACKWARD_MATMULS = {"none": 0, "torch-checkpoint": 5, "save-nothing": 5, "dots_saveable": 0, "names": 5,
                          "offload": 0}


@dataclasses.dataclass(frozen=True)
class Case:
    policy: str  # a key of POLICIES, or "torch-checkpoint" (the peer)
    remat_first: bool = False  # remat_module before parallelize_module
    mode: str = ""  # "comm-debug": CommDebugMode around forward and backward; "comm-debug-forward": forward only

    @property
    def id(self) -> str:
        return "-".join(x for x in ("tp", self.policy, "remat-first" if self.remat_first else "", self.mode) if x)

    @property
    def baseline(self) -> Case:
        return Case("none")


CASES = [
    *(Case(p) for p in POLICIES),
    Case("torch-checkpoint"),
    Case("save-nothing", remat_first=True),
    Case("dots_saveable", remat_first=True),
    Case("save-nothing", mode="comm-debug"),
    Case("dots_saveable", mode="comm-debug-forward"),
    Case("none", mode="comm-debug"),
    Case("torch-checkpoint", mode="comm-debug"),
]
REMAT_CASES = [c for c in CASES if c.policy != "none"]


# ---- the model ---------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # (-1: the heads this rank holds, half of them under tensor parallel, as torchtitan writes it)
        q, k, v = (m(x).view(b, t, -1, DIM // HEADS).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        return self.o(checkpoint_name(y, "attn_out"))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn, self.mlp = Attention(), MLP()
        self.count = CountCalls()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(self.count(x)))
        return x + self.mlp(self.norm2(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.checkpoint = False  # the peer: each block through torch.utils.checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return x


TP_PLAN = {"attn.q": "col", "attn.k": "col", "attn.v": "col", "attn.o": "row", "mlp.up": "col", "mlp.down": "row"}


def make_net() -> Net:
    torch.manual_seed(0)
    return Net().double()


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(BATCH, SEQ, DIM, generator=g, dtype=torch.float64),
            torch.randn(BATCH, SEQ, DIM, generator=g, dtype=torch.float64))


def train(net: Net, x: torch.Tensor, y: torch.Tensor, mode: str = "") -> dict[str, Any]:
    """STEPS steps of SGD; per step the loss, the full gradients, block calls and backward matmuls."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    opt = torch.optim.SGD(net.parameters(), lr=LR)
    out: dict[str, Any] = {"loss": [], "grads": [], "calls": [], "matmuls": [], "collectives": [], "retained": []}
    for _ in range(STEPS):
        counts = [b.count.calls for b in net.blocks]
        # a user's dispatch mode, and the module hooks it installs, around the step or its forward pass only
        comm = CommDebugMode() if mode else _nothing()
        comm.__enter__()
        try:
            with LiveCensus() as census:  # (from outside: a DTensor's shard weighed, NOTE [wrapper subclasses])
                loss = ((net(x) - y) ** 2).mean()
            out["retained"].append(census.live)
        finally:
            if mode != "comm-debug":
                comm.__exit__(None, None, None)
        try:
            with OpCounter() as oc:
                loss.backward()
        finally:
            if mode == "comm-debug":
                comm.__exit__(None, None, None)
                out["collectives"].append(comm.get_total_counts())
        out["calls"].append([b.count.calls - c for b, c in zip(net.blocks, counts)])
        out["matmuls"].append(oc.count)
        out["loss"].append(loss.detach().clone())
        out["grads"].append({n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                             for n, p in net.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


class _nothing:
    def __enter__(self) -> _nothing:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def run_case(case: Case, rank: int, group: dist.ProcessGroup) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    net = make_net()
    x, y = make_data()
    mesh = DeviceMesh.from_group(group, "cpu")
    plan = {k: ColwiseParallel() if v == "col" else RowwiseParallel() for k, v in TP_PLAN.items()}
    policy = POLICIES.get(case.policy)
    for block in net.blocks:
        if case.remat_first and policy is not None:
            remat_module(block, policy=policy)
        parallelize_module(block, mesh, plan)
        if not case.remat_first and policy is not None:
            remat_module(block, policy=policy)
    net.checkpoint = case.policy == "torch-checkpoint"
    return train(net, x, y, case.mode)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn(run_case, CASES, tmp_path_factory.mktemp("tensor_parallel"), WORLD, timeout_s=150)


@pytest.fixture(scope="module")
def single_process() -> dict[str, Any]:
    """The same model in one process: no tensor parallel, no remat."""
    return train(make_net(), *make_data())


# ---- the tests ---------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_single_process_without_remat(runs, single_process, case):
    for rank in range(WORLD):
        got = result(runs, case, rank)
        assert all(torch.isfinite(g).all() for step in got["grads"] for g in step.values())
        assert_tree_close((got["loss"], got["grads"]), (single_process["loss"], single_process["grads"]),
                          rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", REMAT_CASES, ids=lambda c: c.id)
def test_matches_same_run_without_remat_bitwise(runs, case):
    for rank in range(WORLD):
        got, want = result(runs, case, rank), result(runs, case.baseline, rank)
        assert_tree_close((got["loss"], got["grads"]), (want["loss"], want["grads"]), rtol=0, atol=0)


@pytest.mark.parametrize("case", [c for c in CASES if c.policy in EXTRA_BACKWARD_MATMULS], ids=lambda c: c.id)
def test_policies_decide_on_dtensor_ops(runs, case):
    """Counted from outside: the recompute runs each block's forward once more and, per block, the matmuls the
    policy does not save and the backward pass needs (the row-wise ones feed residual adds: not run)."""
    for rank in range(WORLD):
        got, plain = result(runs, case, rank), result(runs, case.baseline, rank)
        # (offloading every saved tensor recomputes nothing)
        assert got["calls"] == [[1 if case.policy in ("none", "offload") else 2] * BLOCKS] * STEPS
        extra = [m - p for m, p in zip(got["matmuls"], plain["matmuls"])]
        assert extra == [EXTRA_BACKWARD_MATMULS[case.policy] * BLOCKS] * STEPS, extra


def test_policies_keep_what_they_say_on_dtensors(runs):
    """Measured from outside (bytes the forward pass's ops allocated, alive at its end, shards included), every step:
    save-nothing keeps under half of the tensor-parallel run without remat (no call silently saves everything),
    save-matmuls keeps more than save-nothing (the matmul outputs it holds) and less than no remat."""
    for rank in range(WORLD):
        plain = result(runs, Case("none"), rank)["retained"]
        nothing = result(runs, Case("save-nothing"), rank)["retained"]
        dots = result(runs, Case("dots_saveable"), rank)["retained"]
        assert all(n < 0.5 * p and n < d < p for n, d, p in zip(nothing, dots, plain)), (nothing, dots, plain)


# ---- FSDP2 and tensor parallel together: a 2-D mesh, four processes ----------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case2D:
    policy: str

    @property
    def id(self) -> str:
        return f"fsdp-tp-{self.policy}"


CASES_2D = [Case2D(p) for p in ("none", "save-nothing", "dots_saveable", "names")]


def run_case_2d(case: Case2D, rank: int, group: dist.ProcessGroup) -> dict[str, Any]:
    """Tensor parallel within pairs of processes, FSDP2 across them (torchtitan's 2-D layout), each data-parallel
    pair on its half of the batch."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))
    net = make_net()
    plan = {k: ColwiseParallel() if v == "col" else RowwiseParallel() for k, v in TP_PLAN.items()}
    for block in net.blocks:
        parallelize_module(block, mesh["tp"], plan)
        fully_shard(block, mesh=mesh["dp"])
        if POLICIES[case.policy] is not None:
            remat_module(block, policy=POLICIES[case.policy])
    fully_shard(net, mesh=mesh["dp"])
    x, y = make_data()
    dp = mesh["dp"].get_local_rank()
    share = BATCH // 2
    return train(net, x[dp * share:(dp + 1) * share], y[dp * share:(dp + 1) * share])


@pytest.fixture(scope="module")
def runs_2d(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn(run_case_2d, CASES_2D, tmp_path_factory.mktemp("fsdp_tp"), 4, timeout_s=150)


@pytest.mark.parametrize("case", CASES_2D, ids=lambda c: c.id)
def test_fsdp_and_tensor_parallel_together(runs_2d, single_process, case):
    """Gradients equal one process without sharding or remat (1e-10; the loss each data-parallel pair reports is
    its half's), and bitwise the same 2-D run without remat."""
    for rank in range(4):
        got, want = result(runs_2d, case, rank), result(runs_2d, Case2D("none"), rank)
        assert all(torch.isfinite(g).all() for step in got["grads"] for g in step.values())
        assert_tree_close(got["grads"], single_process["grads"], rtol=1e-10, atol=1e-10)
        assert_tree_close((got["loss"], got["grads"]), (want["loss"], want["grads"]), rtol=0, atol=0)
