"""Writes into the call's inputs and dead values on the full engine (``torch.func``, ``debug=True``), first call and
later ones, against plain ``f`` under the same transform (float64; state compared too).

Each case was a false error, a crash or a wrong state without an error before the twenty-fifth session's fixes
(NOTE [writes into inputs] in ``remat/_engine/outside_writes.py``; a released kept value read by a random op or a
saved tensor, NOTE [dead ops] in ``remat/_engine/liveness.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, jacrev, vjp

from remat import RematError, checkpoint_name, policies, remat

from .helpers import assert_tree_close, seeded_randn

D = torch.float64


def _accumulate(x: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    acc.add_(1.0)
    return (x * x).sin().sum() * acc


def _renorm(E: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    idx = torch.tensor([0, 2, 2])
    return (F.embedding(idx, E, max_norm=1.0) * x).sum()


def _run(route: str, f: Callable[..., torch.Tensor], a: torch.Tensor, b: torch.Tensor) -> Any:
    a, b = a.clone(), b.clone()
    if route == "grad":
        g = grad(f)(a, b)
    elif route == "jacrev":
        g = jacrev(f)(a, b)
    elif route == "vjp":
        g = vjp(lambda a: f(a, b), a)[1](torch.tensor(1.0, dtype=D))[0]
    else:
        a.requires_grad_()
        f(a, b).backward()
        g = a.grad
    return g, a.detach(), b


@pytest.mark.parametrize("debug", [False, True], ids=["default", "debug"])
@pytest.mark.parametrize("route", ["autograd", "grad", "vjp", "jacrev"])
@pytest.mark.parametrize("case", ["accumulator argument", "embedding max_norm"])
def test_a_write_into_an_input_that_carries_no_gradient_happens_once(case: str, route: str, debug: bool) -> None:
    """Raised "modified its input in place" on the full engine; plain autograd and plain torch.func run it."""
    if case == "accumulator argument":
        if route == "vjp":
            pytest.skip("plain torch.func refuses a write into a captured tensor")
        f, a, b = _accumulate, seeded_randn(4, 3, seed=1), torch.zeros((), dtype=D)
    else:
        f, a, b = _renorm, seeded_randn(5, 4, seed=1) * 2, seeded_randn(3, 4, seed=2)
    expected = _run(route, f, a, b)
    g = remat(f, debug=debug)
    for _ in range(3):
        assert_tree_close(_run(route, g, a, b), expected)


def test_an_input_read_then_written_raises_on_the_full_engine_and_is_exact_on_the_replay() -> None:
    def f(x: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        y = (x + acc).sin().sum()  # (add saves neither argument: plain autograd lets the write pass)
        acc.add_(1.0)
        return y

    a, b = seeded_randn(4, 3, seed=1), torch.ones((), dtype=D)
    assert_tree_close(_run("autograd", remat(f), a, b), _run("autograd", f, a, b))
    with pytest.raises(RematError, match="reads an input .* then writes it in place"):
        _run("grad", remat(f), a, b)


# ---- a value the liveness walk let go of, read after all --------------------------------------------------------


@pytest.mark.parametrize("route", ["grad", "vjp", "jacrev"])
def test_an_offloaded_batch_norm_output_named_under_torch_func_equals_plain(route: str) -> None:
    """Raised remat's internal ``DeadRead``, with no message: the recompute run again without skipping ops still
    read a released kept value, which now runs its op instead."""
    def f(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = F.batch_norm(x, None, None, w, None, training=True)
        h = checkpoint_name(h, "n1")
        return torch.sin(h).sum()

    w, x = seeded_randn(8, seed=1), seeded_randn(4, 8, seed=2)
    expected = _run(route, f, w, x)
    g = remat(f, policy=policies.offload_to_cpu(min_bytes=0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (an offload from the CPU to the CPU frees nothing, and says so)
        for _ in range(3):
            assert_tree_close(_run(route, g, w, x), expected)


@pytest.mark.parametrize("route", ["grad", "debug"])
def test_a_kept_random_op_whose_input_is_dead_equals_plain(route: str) -> None:
    """``bernoulli`` of a dead ``full`` (a placeholder of NaNs) raised torch's "Expected p_in >= 0"."""
    gen = torch.Generator()

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = x * (x * w).sum(0)
        m = torch.bernoulli(torch.full((3, 4), 0.6, dtype=D), generator=gen)
        return (h * m).sum()

    x, w = seeded_randn(3, 4, seed=1), seeded_randn(3, 4, seed=2)
    def keep_bernoulli(op: Any, *a: Any, **k: Any) -> bool:
        return "bernoulli" in str(op)

    for _ in range(3):
        gen.manual_seed(0)
        expected = _run("grad" if route == "grad" else "autograd", f, x, w)
        gen.manual_seed(0)
        g = remat(f, policy=keep_bernoulli, debug=route == "debug")
        assert_tree_close(_run("grad" if route == "grad" else "autograd", g, x, w), expected)


def test_an_offloaded_tensor_written_by_a_torch_function_under_torch_func_names_the_op() -> None:
    def f(W: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(x @ W, t, label_smoothing=0.1)

    W, x, t = seeded_randn(8, 5), seeded_randn(4, 8, seed=1), torch.tensor([0, 3, 1, 4])
    g = remat(f, policy=policies.offload_to_cpu(min_bytes=0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RematError, match=r"offload policy offloads \(aten\.\w+.*cross_entropy"):
            grad(g)(W, x, t)


# ---- what the recompute's write into the copy leaves of the input (the fixes' review) -----------------------------


def test_the_recompute_leaves_a_written_input_at_its_version_and_a_node_outside_the_call_that_saved_it_runs() -> None:
    """The recompute writes into a copy, but its in-place op moved the real input's version counter (above the
    dispatch level): a node outside the call that saved the input raised torch's "is at version 2"."""
    def f(x: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        acc.add_(1.0)
        return x.sin().exp().sum()

    def run(fn: Callable[..., torch.Tensor]) -> Any:
        x, acc = seeded_randn(3).requires_grad_(), torch.zeros(3, dtype=D)
        y = fn(x, acc)
        z = (acc * x).sum()  # (saves acc, outside the call)
        y.backward()
        version = acc._version
        z.backward()
        return x.grad, acc, version

    expected = run(f)
    assert_tree_close(run(remat(f, debug=True)), expected)


@pytest.mark.parametrize("route", ["grad", "jacrev", "debug, double backward"])
def test_an_accumulator_written_then_saved_by_an_op_equals_plain(route: str) -> None:
    """``(x * acc)`` saves the written accumulator: the recompute's version bump made its unpack raise "modified in
    place after it was saved"."""
    def f(x: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        acc.add_(1.0)
        return (x * acc).sin().sum()

    def run(fn: Callable[..., torch.Tensor]) -> Any:
        x, acc = seeded_randn(5), torch.zeros(5, dtype=D)
        if route == "grad":
            return grad(fn)(x, acc), acc
        if route == "jacrev":
            return jacrev(fn)(x, acc), acc
        x.requires_grad_()
        (g,) = torch.autograd.grad(fn(x, acc), x, create_graph=True)
        return torch.autograd.grad((g * g).sum(), x)[0], acc

    expected = run(f)
    g = remat(f, debug=route.startswith("debug"))
    for _ in range(3):
        assert_tree_close(run(g), expected)


def test_a_value_that_carries_a_gradient_written_into_an_input_still_raises_on_the_full_engine() -> None:
    """Written into a copy, the recompute would lose the value's history (a double backward through it)."""
    def f(x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        buf.copy_(x.exp())
        return buf.sin().sum()

    x, buf = seeded_randn(5).requires_grad_(), torch.zeros(5, dtype=D)
    with pytest.raises(RematError, match="modified its input #1"):
        remat(f, debug=True)(x, buf)


@pytest.mark.parametrize("debug", [False, True], ids=["default", "debug"])
@pytest.mark.parametrize("route", ["grad", "autograd"])
def test_an_input_written_once_as_an_accumulator_and_once_otherwise_raises(route: str, debug: bool) -> None:
    """Under torch.func the first write qualifies (NOTE [writes into inputs]) and the second, of a value an op made,
    does not: the check of the inputs skipped the input altogether and the recompute ran the second write again,
    twice in all, silently (found by the fixes' review)."""
    def f(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            a.mul_(0.9).add_(x.mean() * 0.1)
        return (x.sin() * a).sum() + (x @ x).tanh()

    if route == "autograd":
        # (the replay; and the full engine without torch.func levels, whose tensors say that ``x.mean()`` under
        # no_grad carries no gradient: both writes qualify)
        for _ in range(3):
            assert_tree_close(_run("autograd", remat(f, debug=debug), seeded_randn(4), torch.zeros(4, dtype=D)),
                              _run("autograd", f, seeded_randn(4), torch.zeros(4, dtype=D)))
        return
    with pytest.raises(RematError, match="modified its input #1"):
        _run(route, remat(f, debug=debug), seeded_randn(4), torch.zeros(4, dtype=D))


def test_a_tensor_no_mode_saw_at_the_address_of_a_dead_product_is_read_as_from_outside() -> None:
    """A storage address names an op's value only while that op's output lives on that very storage: here the
    product dies, its memory stays (NumPy holds it) and a tensor no mode saw is made on it (``torch.from_numpy``;
    in the fuzzer, a wrapper subclass's inner tensor or ``torch.tensor``'s data where the allocator handed the
    address out again). Taken for the product, it was neither held nor copied, and the re-run read the Python value
    of the backward pass's time: off by 2.9 on every call with ``debug=True`` (one fuzzer call in ~50,000)."""
    state = {"v": 0.5}

    def f(x: torch.Tensor) -> torch.Tensor:
        h = x * 2.0
        arr = h.detach().numpy()
        del h
        arr[:] = state["v"]
        c = torch.from_numpy(arr)
        return (x * c).sin().sum()

    def run(fn: Callable[..., torch.Tensor]) -> torch.Tensor:
        x = seeded_randn(6).requires_grad_()
        state["v"] = 0.5
        y = fn(x)
        state["v"] = 3.0  # (between the passes)
        return torch.autograd.grad(y, x)[0]

    expected = run(f)
    g = remat(f, debug=True)
    for _ in range(3):
        assert_tree_close(run(g), expected)


@pytest.mark.parametrize("route", ["debug", "budget", "budget-debug"])
def test_an_input_written_through_data_on_the_full_engine_raises(route: str) -> None:
    """``h.data.mul_(2)`` moves no version counter, so the recompute, which runs the write again on the written
    input, read it doubled twice: a wrong gradient without an error (off by up to 158) on a memory budget's measuring
    call and with ``debug=True`` until the twenty-seventh session. The replay engine is exact (the fixed policies, and
    a memory budget's measuring call under plain autograd since the thirty-seventh session); the full engine refuses
    it, as it refuses a write into an input that moves its version."""
    W = seeded_randn(4, 4, seed=1).requires_grad_()

    def g(h: torch.Tensor) -> torch.Tensor:
        h.data.mul_(2.0)
        return (h @ W).sin().sum()

    kw: dict[str, Any] = {"debug": True} if route == "debug" else {"policy": policies.memory_budget(0.0)}
    if route == "budget-debug":
        kw["debug"] = True
    h0 = seeded_randn(4, 4, seed=2)
    h = h0.clone().requires_grad_()
    want = torch.autograd.grad(g(h), [h, W])
    if route == "budget":
        h = h0.clone().requires_grad_()
        assert_tree_close(torch.autograd.grad(remat(g, **kw)(h), [h, W]), want, rtol=1e-10, atol=1e-10)
        return
    with pytest.raises(RematError, match=r"modified its input #0 .* in place during its forward pass"):
        remat(g, **kw)(h0.clone().requires_grad_())
    h = h0.clone().requires_grad_()
    assert_tree_close(torch.autograd.grad(remat(g, policy=policies.nothing_saveable)(h), [h, W]), want,
                      rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("transform", ["grad", "grad(grad)", "jacrev(grad)", "hessian"])
@pytest.mark.parametrize("policy", ["save-nothing", "save-matmuls"])
def test_an_input_the_function_never_reads_may_be_written_after_its_call(transform: str, policy: str) -> None:
    """The remat'd function ignores its first argument, which the caller writes in place after the call: under
    ``torch.func`` the recompute refused "input #0 ... was modified in place after its forward pass" (plain is
    exact: nothing reads it). An input no op of the call reads is not checked; one read still is (the tests above)."""

    def body(unused: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(g)

    def make(inner: Callable[..., Any]) -> Callable[..., Any]:
        def f(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            h = x @ w
            y = inner(h, h + x)
            h.mul_(0.5)
            return y.pow(2).sum()
        return f

    run = {"grad": lambda f: grad(f)(w, x), "grad(grad)": lambda f: grad(lambda w: grad(f)(w, x).sum())(w),
           "jacrev(grad)": lambda f: jacrev(grad(f))(w, x), "hessian": lambda f: torch.func.hessian(f)(w, x)}[transform]
    g = make(remat(body, policy=policy))
    for call in range(3):
        gen = torch.Generator().manual_seed(call)
        w = torch.randn(4, 4, dtype=torch.float64, generator=gen)
        x = torch.randn(5, 4, dtype=torch.float64, generator=gen)
        assert torch.allclose(run(g), run(make(body)), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("transform", ["hessian", "jacfwd(jacrev)", "jacrev(jacrev)"])
@pytest.mark.parametrize("policy", ["save-nothing", "save-matmuls"])
def test_a_counter_input_written_under_forward_over_reverse_is_exact(transform: str, policy: str) -> None:
    """A review (thirty-fifth session): a batch norm's buffers passed as explicit inputs (``functional_call(model,
    (params, buffers), x)``) under ``hessian``: its ``num_batches_tracked.add_(1)`` writes an integer input under a
    forward-mode level, where a write into an input is copied only if it carries no tangent, and none was trusted
    to: a false "modified its input #1 in place" (``jacrev(jacrev)`` was exact). An integer input carries none:
    exact, written once per call, three calls."""
    m = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3), torch.nn.Tanh()).double()
    params = {k: v.detach() for k, v in m.named_parameters()}

    def f(x: torch.Tensor, buffers: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.func.functional_call(m, (params, buffers), (x,)).pow(2).sum()

    g = remat(f, policy=policy)
    hess = {"hessian": torch.func.hessian, "jacfwd(jacrev)": lambda h: torch.func.jacfwd(jacrev(h)),
            "jacrev(jacrev)": lambda h: jacrev(jacrev(h))}[transform]
    for call in range(3):
        x = seeded_randn(4, 3, seed=call)
        bufs = [{k: v.clone() for k, v in m.named_buffers()} for _ in range(2)]
        want = hess(f)(x, bufs[0])  # (the buffers are the transform's inputs too: torch.func lets it write them)
        got = hess(g)(x, bufs[1])
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        assert_tree_close(bufs[1], bufs[0], rtol=0, atol=0)
        assert int(bufs[1]["1.num_batches_tracked"]) == 1
