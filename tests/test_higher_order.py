"""Higher-order and forward-mode corners a review of the forward-mode transforms found (twenty-seventh session): each
compares ``remat(f, policy=p)`` with plain ``f`` under the same transform (float64, 1e-10), on three calls.

* a value saved as kept before its ``checkpoint_name`` dropped it (``save_anything_except_these_names``), under
  forward-over-reverse (``hessian``, ``jacfwd(grad)``, ``vmap(jvp(grad))``): NaN before (the replay read dead
  placeholders for its tangents);
* random ops under the legacy vmap of ``torch.autograd.grad(..., is_grads_batched=True)`` and
  ``torch.autograd.functional.jacobian(..., vectorize=True)``: torch's "We do not yet support calling random
  operations inside of vmap" from the replay before;
* ``torch.func.linearize`` (and ``make_fx``) over a remat'd function's gradient: its trace recorded the recompute's
  ops but not the generator states a replayed random op puts back, nor the offload engine's copies, so the traced
  jvp drew other numbers or read trace-time constants (off by 22 before); under a trace remat keeps everything
  (NOTE [under make_fx] in remat/_engine/select.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, hessian, jacfwd, jvp, linearize, vmap
from torch.fx.experimental.proxy_tensor import make_fx

import remat
from remat import checkpoint_name, policies

from .helpers import assert_tree_close

DT = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


X, G, T = _rand(3, 4, seed=0), _rand(4, seed=1), _rand(2, 3, 4, seed=2)

FORWARD_OVER_REVERSE = {
    "jvp(grad)": lambda f: jvp(grad(f), (X,), (T[0],))[1],
    "vmap(jvp(grad))": lambda f: vmap(lambda t: jvp(grad(f), (X,), (t,))[1])(T),
    "jacfwd(grad)": lambda f: jacfwd(grad(f))(X),
    "hessian": lambda f: hessian(f)(X),
}


@pytest.mark.parametrize("op", ["tanh", "softmax", "exp"])
@pytest.mark.parametrize("transform", list(FORWARD_OVER_REVERSE))
def test_a_kept_value_a_name_drops_under_forward_over_reverse(transform: str, op: str) -> None:
    act = {"tanh": torch.tanh, "softmax": lambda x: torch.softmax(x, -1), "exp": torch.exp}[op]

    def f(x: torch.Tensor) -> torch.Tensor:
        h = checkpoint_name(act(x), "n0")
        return ((h * G).sum(-1) ** 2).sum()

    run = FORWARD_OVER_REVERSE[transform]
    want = run(f)
    g = remat.remat(f, policy=policies.save_anything_except_these_names("n0"))
    for _ in range(3):
        got = run(g)
        assert not got.isnan().any()
        assert_tree_close(got, want, **TOL)


def _dropped(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    return F.dropout(torch.sin(x @ W), 0.5, training=True).sum(-1)


BATCHED = {
    "is_grads_batched": lambda f, x, W: torch.autograd.grad(f(x, W), (x, W), grad_outputs=_rand(2, 3, seed=5),
                                                            is_grads_batched=True),
    "jacobian(vectorize)": lambda f, x, W: torch.autograd.functional.jacobian(f, (x, W), vectorize=True),
}


@pytest.mark.parametrize("debug", [False, True], ids=["replay", "debug"])
@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable"])
@pytest.mark.parametrize("how", list(BATCHED))
def test_random_ops_under_the_legacy_vmap_of_batched_grads(how: str, policy: str, debug: bool) -> None:
    x, W = _rand(3, 4, seed=3).requires_grad_(), _rand(4, 4, seed=4).requires_grad_()
    run: Any = BATCHED[how]
    g = remat.remat(_dropped, policy=getattr(policies, policy), debug=debug)
    for call in range(3):
        torch.manual_seed(call)
        want = run(_dropped, x, W)
        torch.manual_seed(call)
        assert_tree_close(run(g, x, W), want, **TOL)


def _silu_mm(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    return F.silu(x @ W).pow(2).sum()


def _dropout_mm(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    return F.dropout(torch.sin(x @ W), 0.5, training=True).pow(2).sum()


TRACED = {
    "linearize(grad)": lambda f, x, W, t: linearize(grad(lambda a: f(a, W)), x)[1](t),
    "make_fx(backward)": lambda f, x, W, t: make_fx(
        lambda a: torch.autograd.grad(f(a, W), a, create_graph=True)[0])(x.requires_grad_())(x),
}


@pytest.mark.parametrize("policy", ["nothing_saveable", "dots_saveable", "offload_to_cpu(min_bytes=0)",
                                    "offload_dot_with_no_batch_dims"])
@pytest.mark.parametrize("fn", [_silu_mm, _dropout_mm], ids=["silu", "dropout"])
@pytest.mark.parametrize("how", list(TRACED))
def test_a_traced_gradient_is_exact(how: str, fn: Any, policy: str) -> None:
    pol = {"offload_to_cpu(min_bytes=0)": policies.offload_to_cpu(min_bytes=0),
           "offload_dot_with_no_batch_dims": policies.offload_dot_with_no_batch_dims("cpu", "cpu")}.get(policy) \
        or getattr(policies, policy)
    g = remat.remat(fn, policy=pol)
    W = _rand(4, 4, seed=6)
    for call in range(3):
        x, t = _rand(3, 4, seed=7 + call), _rand(3, 4, seed=10 + call)
        torch.manual_seed(call)
        want = TRACED[how](fn, x.clone(), W, t)
        state = torch.get_rng_state()
        torch.manual_seed(call)
        assert_tree_close(TRACED[how](g, x.clone(), W, t), want, **TOL)
        assert torch.equal(torch.get_rng_state(), state)  # (the same draws, no more)


# ---- two reverse levels: no dead op's placeholder reaches the outer backward pass ----------------------------------


def _gg(f: Any, w: torch.Tensor, x: torch.Tensor, how: str) -> torch.Tensor:
    V = torch.cos(torch.arange(w.numel(), dtype=w.dtype)).reshape(w.shape)
    if how == "grad(grad)":
        return grad(lambda w: (grad(f)(w, x) * V).sum())(w)
    if how == "jacrev(grad)":
        return torch.func.jacrev(grad(f))(w, x)
    return grad(lambda w: (torch.func.vjp(lambda w: f(w, x), w)[1](torch.tensor(1.0, dtype=w.dtype))[0] * V).sum())(w)


def _routed(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    vals, idx = torch.topk(x @ w, 2, dim=-1)  # (an index made in the call, read by the backward pass)
    y = torch.einsum("sd,ske->se", x, w.T[idx]) * vals.sum(-1, keepdim=True)
    sv, si = torch.sort(y, dim=-1)
    return torch.zeros_like(y).scatter(-1, si, sv.sigmoid()).sin().sum()


@pytest.mark.parametrize("how", ["grad(grad)", "jacrev(grad)", "grad(vjp)"])
@pytest.mark.parametrize("case", ["nested", "routed-budget", "routed-matmuls"])
def test_two_reverse_levels_read_no_placeholder(case: str, how: str) -> None:
    """Under two reverse levels the recompute skipped ops it judged dead, whose NaN placeholders (or uninitialised
    integer ones: an index) the outer level's backward pass read where no capture hook checks: all-NaN second
    derivatives with a remat nested in a save-matmuls remat, and "index 94143521641488 is out of bounds" (or an
    in-bounds garbage index) on a memory budget's later calls. Every op now runs there: plain's values, each call."""
    if case == "nested":
        inner = remat.remat(lambda w, x: (x @ w) @ w.T, policy="save-nothing")

        def plain(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return (((x @ w) @ w.T) + x).sin().sum()

        g = remat.remat(lambda w, x: (inner(w, x) + x).sin().sum(), policy="save-matmuls")
    else:
        plain = _routed
        g = remat.remat(_routed, policy=policies.memory_budget(0.5) if case == "routed-budget" else "save-matmuls")
    for call in range(3):
        gen = torch.Generator().manual_seed(call)
        w = torch.randn(4, 4, dtype=torch.float64, generator=gen) * 0.5
        x = torch.randn(5, 4, dtype=torch.float64, generator=gen)
        want = _gg(plain, w, x, how)
        assert want.isfinite().all()
        assert_tree_close(_gg(g, w, x, how), want, rtol=1e-10, atol=1e-10)
