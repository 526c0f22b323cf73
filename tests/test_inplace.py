"""In-place writes inside and after a remat'd function: right gradients, or a RematError, never silence."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from remat import RematError, policies, remat

from .helpers import assert_tree_close

POLICIES = {
    "save-nothing": "save-nothing",
    "save-matmuls": "save-matmuls",
    "save-everything": "save-everything",
    "names": policies.save_only_these_names("h"),
    "offload": policies.offload_to_cpu(min_bytes=0),
}


def through_view(w, x):
    h = x @ w
    h.view(-1).mul_(2)  # in place through a view of a (saveable) matmul output
    return torch.tanh(h).sum()


def through_index(w, x):
    h = x @ w
    h[:, 0] += 1.0  # in place through an indexing view
    return torch.tanh(h).sum()


def on_itself(w, x):
    h = x @ w
    h.mul_(2)
    return torch.tanh(h).sum()


@pytest.mark.parametrize("fn", [through_view, through_index, on_itself], ids=lambda f: f.__name__)
@pytest.mark.parametrize("policy", list(POLICIES.values()), ids=list(POLICIES))
def test_in_place_inside_the_function(fn, policy):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 4, dtype=torch.float64, generator=g, requires_grad=True)
    x = torch.randn(3, 4, dtype=torch.float64, generator=g)
    (ref,) = torch.autograd.grad(fn(w, x), w)
    (got,) = torch.autograd.grad(remat(fn, policy=policy)(w, x), w)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


def test_result_kept_for_the_replay_modified_after_forward_raises():
    # plain autograd is right here (tanh saves its output, not h); remat replays h in the
    # recompute, so a changed h must be an error, never a silently wrong gradient
    def f(w, x):
        h = x @ w
        return torch.tanh(h).sum(), h

    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 4, dtype=torch.float64)
    loss, h = remat(f, policy="save-matmuls")(w, x)
    with torch.no_grad():
        h.mul_(2)
    with pytest.raises(RematError, match=r"aten\.mm\.default.*modified in place after the forward pass"):
        torch.autograd.grad(loss, w)


def test_result_kept_for_the_replay_unchanged_is_fine():
    def f(w, x):
        h = x @ w
        return torch.tanh(h).sum(), h

    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 4, dtype=torch.float64)
    loss, h = remat(f, policy="save-matmuls")(w, x)
    (got,) = torch.autograd.grad(loss, w)
    (ref,) = torch.autograd.grad(f(w, x)[0], w)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("through", ["name", "view_of_name", "base"])
@pytest.mark.parametrize("policy", [policies.save_only_these_names("h"), policies.save_anything_except_these_names("h"),
                                    policies.dots_saveable, policies.everything_saveable], ids=repr)
def test_write_through_a_checkpoint_name_alias(through: str, policy: Any) -> None:
    """A write through the alias checkpoint_name returns reaches the named tensor in the replay too: the alias is
    run again from its replayed base, never replayed from a copy of its own (which the write would miss)."""
    from remat import checkpoint_name

    def block(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = x @ W
        n = checkpoint_name(h, "h")
        {"name": n, "view_of_name": n[0], "base": h}[through].add_(1)
        return torch.sin(h) @ W

    W = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 4, dtype=torch.float64)
    want = torch.autograd.grad(block(W, x).pow(2).sum(), W)
    f = remat(block, policy=policy)
    for _ in range(3):  # the recorded call, then planned calls
        assert_tree_close(torch.autograd.grad(f(W, x).pow(2).sum(), W), want, rtol=1e-10, atol=1e-10)


def _keep(*ops: Any) -> Any:
    return lambda op, *a, **k: op in ops


@pytest.mark.parametrize("policy", ["save-nothing", "save-matmuls", "keep-exp", "budget"])
@pytest.mark.parametrize("case", ["slice-of-a-clone", "slice-of-a-kept-value"])
def test_a_write_through_a_view_of_a_recomputed_value(case: str, policy: str) -> None:
    """``r[2:4] = v``: the write returns the slice, which nothing reads; the value written (and, when a policy
    keeps it, its stashed source) must still be made in the recompute (found by review: NaN gradients)."""
    def f(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if case == "slice-of-a-clone":
            r = w.clone()
            r[2:4] = x[2:4] * 2
            return torch.tanh(r)
        y = x @ w
        y[:, 0] = y[:, 1].exp()
        return y.cos()

    pol: Any = {"keep-exp": _keep(torch.ops.aten.exp.default), "budget": policies.memory_budget(1.0)}.get(policy, policy)
    g = remat(f, policy=pol)
    w0, x0 = torch.randn(6, 6, dtype=torch.float64), torch.randn(6, 6, dtype=torch.float64)
    for _ in range(3):  # the recorded call, then the planned ones
        w1, x1 = w0.clone().requires_grad_(), x0.clone().requires_grad_()
        w2, x2 = w0.clone().requires_grad_(), x0.clone().requires_grad_()
        got = torch.autograd.grad(g(w1, x1).sum(), [w1, x1])
        ref = torch.autograd.grad(f(w2, x2).sum(), [w2, x2])
        assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-10) for a, b in zip(got, ref))
