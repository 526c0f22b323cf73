"""Calls whose signature or Python state changes: another signature, a module's training flag, BatchNorm's
statistics, nested calls, outside tensors, several outputs, Python numbers and flags that change between calls or
between the forward and the backward pass. On plain autograd (the replay engine) every call gives plain autograd's
gradients, runs the function's Python once and recomputes what its policy drops (counted from outside with
``OpCounter`` around the backward pass, against plain autograd's); under ``torch.func`` the recompute replays the
call's program; with ``debug=True`` the full engine re-runs the Python and raises ``RematError`` where the recompute
diverges.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from remat import RematError, policies, remat, remat_module

from .helpers import OpCounter, Probe, assert_tree_close, chain, f32, f64, grads, leaf

TANH = {torch.ops.aten.tanh.default}

# ---- another signature: exact, recomputed, the Python run once ----------------------------------------------------


@pytest.mark.parametrize("change", ["shape", "dtype", "requires_grad", "training", "autocast", "module state shape"])
def test_signature_change_is_exact(change):
    calls = [0]
    lin = nn.Linear(8, 8).double()

    def f(x):
        calls[0] += 1
        return torch.tanh(lin(x))

    g = remat(f)
    x = leaf(4, 8)
    g(x).sum().backward()
    g(x).sum().backward()
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
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if change == "autocast" else torch.enable_grad()
    calls[0] = 0
    with ctx:
        out = g(x)
        ref_out = f(x)
    assert calls[0] == 2  # g's call and f's: the Python ran once each
    wrt = [p for p in (x, *lin.parameters()) if p.requires_grad]
    with OpCounter(TANH) as plain:
        ref = torch.autograd.grad(ref_out.float().sum(), wrt)
    with OpCounter(TANH) as c:
        got = torch.autograd.grad(out.float().sum(), wrt)
    assert_tree_close(got, ref)
    assert (plain.count, c.count) == (0, 1)  # save-nothing: tanh's output made again by the recompute
    assert calls[0] == 2  # (and no Python in the backward pass)


# ---- module state, nested calls, outside tensors -------------------------------------------------------------------


def test_training_batchnorm_writes_its_statistics_once():
    """BatchNorm in training mode writes its running statistics: once per call, as plain autograd's forward pass
    does, never again in a recompute; the gradients and statistics are plain autograd's, then in eval mode too."""
    bn = nn.BatchNorm1d(8).double()
    ref_bn = copy.deepcopy(bn)

    def f(x):
        return torch.tanh(bn(x))

    g = remat(f)
    x = leaf(16, 8)
    for _ in range(2):
        for _ in range(3):
            wrt = (x, *bn.parameters())
            got = grads(g, (x,), wrt)
            want = grads(lambda x: torch.tanh(ref_bn(x)), (x,), (x, *ref_bn.parameters()))
            assert_tree_close(got, want)
            assert_tree_close(list(bn.buffers()), list(ref_bn.buffers()))
        assert bn.num_batches_tracked.item() == 3  # once per call, never again in a recompute
        bn.eval()
        ref_bn.eval()


_GLOBAL = torch.randn(4, 4, dtype=f64)  # a global: the state walk does not reach it, the trace holds it


def test_nested_and_outside_tensors_are_exact():
    calls = [0]
    inner = remat(lambda h: torch.sin(h) * 2, policy=policies.dots_saveable)

    def nested(W, x):
        calls[0] += 1
        return inner(torch.tanh(x @ W)).sum()

    def reads_global(W, x):
        calls[0] += 1
        return (torch.tanh(x @ W) @ _GLOBAL).sum()

    W, x = leaf(4, 4), leaf(3, 4, seed=1)
    for f in (nested, reads_global):
        g = remat(f)
        for _ in range(2):
            want = torch.autograd.grad(f(W, x), (W, x))
            calls[0] = 0
            assert_tree_close(torch.autograd.grad(g(W, x), (W, x)), want)
            assert calls[0] == 1, f.__name__  # the Python ran once: the recompute replayed its ops


def test_under_torch_func_every_call_is_exact():
    probe = Probe()
    f = chain(probe)
    g = remat(f)
    W, b, x = leaf(5, 5), leaf(5, seed=1), leaf(2, 5, seed=2)
    for _ in range(2):
        got = torch.func.grad(lambda W: g(W, b, x).sum())(W)
        assert_tree_close(got, torch.func.grad(lambda W: f(W, b, x).sum())(W))


@pytest.mark.parametrize("debug", [False, True], ids=["replay", "debug"])
def test_a_held_output_returned_and_written_is_made_again(debug):
    """Several outputs: the matmul's output is returned and held for the recompute (tanh saves its output, dropped
    by save-matmuls). Written in place by the caller (no_grad), it cannot make tanh's output again; plain autograd
    is unaffected (tanh saved its output). Each engine sees the held value's version move and makes it again from
    the inputs: plain autograd's gradient, on every call (the full engine, debug, raised until the thirty-seventh
    session)."""

    def f(W, x):
        a = x @ W
        return a, torch.tanh(a)  # tanh saves its output: dropped, recomputed from the held matmul output

    def both(W, x):
        a, b = f(W, x)
        return a.sum() + b.sum()

    W, x = leaf(4, 4), leaf(2, 4, seed=1)
    g = remat(f, policy=policies.dots_saveable, debug=debug)
    a, b = g(W, x)
    assert_tree_close(torch.autograd.grad(a.sum() + b.sum(), (W, x)), grads(both, (W, x), (W, x)))
    a0, b0 = f(W, x)
    with torch.no_grad():
        a0.mul_(2)
    want = torch.autograd.grad(b0.sum(), (W, x))
    for _ in range(2):
        a, b = g(W, x)
        with torch.no_grad():
            a.mul_(2)  # the matmul's output, which the call holds for its recompute
        assert_tree_close(torch.autograd.grad(b.sum(), (W, x)), want)


def test_debug_runs_every_call_on_the_full_engine():
    probe = Probe()
    f = chain(probe)
    g = remat(f, debug=True)
    W, b, x = leaf(5, 5), leaf(5, seed=1), leaf(2, 5, seed=2)
    for _ in range(3):
        assert_tree_close(grads(g, (W, b, x), (W, b, x)), grads(f, (W, b, x), (W, b, x)))
    assert probe.modes[::3] == [True, True, True]  # each remat'd forward ran under the recorder
    with pytest.raises(TypeError, match="debug must be True or False"):
        remat(f, debug="yes")


class Ramp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.step = 0

    def forward(self, x):
        self.step += 1  # a recompute that ran the Python again would see the next step's scale
        return torch.tanh(self.lin(x) * min(1.0, self.step / 10))


@pytest.mark.parametrize("debug", [False, True], ids=["replay", "debug"])
def test_numbers_that_change_before_the_recompute(debug):
    """A Python number the module changes on every call: the replay reads the forward pass's number, so every call
    gives plain autograd's gradients; the old engine (debug) re-runs the Python, sees another number and raises
    rather than go silently wrong."""
    torch.manual_seed(0)
    plain = Ramp().double()
    m = remat_module(copy.deepcopy(plain), debug=debug)
    x = leaf(3, 4)
    for _ in range(3):
        if debug:
            with pytest.raises(RematError, match="read other values than in the forward pass: argument #1 is"):
                m(x).sum().backward()
            continue
        got = grads(m, (x,), (x, *m.parameters()))
        assert_tree_close(got, grads(plain, (x,), (x, *plain.parameters())))
    assert m.step == (6 if debug else 3)  # the old engine runs the Python again in its recompute; the replay never


def test_a_state_write_on_a_later_call_happens_once_and_is_exact():
    """A buffer written in place on a later call only (Python state): written once, by the forward pass, never
    again by the recompute; the gradient is plain autograd's."""

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
    for call in range(1, 3):
        out = g(x)
        assert m.n.item() == call
        (gx,) = torch.autograd.grad(out.sum(), (x,))
        assert m.n.item() == call  # the recompute did not write it again
        assert_tree_close(gx, 2 * torch.cos(x))


def test_a_later_call_that_runs_other_ops_is_exact():
    extra = {"on": False}

    def f(W, x):
        h = torch.sin(x @ W)
        if extra["on"]:
            h = torch.exp(h) * 0.1  # ops the first call did not run
        return torch.tanh(h @ W)

    W, x = leaf(6, 6), leaf(3, 6, seed=1)
    g = remat(f, policy=policies.dots_saveable)
    g(W, x).sum().backward()
    extra["on"] = True
    ref = grads(f, (W, x), (W, x))
    for _ in range(2):
        assert_tree_close(grads(g, (W, x), (W, x)), ref)
    extra["on"] = False
    assert_tree_close(grads(g, (W, x), (W, x)), grads(f, (W, x), (W, x)))


# ---- Python state changed between the forward and the backward pass ------------------------------------------------


def _between_the_passes(f, g, args, change, debug, match):
    """The gradients of a call whose Python state ``change`` flips between its forward and backward pass: plain
    autograd's (computed with the same flip), or, on the old engine (debug), a ``RematError`` matching ``match``."""
    plain_out, out = f(*args), g(*args)
    change()
    ref = torch.autograd.grad(plain_out.sum(), args)
    if debug:
        with pytest.raises(RematError, match=match):
            out.sum().backward()
    else:
        assert_tree_close(torch.autograd.grad(out.sum(), args), ref)


@pytest.mark.parametrize("debug", [False, True], ids=["replay", "debug"])
def test_flag_flipped_between_forward_and_backward(debug):
    """An impure function: the Python would run another op in a recompute; the replay runs the forward pass's."""
    flag = {"cos": False}

    def f(W, x):
        h = torch.cos(x) if flag["cos"] else torch.sin(x)
        return h @ W

    g = remat(f, debug=debug)
    W, x = leaf(4, 4), leaf(2, 4, seed=1)
    g(W, x).sum().backward()
    _between_the_passes(f, g, (W, x), lambda: flag.update(cos=True), debug,
                        "op #0 was aten.sin.default -> .* in the forward pass but aten.cos.default now")


@pytest.mark.parametrize("debug", [False, True], ids=["replay", "debug"])
def test_a_shape_changed_between_forward_and_backward(debug):
    n = [4]

    def f(W, x):
        return torch.sin(x[:, : n[0]]) @ W[: n[0]]

    g = remat(f, debug=debug)
    W, x = leaf(4, 4), leaf(2, 4, seed=1)
    g(W, x).sum().backward()
    _between_the_passes(f, g, (W, x), lambda: n.__setitem__(0, 3), debug,
                        "diverged from its forward pass: op #0 was aten.alias.default")


@pytest.mark.parametrize("debug", [False, True], ids=["replay", "debug"])
def test_a_recompute_that_would_run_other_ops(debug):
    flag = {"cos": False}

    def f(W, x):
        h = torch.cos(x @ W) if flag["cos"] else torch.sin(x @ W)
        return torch.tanh(h @ W)

    W, x = leaf(6, 6), leaf(3, 6, seed=1)
    g = remat(f, policy=policies.dots_saveable, debug=debug)
    g(W, x).sum().backward()
    _between_the_passes(f, g, (W, x), lambda: flag.update(cos=True), debug,
                        "diverged from its forward pass: op #1 was aten.sin.default")
