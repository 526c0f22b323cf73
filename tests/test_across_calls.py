"""What a remat'd function keeps from one call to the next: nothing of a call outlives its backward pass, whatever
its signature; a new ``remat`` of a function on every step, or of each instance's bound method, is exact on every
call and recomputes what its policy drops; a first call without a graph changes nothing for the training calls after
it; what is learnt per function and policy stays bounded; no argument of a call is
held alive.

Whether a recompute ran is counted from outside (``OpCounter`` around the backward pass, against plain autograd's);
the function's Python runs once per call (the replay engine replays ATen ops).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from remat import policies, remat

from .helpers import OpCounter, assert_tree_close, census, grads, leaf

# ---- across calls and signatures: nothing of a call kept, exact on every call ---------------------------------------


def test_calls_of_many_signatures_leave_nothing_alive():
    """A call per input shape, each with its backward pass: every storage the calls' ops made (inputs included) is
    freed once the test lets go of them, weighed from outside (a memory leak across signatures would show)."""
    g = remat(lambda x: torch.sin(torch.tanh(x)).sum())
    refs = []
    with census() as c:
        for n in range(1, 40):
            x = leaf(n)
            g(x).backward()
            refs.append(weakref.ref(x))
            del x
        gc.collect()
        assert c.live == 0, c.live
    assert all(r() is None for r in refs)


def test_what_is_learnt_stays_bounded_with_a_policy_made_on_every_call():
    from remat._context import CACHES
    from remat._engine.signature import MAX_KEYS

    def block(x):
        return torch.sin(x).sum()

    x = leaf(3)
    for _ in range(MAX_KEYS + 10):
        remat(block, policy=lambda op, *a, **k: False)(x).backward()
    assert len(CACHES.get().learnt[block]) == MAX_KEYS


MM, TANH = torch.ops.aten.mm.default, torch.ops.aten.tanh.default


def _backward_ops(out, wrt):
    """The gradients, and how many matmuls and tanhs the backward pass ran (counted from outside)."""
    with OpCounter({MM, TANH}) as c:
        got = torch.autograd.grad(out, wrt)
    return got, (c.seen.count(MM), c.seen.count(TANH))


def test_a_new_remat_of_a_function_on_every_step_is_exact_and_recomputes():
    """``remat(block, policy=p)(x)`` written inside a forward pass makes a new wrapper each step: each call is exact,
    runs the function's Python once, and its backward pass recomputes what the policy drops (tanh's output, from
    the kept product: one tanh more than plain autograd's backward) and no matmul."""
    calls = [0]

    def block(W, x):
        calls[0] += 1
        return torch.tanh(x @ W) @ W

    W, x = leaf(4, 4), leaf(2, 4, seed=1)
    ref, (plain_mm, plain_tanh) = _backward_ops(block(W, x).sum(), (W, x))
    calls[0] = 0
    for step in range(3):
        got, (mm, tanh) = _backward_ops(remat(block, policy=policies.dots_saveable)(W, x).sum(), (W, x))
        assert_tree_close(got, ref)
        assert calls[0] == step + 1
        assert (mm, tanh) == (plain_mm, plain_tanh + 1) == (4, 1)


def test_bound_methods_of_instances_that_differ_in_a_flag_are_each_exact():
    """Two modules of one class differ in what no signature shows (a config flag): their bound methods, remat'd
    and called in turn with the same inputs, each give their own module's gradients, on every call."""

    class Block(nn.Module):
        def __init__(self, act):
            super().__init__()
            self.lin, self.act = nn.Linear(6, 6), act

        def forward(self, x):
            return self.act(self.lin(x))

    blocks = [Block(torch.tanh).double(), Block(torch.sin).double()]
    wrapped = [remat(blk.forward, policy="save-matmuls") for blk in blocks]
    x = leaf(2, 6)
    for _ in range(3):
        for blk, g in zip(blocks, wrapped):
            wrt = (x, *blk.parameters())
            assert_tree_close(grads(g, (x,), wrt), grads(blk, (x,), wrt))


# ---- a first call without a graph; what a call holds -----------------------------------------------------------------


@pytest.mark.parametrize("first", ["no_grad", "inference_mode"])
def test_a_first_call_without_a_graph_changes_nothing_after_it(first):
    """Issue 39, item 6: a first call under no_grad or inference_mode (a validation pass before training) runs the
    function plainly, and the training calls after it drop what the policy drops (measured from outside) and are
    exact."""
    from remat.bench.measure import LiveCensus

    W = leaf(64, 64)
    x = torch.randn(32, 64, dtype=torch.float64)

    def f(W, x):
        return torch.sin(torch.tanh(x @ W) @ W)

    g = remat(f, policy="save-nothing")
    with getattr(torch, first)():
        assert_tree_close(g(W, x), f(W, x))
    for _ in range(3):
        with LiveCensus() as census:
            out = g(W, x).sum()
            kept = census.live
        with LiveCensus() as census:
            plain = f(W, x).sum()
            full = census.live
        assert kept < 0.6 * full
        assert_tree_close(torch.autograd.grad(out, W), torch.autograd.grad(plain, W))


def test_a_module_passed_as_an_argument_is_not_kept_alive():
    def block(layer, x):
        return torch.tanh(layer(x))

    for g in (remat(block), remat(block, static_argnums=(0,))):
        refs = []
        for _ in range(3):
            layer = nn.Linear(16, 16)
            x = torch.randn(2, 16, requires_grad=True)
            for _ in range(2):
                g(layer, x).sum().backward()
            refs.append(weakref.ref(layer.weight))
            del layer, x
        gc.collect()
        assert [r() for r in refs] == [None, None, None]
