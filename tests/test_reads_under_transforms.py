"""Which tensor an op reads, and Python data lifted inside a custom ``autograd.Function``, on the full engine's routes
(``torch.func`` transforms, ``debug=True``): exact, or a ``RematError``; never a silent mismatch.

Every case compares ``remat(f, policy=p)`` with plain ``f`` under the same transform, float64, on the first call and
on later ones. Each failed on 642217f: the ``from_numpy`` Function raised a false "read a different tensor" under
``grad``/``vjp``/``jacrev`` (save-matmuls also read a dead op's placeholder through NumPy: NOTE [dead ops]); the flag
cases returned a gradient off by up to 4.2 with ``debug=True`` (NOTE [same reads]: a recompute reading a tensor no op
made, where the forward pass read an input or a value of the call, matched it).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vjp

import remat
from remat import RematError, checkpoint_name

from .helpers import assert_tree_close
from .test_replay import POLICIES as REPLAY_POLICIES

f64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}
POLICIES = {**REPLAY_POLICIES, "custom": lambda op, *a, **k: op is torch.ops.aten.mm.default}


class NumpySin(torch.autograd.Function):
    """A Function whose forward leaves torch for NumPy and lifts the result back (no mode sees what it reads)."""

    @staticmethod
    def forward(x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return torch.from_numpy(np.sin(x.detach().numpy()))

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return g * x.cos()


W = torch.linspace(-1, 1, 16, dtype=f64).reshape(4, 4)


def _numpy_fn(x: torch.Tensor) -> torch.Tensor:
    h = checkpoint_name(x @ W_PARAM, "h")
    return (NumpySin.apply(h) * x).tanh()


W_PARAM = nn.Parameter(W.clone())

ROUTES: dict[str, Callable[[Callable[..., Any], torch.Tensor], Any]] = {
    "grad": lambda f, x: grad(lambda t: f(t).sum())(x),
    "vjp": lambda f, x: (lambda o, pb: (o, pb(torch.ones_like(o))))(*vjp(f, x)),
    "jacrev": lambda f, x: jacrev(f)(x),
    "backward": lambda f, x: torch.autograd.grad(f(x.requires_grad_()).sum(), (x, W_PARAM)),
}


@pytest.mark.parametrize("debug", [False, True], ids=["replay", "debug"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("route", ROUTES)
def test_a_custom_function_returning_numpy_data_is_exact(route: str, policy: str, debug: bool) -> None:
    run = ROUTES[route]
    g = remat.remat(_numpy_fn, policy=POLICIES[policy], debug=debug)
    for k in range(3):  # the first call and later ones, on new values each time
        x = torch.linspace(-1.2, 1.1 + k, 12, dtype=f64).reshape(3, 4)
        assert_tree_close(run(g, x.clone()), run(_numpy_fn, x.clone()), **TOL)


class Flag(nn.Module):
    """Which tensor an op reads depends on ``mode``: an input, a value of the call, a parameter, a plain tensor."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4, dtype=f64, generator=g))
        self.vp = nn.Parameter(torch.randn(4, dtype=f64, generator=g))
        self.vec = torch.randn(4, dtype=f64, generator=g)
        self.mode = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint_name(torch.tanh(x @ self.w), "h")
        src = [x, h, self.w[0], self.vp, self.vec][self.mode]
        return torch.sin(h * src).sum()


FLIPS = [(a, b) for a, b in itertools.product(range(5), range(5)) if a != b]


def _flip_between_passes(policy: str, how: str, flip: tuple[int, int]) -> tuple[Any, Any]:
    """(remat's gradients or the RematError it raised, plain autograd's), with ``mode`` flipped between the passes."""
    a, b = flip
    ref_m, m = Flag(), Flag()
    x = torch.linspace(-1.2, 1.1, 12, dtype=f64).reshape(3, 4).requires_grad_()
    ref_m.mode = m.mode = a
    y_ref = ref_m(x)
    ref_m.mode = b
    ref = torch.autograd.grad(y_ref, (x, ref_m.w, ref_m.vp), allow_unused=True, materialize_grads=True)
    run = (remat.remat(m.forward, policy=POLICIES[policy], debug=True) if how == "method"
           else remat.remat_module(m, policy=POLICIES[policy], debug=True))
    y = run(x)
    m.mode = b
    try:
        return torch.autograd.grad(y, (x, m.w, m.vp), allow_unused=True), ref
    except RematError as e:
        return e, ref


@pytest.mark.parametrize("flip", FLIPS, ids=[f"{a}to{b}" for a, b in FLIPS])
@pytest.mark.parametrize("how", ["method", "remat_module"])
@pytest.mark.parametrize("policy", ["save-nothing", "save-matmuls"])
def test_debug_raises_or_is_exact_when_another_tensor_is_read(policy: str, how: str, flip: tuple[int, int]) -> None:
    got, ref = _flip_between_passes(policy, how, flip)
    if isinstance(got, RematError):
        return  # (exact, or an error: never a silent mismatch)
    got = tuple(torch.zeros_like(r) if g is None else g for g, r in zip(got, ref))
    assert_tree_close(got, ref, **TOL)


def test_debug_raises_when_the_recompute_reads_a_parameter_where_the_forward_read_the_input() -> None:
    """The case that was silent (off by 1.9): the forward pass read ``x``, the recompute would read ``self.vp``."""
    got, _ = _flip_between_passes("save-nothing", "method", (0, 3))
    assert isinstance(got, RematError)
    assert "argument #0 of the call" in str(got)


@pytest.mark.parametrize("policy", ["save-nothing", "save-matmuls"])
def test_debug_under_functional_call_and_grad_raises_when_another_tensor_is_read(policy: str) -> None:
    """Under ``torch.func.grad`` over ``functional_call``: the recompute checks which tensor each op reads below the
    transform's levels too (it compared values only before: off by 4.2)."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.flag = True
            self.W = nn.Parameter(torch.linspace(-0.7, 0.9, 16, dtype=f64).reshape(4, 4).sin())
            self.vec = nn.Parameter(torch.linspace(0.2, 1.3, 4, dtype=f64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            src = x if self.flag else self.vec
            h = (src * x).sin() + x
            return (h @ self.W).sin() * h

    def run(m: nn.Module) -> Any:
        m.flag = True
        p = {k: v.detach() for k, v in m.named_parameters()}

        def loss(p: Any, x: torch.Tensor) -> torch.Tensor:
            o = functional_call(m, p, (x,))
            m.flag = False  # between the passes
            return o.sum()

        return grad(loss, argnums=(0, 1))(p, torch.linspace(-1.2, 1.1, 12, dtype=f64).reshape(3, 4))

    ref = run(M())
    with pytest.raises(RematError, match="argument #0 of the call"):
        run(remat.remat_module(M(), policy=POLICIES[policy], debug=True))
    # without debug the program replays: exact
    assert_tree_close(run(remat.remat_module(M(), policy=POLICIES[policy])), ref, **TOL)


class Renormed(nn.Module):
    """``nn.Embedding(max_norm=...)`` renormalises the rows it reads in place, under ``no_grad``, on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 6, max_norm=1.0, dtype=f64)
        self.out = nn.Linear(6, 10, bias=False, dtype=f64)

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.out((self.emb(ids) + x).tanh()).sin().sum()


@pytest.mark.parametrize("policy", ["save-nothing", "save-matmuls", "custom"])
@pytest.mark.parametrize("how", ["method", "remat_module"])
@pytest.mark.parametrize("transform", ["grad", "vjp", "jacrev"])
def test_renormalised_embedding_rows_under_functional_call_are_exact(transform: str, how: str, policy: str) -> None:
    """Review (twenty-eighth session): under ``torch.func`` the recompute wrote the rows into a detached copy of the
    weight, which needed no gradient at the transform's level, so the embedding saved nothing there and remat
    raised a false "saved a tensor of shape [6, 10] where its forward pass saved [2, 5, 6]". Exact on three calls,
    the weights renormalised between them as in plain ``torch.func``."""
    torch.manual_seed(0)
    ref_m, m = Renormed(), Renormed()
    m.load_state_dict(ref_m.state_dict())
    ids, x = torch.randint(0, 10, (2, 5)), torch.randn(2, 5, 6, dtype=f64)
    p = POLICIES[policy]
    block = remat.remat_module(m, policy=p) if how == "remat_module" else m
    fn = m.forward if how == "method" else block
    call = remat.remat(fn, policy=p) if how == "method" else fn

    def run(model: nn.Module, f: Callable[..., torch.Tensor]) -> Any:
        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss(ps: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            with torch.nn.utils.stateless._reparametrize_module(model, ps):
                return f(ids, x)

        if transform == "grad":
            return grad(loss, argnums=(0, 1))(params, x)
        if transform == "vjp":
            out, pull = vjp(loss, params, x)
            return out, pull(torch.ones_like(out))
        return jacrev(loss, argnums=(0, 1))(params, x)

    for _ in range(3):
        assert_tree_close(run(m, call), run(ref_m, ref_m), **TOL)
    torch.testing.assert_close(m.emb.weight, ref_m.emb.weight, rtol=0, atol=0)


@pytest.mark.parametrize("policy", ["save-nothing", "save-matmuls", "custom"])
@pytest.mark.parametrize("how", ["method", "remat_module"])
def test_a_gradient_penalty_through_renormalised_rows_is_exact(how: str, policy: str) -> None:
    """A review (thirty-fifth session): a gradient penalty, ``grad`` over the parameters of ``grad`` over ``x``, the
    weight renormalised in place by ``nn.Embedding(max_norm=...)``. The inner transform does not differentiate the
    weight, the outer one does; the recompute wrote a detached copy of it, which lost the outer level's history: the
    weight's gradient came out 0 (off by all of it, silently; save-matmuls raised a false "saved a tensor of shape").
    Three calls, against plain ``torch.func``."""
    torch.manual_seed(0)
    ref_m, m = Renormed(), Renormed()
    m.load_state_dict(ref_m.state_dict())
    ids, x = torch.randint(0, 10, (2, 5)), torch.randn(2, 5, 6, dtype=f64)
    p = POLICIES[policy]
    call = remat.remat(m.forward, policy=p) if how == "method" else remat.remat_module(m, policy=p)

    def run(model: nn.Module, f: Callable[..., torch.Tensor]) -> Any:
        def loss(ps: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            with torch.nn.utils.stateless._reparametrize_module(model, ps):
                return f(ids, x)

        def penalty(ps: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            return (grad(loss, argnums=1)(ps, x) ** 2).sum()

        return grad(penalty)({k: v.detach() for k, v in model.named_parameters()}, x)

    for _ in range(3):
        got, want = run(m, call), run(ref_m, ref_m)
        assert want["emb.weight"].abs().max() > 0.1
        assert_tree_close(got, want, **TOL)


def _constant_written_in_place(x: torch.Tensor) -> torch.Tensor:
    v = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=f64)  # (built from Python data: aten.lift_fresh)
    v.add_(1.0)
    return (v * x).sin().sum()


@pytest.mark.parametrize("policy", ["save-nothing", "save-matmuls", "budget"])
@pytest.mark.parametrize("transform", ["grad", "vjp", "jacrev", "backward"])
def test_a_constant_built_from_python_data_and_written_in_place(transform: str, policy: str) -> None:
    """A review (thirty-fifth session): ``torch.tensor([...])`` then ``v.add_(1)``. The lifted tensor is the data's own,
    and the full engine's recompute lifted it again from that tensor, which the forward pass's write had changed,
    then wrote it again: off by 9.3 on every call under ``torch.func`` (and on a memory budget's first call under
    plain autograd), silently. The recompute lifts the value the forward pass lifted. Three calls."""
    g = remat.remat(_constant_written_in_place,
                    policy=remat.policies.memory_budget(0.5) if policy == "budget" else POLICIES[policy])
    x0 = torch.tensor([0.3, -1.2, 0.7, 2.0], dtype=f64)

    def run(f: Callable[..., torch.Tensor]) -> Any:
        if transform == "grad":
            return grad(f)(x0)
        if transform == "vjp":
            return vjp(f, x0)[1](torch.tensor(1.0, dtype=f64))
        if transform == "jacrev":
            return jacrev(f)(x0)
        x = x0.clone().requires_grad_()
        f(x).backward()
        return x.grad

    for _ in range(3):
        assert_tree_close(run(g), run(_constant_written_in_place), **TOL)
