"""A planned call's recompute without a graph (NOTE [value recompute] in ``remat/_engine/planned.py``): it runs
the function under no_grad and takes the dropped tensors as the ops return them, bitwise equal to plain autograd;
a call that needs a graph (a double backward, other ops without one, hooks on intermediates) recomputes with one;
the tensor taken is the one the node saved (written values, factories, the data's choice, parameters).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat import RematError, checkpoint_name, policies, remat, remat_module

from .helpers import PLAN_POLICIES, SquareWritingItsSaved, assert_tree_close, f32, f64, grads, leaf, mlp

# ---- without a graph, exact; with one where the call needs it ------------------------------------------------------


class GradModes:
    """Inside the function: whether grad mode was on, per run (the forward pass, then each recompute)."""

    def __init__(self, fn):
        self.fn, self.modes = fn, []

    def __call__(self, *args):
        self.modes.append(torch.is_grad_enabled())
        return self.fn(*args)


def block(params, x):
    from remat.bench.models import transformer_block

    return transformer_block(params, x, 2)


def block_inputs(dtype):
    from remat.bench.models import make_transformer

    params, x, _, _ = make_transformer(blocks=1, batch=2, seq=8, d=16, heads=2, ff=32, dtype=dtype)
    params = [{k: v.requires_grad_() for k, v in p.items()} for p in params] if isinstance(params, list) else params
    return params, x.requires_grad_()


VALUE_CASES = {  # (function, policy): each drops tensors and holds others for its recompute
    "block-dots": ("block", policies.dots_saveable),
    "block-names": ("block", policies.save_only_these_names("attn")),
    "mlp-dots": ("mlp", policies.dots_saveable),
    "mlp-names": ("mlp", policies.save_only_these_names("mid")),
    "mlp-custom": ("mlp", PLAN_POLICIES["custom"]),
    "mlp-offload-matmuls": ("mlp", policies.offload_dot_with_no_batch_dims("cpu", "cpu")),
}


@pytest.mark.parametrize("dtype", [f64, f32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", list(VALUE_CASES))
def test_a_planned_recompute_runs_without_a_graph_and_is_exact(case, dtype):
    """A planned call's recompute runs the function under no_grad (seen from inside it) and takes the dropped
    tensors as its ops return them; gradients bitwise equal to plain autograd's (the recorded call's recompute,
    which saves, runs with grad mode on)."""
    which, policy = VALUE_CASES[case]
    if which == "block":
        params, x = block_inputs(dtype)
        fn, args = block, (params[0] if isinstance(params, list) else params, x)
    else:
        fn, args = mlp, (leaf(8, 8, dtype=dtype), leaf(8, 8, dtype=dtype, seed=1), leaf(4, 8, dtype=dtype, seed=2))
    wrt = [t for t in torch.utils._pytree.tree_leaves(args) if t.requires_grad]
    ref = grads(fn, args, wrt)
    probe = GradModes(fn)
    g = remat(probe, policy=policy)
    for _ in range(3):
        got = grads(g, args, wrt)
        assert all(torch.equal(a, b) for a, b in zip(got, ref))  # (the same kernels: bitwise)
    # the recorded call and its recompute, then two planned calls recomputed without a graph
    assert probe.modes == [True, True, True, False, True, False], probe.modes


def test_a_planned_recompute_for_a_double_backward_builds_its_graph():
    """create_graph=True: the backward pass differentiates what the recompute made, so the recompute builds the
    graph (grad mode on inside the function); the second backward pass recomputes again, without one."""
    W1, W2, x = leaf(8, 8), leaf(8, 8, seed=1), leaf(4, 8, seed=2)
    probe = GradModes(mlp)
    g = remat(probe, policy=policies.dots_saveable)
    g(W1, W2, x).sum().backward()
    gw = grads(g, (W1, W2, x), (W1,), create_graph=True)[0]
    want = grads(mlp, (W1, W2, x), (W1,), create_graph=True)[0]
    assert_tree_close(torch.autograd.grad(gw.pow(2).sum(), (W2, x)), torch.autograd.grad(want.pow(2).sum(), (W2, x)))
    assert probe.modes == [True, True, True, True, False], probe.modes


def test_a_function_that_runs_other_ops_without_a_graph_recomputes_with_one():
    """torch's TransformerEncoderLayer in eval mode takes its fused path when grad mode is off (one op instead of
    ~40): the recompute without a graph sees another op and gives way to the recompute with one, for this call
    and the signature's later ones; gradients exact."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dtype=f64).eval()
    x = leaf(2, 5, 16)
    ref = grads(layer, (x,), (x, *layer.parameters()))
    probe = GradModes(layer)
    g = remat(probe, policy=policies.dots_saveable)
    for _ in range(3):
        assert_tree_close(grads(g, (x,), (x, *layer.parameters())), ref)
    # recorded; planned: tried without a graph, then with one; planned: with one from the start
    assert probe.modes == [True, True, True, False, True, True, True], probe.modes


@pytest.mark.parametrize("what", ["register_hook", "retain_grad"])
def test_a_function_that_needs_grad_mode_recomputes_with_a_graph(what):
    """Review: ``h.register_hook`` or ``h.retain_grad()`` on an intermediate raises without grad mode: the
    recompute without a graph gives way to the one with it (which runs them), for the signature's later calls
    too; exact."""
    def f(W, x):
        h = torch.sin(x @ W)
        if what == "register_hook":
            h.register_hook(lambda g: g * 2)
        else:
            h.retain_grad()
        return torch.tanh(h @ W)

    W, x = leaf(8, 8), leaf(4, 8, seed=1)
    ref = grads(f, (W, x), (W, x))
    probe = GradModes(f)
    g = remat(probe, policy=policies.dots_saveable)
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(grads(g, (W, x), (W, x)), ref))
    assert probe.modes == [True, True, True, False, True, True, True], probe.modes


# ---- the tensor the recompute takes is the one the node saved ------------------------------------------------------


@pytest.mark.parametrize("name", ["dots", "custom"])
def test_a_dropped_tensor_written_before_it_was_saved_comes_back_written(name):
    """A tensor written in place between the op that made it and the op that saved it: the recompute without a
    graph takes it where the forward pass's ops last returned it and runs on to the op that saved it (an in-place
    op's version moves after the op returns), so it holds the written value and its version; exact, no false
    RematError. A write after the save raises, as in plain autograd (NOTE [written after saved])."""
    def f(W, x, after=False):
        h = torch.sin(x @ W)
        h.mul_(1.5)
        y = torch.sin(h) @ W  # sin saves h
        if after:
            h.add_(1)
        return torch.tanh(y)  # tanh saves its output, dropped: the recompute runs past the write

    W, x = leaf(8, 8), leaf(4, 8, seed=1)
    ref = grads(f, (W, x), (W, x))
    probe = GradModes(f)
    g = remat(probe, policy=PLAN_POLICIES[name])
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(grads(g, (W, x), (W, x)), ref))
    assert probe.modes[-2:] == [True, False]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        grads(f, (W, x, True), (W, x))
    g2 = remat(lambda W, x: f(W, x, True), policy=PLAN_POLICIES[name])
    for _ in range(3):
        with pytest.raises(RematError, match="modified a tensor .* in place after an op saved it"):
            grads(g2, (W, x), (W, x))


@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("name", ["dots", "custom"])
def test_a_backward_that_writes_a_recomputed_tensor_another_node_reads_raises(name, view):
    """Review: a node's backward writes the recomputed tensor it read, which another node saved too (or a view of
    it): plain autograd raises, and so must every call, planned ones on the value recompute included (versions
    noted in the recompute and compared when read; not noting them for plans without an in-place op gave a
    wrong gradient without an error)."""
    def f(x, w):
        a = (x @ w).sin()
        other = (a.t() @ x).sum() if view else a.cos().sum()
        return other + SquareWritingItsSaved.apply(a).sum()

    x, w = leaf(4, 8), leaf(8, 8, seed=1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(f(x, w), (x, w))
    probe = GradModes(f)
    g = remat(probe, policy=PLAN_POLICIES[name])
    for _ in range(3):
        with pytest.raises(RematError, match="in place"):
            torch.autograd.grad(g(x, w), (x, w))
    assert probe.modes[-2:] == [True, False]  # the planned call's recompute ran without a graph


@pytest.mark.parametrize("factory", ["rand_like", "zeros_like", "randn"])
def test_a_factory_output_then_a_detach_of_your_own(factory):
    """Review: torch's binding detaches a factory's output that Python holds as it returns; the recompute without a
    graph held what it took strongly, so an extra detach came first and was taken for the function's own
    ``s.detach()`` (the dropped tensor then came from the factory: a wrong gradient without an error). What the
    ops return is held weakly until the next op."""
    make = {"rand_like": torch.rand_like, "zeros_like": torch.zeros_like,
            "randn": lambda y: torch.randn(y.shape, dtype=y.dtype)}[factory]

    def f(W, x):
        y = x @ W
        s = torch.sin(y)
        r = make(y)
        d = s.detach()
        return (x * d).sum() + (r * y).sum()  # mul saves d, dropped

    W, x = leaf(8, 8), leaf(4, 8, seed=2)
    torch.manual_seed(0)
    ref = torch.autograd.grad(f(W, x), (W, x))
    probe = GradModes(f)
    g = remat(probe, policy=policies.dots_saveable)
    for _ in range(3):
        torch.manual_seed(0)
        got = torch.autograd.grad(g(W, x), (W, x))
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert probe.modes[-2:] == [True, False]


def test_a_named_parameter_updated_between_steps():
    """Review: the recompute without a graph compared a dropped tensor's version with the recorded call's; a
    ``checkpoint_name`` alias of a parameter shares its version counter, which an optimizer step moves, so every
    later step raised a false RematError. The versions are read in the recompute, where the forward saved them."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.scale = nn.Parameter(torch.ones(8))

        def forward(self, x):
            s = checkpoint_name(self.scale, "scale")
            return torch.tanh(self.lin(x) * torch.sin(s) * s)  # sin and mul save s, dropped by dots_saveable

    def train(use_remat):
        torch.manual_seed(0)
        net = Block().double()
        if use_remat:
            remat_module(net, policy=policies.dots_saveable)
        opt = torch.optim.SGD(net.parameters(), lr=1e-2)
        x = leaf(4, 8, grad=False)
        out = []
        for _ in range(3):
            opt.zero_grad()
            net(x).pow(2).sum().backward()
            out.append([p.grad.clone() for p in net.parameters()])
            opt.step()
        return out

    for want, got in zip(train(False), train(True)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("policy", ["dots", "custom"])
def test_a_dropped_tensor_chosen_by_the_data_is_recomputed_from_its_own_op(policy):
    """Which of two tensors of one shape a node saves depends on the data. The value recompute took each dropped
    tensor from the op the recorded call saw make it: the sine where a planned call had saved the cosine, a wrong
    gradient without an error. A planned call now checks that each dropped tensor is the one the plan takes (by
    identity, as the tap saw the op return it); another one sends that call to the recompute that saves."""
    W = leaf(4, 4)

    def f(W, x):
        h = x @ W
        a, b = torch.sin(h), torch.cos(h)
        c = a if bool(x[0, 0] > 0) else b
        return (c * c).sum() + (a * b).sum()  # (a and b both saved: neither is dead)

    g = remat(f, policy=PLAN_POLICIES[policy])
    for sign in (1, -1, -1, 1, 1):
        x = leaf(3, 4, seed=1, grad=False).clone()
        x[0, 0] = sign * x[0, 0].abs()
        assert_tree_close(torch.autograd.grad(g(W, x), W), torch.autograd.grad(f(W, x), W))
    (plan,) = g._plans.values()
    assert plan is not None and plan.values is not None  # planned, with a value recompute for the recorded wiring
