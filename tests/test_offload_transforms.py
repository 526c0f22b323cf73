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
from torch.func import grad, vjp

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
