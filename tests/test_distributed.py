"""Data parallelism: DDP and FSDP2 (``fully_shard``) over gloo, two processes, with blocks remat'd in place.

Each case trains a small float64 stack of residual blocks (LayerNorm, Linear,
tanh-GELU, Linear) for two SGD steps on two ranks, each rank on half the batch,
with every block remat'd in place (``remat_module`` before DDP or
``fully_shard``, ``remat_modules(net, Block)`` after it; or not, for the
baselines), and records per step the loss, every parameter's full gradient (FSDP2's sharded
DTensor gradients gathered with ``full_tensor()``), how many times each block's
Python forward ran and how many matmuls and LayerNorms the backward pass ran. The tests then
check, per case:

- loss and gradients equal those of one process running the same model without
  remat over the whole batch (``allclose`` at 1e-10: the all-reduce sums the two
  halves in another order), and are the same on both ranks;
- loss and gradients equal, bitwise, those of the same distributed run without
  remat: remat changes no result;
- the recompute ran: the backward pass runs one more LayerNorm per block under
  remat (its mean and rstd, which both policies drop, recomputed), one more matmul
  per block under save-nothing (the recompute of the first Linear), none more under
  ``dots_saveable``; each block's Python forward runs once per step (the replay
  engine replays the recorded ops in the backward pass, not the Python);
- under FSDP2 with ``reshard_after_forward=True`` (the default) the blocks'
  parameters were sharded again between forward and backward, so the
  recompute read parameters FSDP2 had gathered anew.

FSDP2's hooks inside the remat'd region (issue 39; before, "the recompute
diverged: op #0 was aten.empty.memory_format"): a block whose *submodules* are
sharded, remat'd with ``remat_module``; a closure calling the sharded block
(``remat(lambda x: block(x))``); the block's ``__call__`` (``checkpoint(layer.__call__, ...)``
style, as Hugging Face's gradient-checkpointing hook calls it); and the peer,
``torch.utils.checkpoint.checkpoint(block, x)``. These also count, from outside
(``CommDebugMode``), the all-gathers and reduce-scatters of each step: remat
gathers parameters no more often than the run without remat or
``torch.utils.checkpoint`` (NOTE [FSDP's hooks] in ``remat/_engine/dispatch.py``), and
the parameters are sharded again after the backward pass.

The second step runs with the parameters the first step's update wrote (into
FSDP2's shards): a recompute that read stale or resharded parameters would
change its gradients. All cases run in one ``torch.multiprocessing.spawn`` of
two processes (started once per module, results passed back through files),
each case in its own process group so that one failing case does not derail
the others; the spawn has a time limit so that a hang fails instead of
blocking CI.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from remat import policies, remat, remat_module, remat_modules
from remat.bench.measure import LiveCensus

from .helpers import CountCalls, OpCounter, assert_tree_close
from .spawned import result, spawn

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed or its gloo backend is not available in this torch build",
)

WORLD = 2
DIM, HIDDEN, BLOCKS, BATCH, STEPS, LR = 8, 16, 3, 64, 2, 0.1
SPAWN_TIMEOUT_S = 90  # the whole spawn, every case; a hang fails the tests instead of blocking CI
POLICIES: dict[str, Any] = {"none": None, "save-nothing": "save-nothing", "dots_saveable": policies.dots_saveable}
# per step, beyond the plain backward pass: save-nothing recomputes each block's `up` product (GELU's backward
# reads its output) but not `down`'s, whose output the backward pass never reads (NOTE [dead ops]);
# dots_saveable keeps both products
EXTRA_BACKWARD_MATMULS = {"none": 0, "save-nothing": BLOCKS, "dots_saveable": 0}
# and both recompute each block's LayerNorm (its backward reads the mean and rstd the op returned, dropped by both)
LAYER_NORM = torch.ops.aten.native_layer_norm.default
EXTRA_BACKWARD_NORMS = {"none": 0, "save-nothing": BLOCKS, "dots_saveable": BLOCKS}


@dataclasses.dataclass(frozen=True)
class Case:
    parallel: str  # "ddp" or "fsdp"
    policy: str  # a key of POLICIES
    reshard_after_forward: bool = True  # fsdp: the blocks' setting (True is fully_shard's default)
    remat_first: bool = False  # fsdp: remat_module before fully_shard instead of after
    shard_linears: bool = False  # fsdp: fully_shard each block's Linears instead of the block
    # fsdp: how the sharded block is called with its hooks inside the region: "closure" (remat(lambda x: block(x))),
    # "call" (remat(block.__call__)), "torch" (torch.utils.checkpoint.checkpoint(block, x), the peer); "" otherwise
    inside: str = ""

    @property
    def id(self) -> str:
        parts = [self.parallel]
        if self.parallel == "fsdp":
            parts.append("reshard" if self.reshard_after_forward else "no-reshard")
            if self.remat_first:
                parts.append("remat-first")
            if self.shard_linears:
                parts.append("linears-sharded")
            if self.inside:
                parts.append(f"hooks-inside-{self.inside}")
        return "-".join([*parts, self.policy])

    @property
    def baseline(self) -> Case:
        """The same distributed run without remat."""
        return dataclasses.replace(self, policy="none", remat_first=False, inside="")


CASES = [
    *(Case("ddp", p) for p in POLICIES),
    *(Case("fsdp", p, reshard_after_forward=r) for r in (True, False) for p in POLICIES),
    Case("fsdp", "save-nothing", remat_first=True),
    Case("fsdp", "none", shard_linears=True),
    # FSDP2's hooks inside the remat'd region (NOTE [FSDP's hooks] in remat/_engine/dispatch.py)
    *(Case("fsdp", p, shard_linears=True) for p in ("save-nothing", "dots_saveable")),
    *(Case("fsdp", p, inside=w) for w in ("closure", "call") for p in ("save-nothing", "dots_saveable")),
    Case("fsdp", "none", inside="torch"),
]
REMAT_CASES = [c for c in CASES if c.policy != "none"]
HOOKS_INSIDE = [c for c in CASES if c.inside or c.shard_linears]


# ---- the model ---------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.act = nn.GELU(approximate="tanh")
        self.count = CountCalls()
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.count(self.act(self.up(self.norm(x)))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, 1)

        self.wrap: Any = None  # how each block is called (Case.inside)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x) if self.wrap is None else self.wrap(block, x)
        return self.head(x)


def make_net() -> Net:
    torch.manual_seed(0)
    return Net().double()


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(BATCH, DIM, generator=g, dtype=torch.float64),
            torch.randn(BATCH, 1, generator=g, dtype=torch.float64))


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def train(model: nn.Module, named: nn.Module, x: torch.Tensor, y: torch.Tensor, full_loss: Any,
          full_grad: Any, count_collectives: bool = False) -> dict[str, Any]:
    """STEPS steps of SGD; per step the (global) loss, the full gradients, block calls, backward matmuls and
    LayerNorms (and the collectives of the step, counted by CommDebugMode around it)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode

    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out: dict[str, Any] = {"loss": [], "grads": [], "calls": [], "matmuls": [], "norms": [], "sharded": [],
                           "collectives": [], "sharded_after_backward": [], "retained": []}
    for _ in range(STEPS):
        counts = [b.count.calls for b in named.blocks]
        comm = CommDebugMode()
        if count_collectives:
            comm.__enter__()
        try:
            with LiveCensus() as census:
                loss = loss_fn(model, x, y)
            out["retained"].append(census.live)
            # FSDP2 registers the sharded parameters again after a block's forward pass if it reshards
            out["sharded"].append([isinstance(b.up.weight, DTensor) for b in named.blocks])
            with OpCounter() as oc, OpCounter({LAYER_NORM}) as norms:
                loss.backward()
        finally:
            if count_collectives:
                comm.__exit__(None, None, None)
                out["collectives"].append({str(k): v for k, v in comm.get_comm_counts().items()})
        out["sharded_after_backward"].append([isinstance(b.up.weight, DTensor) for b in named.blocks])
        out["calls"].append([b.count.calls - c for b, c in zip(named.blocks, counts)])
        out["matmuls"].append(oc.count)
        out["norms"].append(norms.count)
        out["loss"].append(full_loss(loss.detach()))
        out["grads"].append({n: full_grad(p.grad).clone() for n, p in named.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


# ---- the distributed runs ----------------------------------------------------------


def run_case(case: Case, rank: int, group: dist.ProcessGroup) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    net = make_net()
    x, y = make_data()
    share = BATCH // WORLD
    x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]

    def remat_each_block() -> None:
        if case.policy != "none":
            for b in net.blocks:
                remat_module(b, policy=POLICIES[case.policy])

    def full_loss(loss: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(loss, group=group)
        return loss / WORLD

    if case.parallel == "ddp":
        remat_each_block()
        model: nn.Module = DistributedDataParallel(net, process_group=group)
        return train(model, net, x, y, full_loss, lambda g: g)

    mesh = DeviceMesh.from_group(group, "cpu")
    policy = POLICIES[case.policy]
    if case.inside == "closure":
        net.wrap = lambda block, x: remat(lambda y: block(y), policy=policy)(x)
    elif case.inside == "call":
        net.wrap = lambda block, x: remat(block.__call__, policy=policy)(x)
    elif case.inside == "torch":
        net.wrap = lambda block, x: torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    if case.remat_first:
        remat_each_block()
    for b in net.blocks:
        for m in (b.up, b.down) if case.shard_linears else (b,):
            fully_shard(m, mesh=mesh, reshard_after_forward=case.reshard_after_forward)
    fully_shard(net, mesh=mesh)
    if not case.remat_first and case.policy != "none" and not case.inside:
        # fully_shard changed the blocks' class to a subclass (FSDPBlock): selecting by Block still finds them
        names = remat_modules(net, Block, policy=POLICIES[case.policy])
        assert names == [f"blocks.{i}" for i in range(BLOCKS)], names
    return train(net, net, x, y, full_loss, lambda g: g.full_tensor() if isinstance(g, DTensor) else g,
                 count_collectives=case.parallel == "fsdp" and not case.remat_first)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn(run_case, CASES, tmp_path_factory.mktemp("distributed"), WORLD, SPAWN_TIMEOUT_S)


@pytest.fixture(scope="module")
def single_process() -> dict[str, Any]:
    """The same model without remat, one process, the whole batch."""
    net = make_net()
    x, y = make_data()
    return train(net, net, x, y, lambda loss: loss, lambda g: g)


# ---- the tests ---------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_single_process_without_remat(runs, single_process, case):
    for rank in range(WORLD):
        got = result(runs, case, rank)
        assert_tree_close((got["loss"], got["grads"]), (single_process["loss"], single_process["grads"]),
                          rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", REMAT_CASES, ids=lambda c: c.id)
def test_matches_same_run_without_remat(runs, case):
    for rank in range(WORLD):
        got, want = result(runs, case, rank), result(runs, case.baseline, rank)
        assert_tree_close((got["loss"], got["grads"]), (want["loss"], want["grads"]), rtol=0, atol=0)


@pytest.mark.parametrize("case", [c for c in CASES if c.parallel == "fsdp"], ids=lambda c: c.id)
def test_fsdp_resharded_between_forward_and_backward(runs, case):
    """After the forward pass the blocks' parameters were sharded again (or stayed gathered, without resharding)."""
    for rank in range(WORLD):
        assert result(runs, case, rank)["sharded"] == [[case.reshard_after_forward] * BLOCKS] * STEPS


@pytest.mark.parametrize("case", [c for c in CASES if c.inside != "torch"], ids=lambda c: c.id)
def test_recompute_ran(runs, case):
    """Counted from outside: the ops the backward pass recomputes; each block's Python ran once a step (twice where
    FSDP2-sharded Linears sit inside the block: FSDP2 gathers their parameters again only when the backward pass
    reaches them, so that call takes the re-run engine, docs/how-it-works.md "Where the replay does not serve")."""
    for rank in range(WORLD):
        got, plain = result(runs, case, rank), result(runs, case.baseline, rank)
        assert got["calls"] == [[2 if case.shard_linears and case.policy != "none" else 1] * BLOCKS] * STEPS
        assert [m - p for m, p in zip(got["matmuls"], plain["matmuls"])] == [EXTRA_BACKWARD_MATMULS[case.policy]] * STEPS
        assert [n - p for n, p in zip(got["norms"], plain["norms"])] == [EXTRA_BACKWARD_NORMS[case.policy]] * STEPS


def test_torch_checkpoint_reruns_the_python(runs):
    """The peer, torch.utils.checkpoint, re-runs each block's Python in the backward pass (and its matmul)."""
    case = Case("fsdp", "none", inside="torch")
    for rank in range(WORLD):
        got, plain = result(runs, case, rank), result(runs, case.baseline, rank)
        assert got["calls"] == [[2] * BLOCKS] * STEPS
        assert [m - p for m, p in zip(got["matmuls"], plain["matmuls"])] == [BLOCKS] * STEPS


@pytest.mark.parametrize("case", HOOKS_INSIDE, ids=lambda c: c.id)
def test_fsdp_hooks_inside_the_region_gather_no_more_and_reshard(runs, case):
    """Counted from outside: a step with FSDP2's hooks inside the remat'd region all-gathers and reduce-scatters as
    often as the same step without remat (and as torch.utils.checkpoint); the parameters are sharded again after
    the backward pass."""
    plain = Case("fsdp", "none", shard_linears=case.shard_linears)
    for rank in range(WORLD):
        got, want = result(runs, case, rank), result(runs, plain, rank)
        assert got["collectives"] == want["collectives"] and got["collectives"][0], got["collectives"]
        assert got["sharded_after_backward"] == [[True] * BLOCKS] * STEPS


@pytest.mark.parametrize("case", [c for c in REMAT_CASES if c.policy == "save-nothing"], ids=lambda c: c.id)
def test_remat_keeps_less(runs, case):
    """Measured from outside (the bytes the forward pass's ops allocated, alive at its end): save-nothing keeps less
    than half of what the same run without remat keeps, on every step: no call silently saves everything (a step
    also holds what DDP or FSDP2 allocate anyway, a few KiB)."""
    for rank in range(WORLD):
        got, want = result(runs, case, rank)["retained"], result(runs, case.baseline, rank)["retained"]
        assert all(g < 0.5 * w for g, w in zip(got, want)), (got, want)
