"""Autograd hooks that the remat'd function registers itself (``x.register_hook(scale)`` inside a block) are a
side effect of its forward pass: registered once per call, as in plain autograd, on every route (the replay, the
program replay under ``torch.func``, and the re-runs: ``debug=True``, a memory budget's first call). A recompute
that registered them again ran a scaling hook twice, a hook removed inside the function anyway, and left hooks on a
parameter that every later backward pass ran."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, jacrev, vjp, vmap

from remat import policies, remat, remat_module

WRAPS: dict[str, dict[str, Any]] = {
    "save-nothing": {"policy": "save-nothing"},
    "save-matmuls": {"policy": "save-matmuls"},
    "save-everything": {"policy": "save-everything"},
    "debug": {"debug": True},
    "budget": {"policy": policies.memory_budget(0.3)},
}


def on_input(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    x.register_hook(lambda g: g * 2)
    return F.gelu(x @ W).sin().sum()


def on_param(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    W.register_hook(lambda g: g * 3)
    return torch.tanh(x @ W).sin().sum()


def removed(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    h = W.register_hook(lambda g: g * 100)
    h.remove()
    return torch.tanh(x @ W).sin().sum()


def on_intermediate(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ W)
    h.register_hook(lambda g: g * 5)
    return (h * h.sin()).sum()


FNS = {f.__name__: f for f in (on_input, on_param, removed, on_intermediate)}


def _data(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, 4, dtype=dtype, generator=g), torch.randn(4, 6, dtype=dtype, generator=g)


def _backward(f: Callable[..., torch.Tensor], x0: torch.Tensor, W0: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x, W = x0.clone().requires_grad_(), W0.clone().requires_grad_()
    f(x, W).backward()
    assert x.grad is not None and W.grad is not None
    return x.grad, W.grad


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("wrap", WRAPS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_hooks_registered_inside_run_once_under_plain_autograd(fn: str, wrap: str, dtype: torch.dtype) -> None:
    f = FNS[fn]
    x, W = _data(dtype)
    ref = _backward(f, x, W)
    g = remat(f, **WRAPS[wrap])
    for _ in range(3):  # the first call (a budget's measuring one) and later ones
        for got, want in zip(_backward(g, x, W), ref):
            torch.testing.assert_close(got, want, rtol=1e-12 if dtype is torch.float64 else 0, atol=0)


TRANSFORMS: dict[str, Callable[[Callable[..., torch.Tensor], torch.Tensor, torch.Tensor], Any]] = {
    "grad": lambda f, x, W: grad(f, argnums=(0, 1))(x, W),
    "vjp": lambda f, x, W: vjp(f, x, W)[1](torch.ones((), dtype=x.dtype)),
    "vmap(grad)": lambda f, x, W: vmap(grad(lambda x, W: f(x[None], W), argnums=(0, 1)), in_dims=(0, None))(x, W),
    "jacrev": lambda f, x, W: jacrev(f, argnums=(0, 1))(x, W),
}


@pytest.mark.parametrize("fn", ["on_input", "on_param", "removed"])
@pytest.mark.parametrize("wrap", WRAPS)
@pytest.mark.parametrize("transform", TRANSFORMS)
def test_hooks_registered_inside_run_once_under_torch_func(fn: str, wrap: str, transform: str) -> None:
    f, t = FNS[fn], TRANSFORMS[transform]
    x, W = _data()
    ref = t(f, x, W)
    g = remat(f, **WRAPS[wrap])
    for _ in range(3):
        torch.testing.assert_close(t(g, x, W), ref, rtol=1e-12, atol=0)


@pytest.mark.parametrize("wrap", WRAPS)
@pytest.mark.parametrize("under", ["grad", "backward"])
def test_the_hooks_left_on_a_parameter_are_plain_autograds(wrap: str, under: str) -> None:
    """The hooks a recompute registered stayed on the parameter: every later backward pass, remat or not, ran
    them (a gradient 1000x after three torch.func calls). Plain autograd leaves the forward pass's own (one per
    call under .backward(); none under torch.func, whose hook goes on the level's wrapper)."""
    x, W0 = _data()
    Ws = []
    for f in (on_param, remat(on_param, **WRAPS[wrap])):
        W = W0.clone().requires_grad_()
        for _ in range(3):
            if under == "grad":
                grad(lambda W: f(x, W))(W)  # noqa: B023 (called at once)
            else:
                f(x, W).backward()
        Ws.append(W)
    assert len(Ws[1]._backward_hooks or ()) == len(Ws[0]._backward_hooks or ())
    for W in Ws:
        W.grad = None
        torch.tanh(x @ W).sin().sum().backward()
    torch.testing.assert_close(Ws[1].grad, Ws[0].grad, rtol=0, atol=0)


@pytest.mark.parametrize("wrap", WRAPS)
def test_a_post_accumulate_grad_hook_runs_once(wrap: str) -> None:
    seen: list[int] = []

    def f(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        W.register_post_accumulate_grad_hook(lambda p: seen.append(1))
        return torch.tanh(x @ W).sin().sum()

    x, W0 = _data()
    g = remat(f, **WRAPS[wrap])
    for step in range(3):
        W = W0.clone().requires_grad_()
        seen.clear()
        g(x, W).backward()
        assert len(seen) == 1, (step, len(seen))


@pytest.mark.parametrize("wrap", WRAPS)
def test_a_registration_torch_refuses_is_refused_in_the_recompute_too(wrap: str) -> None:
    """A re-run's hook registrations do nothing, except one torch refuses (a tensor that needs no gradient): it
    raises there too, so a function that catches it takes the same branch ("diverged: 2.0 in the recompute but
    3.0 in the forward pass" when the re-run registered it)."""
    def f(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        c = torch.ones(())  # (needs no gradient)
        try:
            c.register_hook(lambda g: g)
            scale = 2.0
        except RuntimeError:
            scale = 3.0
        return torch.tanh(x @ W).mul(scale).sin().sum()

    x, W = _data()
    ref = _backward(f, x, W)
    g = remat(f, **WRAPS[wrap])
    for _ in range(3):
        for got, want in zip(_backward(g, x, W), ref):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


class _Watched(torch.nn.Module):
    """A block whose inner Linear has a full backward hook (a gradient monitor that also scales)."""

    def __init__(self, seen: list[int]) -> None:
        super().__init__()
        self.up = torch.nn.Linear(4, 8, dtype=torch.float64)
        self.down = torch.nn.Linear(8, 4, dtype=torch.float64)
        self.down.register_full_backward_hook(
            lambda mod, gin, gout: (seen.append(1), tuple(None if g is None else g * 2 for g in gin))[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x))).sin()


@pytest.mark.parametrize("wrap", WRAPS)
def test_a_full_backward_hook_inside_the_block(wrap: str) -> None:
    """A memory budget's first call replays the torch calls of the forward pass; the hook's Function made its
    input with grad mode off, so the replayed linear saved one tensor less ("the recompute saved 4 tensors where
    its forward pass saved 5"). The hook runs once per backward pass, as in plain autograd."""
    seen: list[int] = []
    torch.manual_seed(0)
    plain, model = _Watched(seen), _Watched(seen)
    model.load_state_dict(plain.state_dict())
    remat_module(model, **WRAPS[wrap])
    x0 = torch.randn(3, 4, dtype=torch.float64)
    for _ in range(3):
        grads = []
        for m in (plain, model):
            seen.clear()
            x = x0.clone().requires_grad_()
            grads.append(torch.autograd.grad(m(x).pow(2).sum(), [x, *m.parameters()]))
            assert len(seen) == 1
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=0)
