"""A backward pass inside the forward pass, on a later call only (data-dependent: not in the signature's first
call): a gradient penalty or ``torch.func`` inside is exact, first and second order; an input written before it is
written once, as plain autograd writes it; the call draws the random numbers plain autograd draws; a gradient
accumulated inside the function is accumulated once, as plain autograd accumulates it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from remat import policies, remat

from .helpers import PLAN_POLICIES, assert_tree_close, grads, leaf


def test_a_gradient_penalty_on_a_later_call_is_exact():
    """A gradient penalty that appears only on later calls (data-dependent): recomputed partially, exact."""
    penalty = {"on": False}

    def f(W, x):
        h = torch.tanh(x @ W)
        if penalty["on"]:
            (gh,) = torch.autograd.grad(h.pow(2).sum(), (x,), create_graph=True)
            h = h + gh.pow(2).sum()
        return torch.sin(h)

    W, x = leaf(4, 4), leaf(3, 4, seed=1)
    g = remat(f)
    g(W, x).sum().backward()
    penalty["on"] = True
    ref = grads(f, (W, x), (W, x))
    assert_tree_close(grads(g, (W, x), (W, x)), ref)


def test_torch_func_inside_on_a_later_call_becomes_a_region():
    inner = {"on": False}

    def f(W, x):
        h = torch.sin(x @ W)
        if inner["on"]:
            h = h + torch.func.grad(lambda y: torch.tanh(y).sum())(h)
        return h.pow(2)

    W, x = leaf(4, 4), leaf(3, 4, seed=1)
    g = remat(f)
    g(W, x).sum().backward()
    inner["on"] = True
    ref = grads(f, (W, x), (W, x))
    assert_tree_close(grads(g, (W, x), (W, x)), ref)


@pytest.mark.parametrize("write", [False, True], ids=["", "held-output-written-first"])
@pytest.mark.parametrize("create_graph", [False, True])
@pytest.mark.parametrize("policy", [policies.dots_saveable, policies.save_only_these_names()], ids=["dots", "none"])
def test_an_inner_backward_in_a_later_call(policy, create_graph, write):
    """A backward pass inside a later call's forward pass (data-dependent: not in the first call) reads what the
    call holds before the end of its forward pass: exact, first and second order. A held output written in place
    before it (plain autograd allows it: ``exp`` saves its result, the matmul its inputs, nothing saves the product
    itself) is not handed to that recompute written."""
    penalty = {"on": False}

    def f(W, x):
        q = x @ W
        e = q.exp()
        h = torch.nn.functional.gelu(e) + e
        if penalty["on"]:
            if write:
                q.mul_(2)
            (gW,) = torch.autograd.grad(h.pow(2).sum(), (W,), create_graph=create_graph, retain_graph=True)
            h = h + gW.sum()
        return torch.sin(h @ W)

    W, x = leaf(4, 4), leaf(3, 4, seed=1)
    g = remat(f, policy=policy)
    for _ in range(2):
        g(W, x).sum().backward()
    penalty["on"] = True
    for _ in range(2):
        assert_tree_close(grads(g, (W, x), (W, x)), grads(f, (W, x), (W, x)))


@pytest.mark.parametrize("policy", ["dots", "names"])
def test_an_input_written_then_a_backward_inside_the_forward_pass_is_written_once(policy):
    """A backward pass inside the forward pass after the function wrote its input (which needs no gradient, and
    which no node saved before the write: plain autograd allows it): the input is written once, as plain autograd
    writes it, and the gradients are plain autograd's, on the later calls that write it."""
    branch = {"on": False}

    def f(W, x):
        q = torch.tanh(W * 2) + x.sum()
        if branch["on"]:
            x.mul_(2)
            (gW,) = torch.autograd.grad(torch.sin(x @ W).sum(), (W,), retain_graph=True)
            q = q + gW.sum()
        return torch.sin(q @ W)

    g = remat(f, policy=PLAN_POLICIES[policy])
    W, x0 = leaf(4, 4), leaf(3, 4, seed=1, grad=False)
    for on in (0, 0, 0, 1, 1):
        branch["on"] = bool(on)
        x, xp = x0.clone(), x0.clone()
        out = g(W, x)
        assert torch.equal(x, x0 * 2 if on else x0)  # written once, by the forward pass
        got = torch.autograd.grad(out.sum(), (W,))
        assert torch.equal(x, x0 * 2 if on else x0)  # and not again by the backward pass
        assert_tree_close(got, grads(f, (W, xp), (W,)))


def test_a_backward_inside_a_later_forward_pass_draws_what_plain_autograd_draws():
    """A later call (not the signature's first) draws random numbers (dropouts in a branch) and runs a backward pass
    inside its forward pass between them: the call draws what plain autograd draws, and so computes the same
    values, gradients and next random numbers under the same seed."""
    branch = {"on": False}

    def f(W, x):
        h = (x @ W).exp()
        if branch["on"]:
            h = F.dropout(h, 0.5)
            (gW,) = torch.autograd.grad(h.pow(2).sum(), (W,), retain_graph=True)
            h = F.dropout(h, 0.5) + gW.sum()
        return torch.sin(h @ W)

    def run(fn):
        torch.manual_seed(123)
        W, x = leaf(4, 4), leaf(3, 4, seed=1)
        out = fn(W, x)
        return (out.detach(), *torch.autograd.grad(out.sum(), (W, x)), torch.rand(3))

    g = remat(f, policy=policies.dots_saveable)
    for on in (0, 0, 0, 1, 1):
        branch["on"] = bool(on)
        assert_tree_close(run(g), run(f))


@pytest.mark.parametrize("preset", [False, True], ids=["grad-none", "grad-preset"])
@pytest.mark.parametrize("inner", ["twice", "saves-nothing"])
@pytest.mark.parametrize("policy", ["dots", "names"])
def test_a_backward_that_accumulates_inside_the_function_is_accumulated_once(policy, inner, preset):
    """``loss.backward()`` inside the function: a recompute that runs it again would add its gradient twice
    (``torch.utils.checkpoint`` does, silently). Twice (the second one's recompute would run the first again), or
    once over a graph that saves nothing of the call's, with ``.grad`` None or allocated before: the replay runs no
    Python, so every call gives plain autograd's gradients, accumulated once, where everything is recomputed
    too."""
    branch = {"on": False}

    def f(W, x):
        h = (x @ W).exp()
        if branch["on"]:
            if inner == "twice":
                h.pow(2).sum().backward(retain_graph=True)
                h.pow(3).sum().backward(retain_graph=True)
            else:
                (x * 3 + W.sum()).sum().backward()
        return torch.sin(h @ W)

    def leaves():
        W, x = leaf(4, 4), leaf(3, 4, seed=1)
        if preset:
            W.grad, x.grad = torch.ones_like(W), torch.ones_like(x)
        return W, x

    g = remat(f, policy=PLAN_POLICIES[policy])
    for on in (0, 0, 0, 1, 1):
        branch["on"] = bool(on)
        (W, x), (Wp, xp) = leaves(), leaves()
        g(W, x).sum().backward()
        f(Wp, xp).sum().backward()
        assert_tree_close((W.grad, x.grad), (Wp.grad, xp.grad))
