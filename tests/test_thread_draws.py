"""Random ops while other threads draw from torch's shared generators (NOTE [draws in threads] in _engine/ambient.py).

Another thread drawing from the default generator between the moment a call notes a random op's state and the op's
draw (or between the replay's putting it back and its draw) made the replay draw another mask than the forward
pass's: a wrong gradient without an error (the review: 9 of 200 calls of one trainer against two drawing threads;
torch checkpoint 268 of 400). Each test compares with the gradient the forward pass's own random numbers give, which
plain autograd computes.
"""

from __future__ import annotations

import threading

import pytest
import torch

import remat
from remat import RematError, policies
from remat._engine.ambient import draw_as_recorded, with_generator

N = 4096
CALLS = 150


def _dropout(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.dropout(torch.tanh(x * w), 0.5, training=True)  # (bernoulli_ on the CPU)


def _rand(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x * w) * torch.rand(N, dtype=x.dtype)  # (rand.default: drawn through rand.generator)


def _native(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # (CUDA's dropout: an op no generator can be handed to)
    noise = torch.ops.aten.native_dropout(torch.ones(N, dtype=x.dtype), 0.5, True)[0] + 1
    return torch.tanh(x * w) * noise


def _expected(out: torch.Tensor, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """d sum(tanh(x w) * r) / dw for the r the forward pass drew (out / tanh(x w))."""
    t = torch.tanh(x * w)
    return out / t * (1 - t**2) * x


def _train(fn, transform: str, wrong: list[float], errors: list[str]) -> None:
    w = torch.randn(N, dtype=torch.float64, requires_grad=True)
    x = torch.randn(N, dtype=torch.float64)
    for _ in range(CALLS):
        try:
            if transform == "grad":
                g, out = torch.func.grad(lambda w: (lambda o: (o.sum(), o.detach()))(fn(w, x)), has_aux=True)(w.detach())
            else:
                out = fn(w, x)
                g = torch.autograd.grad(out.sum(), w)[0]
        except RematError as e:
            errors.append(str(e))
            continue
        with torch.no_grad():
            d = (g - _expected(out, w, x)).abs().max().item()
        if not d < 1e-8:
            wrong.append(d)


def _with_drawers(fn, transform: str) -> tuple[list[float], list[str]]:
    stop = threading.Event()

    def drawer() -> None:
        while not stop.is_set():
            torch.rand(N)  # (data augmentation, a sampler: torch's default generator, another thread)

    drawers = [threading.Thread(target=drawer) for _ in range(2)]
    for d in drawers:
        d.start()
    wrong: list[float] = []
    errors: list[str] = []
    try:
        trainer = threading.Thread(target=_train, args=(fn, transform, wrong, errors))
        trainer.start()
        trainer.join()
    finally:
        stop.set()
        for d in drawers:
            d.join()
    return wrong, errors


@pytest.mark.parametrize("body", [_dropout, _rand, _native], ids=["dropout", "rand", "native_dropout"])
@pytest.mark.parametrize("policy", ["save-nothing", "save-matmuls", "debug", policies.memory_budget(0.5)],
                         ids=["nothing", "matmuls", "debug", "budget"])
def test_draws_of_other_threads_leave_the_gradient_exact(body, policy) -> None:
    fn = remat.remat(body, debug=True) if policy == "debug" else remat.remat(body, policy=policy)
    wrong, errors = _with_drawers(fn, "backward")
    assert wrong == [] and errors == []


@pytest.mark.parametrize("body", [_dropout, _rand, _native], ids=["dropout", "rand", "native_dropout"])
def test_draws_of_other_threads_under_torch_func(body) -> None:
    wrong, errors = _with_drawers(remat.remat(body), "grad")
    assert wrong == [] and errors == []


def test_alone_the_draws_are_the_shared_generators() -> None:
    """With no other thread the forward pass draws from the shared generator, as plain autograd: the same numbers,
    and the generator ends where plain's does."""
    x = torch.randn(N, dtype=torch.float64)
    w = torch.randn(N, dtype=torch.float64, requires_grad=True)
    for body in (_dropout, _rand, _native):
        torch.manual_seed(3)
        plain = body(w, x)
        after_plain = torch.get_rng_state()
        torch.manual_seed(3)
        out = remat.remat(body)(w, x)
        assert torch.equal(torch.get_rng_state(), after_plain)
        g = torch.autograd.grad(out.sum(), w)[0]
        assert torch.equal(out, plain)
        assert torch.equal(g, torch.autograd.grad(plain.sum(), w)[0])


def test_every_random_op_but_native_dropout_can_be_handed_a_generator() -> None:
    aten = torch.ops.aten
    assert with_generator(aten.rand.default) is aten.rand.generator
    assert with_generator(aten.randint.low) is aten.randint.low_generator
    assert with_generator(aten.randperm.default) is aten.randperm.generator
    assert with_generator(aten.bernoulli_.float) is aten.bernoulli_.float
    assert with_generator(aten.native_dropout.default) is None


def test_a_draw_that_never_ends_where_the_forward_pass_did_raises() -> None:
    """An op no generator can be handed to, whose replay never ends at the state the forward pass's draw ended at
    (another thread drew meanwhile in the forward pass): RematError, not another mask."""
    gen = torch.default_generator
    state = gen.get_state()
    other = torch.Generator().manual_seed(123).get_state()
    op = torch.ops.aten.native_dropout.default
    with pytest.raises(RematError, match="another thread drew from the same torch generator"):
        draw_as_recorded(gen, state, other, op, op, (torch.ones(8), 0.5, True), {}, "f")
    gen.set_state(state)
    out = draw_as_recorded(gen, state, None, op, op, (torch.ones(8), 0.5, True), {}, "f")
    assert out[0].shape == (8,)
