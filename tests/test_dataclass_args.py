"""Dataclasses of tensors as arguments: their fields are the call's inputs, as a dict's are.

optree takes a dataclass optree does not know (a plain one, or one registered with ``torch.utils._pytree`` for
``torch.func``) as a leaf: its tensors were then tensors from outside the call, and under ``vjp``, ``jacrev`` and
``hessian`` the recompute read them at the forward pass's levels, not the rebuilt ones (a false "saved 4 tensors where
its forward pass saved 5", where plain is exact). Each transform compares ``remat(f)`` with plain ``f`` under it, on
the first and a later call, float64 to 1e-10 and float32 bitwise.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch.func import grad, hessian, jacrev, vjp, vmap

from remat import remat

from .helpers import f32, f64, seeded_randn


@dataclasses.dataclass
class Params:
    w: torch.Tensor
    b: torch.Tensor


pytree.register_dataclass(Params)  # (torch.func differentiates its fields; optree does not know it)


@dataclasses.dataclass(frozen=True)
class Frozen:
    layers: list[torch.Tensor]
    scale: float


@dataclasses.dataclass(slots=True)
class Slotted:
    inner: Frozen
    b: torch.Tensor


def _f(p: Params, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(torch.sin(x @ p.w) + p.b).pow(2).sum()


def _params(dtype: torch.dtype) -> tuple[Params, torch.Tensor]:
    return Params(seeded_randn(4, 4, dtype=dtype), seeded_randn(4, dtype=dtype, seed=1)), \
        seeded_randn(3, 4, dtype=dtype, seed=2)


TRANSFORMS = {
    "backward": lambda F, p, x: torch.autograd.grad(F(Params(p.w.requires_grad_(), p.b), x), p.w),
    "grad": lambda F, p, x: grad(F)(p, x),
    "vjp": lambda F, p, x: vjp(F, p, x)[1](torch.ones((), dtype=x.dtype)),
    "jacrev": lambda F, p, x: jacrev(F, argnums=(0, 1))(p, x),
    "hessian": lambda F, p, x: hessian(lambda w: F(Params(w, p.b), x))(p.w),
    "vmap(grad)": lambda F, p, x: vmap(grad(F), in_dims=(None, 0))(p, x[:, None]),
}


def _same(a: Any, b: Any, dtype: torch.dtype) -> None:
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    assert len(la) == len(lb) > 0
    for u, v in zip(la, lb):
        if dtype is f32:
            assert torch.equal(u, v)
        else:
            assert torch.allclose(u, v, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [f64, f32], ids=["f64", "f32"])
@pytest.mark.parametrize("policy", ["save-nothing", "save-matmuls"])
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_a_dataclass_of_parameters_is_exact_under_every_transform(transform: str, policy: str,
                                                                    dtype: torch.dtype) -> None:
    run = TRANSFORMS[transform]
    r = remat(_f, policy=policy)
    for _ in range(2):  # (the first call, and a later one)
        p, x = _params(dtype)
        want = run(_f, p, x)
        p, x = _params(dtype)
        _same(run(r, p, x), want, dtype)


@pytest.mark.parametrize("transform", ["vjp", "jacrev", "backward"])
def test_nested_frozen_and_slotted_dataclasses_with_a_list_field(transform: str) -> None:
    """A dataclass known to nobody (neither optree nor torch), frozen, with a list of tensors and a number, inside a
    ``slots=True`` one: its tensors are the call's inputs, at any depth."""

    def f(s: Slotted, x: torch.Tensor) -> torch.Tensor:
        h = x
        for W in s.inner.layers:
            h = torch.sin(h @ W) * s.inner.scale
        return (h + s.b).tanh().sum()

    def make() -> tuple[Slotted, torch.Tensor]:
        layers = [seeded_randn(4, 4, seed=i) for i in range(3)]
        return Slotted(Frozen(layers, 0.7), seeded_randn(4, seed=5)), seeded_randn(3, 4, seed=6)

    def run(F: Any) -> Any:
        s, x = make()
        if transform == "backward":
            x.requires_grad_()
            return torch.autograd.grad(F(s, x), x)
        G = lambda x: F(s, x)  # noqa: E731
        if transform == "vjp":
            return vjp(G, x)[1](torch.ones((), dtype=f64))
        return jacrev(G)(x)

    for policy in ("save-nothing", "save-matmuls"):
        r = remat(f, policy=policy)
        for _ in range(2):
            _same(run(r), run(f), f64)


def test_the_function_gets_the_callers_own_instance_and_the_frame_holds_none_of_its_tensors() -> None:
    """The forward pass passes the caller's object itself (an attribute it sets is the caller's), and nothing of
    the call holds the instance or its tensors but through the graph (the instance dies with the caller's name)."""
    seen: list[int] = []

    def f(p: Params, x: torch.Tensor) -> torch.Tensor:
        seen.append(id(p))
        p.calls = getattr(p, "calls", 0) + 1  # type: ignore[attr-defined]
        return torch.sin(x @ p.w + p.b).sum()

    p, x = _params(f64)
    p.w.requires_grad_()
    loss = remat(f)(p, x)
    assert seen == [id(p)] and p.calls == 1  # type: ignore[attr-defined]
    ref = weakref.ref(p)
    del p
    gc.collect()
    assert ref() is None  # (the frame holds it weakly)
    loss.backward()


@dataclasses.dataclass(slots=True)
class _SlottedState:
    w: torch.Tensor
    calls: int = 0
    cache: Any = None


_GLOBAL: list[Any] = []


def test_a_slots_dataclass_is_the_callers_own_in_the_forward_pass() -> None:
    """A ``slots=True`` instance cannot be held weakly: held then (as a leaf was), so that the function still gets the
    caller's own object (before: a copy; what it set was lost and ``s is GLOBAL`` flipped, silently)."""

    def f(s: _SlottedState, x: torch.Tensor) -> torch.Tensor:
        s.calls += 1
        s.cache = h = torch.sin(x @ s.w)
        return h.sum() * (2.0 if s is _GLOBAL[0] else 1.0)

    _GLOBAL[:] = [_SlottedState(seeded_randn(4, 4).requires_grad_())]
    s, x = _GLOBAL[0], seeded_randn(3, 4, seed=1)
    want = torch.autograd.grad(f(s, x), s.w)
    got = torch.autograd.grad(remat(f)(s, x), s.w)
    assert s.calls == 2 and s.cache is not None
    _same(got, want, f64)


@dataclasses.dataclass
class _Lazy:
    w: torch.Tensor
    cache: torch.Tensor = dataclasses.field(init=False)  # (not set until the function sets it)


@dataclasses.dataclass
class _Node:
    w: torch.Tensor
    parent: Any = None
    it: Any = None


@pytest.mark.parametrize("kind", ["init-false-unset", "cycle", "iterator-field", "uncopyable"])
def test_a_dataclass_that_cannot_be_taken_apart_stays_a_leaf(kind: str) -> None:
    """A field not set yet, an instance that refers to itself, an iterator among its fields or one that cannot be
    copied: a leaf, as before the fields became inputs (those raised AttributeError, RecursionError, TypeError)."""

    class NoCopy(_Node):
        def __copy__(self) -> Any:
            raise TypeError("no copies")

    def make() -> Any:
        w = seeded_randn(4, 4).requires_grad_()
        if kind == "init-false-unset":
            return _Lazy(w)
        n = (NoCopy if kind == "uncopyable" else _Node)(w)
        if kind == "cycle":
            n.parent = n
        if kind == "iterator-field":
            n.it = iter([1, 2])
        return n

    def f(p: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ p.w).pow(2).sum()

    x = seeded_randn(3, 4, seed=1)
    p = make()
    want = torch.autograd.grad(f(p, x), p.w)
    p = make()
    _same(torch.autograd.grad(remat(f)(p, x), p.w), want, f64)


@pytest.mark.parametrize("debug", [False, True], ids=["replay", "re-run"])
def test_a_field_rebound_between_the_passes_is_read_as_the_forward_pass_read_it(debug: bool) -> None:
    """The caller rebinds a field between the passes (``p.b = p.b + 1``), as it may a dict's entry: the recompute
    reads the leaves of the forward pass (a re-run is handed a copy holding them; it was handed the caller's instance,
    whose new field made it diverge)."""

    def f(p: Params, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.sin(x @ p.w) + p.b).pow(2).sum()

    def run(F: Any) -> Any:
        p, x = _params(f64)
        p.w.requires_grad_()
        out = F(p, x)
        p.b = p.b + 1
        return torch.autograd.grad(out, p.w)

    _same(run(remat(f, debug=debug)), run(f), f64)
