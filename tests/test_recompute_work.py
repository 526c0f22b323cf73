"""What the recompute computes and holds, counted from outside remat (issue 9: the peers' suites).

Each test compares with the function without remat (or with ``torch.utils.checkpoint`` where
the claim is "no worse than torch"), and counts ops with a dispatch mode (``OpCounter``),
bytes with ``LiveCensus`` (a dispatch mode weighing the storages ops allocate) or liveness of
the memory itself (weak references to numpy buffers), never with remat's own bookkeeping.

* recomputed tensors are let go as the backward pass reads them (NOTE [free as used]);
* a tensor built from Python data inside the function is not held (NOTE [outside tensors]);
* values that depend on no differentiated input follow the policy, as in JAX;
* outputs the backward pass does not differentiate are not recomputed (NOTE [unused outputs]);
* an op output with a non-tensor part is replayed, not run again;
* under torch.func an in-place op keeps dead-op elimination and stash pruning on.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch
import torch.utils.checkpoint as tcp

from remat import RematError, policies, remat
from remat.bench.measure import LiveCensus

from .helpers import MATMUL_OPS, OpCounter, assert_tree_close, seeded_randn

SIN = {torch.ops.aten.sin.default}
EXP = {torch.ops.aten.exp.default}


# ---- freed as used -----------------------------------------------------------------------------------


def _chain(x: torch.Tensor) -> torch.Tensor:
    for _ in range(6):
        x = torch.sin(x)
    return x


def _backward_live(wrap, n: int = 4096) -> tuple[list[int], int, torch.Tensor]:
    """Live op-allocated bytes each time the backward pass runs a cos (one per sin node), and the peak."""
    x = seeded_randn(n).requires_grad_()
    loss = wrap(_chain)(x).sum()
    trace: list[int] = []
    census = LiveCensus()

    class Probe(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.cos.default:
                trace.append(census.live)
            return out

    try:
        with census, Probe():
            (g,) = torch.autograd.grad(loss, x)
    finally:
        census.close()
    return trace, census.peak, g


def test_recomputed_tensors_are_freed_as_the_backward_reads_them() -> None:
    torch_trace, torch_peak, want = _backward_live(lambda f: lambda x: tcp.checkpoint(f, x, use_reentrant=False))
    trace, peak, got = _backward_live(lambda f: remat(f))
    plain_trace, plain_peak, plain = _backward_live(lambda f: f)
    assert torch.equal(got, want) and torch.equal(got, plain)
    assert len(trace) == 6 and len(torch_trace) == 6
    # falls node by node as torch's does (before: flat until the last node read its tensor)
    assert trace[0] > trace[-1] and all(a >= b for a, b in zip(trace, trace[1:])), trace
    assert peak <= torch_peak, (peak, torch_peak, trace, torch_trace)
    assert all(a <= b for a, b in zip(trace, torch_trace)), (trace, torch_trace)
    assert plain_peak < peak  # the census is not vacuous: the recompute allocates


def test_a_saved_tensor_read_twice_is_recomputed_again() -> None:
    x = seeded_randn(5).requires_grad_()
    y = remat(lambda x: x.sin().sin())(x)
    node = y.grad_fn
    with OpCounter(SIN) as c:
        a = node._saved_self  # SinBackward of the second sin: its input, recomputed
        b = node._saved_self
    assert torch.equal(a, torch.sin(x)) and torch.equal(b, a)
    assert c.count == 2  # once per read: the first read let it go


# ---- a tensor built from Python data inside the function -------------------------------------------------


def test_a_constant_from_numpy_is_held_as_plain_autograd_holds_it_and_let_go_after() -> None:
    """``x * torch.from_numpy(arr)``: ``mul`` saves the constant (x needs a gradient), so plain autograd holds it
    between the passes. The replay engine cannot build it again without running the Python (which it never does):
    it holds it as plain autograd does, reads it in the replay, and lets it go with the graph."""
    refs: list[weakref.ref] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        arr = np.full(1 << 18, 0.5)  # 2 MiB, made afresh on every call
        refs.append(weakref.ref(arr))
        return (x * torch.from_numpy(arr)).sin().sum()

    x = seeded_randn(1 << 18).requires_grad_()
    loss = f(x)
    gc.collect()
    assert refs[-1]() is not None  # plain autograd holds it
    (want,) = torch.autograd.grad(loss, x)
    del loss
    loss = remat(f)(x)
    gc.collect()
    assert refs[-1]() is not None
    (got,) = torch.autograd.grad(loss, x)
    assert torch.equal(got, want)
    del loss
    gc.collect()
    assert refs[-1]() is None  # let go with the graph
    assert len(refs) == 2  # the Python ran once per call (the replay engine replays the recorded ops)


@pytest.mark.parametrize("make", ["tensor", "as_tensor"])
def test_a_constant_built_from_python_data_gives_exact_gradients(make: str) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        data = [[1.0, 2.0], [3.0, 4.0]]
        c = torch.tensor(data, dtype=x.dtype) if make == "tensor" else torch.as_tensor(np.array(data), dtype=x.dtype)
        return (x @ c).tanh().sum()

    for dtype in (torch.float64, torch.float32):
        x = seeded_randn(3, 2, dtype=dtype).requires_grad_()
        (want,) = torch.autograd.grad(f(x), x)
        (got,) = torch.autograd.grad(remat(f)(x), x)
        assert_tree_close(got, want)


@pytest.mark.parametrize("debug", [False, True], ids=["replay", "full-engine"])
def test_a_large_constant_whose_data_changed_before_the_backward_is_exact_or_raises(debug: bool) -> None:
    """The replay engine (plain autograd) replays the constant the forward pass built: plain autograd's gradient.
    The full engine (``debug=True``) builds it again from the Python data and raises, as the data changed."""
    # (a small one, up to 64 KiB, is copied and the recompute reads the forward's value: test_modules.py)
    scale = [2.0] * 20000  # 160 KB as float64

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x * torch.tensor(scale, dtype=x.dtype)).sin().sum()

    x = seeded_randn(20000).requires_grad_()
    (want,) = torch.autograd.grad(f(x), x)
    loss = remat(f, debug=debug)(x)
    scale[0] = 3.0
    if not debug:
        (got,) = torch.autograd.grad(loss, x)
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-10)
        return
    with pytest.raises(RematError, match="built from Python data"):
        loss.backward()


@pytest.mark.parametrize("policy", ["save-nothing", "save-matmuls"])
def test_a_large_numpy_array_lifted_inside_and_written_before_the_backward_is_exact(policy: str) -> None:
    """``torch.as_tensor(array)`` inside the function shares the array's memory; NumPy writes it in place between
    the passes, which no version counter shows. Plain autograd does not save it (``add``), so its gradient is the
    forward pass's; the replay reads a copy taken when the forward pass ended, of any size (a small outside tensor's
    copy alone gave the written values to one over 64 KiB: off by 148)."""
    state = {}

    def f(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ W + torch.as_tensor(state["arr"]))

    def run(fn):
        state["arr"] = np.arange(130 * 130).reshape(130, 130) % 7 * 0.01  # 135 KB
        W = (seeded_randn(130, 130) * 0.1).requires_grad_()
        out = fn(W, torch.ones(130, 130, dtype=torch.float64))
        state["arr"] += 1.0  # in place, through NumPy
        (g,) = torch.autograd.grad(out.pow(2).sum(), W)
        return g

    want = run(f)
    got = run(remat(f, policy=policy))
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-10)


def test_a_lifted_array_over_16_mib_is_hashed_not_copied_and_a_write_raises() -> None:
    """Past 16 MiB the copy would hold a whole table per call (a memory-mapped one read into memory): the replay
    checks a hash of it instead. Unwritten, exact; written through NumPy between the passes, ``RematError``."""
    arr = np.ones((1100, 2000))  # 17.6 MB

    def f(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ W + torch.as_tensor(arr)[:4, :3]).sum()

    W, x = seeded_randn(3, 3).requires_grad_(), seeded_randn(4, 3, seed=1)
    g = remat(f)
    (want,) = torch.autograd.grad(f(W, x), W)
    (got,) = torch.autograd.grad(g(W, x), W)
    assert torch.equal(got, want)
    loss = g(W, x)
    arr[0, 0] = 5.0
    with pytest.raises(RematError, match="from Python data inside the call"):
        loss.backward()


# ---- values that depend on no differentiated input follow the policy, as in JAX ----------------------------


@pytest.mark.parametrize("transform", ["autograd", "grad", "vjp"])
def test_values_not_depending_on_differentiated_inputs_follow_the_policy(transform: str) -> None:
    """JAX 0.10.2 (measured on the CPU) recomputes sin(x) here outside jit, and so does remat under save-nothing;
    a policy that saves sin keeps it: no second sin."""

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (torch.sin(x) * y).sum()

    x, y = seeded_randn(3), seeded_randn(3, seed=1)

    def grad_y(fn):
        if transform == "autograd":
            yy = y.clone().requires_grad_()
            return torch.autograd.grad(fn(x, yy), yy)[0]
        if transform == "grad":
            return torch.func.grad(fn, argnums=1)(x, y)
        _, vjp = torch.func.vjp(lambda yy: fn(x, yy), y)
        return vjp(torch.ones(()))[0]

    want = grad_y(f)
    save_sin = lambda op, *a, **k: op is torch.ops.aten.sin.default  # noqa: E731
    for policy, sins in ((policies.nothing_saveable, 2), (save_sin, 1)):
        with OpCounter(SIN) as c:
            got = grad_y(remat(f, policy=policy))
        assert torch.equal(got, want)
        assert c.count == sins, (policy, c.count)


# ---- outputs the backward pass does not differentiate (JAX's test_remat_eqn_dce) -------------------------


def _two(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.sin(torch.sin(x)), torch.exp(torch.exp(y))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_an_output_without_cotangent_is_not_recomputed(dtype: torch.dtype) -> None:
    x, y = seeded_randn(5, dtype=dtype).requires_grad_(), seeded_randn(5, dtype=dtype, seed=1).requires_grad_()
    a0, _ = _two(x, y)
    (want,) = torch.autograd.grad(a0.sum(), x)
    a, b = remat(_two)(x, y)
    with OpCounter(EXP) as ce, OpCounter(SIN) as cs:
        (got,) = torch.autograd.grad(a.sum(), x)
    assert torch.equal(got, want)
    assert ce.count == 0  # exp(exp(y)) is not recomputed
    assert cs.count == 1  # sin(x) is (the outer sin's input); the outer sin is dead
    # both differentiated: both recomputed, exact
    a, b = remat(_two)(x, y)
    with OpCounter(EXP) as ce:
        got2 = torch.autograd.grad(a.sum() + b.sum(), (x, y))
    a1, b1 = _two(x, y)
    assert_tree_close(got2, torch.autograd.grad(a1.sum() + b1.sum(), (x, y)))
    assert ce.count == 2


def test_unused_outputs_when_only_some_inputs_are_asked_for() -> None:
    x, y = seeded_randn(5).requires_grad_(), seeded_randn(5, seed=1).requires_grad_()
    a, b = remat(_two)(x, y)
    with OpCounter(EXP) as ce:
        (got,) = torch.autograd.grad(a.sum() + b.sum(), x)  # b's nodes do not run: y is not asked for
    assert ce.count == 0
    assert torch.allclose(got, torch.cos(torch.sin(x)) * torch.cos(x), rtol=1e-12, atol=1e-12)


# ---- an op with a non-tensor output -----------------------------------------------------------------------

_calls: list[int] = []


@torch.library.custom_op("remat_tests::sin_and_count", mutates_args=())
def _sin_and_count(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    _calls.append(1)
    return x.sin(), 3


@_sin_and_count.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    return torch.empty_like(x), 3


def _sc_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    ctx.save_for_backward(inputs[0])


def _sc_backward(ctx, g, _n):  # type: ignore[no-untyped-def]
    return g * ctx.saved_tensors[0].cos()


_sin_and_count.register_autograd(_sc_backward, setup_context=_sc_setup)


def test_an_op_with_a_number_output_saved_by_the_policy_is_replayed() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        y, n = _sin_and_count(x)
        return (y * y * n).sin().sum()  # sin's input is dropped: the backward pass recomputes

    x = seeded_randn(5).requires_grad_()
    (want,) = torch.autograd.grad(f(x), x)
    pol = lambda op, *a, **k: "sin_and_count" in str(op)  # noqa: E731
    for policy, runs in ((pol, 0), (policies.nothing_saveable, 1)):
        loss = remat(f, policy=policy)(x)
        _calls.clear()
        with OpCounter({torch.ops.aten.mul.Tensor}) as muls:
            (got,) = torch.autograd.grad(loss, x)
        assert torch.equal(got, want)
        assert muls.count >= 2  # the recompute ran (y * y * n again)
        assert len(_calls) == runs  # saved: (y, 3) replayed; save-nothing: run again


# ---- in-place ops under torch.func keep the liveness analysis ------------------------------------------------


def _block(inplace: bool):
    def f(w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ w1)
        if inplace:
            h = h * 1.0
            h.mul_(1.0)  # any in-place op
        v = torch.matmul(h, w2[:, 0])  # a 1-D operand: torch.matmul emits squeeze_
        return (h @ w2).sum() + v.sum()

    return f


@pytest.mark.parametrize("transform", ["grad", "vmap_grad"])
def test_an_inplace_op_under_torch_func_keeps_dead_op_elimination(transform: str) -> None:
    w1, w2, x = seeded_randn(6, 6), seeded_randn(6, 6, seed=1), seeded_randn(4, 6, seed=2)

    def run(f):
        if transform == "grad":
            return torch.func.grad(f, argnums=(0, 1))(w1, w2, x)
        return torch.func.vmap(torch.func.grad(f, argnums=(0, 1)), in_dims=(None, None, 0))(w1, w2, x[:, None])

    counts = {}
    for inplace in (False, True):
        f = _block(inplace)
        want = run(f)
        with OpCounter(MATMUL_OPS) as c:
            got = run(remat(f))
        assert_tree_close(got, want)
        with OpCounter(MATMUL_OPS) as c0:
            run(f)
        counts[inplace] = c.count - c0.count  # matmuls the recompute ran
    # x @ w1 only (tanh's output is dropped); h @ w2 and the matrix-vector product are dead
    assert counts[True] == counts[False] == 1, counts


# ---- the unused-output analysis is checked, never trusted ------------------------------------------------------

ALL_POLICIES = {"nothing": policies.nothing_saveable, "dots": policies.dots_saveable,
                "names": policies.save_only_these_names("none"), "offload": policies.offload_to_cpu(min_bytes=0),
                "everything": policies.everything_saveable}


def _random_two(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    p = torch.sigmoid(x * 3)
    m = torch.normal(p, 0.1)  # a random op reading an op's output: it runs in the recompute whatever
    o2 = m * x
    o1 = x.exp().sin()  # made last: its node runs first in the backward pass, and triggers the recompute
    return o1, o2


@pytest.mark.parametrize("policy", list(ALL_POLICIES))
def test_an_output_written_in_place_after_use_counts_as_used(policy: str) -> None:
    """o2 is used in the loss, then written in place: its tensor's node is no longer the one the backward runs."""
    x = seeded_randn(6).requires_grad_()

    def run(fn):
        torch.manual_seed(0)
        o1, o2 = fn(x)
        loss = o1.sum() + o2.sum()
        o2.mul_(2)
        return torch.autograd.grad(loss, x)

    assert_tree_close(run(remat(_random_two, policy=ALL_POLICIES[policy])), run(_random_two))


_LEAKED: list[torch.Tensor] = []


def _leaks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    p = torch.sigmoid(x * 3)
    _LEAKED.append(torch.bernoulli(p) * x)  # a value of the call used outside it, not through its outputs
    return x.exp().sin(), p * 2


@pytest.mark.parametrize("policy", list(ALL_POLICIES))
def test_a_value_leaked_out_of_the_call_is_recomputed_in_full(policy: str) -> None:
    x = seeded_randn(6).requires_grad_()

    def run(fn):
        _LEAKED.clear()
        torch.manual_seed(0)
        o1, _ = fn(x)
        loss = o1.sum() + _LEAKED[0].sum()  # the second output is not differentiated
        return torch.autograd.grad(loss, x)

    try:
        assert_tree_close(run(remat(_leaks, policy=ALL_POLICIES[policy])), run(_leaks))
    finally:
        _LEAKED.clear()


def test_three_levels_of_nesting_under_double_backward() -> None:
    def inner(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.sin(x @ w)

    def mid(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return remat(inner)(x, w) @ w

    def top(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return remat(mid, policy=policies.dots_saveable)(x, w).sin()

    def run(f):
        x, w = seeded_randn(4, 3).requires_grad_(), seeded_randn(3, 3, seed=1).requires_grad_()
        g = torch.autograd.grad(f(x, w).sum(), (x, w), create_graph=True)
        return torch.autograd.grad(sum((gi ** 2).sum() for gi in g), (x, w))

    want = run(top)
    for policy in ALL_POLICIES.values():
        assert_tree_close(run(remat(top, policy=policy)), want)


@pytest.mark.parametrize("debug", [False, True], ids=["replay", "full-engine"])
def test_a_large_constant_checksum_is_a_real_hash(debug: bool) -> None:
    """Two large index lists that a positional byte sum cannot tell apart (elements 65521 apart swapped): the full
    engine (``debug=True``), which builds the constant again, raises. The replay engine (plain autograd) replays
    the index tensor the forward pass built: plain autograd's gradient."""
    n = 70000
    data = list(range(n))

    def f(x: torch.Tensor) -> torch.Tensor:
        idx = torch.tensor(data)
        return (x[idx] * torch.arange(n, dtype=x.dtype)).sin().sum()

    x = seeded_randn(n).requires_grad_()
    (want,) = torch.autograd.grad(f(x), x)
    loss = remat(f, debug=debug)(x)
    data[0], data[65521] = data[65521], data[0]
    if not debug:
        (got,) = torch.autograd.grad(loss, x)
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-10)
        return
    with pytest.raises(RematError, match="built from Python data"):
        loss.backward()


def _dropped_out(x: torch.Tensor, W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m = (x * 1) @ W
    return torch.nn.functional.dropout(m, 0.3, training=True), m


@pytest.mark.parametrize("wrap", [{"debug": True}, {"policy": policies.memory_budget(0.3)}, {}])
@pytest.mark.parametrize("double", [False, True])
def test_an_unused_output_made_by_in_place_random_ops(wrap: dict, double: bool) -> None:
    """Dropout's mask is made in place (``empty_like(...).bernoulli_().div_()``); with only the other output
    differentiated its ops are dead and skipped on the re-run routes, and the check of which tensor each op reads
    raised "diverged" (``div_`` read ``empty_like``'s output, not ``bernoulli_``'s) where plain autograd is exact."""
    g = remat(_dropped_out, **wrap)
    for _ in range(3):
        grads = []
        for f in (_dropped_out, g):
            torch.manual_seed(0)
            x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
            W = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)
            _, m = f(x, W)
            (gw,) = torch.autograd.grad(m.sin().sum(), W, create_graph=double)
            grads.append(torch.autograd.grad(gw.pow(2).sum(), x)[0] if double else gw)
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-12, atol=0)


@pytest.mark.parametrize("route", ["debug", "budget", "torch.func"])
def test_a_dead_random_op_on_a_dead_factory_draws_on_valid_values(route: str) -> None:
    """``torch.multinomial`` over weights a factory made, whose sample the backward pass does not need: the re-run
    skips the factory (NOTE [dead ops]) and still runs the random op, on a stand-in for its weights; stand-ins of zeros
    are no distribution ("invalid multinomial distribution"): plain autograd's gradient."""
    import remat

    def f(x: torch.Tensor) -> torch.Tensor:
        r = torch.multinomial(torch.ones(4), 2).sum()
        return torch.nn.functional.dropout(x, 0.5).sin() * 2 + r

    x = torch.randn(3, 4, dtype=torch.float64)
    torch.manual_seed(0)
    if route == "torch.func":
        want = torch.func.grad(lambda x: f(x).sum())(x)
        torch.manual_seed(0)
        got = torch.func.grad(lambda x: remat.remat(f)(x).sum())(x)
    else:
        want = torch.autograd.grad(f(x.requires_grad_()).sum(), x)[0]
        r = remat.remat(f, debug=True) if route == "debug" else remat.remat(f, policy=remat.policies.memory_budget(0.3))
        torch.manual_seed(0)
        got = torch.autograd.grad(r(x).sum(), x)[0]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
