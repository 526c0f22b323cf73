"""Random ops while other threads draw from torch's shared generators (NOTE [draws in threads] in _engine/ambient.py).

Another thread drawing from the default generator between the moment a call notes a random op's state and the op's
draw (or between the replay's putting it back and its draw) made the replay draw another mask than the forward
pass's: a wrong gradient without an error (the review: 9 of 200 calls of one trainer against two drawing threads;
torch checkpoint 268 of 400). Each test compares with the gradient the forward pass's own random numbers give, which
plain autograd computes.
"""

from __future__ import annotations

import os
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


def _with_idle_thread(run):
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        return run()
    finally:
        stop.set()
        t.join()


@pytest.mark.parametrize("outer", ["save-nothing", "debug", "grad"])
def test_a_nested_call_draws_where_the_enclosing_one_sees_it(outer) -> None:
    """With another thread alive (an idle one), an inner call handed its random op a generator of its own, which the
    enclosing call recorded as an argument: its recompute raised "has 2 arguments in the recompute but 3 in the
    forward pass" (the review: 27 of 100 nested cases). A draw another remat mode would see is not handed a
    generator; its replay checks where the draw ended instead."""
    inner = remat.remat(lambda h: torch.nn.functional.dropout(torch.tanh(h), 0.5, training=True))
    body = lambda w, x: inner(x * w).sin().sum()  # noqa: E731
    f = remat.remat(body, debug=outer == "debug")
    w = torch.randn(N, dtype=torch.float64)
    x = torch.randn(N, dtype=torch.float64)

    def run():
        out = []
        for fn in (body, f):
            torch.manual_seed(5)
            if outer == "grad":
                out.append(torch.func.grad(fn)(w, x))
            else:
                ww = w.clone().requires_grad_()
                out.append(torch.autograd.grad(fn(ww, x), ww)[0])
        return out

    for _ in range(3):
        want, got = _with_idle_thread(run)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("op", ["poisson", "binomial"])
def test_a_generator_passed_positionally(op) -> None:
    """``torch.poisson(rates, generator=g)`` takes its generator as a positional argument of the ATen op: the trace
    noted the default generator's state (a wrong gradient, silent, off by 3.2) and then handed the op a second
    generator (torch's "expected at most 2 argument(s)")."""
    g = torch.Generator().manual_seed(0)

    def body(w, x):
        rates = torch.exp(x * w).detach() * 3
        draw = torch.poisson(rates, generator=g) if op == "poisson" else \
            torch.binomial(torch.full_like(rates, 10.0), torch.sigmoid(rates), generator=g)
        return (torch.tanh(x * w) * draw).sum()

    w = torch.randn(N, dtype=torch.float64)
    x = torch.randn(N, dtype=torch.float64)
    f = remat.remat(body)
    for _ in range(3):
        state = g.get_state()
        ww = w.clone().requires_grad_()
        want = torch.autograd.grad(body(ww, x), ww)[0]
        after = g.get_state()
        g.set_state(state)
        ww = w.clone().requires_grad_()
        got = torch.autograd.grad(f(ww, x), ww)[0]
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        assert torch.equal(g.get_state(), after)


_HELD_SCRIPT = """
import sys, threading, torch, remat
sys.path.insert(0, sys.argv[1])
from tests.helpers import heap_in_use

def body(x):
    for _ in range(4):
        x = torch.ops.aten.native_dropout(torch.tanh(x), 0.5, True)[0]
    return x.sum()

x = torch.randn(512, 1024, requires_grad=True)
f = remat.remat(body)
f(x).backward()  # (warm)
stop = threading.Event()
if sys.argv[2] == "thread":
    threading.Thread(target=stop.wait).start()
before = heap_in_use()
out = f(x)
held = heap_in_use() - before
out.backward()
stop.set()
print(held)
"""


@pytest.mark.parametrize("thread", ["alone", "thread"])
def test_an_op_no_generator_can_be_handed_is_held_only_with_another_thread(thread) -> None:
    """An op no generator can be handed to (CUDA's dropout) is held while another thread is alive (a check of where
    its replay's draw ends can be fooled by another thread's draws of the same size: a wrong gradient in the review);
    with none, it is dropped and its replay checks its draw. Heap bytes held between the passes, in a process of its
    own (an xdist worker runs threads of its own): 4 dropouts' masks (0.5 MiB each) and the 3 outputs the next
    ``tanh`` reads (2 MiB each), or none."""
    import subprocess
    import sys
    from pathlib import Path

    from .helpers import heap_in_use

    if heap_in_use() is None:
        pytest.skip("needs glibc's mallinfo2")
    root = str(Path(__file__).resolve().parents[1])
    res = subprocess.run([sys.executable, "-c", _HELD_SCRIPT, root, thread], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr
    held = int(res.stdout.split()[-1]) / 2**20
    if thread == "alone":
        assert held < 1.0, held
    else:
        assert held > 3 * 2 + 4 * 0.5 - 0.5, held


def test_a_value_dependent_draw_replayed_on_stand_in_values() -> None:
    """A draw whose count depends on its input's values (``poisson``), which the full engine's recompute may run on
    stand-in values (an op whose outputs nothing needs: NOTE [unused outputs]), under a dispatch mode (here a flop
    counter), so that its end state was checked: a false "another thread drew", with no other thread."""
    from torch.utils.flop_counter import FlopCounterMode

    def base(x):
        return torch.sin(x) * torch.poisson(x.detach().abs() * 2) + torch.tanh(x)

    grads = []
    for wrap in (lambda f: f, remat.remat):
        torch.manual_seed(0)
        x = torch.randn(8, dtype=torch.float64)
        inner = wrap(base)
        outer = wrap(lambda x, inner=inner: inner(torch.sin(inner(x))))
        with FlopCounterMode(display=False):
            grads.append(torch.func.grad(lambda x, outer=outer: (outer(x) * torch.arange(8.0, dtype=x.dtype)).sum())(x))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-10, atol=1e-12)
