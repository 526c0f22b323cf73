"""Offloading under ``torch.func``: the plain tensor under a wrapper is offloaded and freed, ``vjp`` is
float32 bitwise, ``hessian`` with forward AD's zero tangents is exact, and an in-place write into an offloaded
output raises as plain ``torch.func`` does.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from torch.func import grad, jvp, vjp

from remat import RematError, policies, remat
from remat._context import internal
from remat._torch_internals import unwrap_all
from remat.bench.models import make_model
from remat.offload import OffloadEngine, use_engine

from .helpers import assert_tree_close

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("policy", ["offload", "save-everything"])
def test_offloaded_wrapper_freed_under_grad(policy: str) -> None:
    refs: list[weakref.ref[Any]] = []
    alive: list[bool] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        a = x.exp()
        with internal():  # (the test's probe, not a call of the function: the program would hold what it reads)
            refs.append(weakref.ref(unwrap_all(a).untyped_storage()))  # the memory below the grad wrapper
        return (a * x).sum()

    g = remat(f, policy=policies.offload_to_cpu(min_bytes=0) if policy == "offload" else "save-everything")

    def outer(x: torch.Tensor) -> torch.Tensor:
        y = g(x)
        gc.collect()
        alive.append(refs[0]() is not None)
        return y

    x = torch.randn(256, dtype=torch.float64)
    eng = OffloadEngine()
    with use_engine(eng):
        gx = grad(outer)(x)
    assert_tree_close(gx, grad(f)(x))
    assert alive == [policy != "offload"]
    assert (eng.stats["offloaded"] > 0) == (policy == "offload")


def test_vjp_float32_bitwise() -> None:
    params, x, _, apply = make_model("mlp", "small", torch.float32, "cpu")
    eng = OffloadEngine()
    with use_engine(eng):
        out, fn = vjp(lambda p: apply(p, x, lambda f: remat(f, policy="offload-to-cpu")), params)
        (g,) = fn(torch.ones_like(out))
    out0, fn0 = vjp(lambda p: apply(p, x), params)
    assert_tree_close((out, g), (out0, fn0(torch.ones_like(out0))[0]))


def test_hessian_with_a_zero_tangent_offloaded():
    """Found by review: under ``hessian`` (jacfwd over jacrev) a relu's zero tangent is forward AD's efficient zero
    tensor, which has no storage; offloading it raised "Attempted to access the data pointer on an invalid python
    storage". It is kept (it costs nothing); the Hessian equals plain autograd's."""
    from torch.func import hessian

    torch.manual_seed(0)
    W1 = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)
    W2, x = torch.randn(6, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)

    def f(W1, W2, x):
        return torch.exp(torch.relu(x @ W1) @ W2)

    g = remat(f, policy=policies.offload_to_cpu(min_bytes=0))
    want = hessian(lambda W: f(W, W2, x).pow(2).sum())(W1)
    for _ in range(2):
        got = hessian(lambda W: g(W, W2, x).pow(2).sum())(W1)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_in_place_write_into_a_promoted_offloaded_output_under_torch_func_raises() -> None:
    """``a = x.exp(); a.mul_(2)`` under torch.func.grad: the offloaded copy of exp's output was made by
    ``promote`` from a detached alias that died at once, so the write went unseen (4 exp(x) came out).
    Plain torch.func raises for this program; remat raises too."""
    def f(x: torch.Tensor) -> torch.Tensor:
        a = x.exp()
        a.mul_(2)
        return a.sin().sum()

    x = torch.randn(5, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        grad(f)(x)
    with pytest.raises(RematError, match="writes in place into a tensor that its offload policy offloads"):
        grad(remat(f, policy=policies.offload_to_cpu(min_bytes=0)))(x)


@pytest.mark.parametrize("fill", ["zero_", "fill_", "copy_"])
@pytest.mark.parametrize("transform", ["vjp", "grad", "jacrev"])
def test_a_fill_into_an_offloaded_output_in_the_forward_pass_is_no_write_after_saving(fill: str,
                                                                                     transform: str) -> None:
    """The clone of a saved value, offloaded for the recompute, then filled in place through a view by the forward
    pass itself: the copy holds the clone as its op made it, which the recompute reads, and nothing is written after
    the forward pass. It raised "offloaded for the backward pass was modified in place after it was saved (version 0
    -> 1)" on every call under vjp; now plain torch.func's gradient, float64, every call."""

    def f(x: torch.Tensor) -> torch.Tensor:
        v5 = torch.sigmoid(x)
        v6 = v5.clone()
        piece = v6.view(6, 4)[::2]
        {"zero_": lambda: piece.zero_(), "fill_": lambda: piece.fill_(2.0),
         "copy_": lambda: piece.copy_(v5.view(6, 4)[1::2] * 3)}[fill]()
        return v6

    g = remat(f, policy=policies.offload_to_cpu(min_bytes=0))
    ct = torch.arange(24, dtype=torch.float64).cos().view(4, 6)
    run = {"vjp": lambda h, x: vjp(h, x)[1](ct)[0],
           "grad": lambda h, x: grad(lambda t: (h(t) * ct).sum())(x),
           "jacrev": lambda h, x: torch.func.jacrev(h)(x)}[transform]
    for call in range(3):
        x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(call))
        assert_tree_close(run(g, x), run(f, x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("transform", ["jvp", "jacfwd"])
def test_forward_mode_alone_takes_an_in_place_write_into_an_offloaded_output(transform: str) -> None:
    """Forward mode alone saves nothing a backward pass reads: ``h.relu_()`` into an offloaded product under ``jvp``
    or ``jacfwd`` raised "writes in place into a tensor that its offload policy offloads ... under torch.func"
    (the refusal guards a backward pass's replay). Now plain's values, every call; with plain autograd below the
    level, the jvp too (it raised there, with parameters that require a gradient, as a module's do), and a backward
    pass through the primal refuses."""

    def f(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = x @ w
        h.relu_()
        return h.sin()

    g = remat(f, policy=policies.offload_to_cpu(min_bytes=0))
    for call in range(3):
        gen = torch.Generator().manual_seed(call)
        w, x, t = (torch.randn(*s, dtype=torch.float64, generator=gen) for s in ((4, 4), (3, 4), (4, 4)))
        assert_tree_close(_forward_mode(transform, g, w, x, t), _forward_mode(transform, f, w, x, t), rtol=1e-10,
                          atol=1e-10)
    w = w.clone().requires_grad_()
    out, tangent = jvp(lambda w: g(w, x), (w,), (t,))
    assert_tree_close((out, tangent), jvp(lambda w: f(w, x), (w,), (t,)), rtol=1e-10, atol=1e-10)
    assert out.grad_fn is not None
    with pytest.raises(RematError, match="offload policy offloads"):
        out.sum().backward()


def _forward_mode(transform: str, h: Any, w: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> Any:
    if transform == "jvp":
        return jvp(lambda w: h(w, x), (w,), (t,))
    return torch.func.jacfwd(h)(w, x)
