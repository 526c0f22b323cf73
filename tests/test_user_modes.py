"""A user's dispatch mode or module hooks around a remat'd call leave it exact, and still remat'd.

Profilers and debuggers install a ``TorchDispatchMode`` (torch's own
``CommDebugMode`` counts collectives) and global module hooks. Under a mode,
``param.data`` dispatches a ``detach``; a global full backward hook wraps every
module's inputs and outputs in ``BackwardHookFunction``, whose outputs are
``view``s of the same shape. Both happen in the forward pass and not in a
recompute that runs outside the mode, or the other way round. Before (issue
39), ``CommDebugMode`` around a remat'd call raised "the recompute diverged: op
#0 was aten.detach.default ... but aten.view.default now" on every policy,
where ``torch.utils.checkpoint`` runs. NOTE [hooks' aliases] in
``remat/_engine/dispatch.py``: such identity aliases are the same value under another
name; a pass may lack them or have more.

Every case compares ``remat(block, policy=p)`` with the plain block under the same
mode, on three calls, float64 and float32, bitwise; and checks from outside that
the recompute ran: the backward pass runs forward ops (``tanh``, the layer norm)
that plain autograd's backward pass never runs, under a policy that drops
something, and none under one that offloads. The block's Python runs once per
call on the replay engine (the first call of a memory budget measures on the
full engine, which runs it again in its recompute).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from remat import policies, remat_module

from .helpers import CountCalls, OpCounter, assert_tree_close

POLICIES: dict[str, Any] = {
    "save-nothing": "save-nothing",
    "dots_saveable": policies.dots_saveable,
    "memory_budget": policies.memory_budget(0.3),
    "offload": policies.offload_to_cpu(min_bytes=0),
}
RECOMPUTES = {"save-nothing": True, "dots_saveable": True, "memory_budget": True, "offload": False}
# forward ops that a backward pass runs only to recompute (plain autograd's backward pass runs none of them)
FORWARD_OPS = {torch.ops.aten.tanh.default, torch.ops.aten.native_layer_norm.default}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.count = CountCalls()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(self.count(x)))))


class Counting(TorchDispatchMode):
    """A mode that counts ops and runs ops of its own in its handler (a profiler taking statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.n += 1
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            out.detach().abs().sum()  # (its own op, inside its handler)
        return out


@contextlib.contextmanager
def full_backward_hooks() -> Iterator[None]:
    """A global full backward hook on every module (what torch's module trackers install)."""
    handle = nn.modules.module.register_module_full_backward_hook(lambda m, gi, go: None)
    try:
        yield
    finally:
        handle.remove()


def comm_debug() -> Any:
    from torch.distributed.tensor.debug import CommDebugMode

    return CommDebugMode()


MODES: dict[str, Callable[[], Any]] = {"comm-debug": comm_debug, "counting": Counting,
                                       "backward-hooks": full_backward_hooks}


def step(model: nn.Module, x: torch.Tensor, mode: Callable[[], Any] | None, where: str,
         replayed: list[int] | None = None) -> tuple[Any, ...]:
    """One forward and backward pass, with the mode around both, the forward pass only or the backward pass only;
    appends to ``replayed`` how many ``FORWARD_OPS`` the backward pass ran (seen inside the user's mode)."""
    fwd = mode() if mode is not None and where in ("both", "forward") else contextlib.nullcontext()
    bwd = mode() if mode is not None and where == "backward" else contextlib.nullcontext()
    counter = OpCounter(FORWARD_OPS)
    with fwd:
        out = model(x)
        if where == "both":
            with counter:
                out.pow(2).sum().backward()
    if where != "both":
        with bwd, counter:
            out.pow(2).sum().backward()
    if replayed is not None:
        replayed.append(counter.count)
    grads = tuple(p.grad.clone() for p in model.parameters())
    model.zero_grad(set_to_none=True)
    return (out.detach(), *grads)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("where", ["both", "forward", "backward"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", POLICIES)
def test_a_mode_or_hooks_around_the_call_leave_it_exact(policy, mode, where, dtype):
    torch.manual_seed(0)
    plain = Block().to(dtype)
    torch.manual_seed(0)
    budget = policy == "memory_budget"
    model = remat_module(Block().to(dtype), policy=policies.memory_budget(0.3) if budget else POLICIES[policy])
    x = torch.randn(2, 3, 8, dtype=dtype)
    for call in range(3):
        before = model.count.calls
        replayed: list[int] = []
        got = step(model, x, MODES[mode], where, replayed)
        want = step(plain, x, MODES[mode], where, replayed)
        # (a budget's measuring first call replays its program too: NOTE [program replay])
        assert model.count.calls - before == 1, f"call {call}"
        assert plain.count.calls == call + 1
        assert (replayed[0] > replayed[1]) == RECOMPUTES[policy], f"call {call}: forward ops in backward {replayed}"
        assert_tree_close(got, want, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_a_mode_between_calls_changes_nothing():
    """Calls with and without a mode alternate on one signature (its plan made under the mode, or not)."""
    torch.manual_seed(0)
    plain = Block().double()
    torch.manual_seed(0)
    model = remat_module(Block().double(), policy=policies.dots_saveable)
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    for mode, where in [(comm_debug, "forward"), (None, "both"), (comm_debug, "both"), (full_backward_hooks, "forward"),
                        (None, "both"), (comm_debug, "backward"), (full_backward_hooks, "both")]:
        assert_tree_close(step(model, x, mode, where), step(plain, x, mode, where), rtol=0, atol=0)


def test_a_detach_made_in_the_forward_pass_only_is_the_same_value():
    """A function whose forward pass alone detaches a tensor (an identity alias, the same value) recomputes the
    forward's values. One whose Python reads another value after the forward pass gets the forward's gradient on
    the replay engine (its Python is not run again); on the full engine (debug=True), which runs it again, it
    still raises (NOTE [same reads])."""
    from remat import RematError, remat

    W = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)

    def f(x):
        h = torch.tanh(x @ W)
        if torch.is_grad_enabled():
            h = h.view_as(h)  # the same value under another name, made under grad mode only
        return torch.sin(h @ W).sum()

    x = torch.randn(4, 8, dtype=torch.float64)
    g = remat(f, policy="save-nothing")
    for _ in range(3):
        assert_tree_close(torch.autograd.grad(g(x), W), torch.autograd.grad(f(x), W), rtol=0, atol=0)

    scale = {"s": 1.0}

    def h(x):
        return torch.sin(torch.tanh(x @ W) * scale["s"] @ W).sum()

    gh = remat(h, policy="save-nothing")
    for _ in range(2):
        want = torch.autograd.grad(h(x), W)
        y = gh(x)
        scale["s"] += 1.0
        assert_tree_close(torch.autograd.grad(y, W), want, rtol=1e-10, atol=1e-10)

    debug = remat(h, policy="save-nothing", debug=True)
    for _ in range(2):
        y = debug(x)
        scale["s"] += 1.0
        with pytest.raises(RematError, match="read other values"):
            torch.autograd.grad(y, W)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("policy", ["save-nothing", "dots_saveable"])
def test_every_call_drops_what_the_policy_drops_with_or_without_a_mode(policy):
    """Measured from outside (the bytes the forward pass's ops allocated and still alive at its end): a call after one
    under CommDebugMode (whose plan has the mode's aliases) or with global backward hooks keeps what a call without
    them keeps, and less than the block without remat. Before, a call without the mode after the plan was made
    under it left the plan at the hooks' first view and held everything for that call."""
    from remat.bench.measure import LiveCensus

    torch.manual_seed(0)
    big = nn.Sequential(*[Block() for _ in range(3)]).double()
    model = nn.Sequential(*[remat_module(Block(), policy=POLICIES[policy]) for _ in range(3)]).double()
    model.load_state_dict(big.state_dict())
    x = torch.randn(16, 32, 8, dtype=torch.float64)

    def kept(m: nn.Module, mode: Callable[[], Any] | None) -> int:
        with mode() if mode is not None else contextlib.nullcontext(), LiveCensus() as census:
            loss = m(x).pow(2).sum()
            live = census.live
            loss.backward()
        return live

    plain = kept(big, None)
    first = copy.deepcopy(model)  # (same weights, plans of its own: its first call is under the mode)
    alone = [kept(model, None) for _ in range(2)][-1]
    assert alone < plain * (0.5 if policy == "save-nothing" else 0.8)
    for m, modes in [(first, [comm_debug, None, None, full_backward_hooks, None, comm_debug, None]),
                     (model, [comm_debug, None, full_backward_hooks, None, comm_debug, comm_debug, None])]:
        for mode in modes:
            assert kept(m, mode) == alone, mode
