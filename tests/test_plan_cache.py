"""Which plan a call finds (NOTE [planned calls] in ``remat/_engine/plans.py``): one table per function and
policy, shared by every ``remat`` of them, a bound method's per instance; bounded; made only by a call that builds
a graph; holding no argument of a call alive.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from remat import policies, remat

from .helpers import Probe, assert_tree_close, grads, leaf

# ---- one table of plans per function and policy, bounded -----------------------------------------------------------


def test_plans_are_bounded():
    from remat._engine.plans import MAX_PLANS

    g = remat(lambda x: torch.sin(x).sum())
    for n in range(1, MAX_PLANS + 6):
        g(leaf(n)).backward()
    assert len(g._plans) == MAX_PLANS


def test_plans_stay_bounded_with_a_policy_made_on_every_call():
    from remat._context import CACHES
    from remat._engine.plans import MAX_PLANS

    def block(x):
        return torch.sin(x).sum()

    x = leaf(3)
    for _ in range(MAX_PLANS + 10):
        remat(block, policy=lambda op, *a, **k: False)(x).backward()
    assert len(CACHES.get().plans[block]) == MAX_PLANS


def test_plans_are_shared_by_every_remat_of_a_function_and_policy():
    """remat(block, policy=p)(x) written inside a forward pass makes a new wrapper each step: it still plans."""
    probe = Probe()

    def block(W, x):
        probe()
        return torch.tanh(x @ W) @ W

    W, x = leaf(4, 4), leaf(2, 4, seed=1)
    ref = grads(block, (W, x), (W, x))
    probe.modes.clear()
    for _ in range(3):
        assert_tree_close(grads(remat(block, policy=policies.dots_saveable), (W, x), (W, x)), ref)
    assert probe.fast_calls() == [False, False, True, True, True, True]  # recorder, then planned tap and replay
    assert remat(block, policy=policies.dots_saveable)._plans is remat(block, policy=policies.dots_saveable)._plans
    assert remat(block, policy=policies.dots_saveable)._plans is not remat(block)._plans
    (plan,) = remat(block, policy=policies.dots_saveable)._plans.values()
    assert plan is not None and plan.ops is not None


def test_plans_of_a_method_are_per_instance():
    """A bound method's plans belong to its instance (two modules of one class may differ in what no signature
    shows, a config flag); a new wrapper of the same instance's method finds them."""
    blocks = [nn.Sequential(nn.Linear(6, 6), nn.Tanh()).double() for _ in range(2)]
    a, b = (remat(blk.forward, policy="save-matmuls") for blk in blocks)
    assert a._plans is not b._plans
    assert remat(blocks[0].forward, policy="save-matmuls")._plans is a._plans
    x = leaf(2, 6)
    a(x).sum().backward()
    assert len(remat(blocks[0].forward, policy="save-matmuls")._plans) == 1 and not b._plans


# ---- what makes a plan, and what a plan holds ----------------------------------------------------------------------


@pytest.mark.parametrize("first", ["no_grad", "inference_mode"])
def test_a_first_call_without_a_graph_leaves_no_plan(first):
    """Issue 39, item 6: a plan is made by a call that builds a graph; one under no_grad or inference_mode (a
    validation pass before training) runs the function plainly and plans nothing, so the training calls after it
    drop what the policy drops (measured from outside) and are exact."""
    from remat.bench.measure import LiveCensus

    W = leaf(64, 64)
    x = torch.randn(32, 64, dtype=torch.float64)

    def f(W, x):
        return torch.sin(torch.tanh(x @ W) @ W)

    g = remat(f, policy="save-nothing")
    with getattr(torch, first)():
        assert_tree_close(g(W, x), f(W, x))
    assert not g._plans
    for _ in range(3):
        with LiveCensus() as census:
            out = g(W, x).sum()
            kept = census.live
        with LiveCensus() as census:
            plain = f(W, x).sum()
            full = census.live
        assert kept < 0.6 * full
        assert_tree_close(torch.autograd.grad(out, W), torch.autograd.grad(plain, W))
    assert list(g._plans.values()) != [None]


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
