"""When and how often the recompute runs, what it holds and for how long; nesting; randomness.

Everything here is observed from outside the library: the ATen ops a dispatch mode around the backward pass sees
(against plain autograd's backward pass on the same function: more ops mean a recompute ran), tensor hooks firing
in the backward pass, weak references to storages, and Python call counts of the wrapped function. Under plain
autograd the replay engine runs each call (remat/_engine/traced.py): its recompute replays the ATen ops the forward
pass recorded, so the Python runs once per call; on the full engine (``debug=True``) it runs again.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from remat import checkpoint_name, policies, remat

from .helpers import Counted, OpCounter, OpLog, assert_tree_close, census, leaf

aten = torch.ops.aten
TANH = aten.tanh.default  # in the forward pass only: plain autograd's backward runs tanh_backward


def ops_of(run: Callable[[], Any]) -> Counter[Any]:
    """The ATen ops ``run()`` runs, seen from outside remat (``aten.detach``, autograd's unpacking, left out)."""
    with OpLog() as log:
        run()
    return Counter(op for op in log.ops if op is not aten.detach.default)


def replayed(fn: Callable[..., Any], plain: Callable[..., Any], args: tuple[Any, ...], wrt: Any) -> Counter[Any]:
    """The ops the backward pass of ``fn(*args).sum()`` runs beyond plain autograd's backward pass of ``plain``:
    what its recompute ran."""
    out, out0 = fn(*args).sum(), plain(*args).sum()
    return ops_of(lambda: torch.autograd.grad(out, wrt)) - ops_of(lambda: torch.autograd.grad(out0, wrt))


def mlp2(W1, W2, x):
    """Two matmuls and elementwise work between them: everything a policy can choose from."""
    h = torch.tanh(x @ W1)
    h = torch.sin(h) * h
    return (torch.exp(h @ W2) * 0.1).sin()


# ---- once, lazily ------------------------------------------------------------------


@pytest.mark.parametrize("policy,recomputes", [
    ("save-nothing", 1), (policies.dots_saveable, 1), (policies.dots_with_no_batch_dims_saveable, 1),
    ("save-everything", 0),
])
def test_recompute_runs_once_per_backward(policy, recomputes):
    W1, W2, x = leaf(6, 6), leaf(6, 6, seed=1), leaf(4, 6, seed=2)
    f = Counted(mlp2)
    forward = ops_of(lambda: mlp2(W1, W2, x))
    extra = replayed(remat(f, policy=policy), mlp2, (W1, W2, x), (W1, W2, x))
    assert f.calls == 1  # the recompute replays the recorded ops: the Python ran once
    # many dropped tensors (tanh, sin, mul, exp outputs), one recompute: no forward op runs twice
    assert extra[TANH] == recomputes, extra
    assert not extra - forward, extra


def test_recompute_is_lazy():
    """Nothing is recomputed in the forward pass, nor before the backward pass reaches the call."""
    W1, W2, x = leaf(6, 6), leaf(6, 6, seed=1), leaf(4, 6, seed=2)
    f = Counted(mlp2)
    with OpLog() as forward:
        out = remat(f)(W1, W2, x)
    assert forward.ops.count(TANH) == 1  # the forward pass ran the function's one tanh, no recompute
    log = OpLog()  # the backward pass's ops: each recompute runs the tanh again
    seen = []
    out.register_hook(lambda g: seen.append(("output grad", log.ops.count(TANH))))
    # work after the remat'd call: its backward runs before the call's own backward
    loss = (out.cos() * 3).sum()
    x.register_hook(lambda g: seen.append(("input grad", log.ops.count(TANH))))
    with log:
        loss.backward()
    assert seen == [("output grad", 0), ("input grad", 1)]
    assert f.calls == 1


def test_recompute_starts_only_when_that_call_is_reached():
    """Two calls: the backward pass reaches the second first; the first recomputes only then."""
    W1, W2, x = leaf(6, 6), leaf(6, 6, seed=1), leaf(4, 6, seed=2)
    a, b = Counted(mlp2), Counted(mlp2)
    h = remat(a)(W1, W2, x)
    out = remat(b)(W1, W2, h)
    log = OpLog()  # each call's recompute runs its tanh once
    seen = []
    h.register_hook(lambda g: seen.append(log.ops.count(TANH)))
    with log:
        out.sum().backward()
    assert seen == [1]  # when b's backward is done (b recomputed, to get there), a has not been recomputed yet
    assert log.ops.count(TANH) == 2
    assert (a.calls, b.calls) == (1, 1)


def test_a_call_whose_gradient_is_not_needed_is_not_recomputed():
    W1, W2, x = leaf(6, 6), leaf(6, 6, seed=1), leaf(4, 6, seed=2)
    a, b = Counted(mlp2), Counted(mlp2)
    u = remat(a)(W1, W2, x)
    v = remat(b)(W1.detach() * 2, W2.detach(), x.detach())  # nothing here requires grad
    ops = ops_of(lambda: torch.autograd.grad((u + v).sum(), x))
    assert ops[TANH] == 1  # a's recompute only (plain autograd's backward runs no tanh)
    assert (a.calls, b.calls) == (1, 1)


def test_dots_saveable_recomputes_no_matmul():
    W1, W2, x = leaf(16, 16), leaf(16, 16, seed=1), leaf(8, 16, seed=2)
    counts = {}
    for name, fn in [("plain", mlp2), ("save-matmuls", remat(mlp2, policy=policies.dots_saveable)),
                     ("save-nothing", remat(mlp2, policy="save-nothing"))]:
        out = fn(W1, W2, x)
        with OpCounter() as oc:
            torch.autograd.grad(out.sum(), (W1, W2, x))
        counts[name] = oc.count
    # plain backward: 2 matmuls per product; save-nothing reruns both products once more
    assert counts == {"plain": 4, "save-matmuls": 4, "save-nothing": 6}


def test_dots_with_no_batch_dims_recomputes_only_batched_products():
    B, W, x = leaf(3, 5, 5), leaf(5, 5, seed=1), leaf(3, 4, 5, seed=2)

    def f(B, W, x):
        h = torch.bmm(x, B).tanh()  # batched: recomputed
        return (h.reshape(12, 5) @ W).sin()  # unbatched: kept

    counts = {}
    for name, fn in [("plain", f), ("nobatch", remat(f, policy=policies.dots_with_no_batch_dims_saveable))]:
        out = fn(B, W, x)
        with OpCounter() as oc:
            g = torch.autograd.grad(out.sum(), (B, W, x))
        counts[name] = sorted(map(str, oc.seen))
        if name == "plain":
            g0 = g
    assert_tree_close(g, g0)
    assert counts["nobatch"] == sorted(counts["plain"] + ["aten.bmm.default"])


# ---- freeing -----------------------------------------------------------------------


def storages(tensors):
    return [weakref.ref(t.untyped_storage()) for t in tensors]


def alive(refs):
    return [r() is not None for r in refs]


def recomputed(c: Any, names: tuple[str, ...]) -> list[weakref.ref[Any]]:
    """The storages of the ops named ``names`` that the census saw made (in the backward pass: by a recompute)."""
    return [ref for name, ref in c.records if name in names]


def test_forward_intermediates_are_freed_and_recomputed_copies_freed_after_the_call_backward():
    made = []  # weak references to the storages of the intermediates the forward pass made
    names = ("tanh.default", "exp.default")  # (plain autograd's backward of these three runs neither)

    def f(x):
        a = x.tanh()
        b = a.exp()
        made.append(storages([a, b]))
        return b.sigmoid()

    x = leaf(50)
    out = remat(f)(x)
    assert [alive(r) for r in made] == [[False, False]]  # dropped: nothing holds them until the backward
    seen = []
    with census() as c:  # the storages the recompute makes, seen from outside
        out.register_hook(lambda g: seen.append(("call's backward starts", alive(recomputed(c, names)))))
        x.register_hook(lambda g: seen.append(("call's backward done", alive(recomputed(c, names)))))
        out.sum().backward()
    # not recomputed before the call's backward; its copies are gone as soon as that backward is done
    assert seen == [("call's backward starts", []), ("call's backward done", [False, False])]
    assert len(made) == 1  # the Python ran once


def test_recomputed_copies_are_freed_before_the_backward_pass_ends():
    """Call 2's recomputed tensors are gone before call 1's backward starts."""
    made = [[], []]

    def make(i):
        def f(x):
            a = x.sin()  # (plain autograd's backward of sin and exp runs cos and mul, no sin)
            made[i].append(weakref.ref(a.untyped_storage()))
            return a.exp()
        return f

    x = leaf(50)
    h = remat(make(0))(x)
    out = remat(make(1))(h)
    assert [alive(r) for r in made] == [[False], [False]]
    observed = []
    with census() as c:  # the sin outputs each recompute makes, seen from outside
        h.register_hook(lambda g: observed.append(alive(recomputed(c, ("sin.default",)))))
        out.sum().backward()
    # when call 2's backward is done (h's gradient is ready): call 2 recomputed and freed its copy,
    # call 1 has not recomputed yet
    assert observed == [[False]]
    assert alive(recomputed(c, ("sin.default",))) == [False, False]
    assert [alive(r) for r in made] == [[False], [False]]  # the Python ran once per call


def test_retain_graph_and_two_backward_passes():
    W1, W2, x = leaf(6, 6), leaf(6, 6, seed=1), leaf(4, 6, seed=2)
    f = Counted(mlp2)
    out = remat(f)(W1, W2, x).sum()
    res, tanhs = [], []
    for _ in range(2):
        with OpLog() as log:
            res.append(torch.autograd.grad(out, (W1, W2, x), retain_graph=True))
        tanhs.append(log.ops.count(TANH))
    with OpLog() as log:
        out.backward()
    tanhs.append(log.ops.count(TANH))
    assert tanhs == [1, 1, 1]  # each backward pass recomputes once
    assert f.calls == 1
    g1, g2 = res
    want = torch.autograd.grad(mlp2(W1, W2, x).sum(), (W1, W2, x))
    assert_tree_close(g1, want)
    assert_tree_close(g2, want)
    assert_tree_close((W1.grad, W2.grad, x.grad), want)


def test_backward_twice_without_retain_graph_is_torchs_error():
    x = leaf(5)
    out = remat(lambda x: x.sin().exp())(x).sum()
    out.backward()
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        out.backward()


def test_two_backward_passes_through_different_outputs():
    W1, W2, x = leaf(6, 6), leaf(6, 6, seed=1), leaf(4, 6, seed=2)
    f = Counted(lambda W1, W2, x: (mlp2(W1, W2, x), torch.tanh(x @ W1).exp()))
    a, b = remat(f)(W1, W2, x)
    ga = torch.autograd.grad(a.sum(), (W1, x), retain_graph=True)
    gb = torch.autograd.grad(b.sum(), (W1, x))
    a0, b0 = f.fn(W1, W2, x)
    assert_tree_close(ga, torch.autograd.grad(a0.sum(), (W1, x), retain_graph=True))
    assert_tree_close(gb, torch.autograd.grad(b0.sum(), (W1, x)))


# ---- nesting -----------------------------------------------------------------------


@pytest.mark.parametrize("inner_policy", [None, policies.dots_saveable, policies.everything_saveable])
@pytest.mark.parametrize("outer_policy", [None, policies.dots_saveable, policies.everything_saveable])
def test_nested_remat(inner_policy, outer_policy):
    """NOTE [nested replay] in remat/_engine/traced.py: the inner call is a frame whose parent is the outer one."""
    W1, W2, x = leaf(6, 6), leaf(6, 6, seed=1), leaf(4, 6, seed=2)
    inner = Counted(mlp2)
    ri = remat(inner, policy=inner_policy)

    def outer_fn(W1, W2, x):
        return ri(W1, W2, ri(W1, W2, x).sigmoid()).cos()  # (sigmoid: the outer's own op, once per outer run)

    outer = Counted(outer_fn)
    out = remat(outer, policy=outer_policy)(W1, W2, x)
    assert (inner.calls, outer.calls) == (2, 1)
    inner_fn = inner.fn
    want = torch.autograd.grad(inner_fn(W1, W2, inner_fn(W1, W2, x).sigmoid()).cos().sum(), (W1, W2, x))
    with OpLog() as log:
        g = torch.autograd.grad(out.sum(), (W1, W2, x))
    assert_tree_close(g, want)
    assert (inner.calls, outer.calls) == (2, 1)  # no Python runs again at any level
    # each call recomputes at most once: the outer once (if it drops anything), replaying its sigmoid
    assert log.ops.count(aten.sigmoid.default) == (0 if outer_policy is policies.everything_saveable else 1)
    # tanh (one per inner call, never in plain autograd's backward): each inner call replays it once for its own
    # dropped tensors (unless it saves everything), and the outer replay runs the two inner tanhs again when what
    # it must remake needs them: under an outer save-nothing always (the inner outputs, or the matmul outputs an
    # inner dots_saveable keeps through it), under an outer dots_saveable only the tanh outputs an inner
    # save-everything keeps through it (the inner outputs come from the matmul outputs it keeps)
    inner_re = 0 if inner_policy is policies.everything_saveable else 2
    outer_re = {None: 2,
                policies.dots_saveable: 2 if inner_policy is policies.everything_saveable else 0,
                policies.everything_saveable: 0}[outer_policy]
    assert log.ops.count(TANH) == inner_re + outer_re


def test_nested_remat_double_backward():
    W1, W2, x = leaf(5, 5), leaf(5, 5, seed=1), leaf(3, 5, seed=2)
    ri = remat(mlp2)

    def outer(W1, W2, x):
        return ri(W1, W2, ri(W1, W2, x))

    def grads(fn):
        g = torch.autograd.grad(fn(W1, W2, x).pow(2).sum(), (W1, W2, x), create_graph=True)
        return [*g, *torch.autograd.grad(sum((t * t).sum() for t in g), (W1, W2, x))]

    assert_tree_close(grads(remat(outer)), grads(lambda *a: mlp2(a[0], a[1], mlp2(*a))))


def test_same_tensor_passed_twice_to_a_nested_call():
    W, x = leaf(5, 5), leaf(3, 5, seed=1)
    ri = remat(lambda a, b: (a @ b).tanh().sin())
    g = torch.autograd.grad(remat(lambda W, x: ri(W, W) @ x.T)(W, x).sum(), (W, x))
    want = torch.autograd.grad(((W @ W).tanh().sin() @ x.T).sum(), (W, x))
    assert_tree_close(g, want)


# ---- randomness --------------------------------------------------------------------


def noisy(W, x):
    h = F.dropout(torch.tanh(x @ W), p=0.5, training=True)
    return (h * torch.rand_like(h) + torch.randn(h.shape, dtype=h.dtype)).sin() @ W


@pytest.mark.parametrize("policy", ["save-nothing", policies.dots_saveable, "save-everything"])
def test_random_ops_give_the_same_gradients_and_leave_the_rng_as_plain(policy):
    W, x = leaf(16, 16), leaf(8, 16, seed=1)
    torch.manual_seed(7)
    f = Counted(noisy)
    out = remat(f, policy=policy)(W, x)
    with OpLog() as log:
        g = torch.autograd.grad(out.sum(), (W, x))
    state = torch.get_rng_state()
    after = torch.rand(3)  # the caller's stream goes on as if remat was not there
    torch.manual_seed(7)
    out0 = noisy(W, x)
    g0 = torch.autograd.grad(out0.sum(), (W, x))
    assert torch.equal(state, torch.get_rng_state())
    assert torch.equal(after, torch.rand(3))
    assert f.calls == 1
    # (by name: the replay draws through the overloads that take a generator, NOTE [draws in threads])
    draws = [sum(getattr(op, "overloadpacket", None) is p for op in log.ops) for p in (aten.bernoulli_, aten.rand_like,
                                                                                       aten.randn)]
    assert draws == ([0, 0, 0] if policy == "save-everything" else [1, 1, 1])  # the recompute drew again
    assert_tree_close((out, g), (out0, g0))


def test_rng_state_drawn_between_forward_and_backward_does_not_leak_into_the_recompute():
    W, x = leaf(16, 16), leaf(8, 16, seed=1)
    torch.manual_seed(3)
    out = remat(noisy)(W, x)
    torch.rand(100)  # the caller draws numbers before the backward pass
    state = torch.get_rng_state()
    g = torch.autograd.grad(out.sum(), (W, x))
    assert torch.equal(state, torch.get_rng_state())  # the recompute's draws are not the caller's
    torch.manual_seed(3)
    assert_tree_close(g, torch.autograd.grad(noisy(W, x).sum(), (W, x)))


@pytest.mark.parametrize("debug", [False, True], ids=["first-calls", "full-engine"])
@pytest.mark.parametrize("policy", ["save-nothing", policies.dots_saveable])
def test_a_generator_of_your_own_draws_the_same_numbers_in_the_recompute(policy, debug):
    """NOTE [generators of your own] in _engine/ambient.py: ``torch.rand(..., generator=G)`` inside the function. The
    recompute drew from G's state at the backward pass (the caller drew from G in between): another mask, a wrong
    gradient without an error (as torch.utils.checkpoint gives). G is left as the caller left it."""
    G = torch.Generator().manual_seed(0)

    def f(W, x):
        h = torch.sin(x @ W)
        mask = (torch.rand(h.shape, generator=G, dtype=h.dtype) > 0.5).to(h.dtype)
        return torch.tanh((h * mask) @ W).sum()

    W, x = leaf(6, 6), leaf(4, 6, seed=1)
    g = remat(f, policy=policy, debug=debug)
    for step in range(3):
        G.manual_seed(step)
        want = torch.autograd.grad(f(W, x), (W, x))
        G.manual_seed(step)
        out = g(W, x)
        torch.rand(7, generator=G)  # the caller draws from G before the backward pass
        state = G.get_state()
        got = torch.autograd.grad(out, (W, x))
        assert all(torch.equal(a, b) for a, b in zip(got, want))  # (float64, the same kernels: bitwise)
        assert torch.equal(G.get_state(), state)


@pytest.mark.parametrize("debug", [False, True], ids=["replay", "full-engine"])
def test_preserve_rng_state_false(debug):
    """Every engine puts back, before each random op of the recompute, the generator state its forward pass drew
    from (the replay engine's steps, the re-run engine's records: NOTE [random ops]), and the generators it set
    afterwards: plain autograd's gradient and the caller's stream as plain autograd leaves it, with or without
    ``preserve_rng_state``. Functions that draw nothing are unaffected either way."""
    W, x = leaf(16, 16), leaf(8, 16, seed=1)
    torch.manual_seed(3)
    g = torch.autograd.grad(remat(noisy, preserve_rng_state=False, debug=debug)(W, x).sum(), (W, x))
    after = torch.get_rng_state()
    torch.manual_seed(3)
    g0 = torch.autograd.grad(noisy(W, x).sum(), (W, x))
    assert torch.equal(g[0], g0[0])
    assert torch.equal(after, torch.get_rng_state())
    # deterministic functions: same gradients, RNG untouched
    W1, W2, x = leaf(6, 6), leaf(6, 6, seed=1), leaf(4, 6, seed=2)
    state = torch.get_rng_state()
    g = torch.autograd.grad(remat(mlp2, preserve_rng_state=False, debug=debug)(W1, W2, x).sum(), (W1, W2, x))
    assert torch.equal(state, torch.get_rng_state())
    assert_tree_close(g, torch.autograd.grad(mlp2(W1, W2, x).sum(), (W1, W2, x)))


def test_random_ops_in_nested_remat():
    W, x = leaf(16, 16), leaf(8, 16, seed=1)
    ri = remat(noisy)

    def outer(W, x):
        return ri(W, ri(W, x).tanh())

    torch.manual_seed(5)
    g = torch.autograd.grad(remat(outer)(W, x).sum(), (W, x))
    state = torch.get_rng_state()
    torch.manual_seed(5)
    g0 = torch.autograd.grad(noisy(W, noisy(W, x).tanh()).sum(), (W, x))
    assert torch.equal(state, torch.get_rng_state())
    assert_tree_close(g, g0)


# ---- names that drop a value whose inputs nothing holds -------------------------------


@pytest.mark.parametrize("policy", [policies.save_anything_except_these_names("attn"),
                                    policies.save_from_both_policies(policies.dots_saveable,
                                                                     policies.save_anything_except_these_names("attn"))])
def test_dropping_a_named_value_whose_input_is_already_freed(policy):
    """softmax(x @ w) is named after the product is freed: the recompute must rerun the product
    (it was saveable, but nothing held it), not replay a dead value (NaN gradients)."""
    x, w = leaf(4, 4), leaf(4, 4, seed=1)

    def f(x, w):
        a = checkpoint_name(torch.softmax(x @ w, -1), "attn")
        return (a @ w).tanh().sum()

    counted = Counted(f)
    out = remat(counted, policy=policy)(x, w)
    with OpCounter() as oc:
        g = torch.autograd.grad(out, (x, w))
    out0 = f(x, w)
    with OpCounter() as plain:
        g0 = torch.autograd.grad(out0, (x, w))
    assert counted.calls == 1
    assert oc.count == plain.count + 1  # the product x @ w ran again in the recompute
    assert_tree_close(g, g0)


@pytest.mark.parametrize("where", ["forward-under-autocast", "backward-under-autocast"])
def test_recompute_runs_under_the_forwards_autocast_state(where: str) -> None:
    """The recompute replays the forward's autocast state, whatever is active when the backward runs."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16)

    def f(v: torch.Tensor) -> torch.Tensor:
        return torch.tanh(lin(v)).float().square().sum()

    def grads(fn: Any) -> torch.Tensor:
        lin.weight.grad = None
        fwd = torch.autocast("cpu", dtype=torch.bfloat16) if where == "forward-under-autocast" else nullcontext()
        bwd = torch.autocast("cpu", dtype=torch.bfloat16) if where == "backward-under-autocast" else nullcontext()
        with fwd:
            loss = fn(x)
        with bwd:
            loss.backward()
        return lin.weight.grad.clone()  # type: ignore[union-attr]

    assert torch.equal(grads(remat(f)), grads(f))


# ---- values made where no mode sees (NOTE [FSDP's hooks], NOTE [dead ops]) -------------------------------------


class _PassThrough(torch.autograd.Function):
    """What FSDP2's hooks wrap a module's inputs in: its input again, as a view made inside the hook."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


_CALLS = [0]


def _hooked(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    _CALLS[0] += 1
    h = x @ W + 1.0  # (nothing saves the add's output: exp saves its own)
    with torch.profiler.record_function("FSDP::pre_forward"):  # (ops in FSDP2's hooks are not the call's)
        h = _PassThrough.apply(h)
    return torch.sin(h.exp() @ W).sum()


@pytest.mark.parametrize("policy", ["save-nothing", "save-matmuls"])
@pytest.mark.parametrize("engine", ["replay", "full-engine", "full-engine-alias-lost"])
def test_a_value_made_in_a_hook_is_recomputed_or_the_recompute_runs_again(policy, engine, monkeypatch):
    """``exp`` after the hook reads an alias of the add's output that no mode saw made.

    On the replay engine (plain autograd) the function runs once, and what the hook made is read as an outside
    tensor. On the full engine (``debug=True``) the liveness walk takes the alias for the add's output
    (its storage's op), so the add runs in the recompute. If the walk missed it (forced here), the add would be dead
    and its NaN placeholder, through the hook's alias, ``exp``'s input: a wrong gradient without an error (as under
    FSDP2 before issue 39). An op the recompute needs, or a saved tensor, that shares a placeholder's storage stops
    the recompute, which runs again without skipping any op (the function runs three times). Exact on every engine,
    float64 bitwise."""
    from remat._engine.dispatch import Recorder

    if engine == "full-engine-alias-lost":
        vid = Recorder.vid
        monkeypatch.setattr(Recorder, "vid", lambda self, t, read=False: vid(self, t))
    W = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 8, dtype=torch.float64)
    want = torch.autograd.grad(_hooked(W, x), W)
    out0 = _hooked(W, x)
    plain = ops_of(lambda: torch.autograd.grad(out0, W))  # plain autograd's backward pass
    # (a function of its own: the full engine's plans are per function)
    g = remat(lambda W, x: _hooked(W, x), policy=policy, debug=engine != "replay")
    for _ in range(3):
        _CALLS[0] = 0
        out = g(W, x)
        with OpLog() as log:
            got = torch.autograd.grad(out, W)
        extra = Counter(op for op in log.ops if op is not aten.detach.default) - plain
        assert_tree_close(got, want, rtol=0, atol=0)
        assert _CALLS[0] == {"replay": 1, "full-engine": 2, "full-engine-alias-lost": 3}[engine]
        if engine == "replay":
            # ops inside FSDP2's hook ranges are not the call's (a collective there must never be replayed): the
            # hook's alias of the add's output is an outside tensor, held as plain autograd holds what exp saves,
            # and the replay reads it rather than running the add
            assert extra[aten.add.Tensor] == 0, extra
            assert extra[aten.exp.default] == 1, extra
        else:
            assert extra[aten.add.Tensor] == 1, extra  # the add ran in the recompute (once: its alias is not held)
