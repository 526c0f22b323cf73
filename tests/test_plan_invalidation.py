"""When a call cannot follow its signature's plan (NOTE [fast path] and NOTE [planned calls] in
``remat/_engine/plans.py``): another signature records again; calls that are never planned keep the full engine and
its checks; a call that leaves its plan is exact, and its signature runs on the full engine from then on; a
recompute that diverges from its forward pass raises ``RematError``.

Whether a call ran fast is observed from inside the function, independently of remat's bookkeeping (``Probe``:
the full engine's recorder is a ``TorchDispatchMode`` of ``remat._dispatch`` on the stack, the fast path's are of
``remat._engine``). Gradients are compared with the plain function under the same inputs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat import RematError, policies, remat, remat_module

from .helpers import Probe, assert_tree_close, chain, f32, f64, grads, leaf

# ---- another signature records again -------------------------------------------------------------------------------


@pytest.mark.parametrize("change", ["shape", "dtype", "requires_grad", "training", "autocast", "module state shape"])
def test_signature_change_records_again(change):
    probe = Probe()
    lin = nn.Linear(8, 8).double()

    def f(x):
        probe()
        return torch.tanh(lin(x))

    g = remat(f)
    x = leaf(4, 8)
    g(x).sum().backward()
    g(x).sum().backward()
    assert len(g._plans) == 1 and probe.fast_calls()[-2:] == [True, True]
    if change == "shape":
        x = leaf(5, 8)
    elif change == "dtype":
        x, lin = leaf(4, 8, dtype=f32), lin.float()
    elif change == "requires_grad":
        x = leaf(4, 8, grad=False)
    elif change == "training":
        lin.eval()
    elif change == "module state shape":
        lin.weight = nn.Parameter(torch.randn(8, 8, dtype=f64, requires_grad=True)[:, :8].contiguous())
        lin.bias = nn.Parameter(torch.randn(1, 8, dtype=f64))
    probe.modes.clear()
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if change == "autocast" else torch.enable_grad()
    with ctx:
        out = g(x)
        ref_out = f(x)
    ref = torch.autograd.grad(ref_out.float().sum(), [p for p in (x, *lin.parameters()) if p.requires_grad])
    got = torch.autograd.grad(out.float().sum(), [p for p in (x, *lin.parameters()) if p.requires_grad])
    assert_tree_close(got, ref)
    assert len(g._plans) == 2  # a new signature, recorded by the full engine
    assert probe.modes[0] is True  # g's call ran under the recorder


# ---- calls that are never planned keep the full engine and its checks ----------------------------------------------


def test_training_batchnorm_never_takes_the_fast_path():
    """BatchNorm in training mode writes its running statistics: the full engine writes them once."""
    probe = Probe()
    bn = nn.BatchNorm1d(8).double()

    def f(x):
        probe()
        return torch.tanh(bn(x))

    g = remat(f)
    x = leaf(16, 8)
    for _ in range(3):
        g(x).sum().backward()
    assert list(g._plans.values()) == [None]
    assert not any(probe.fast_calls())
    assert bn.num_batches_tracked.item() == 3  # once per call, never again in a recompute
    bn.eval()
    probe.modes.clear()
    for _ in range(2):
        g(x).sum().backward()
    assert probe.fast_calls() == [False, False, True, True]  # eval: another signature, clean


_GLOBAL = torch.randn(4, 4, dtype=f64)  # a global: the state walk does not reach it, the recorder watches it


def test_nested_and_outside_tensors_keep_the_full_engine():
    probe = Probe()
    inner = remat(lambda h: torch.sin(h) * 2, policy=policies.dots_saveable)

    def nested(W, x):
        probe()
        return inner(torch.tanh(x @ W)).sum()

    def reads_global(W, x):
        probe()
        return (torch.tanh(x @ W) @ _GLOBAL).sum()

    W, x = leaf(4, 4), leaf(3, 4, seed=1)
    for f in (nested, reads_global):
        g = remat(f)
        probe.modes.clear()
        for _ in range(2):
            assert_tree_close(torch.autograd.grad(g(W, x), (W, x)), torch.autograd.grad(f(W, x), (W, x)))
        assert list(g._plans.values()) == [None], f.__name__
        assert not any(probe.modes[i] is False for i in (0, 1, 3, 4)), f.__name__


def test_under_torch_func_no_fast_path():
    probe = Probe()
    f = chain(probe)
    g = remat(f)
    W, b, x = leaf(5, 5), leaf(5, seed=1), leaf(2, 5, seed=2)
    for _ in range(2):
        got = torch.func.grad(lambda W: g(W, b, x).sum())(W)
        assert_tree_close(got, torch.func.grad(lambda W: f(W, b, x).sum())(W))
    assert not g._plans


def test_several_outputs_keep_the_full_engine_and_its_checks():
    """Only the full engine skips what feeds outputs a backward pass does not differentiate (NOTE [unused
    outputs]): a call with several differentiable outputs is never planned. Its checks hold on every call."""

    def f(W, x):
        a = x @ W
        return a, torch.tanh(a)  # tanh saves its output: dropped, recomputed from the held matmul output

    W, x = leaf(4, 4), leaf(2, 4, seed=1)
    g = remat(f, policy=policies.dots_saveable)
    a, b = g(W, x)
    (a.sum() + b.sum()).backward()
    assert list(g._plans.values()) == [None]
    a, b = g(W, x)
    with torch.no_grad():
        a.mul_(2)  # the matmul's output, which the call holds for its recompute
    with pytest.raises(RematError, match="modified in place"):
        (b.sum()).backward()


def test_debug_runs_every_call_on_the_full_engine():
    probe = Probe()
    f = chain(probe)
    g = remat(f, debug=True)
    W, b, x = leaf(5, 5), leaf(5, seed=1), leaf(2, 5, seed=2)
    for _ in range(3):
        assert_tree_close(grads(g, (W, b, x), (W, b, x)), grads(f, (W, b, x), (W, b, x)))
    assert not g._plans
    assert probe.modes[::3] == [True, True, True]  # each remat'd forward ran under the recorder
    with pytest.raises(TypeError, match="debug must be True or False"):
        remat(f, debug="yes")


def test_numbers_that_change_before_the_recompute_keep_the_full_engine():
    """The full engine checks each op's Python numbers in the recompute; a signature whose recorded call fails
    that check is never planned, so every call keeps raising rather than a later one going silently wrong."""

    class Ramp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.step = 0

        def forward(self, x):
            self.step += 1  # the recompute would see the next step's scale
            return torch.tanh(self.lin(x) * min(1.0, self.step / 10))

    m = remat_module(Ramp().double())
    x = leaf(3, 4)
    for _ in range(3):
        with pytest.raises(RematError, match="read other values than in the forward pass: argument #1 is"):
            m(x).sum().backward()
    assert list(m.forward._plans.values()) == [None]


# ---- a call that leaves its plan is exact, then the full engine runs -----------------------------------------------


def test_data_dependent_state_write_raises_then_the_full_engine_runs():
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("n", torch.zeros(()))
            self.count = False

        def forward(self, x):
            if self.count:
                self.n.add_(1)
            return torch.sin(x) * 2

    m = Counter().double()
    g = remat(m)
    x = leaf(4)
    g(x).sum().backward()
    g(x).sum().backward()
    m.count = True
    with pytest.raises(RematError, match=r"wrote Counter.n in place in this call.*first call"):
        g(x)
    assert list(g._inner._plans.values()) == [None]  # the full engine from now on, exactly
    n0 = m.n.item()
    out = g(x)
    assert m.n.item() == n0 + 1
    (gx,) = torch.autograd.grad(out.sum(), (x,))
    assert m.n.item() == n0 + 1  # the recompute did not write it again
    assert_tree_close(gx, 2 * torch.cos(x))


def test_planned_call_leaving_the_plan_is_exact_then_the_full_engine_runs():
    extra = {"on": False}

    def f(W, x):
        h = torch.sin(x @ W)
        if extra["on"]:
            h = torch.exp(h) * 0.1  # ops the plan does not have
        return torch.tanh(h @ W)

    W, x = leaf(6, 6), leaf(3, 6, seed=1)
    g = remat(f, policy=policies.dots_saveable)
    g(W, x).sum().backward()
    extra["on"] = True
    ref = grads(f, (W, x), (W, x))
    assert_tree_close(grads(g, (W, x), (W, x)), ref)  # left the plan at exp: every later save held
    assert list(g._plans.values()) == [None]  # the full engine from now on
    assert_tree_close(grads(g, (W, x), (W, x)), ref)


# ---- a recompute that diverges from its forward pass raises --------------------------------------------------------


def test_flag_flipped_between_forward_and_backward_is_caught():
    """An impure function: what the recompute saves is made by another op; never a wrong gradient."""
    flag = {"cos": False}

    def f(W, x):
        h = torch.cos(x) if flag["cos"] else torch.sin(x)
        return h @ W

    g = remat(f)
    W, x = leaf(4, 4), leaf(2, 4, seed=1)
    g(W, x).sum().backward()
    out = g(W, x)
    flag["cos"] = True
    with pytest.raises(RematError, match="op #0 was aten.sin.default in the forward pass but aten.cos.default now"):
        out.sum().backward()


def test_recompute_shape_divergence_is_caught():
    n = [4]

    def f(W, x):
        return torch.sin(x[:, : n[0]]) @ W[: n[0]]

    g = remat(f)
    W, x = leaf(4, 4), leaf(2, 4, seed=1)
    g(W, x).sum().backward()
    out = g(W, x)
    n[0] = 3
    with pytest.raises(RematError, match="diverged from its forward pass: op #0 was aten.alias.default"):
        out.sum().backward()


def test_planned_recompute_that_runs_other_ops_raises():
    flag = {"cos": False}

    def f(W, x):
        h = torch.cos(x @ W) if flag["cos"] else torch.sin(x @ W)
        return torch.tanh(h @ W)

    W, x = leaf(6, 6), leaf(3, 6, seed=1)
    g = remat(f, policy=policies.dots_saveable)
    g(W, x).sum().backward()
    out = g(W, x)
    flag["cos"] = True
    with pytest.raises(RematError, match="diverged from its forward pass: op #1 was aten.sin.default"):
        out.sum().backward()
