"""remat nested in remat, under torch.func transforms, and two-level checkpointing measured from outside.

Correctness: an inner ``remat`` (its own policy) inside an outer ``remat`` under
every kind of transform, against plain ``f`` (float64, 1e-10). Proof that each
level keeps its own policy, and that no Python runs twice: the ATen ops seen from
outside (the replay engine's, NOTE [nested replay] in remat/_engine/traced.py; under
torch.func transforms the full engine's, NOTE [nested programs] in
remat/_engine/program.py), and the Python calls of each level, once each. Memory: the RSS of a fresh subprocess
(glibc told to return freed memory, /work/shared/research/measuring-memory.md)
between the forward and the backward pass shows that an outer save-nothing
keeps only its inputs, whatever the inner policy.
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.func import grad, hessian, jacrev, vjp, vmap

from remat import RematError, checkpoint_name, policies, remat
from remat.bench.measure import LiveCensus

from .helpers import Counted, OpLog, assert_tree_close, seeded_randn

DT = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


W1, W2, X, XB = _rand(4, 4), _rand(4, 4, seed=1), _rand(4, seed=2), _rand(3, 4, seed=3)


def inner_fn(W: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h @ W).sin()


def make_outer(inner: Callable[..., Any]) -> Callable[..., Any]:
    def outer_fn(W1: torch.Tensor, W2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = inner(W1, x).exp()
        return (inner(W2, h) * h).sum()

    return outer_fn


def _backward(g: Callable[..., Any], watch: Any) -> Any:
    W = W1.clone().requires_grad_()
    x = X.clone().requires_grad_()
    loss = g(W, W2, x)
    with watch:
        loss.backward()
    return W.grad, x.grad


def _double_backward(g: Callable[..., Any], watch: Any) -> Any:
    x = X.clone().requires_grad_()
    loss = g(W1, W2, x)
    with watch:
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        return gx.detach(), torch.autograd.grad(gx.pow(2).sum(), x)[0]


# plain autograd, the replay engine: ``watch`` is entered around the backward passes only
PLAIN: dict[str, Callable[[Callable[..., Any], Any], Any]] = {
    "backward": _backward,
    "double_backward": _double_backward,
}

# torch.func transforms, the full engine (it runs the Python again in each recompute)
TRANSFORMS: dict[str, Callable[[Callable[..., Any]], Any]] = {
    "grad": lambda g: grad(g, argnums=(0, 1, 2))(W1, W2, X),
    "vjp_twice": lambda g: [fn(torch.tensor(c, dtype=DT)) for fn in [vjp(g, W1, W2, X)[1]] for c in (1.0, 2.0)],
    "vmap(grad)": lambda g: vmap(grad(g), in_dims=(None, None, 0))(W1, W2, XB),
    "grad(vmap)": lambda g: grad(lambda W: vmap(g, in_dims=(None, None, 0))(W, W2, XB).sum())(W1),
    "jacrev": lambda g: jacrev(g, argnums=2)(W1, W2, X),
    "hessian": lambda g: hessian(g, argnums=2)(W1, W2, X),
    "grad(grad)": lambda g: grad(lambda x: grad(g, argnums=2)(W1, W2, x).sin().sum())(X),
}

PAIRS = {  # outer policy / inner policy
    "nothing/nothing": (policies.nothing_saveable, policies.nothing_saveable),
    "nothing/dots": (policies.nothing_saveable, policies.dots_saveable),
    "nothing/everything": (policies.nothing_saveable, policies.everything_saveable),
    "dots/nothing": (policies.dots_saveable, policies.nothing_saveable),
    "everything/nothing": (policies.everything_saveable, policies.nothing_saveable),
}


@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_nested_under_transforms(transform: str, pair: str) -> None:
    """Under every torch.func transform (the full engine: NOTE [nested programs] in remat/_engine/program.py), the
    same claims as on plain autograd below, counted in the ops the whole transform runs: the Python runs once at every
    level (an outer recompute replays the inner call's program: it ran the inner Python again, and an inner's own
    recompute a third time, before); ``exp`` runs more often than without remat iff the outer call recomputes;
    ``tanh`` more often than twice per ``exp`` iff the inner call recomputes its own activations."""
    run = TRANSFORMS[transform]
    outer_pol, inner_pol = PAIRS[pair]
    exp, tanh = torch.ops.aten.exp.default, torch.ops.aten.tanh.default
    plain, log = OpLog(), OpLog()
    with plain:
        ref = run(make_outer(inner_fn))
    inner = Counted(inner_fn)
    outer = Counted(make_outer(remat(inner, policy=inner_pol)))
    with log:
        out = run(remat(outer, policy=outer_pol))
    assert_tree_close(out, ref, **TOL)
    assert (outer.calls, inner.calls) == (1, 2)  # no Python runs twice, at any level
    if outer_pol is policies.everything_saveable:
        assert log.ops.count(exp) == plain.ops.count(exp), "the outer call recomputed"
    else:
        assert log.ops.count(exp) > plain.ops.count(exp), "the outer call never recomputed"
    # each run of the outer call's ops (its forward pass, each of its recomputes) runs one exp and two inner calls'
    # tanh; the inner calls' own recomputes come on top
    own = log.ops.count(tanh) - 2 * log.ops.count(exp)
    assert plain.ops.count(tanh) == 2 * plain.ops.count(exp)
    if inner_pol is policies.everything_saveable:
        assert own == 0, f"inner save-everything recomputed its own activations ({own} more tanh)"
    else:
        assert own > 0, "the inner call never recomputed its own activations"


@pytest.mark.parametrize("pair", list(PAIRS))
@pytest.mark.parametrize("transform", list(PLAIN))
def test_nested_on_plain_autograd(transform: str, pair: str) -> None:
    """The same claims on the replay engine, counted in the ops the backward pass runs: ``exp`` (the outer
    function's own op) runs again iff the outer call recomputes; ``tanh`` (the inner function's) runs more often
    than under the same outer call over a plain inner function iff the inner call recomputes its own activations."""
    run = PLAIN[transform]
    outer_pol, inner_pol = PAIRS[pair]
    exp, tanh = torch.ops.aten.exp.default, torch.ops.aten.tanh.default
    plain = OpLog()
    ref = run(make_outer(inner_fn), plain)
    outer_only = OpLog()  # the outer call over a plain inner function: what the outer recompute runs
    assert_tree_close(run(remat(make_outer(inner_fn), policy=outer_pol), outer_only), ref, **TOL)
    inner = Counted(inner_fn)
    outer = Counted(make_outer(remat(inner, policy=inner_pol)))
    log = OpLog()
    out = run(remat(outer, policy=outer_pol), log)
    assert_tree_close(out, ref, **TOL)
    assert (outer.calls, inner.calls) == (1, 2)  # no Python runs twice, at any level
    assert plain.ops.count(exp) == plain.ops.count(tanh) == 0  # (plain autograd's backward runs neither)
    if outer_pol is policies.everything_saveable:
        assert log.ops.count(exp) == 0, "the outer call recomputed"
    else:
        assert log.ops.count(exp) > 0, "the outer call never recomputed"
    own = log.ops.count(tanh) - outer_only.ops.count(tanh)
    if inner_pol is policies.everything_saveable:
        assert own == 0, f"inner save-everything recomputed its own activations ({own} more tanh)"
    else:
        assert own > 0, "the inner call never recomputed its own activations"


THREE = {"n": policies.nothing_saveable, "e": policies.everything_saveable, "d": policies.dots_saveable}


@pytest.mark.parametrize("pols", ["".join(c) for c in itertools.product("ned", repeat=3)])
def test_three_levels_bitwise(pols: str) -> None:
    """outer / middle / inner policies: kept tensors routed through two parents (NOTE [nested replay] in
    remat/_engine/traced.py). Each level's recompute counted in the ops the backward pass runs: ``tanh`` is the
    inner block's (plain autograd's backward runs none)."""
    def blk(W: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.tanh(h @ W) @ W.T).sin()

    def build(inner: Callable[..., Any], wrap: Callable[..., Any]) -> Callable[..., Any]:
        mid = wrap(lambda W, h: inner(W, inner(W, h).exp() * 0.5) * h, 1)
        return wrap(lambda W, x: (mid(W, mid(W, x)) ** 2).sum(), 0)

    W0 = torch.randn(5, 5, generator=torch.Generator().manual_seed(4)) / 3
    x0 = torch.randn(3, 5, generator=torch.Generator().manual_seed(5))

    def grads(f: Callable[..., Any], log: OpLog) -> list[torch.Tensor]:
        W, x = W0.clone().requires_grad_(), x0.clone().requires_grad_()
        loss = f(W, x)
        with log:
            loss.backward()
        return [W.grad, x.grad]

    tanh = torch.ops.aten.tanh.default
    plain = OpLog()
    ref = grads(build(blk, lambda f, i: f), plain)
    assert plain.ops.count(tanh) == 0
    outer_only = OpLog()  # the same outer levels over a plain inner: the tanhs their recomputes run
    grads(build(blk, lambda f, i: remat(f, policy=THREE[pols[i]])), outer_only)
    inner = Counted(blk)
    log = OpLog()
    out = grads(build(remat(inner, policy=THREE[pols[2]]), lambda f, i: remat(f, policy=THREE[pols[i]])), log)
    assert all(torch.equal(a, b) for a, b in zip(out, ref)), pols  # float32: bitwise
    assert inner.calls == 4  # two mid calls of two inner calls each, each run once
    ours, theirs = log.ops.count(tanh), outer_only.ops.count(tanh)
    if pols[2] == "e":  # an inner save-everything is only replayed by the recomputes of the levels above
        assert ours == theirs, (ours, theirs)
    else:
        assert ours > theirs, "the inner call never recomputed itself"


# ---- memory: two-level checkpointing, measured by RSS in a fresh process ----------------------

_MEASURE = textwrap.dedent(r"""
    import gc, json, sys
    import torch
    from remat import remat, policies
    torch.set_num_threads(1)
    torch.manual_seed(0)
    L, N, D = 6, 256, 512  # 6 blocks, activations of 512 KiB each (float32)
    Ws = [torch.randn(D, D) / D ** 0.5 for _ in range(L)]
    x = torch.randn(N, D, requires_grad=True)
    pol = {"nothing": policies.nothing_saveable, "everything": policies.everything_saveable,
           "dots": policies.dots_saveable}

    def block(W, h):
        for _ in range(3):
            h = torch.tanh(h @ W)
        return h

    def rss():
        gc.collect()
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def build(cfg):
        outer_p, inner_p = cfg.split("/")
        blk = block if inner_p == "-" else remat(block, policy=pol[inner_p])
        def stack(x):
            h = x
            for W in Ws:
                h = blk(W, h)
            return (h * h).mean()
        return stack if outer_p == "-" else remat(stack, policy=pol[outer_p])

    out = {}
    for cfg in sys.argv[1:] * 2:  # the first round warms up (allocator, lazy init); keep the second
        f = build(cfg)
        before = rss()
        loss = f(x)
        held = rss() - before
        loss.backward()
        x.grad = None
        del loss
        out[cfg] = held
    print(json.dumps(out))
""")


@functools.lru_cache(maxsize=1)
def _retained(configs: tuple[str, ...]) -> dict[str, int]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", _MEASURE, *configs], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


CONFIGS = ("-/-", "-/nothing", "nothing/nothing", "nothing/everything", "everything/nothing", "nothing/dots")
act = 256 * 512 * 4  # bytes of one activation in _MEASURE


def test_two_level_checkpointing_memory() -> None:
    """Outer save-nothing keeps only its inputs; an inner policy alone keeps one input per block."""
    held = _retained(CONFIGS)
    mib = collections.OrderedDict((k, round(v / 2**20, 1)) for k, v in held.items())
    # plain autograd: 6 blocks x 3 layers x (tanh output + matmul input) ~ 18-36 activations
    assert held["-/-"] > 15 * act, mib
    # inner save-nothing alone: one input per block (6 activations)
    assert 4 * act < held["-/nothing"] < 9 * act, mib
    # outer save-nothing: only the outer inputs, which already exist: nothing new, whatever the inner
    assert held["nothing/nothing"] < 1.5 * act, mib
    # outer save-everything over inner save-nothing: the inner policy decides again (one input per block)
    assert 4 * act < held["everything/nothing"] < 9 * act, mib


def test_outer_save_nothing_over_inner_dots_saveable_memory() -> None:
    """The inner call's replay stash (its matmul outputs) is routed through the outer call too: an outer
    save-nothing keeps only its inputs (it kept 18 matmul outputs, more than plain autograd, before)."""
    held = _retained(CONFIGS)
    assert held["nothing/dots"] < 1.5 * act, {k: round(v / 2**20, 1) for k, v in held.items()}


def test_outer_save_nothing_over_inner_save_everything_memory() -> None:
    """The outer policy governs what survives the forward pass: an inner save-everything keeps nothing here."""
    held = _retained(CONFIGS)
    assert held["nothing/everything"] < 1.5 * act, {k: round(v / 2**20, 1) for k, v in held.items()}


def test_outer_offload_over_inner_save_nothing() -> None:
    """The inner call's input comes back from the outer call as a copy from host memory: not an input modified in
    place (a false RematError before)."""
    inner = remat(lambda y: y.sin().exp(), policy=policies.nothing_saveable)

    def f(x: torch.Tensor) -> torch.Tensor:
        return inner(x.cos()).sum()

    x = torch.randn(5, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    want = torch.autograd.grad((x.cos().sin().exp()).sum(), x)
    got = torch.autograd.grad(remat(f, policy=policies.offload_to_cpu(min_bytes=0))(x), x)
    assert torch.allclose(got[0], want[0], rtol=1e-12, atol=1e-12)
    with pytest.raises(RematError, match="modified in place"):  # a real in-place write is still caught
        y = x.detach().clone().requires_grad_()
        h = y * 1.0
        loss = remat(lambda h: inner(h).sum(), policy=policies.offload_to_cpu(min_bytes=0))(h)
        with torch.no_grad():
            h.mul_(2)
        loss.backward()


@pytest.mark.parametrize("outer", ["keep-exp", "keep-nothing", "keep-mm", "budget-0.5"])
@pytest.mark.parametrize("inner", ["dots", "nothing", "everything"])
def test_inner_stash_routed_to_an_outer_that_keeps_a_later_op(inner: str, outer: str) -> None:
    """An inner call's replay stash (dots_saveable's matmul outputs) is routed through the outer call as copies;
    an outer policy that keeps only the op after the inner call (exp) must still recompute what those copies
    stand for (found by review: NaN gradients)."""
    ip = {"dots": policies.dots_saveable, "nothing": policies.nothing_saveable,
          "everything": policies.everything_saveable}[inner]
    block = remat(lambda w, h: torch.tanh(h @ w) @ w, policy=ip)

    def f(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return block(w, torch.tanh(x @ w)).exp()

    keep = {"keep-exp": torch.ops.aten.exp.default, "keep-mm": torch.ops.aten.mm.default}.get(outer)
    op: Any = policies.memory_budget(0.5) if outer == "budget-0.5" else (lambda o, *a, **k: o is keep)
    g = remat(f, policy=op)
    w0, x = torch.randn(6, 6, dtype=torch.float64) * 0.5, torch.randn(4, 6, dtype=torch.float64)
    for _ in range(3):
        w1, w2 = w0.clone().requires_grad_(), w0.clone().requires_grad_()
        got = torch.autograd.grad(g(w1, x).sum(), w1)[0]
        ref = torch.autograd.grad(f(w2, x).sum(), w2)[0]
        assert torch.allclose(got, ref, rtol=1e-10, atol=1e-10)


def _backward_peak(fn: Any, x: torch.Tensor, wrt: list[torch.Tensor]) -> tuple[int, list[torch.Tensor]]:
    """Peak bytes of the storages ops allocate during the backward pass (a census outside remat)."""
    census = LiveCensus()
    try:
        with census:
            loss = fn(x).pow(2).sum()
            census.peak = census.live
            grads = list(torch.autograd.grad(loss, wrt))
        return census.peak, grads
    finally:
        census.close()


def test_two_level_checkpointing_lowers_the_backward_peak() -> None:
    """NOTE [what a recompute holds]: 16 blocks in 4 remat'd segments of 4. With each block remat'd inside too, the
    outer recompute does not hold the blocks' activations: the backward pass peaks at about one block's
    activations plus the segment's block inputs, not a whole segment's (JAX's nested checkpoint)."""
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(64, 64, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(16)]
    x = torch.randn(32, 64, generator=g, dtype=torch.float64, requires_grad=True)

    def block(w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.tanh(h @ w) @ w) + h

    def run(bs: list[Any]) -> Any:
        def f(h: torch.Tensor) -> torch.Tensor:
            for b in bs:
                h = b(h)
            return h
        return f

    blocks = [functools.partial(block, w) for w in ws]
    single = run([remat(run(blocks[s:s + 4])) for s in range(0, 16, 4)])
    two = run([remat(run([remat(b) for b in blocks[s:s + 4]])) for s in range(0, 16, 4)])
    plain_peak, ref = _backward_peak(run(blocks), x, [x, *ws])
    for fn in (single, two):
        assert_tree_close(_backward_peak(fn, x, [x, *ws])[1], ref, **TOL)
    # peaks of the backward pass to x alone (no weight gradients piling up), in activations of 32 x 64
    act = 32 * 64 * 8
    plain_peak, single_peak, two_peak = (_backward_peak(fn, x, [x])[0] / act for fn in (run(blocks), single, two))
    print(f"backward peaks, in activations: plain {plain_peak:.1f}, single {single_peak:.1f}, two {two_peak:.1f}")
    # a segment's recompute holds its 4 blocks (2 saved activations each); nested, about one block
    assert single_peak >= 8 and two_peak <= single_peak - 4, (single_peak, two_peak)
    assert two_peak < single_peak < plain_peak


class _Stateful:
    """An inner block with side effects and a seed set inside: it must run once per call, as without remat."""

    def __init__(self) -> None:
        self.calls, self.seed = 0, 7

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        torch.manual_seed(self.seed)
        self.seed += 1
        return torch.nn.functional.dropout(x.sin(), 0.5, training=True) + x


def _stateful_once_per_call(run: Callable[..., Any], outer_pol: Any, inner_pol: Any) -> None:
    """Three calls of an outer remat'd call over a ``_Stateful`` block remat'd inside, against the same without remat:
    the block's Python runs once a call (its counter and seed as plain's), and the results are plain's."""
    results = []
    for use in (False, True):
        block = _Stateful()
        inner = remat(block, policy=inner_pol) if use else block
        body = functools.partial(lambda blk, x: blk(x).cos(), inner)
        f = remat(body, policy=outer_pol) if use else body
        results.append(([run(f, _rand(3, 4, seed=k)) for k in range(3)], block.calls, block.seed))
    (ref, calls0, seed0), (got, calls1, seed1) = results
    assert (calls1, seed1) == (calls0, seed0) == (3, 10)
    assert_tree_close(got, ref, **TOL)


NESTED_ROUTES: dict[str, Callable[[Callable[..., Any], torch.Tensor], Any]] = {
    "grad": lambda f, x: grad(lambda t: f(t).sum())(x),
    "vjp": lambda f, x: (lambda o, pb: (o, pb(torch.ones_like(o))))(*vjp(f, x)),
    "jacrev": lambda f, x: jacrev(f)(x),
    "vmap(grad)": lambda f, x: vmap(grad(lambda t: f(t).sum()), randomness="same")(x.unsqueeze(0).repeat(2, 1, 1)),
}


@pytest.mark.parametrize("pols", ["nothing/nothing", "nothing/dots", "dots/nothing", "everything/nothing"])
@pytest.mark.parametrize("route", list(NESTED_ROUTES))
def test_nested_side_effects_run_once_per_call_under_transforms(route: str, pols: str) -> None:
    """NOTE [nested programs]: the outer recompute replays the inner call's program. It ran the inner Python again
    (twice with the inner's own recompute), so a seed advanced inside drew other numbers on the next call: off by
    up to 2.3 from the second call on, silently (and 9 calls of the inner block for 3)."""
    run = NESTED_ROUTES[route]
    outer_pol, inner_pol = PAIRS[pols]
    _stateful_once_per_call(run, outer_pol, inner_pol)


@pytest.mark.parametrize("route", list(NESTED_ROUTES))
def test_an_inner_call_closing_over_a_value_of_the_outer_call_is_exact(route: str) -> None:
    """The inner call reads a value of the outer call through its closure (its module state, NOTE [state is an
    input]): the enclosing program hands the inner program that value as the outer replay made it again (the first
    version of NOTE [nested programs] read the forward pass's, a false "diverged" on every call). Three calls."""
    run = NESTED_ROUTES[route]
    W = _rand(4, 4, seed=5)

    def make(wrap: Callable[..., Any]) -> Callable[..., Any]:
        def outer(x: torch.Tensor) -> torch.Tensor:
            h = x.cos() @ W
            body = wrap(lambda y: (y * h).sin())
            return body(x).pow(2)

        return wrap(outer)

    for k in range(3):
        x = _rand(4, 4, seed=10 + k)
        assert_tree_close(run(make(remat), x), run(make(lambda f: f), x), **TOL)


BUDGET_CASES = {
    "outer budget, backward": ("backward", policies.memory_budget(0.5), policies.nothing_saveable),
    "inner budget, grad": ("grad", policies.nothing_saveable, policies.memory_budget(0.5)),
    "both budgets, vjp": ("vjp", policies.memory_budget(0.5), policies.memory_budget(0.5)),
}


@pytest.mark.parametrize("case", list(BUDGET_CASES))
def test_a_memory_budgets_measuring_call_runs_nested_python_once(case: str) -> None:
    """A memory budget's first call (its measuring call, on the full engine) over a nested call: the outer program
    records the nested call (NOTE [nested programs]) on plain autograd too, and a nested measuring call records a
    program. Each ran its Python again before (the outer twice, the inner three times on the measuring call): a
    seed advanced inside the inner block was off by up to 0.6 on the next calls, silently."""
    route, outer_pol, inner_pol = BUDGET_CASES[case]
    runs: dict[str, Callable[[Callable[..., Any], torch.Tensor], Any]] = {
        "backward": lambda f, x: torch.autograd.grad(f(x.requires_grad_()).sum(), x),
        **NESTED_ROUTES,
    }
    run = runs[route]
    _stateful_once_per_call(run, outer_pol, inner_pol)


@pytest.mark.parametrize("outer_pol", ["budget", "save-nothing"])
def test_an_inner_call_writing_a_value_of_the_outer_call_in_place_is_exact(outer_pol: str) -> None:
    """The inner call writes in place a value of the outer call it closes over, under an outer memory budget's
    measuring call: the recompute writes a stand-in of it, which needs a gradient as it does and must be no leaf (a
    leaf that needs one refuses an in-place write: "a leaf Variable that requires grad is being used in an in-place
    operation", found by review of the stand-in for nn.Embedding(max_norm)). Three calls."""
    W1, W2 = _rand(4, 4, seed=6).requires_grad_(), _rand(4, 4, seed=7).requires_grad_()

    def make(on: bool) -> Callable[..., Any]:
        def outer(x: torch.Tensor) -> torch.Tensor:
            h = (x @ W1).tanh()
            g = h * 2

            def inner(a: torch.Tensor) -> torch.Tensor:
                g.mul_(1.5)
                return a @ W2 + g

            return (remat(inner) if on else inner)(h.sin()) * g

        return remat(outer, policy=policies.memory_budget(0.5) if outer_pol == "budget" else outer_pol) if on else outer

    x = _rand(3, 4, seed=8).requires_grad_()
    want = torch.autograd.grad(make(False)(x).sum(), [x, W1, W2])
    f = make(True)
    for _ in range(3):
        assert_tree_close(torch.autograd.grad(f(x).sum(), [x, W1, W2]), want, **TOL)


_G = torch.zeros(4, dtype=DT)
_WN = _rand(4, 4, seed=9)


def _writes_global(x: torch.Tensor) -> torch.Tensor:
    _G.add_(1.0)
    return (x @ _WN + _G).sin()


def _writes_input(h: torch.Tensor) -> torch.Tensor:
    h.mul_(2.0)
    return (h @ _WN).cos()


def _writes_a_view_of_input(h: torch.Tensor) -> torch.Tensor:
    h[:, :2].mul_(3.0)
    return (h @ _WN).tanh()


def _outer_of(inner: Callable[..., Any], kind: str) -> Callable[..., Any]:
    def outer(x: torch.Tensor) -> torch.Tensor:
        if kind == "global":  # (each call of inner writes the global, which its other call read)
            return inner(inner(x)).sum()
        h = x.sin() * 1.5
        return (inner(h) * h).sum()

    return outer


@pytest.mark.parametrize("inner_pol", ["nothing", "dots", "everything"])
@pytest.mark.parametrize("outer_pol", ["nothing", "dots", "everything"])
@pytest.mark.parametrize("case", [(_writes_global, "global"), (_writes_input, "input"),
                                  (_writes_a_view_of_input, "view")], ids=["global", "input", "view"])
def test_an_inner_call_writing_what_the_outer_call_reads_is_exact(case: Any, outer_pol: str, inner_pol: str) -> None:
    """An inner call on the replay engine writes in place a global that the other inner call read, or its input (or
    a view of it), a value of the outer call: its replay reads its own copy of that storage from before the write
    (NOTE [outside writes]), not the outer call's value, which the write moved. These raised "modified in place after
    it was saved" (12 of these 27 cases) until the twenty-seventh session; plain autograd is exact. Three calls."""
    inner, kind = case
    pols = {"nothing": policies.nothing_saveable, "dots": policies.dots_saveable,
            "everything": policies.everything_saveable}
    W = _WN.requires_grad_()
    try:
        for _ in range(3):
            x = _rand(3, 4, seed=10).requires_grad_()
            _G.zero_()
            want = torch.autograd.grad(_outer_of(inner, kind)(x), [x, W])
            want_g = _G.clone()
            _G.zero_()
            f = remat(_outer_of(remat(inner, policy=pols[inner_pol]), kind), policy=pols[outer_pol])
            assert_tree_close(torch.autograd.grad(f(x), [x, W]), want, **TOL)
            assert torch.equal(_G, want_g)  # (each call's write ran once)
    finally:
        _WN.requires_grad_(False)


def test_an_inner_call_writing_its_input_holds_only_its_copy_of_it() -> None:
    """An outer save-nothing over four inner save-nothing calls, each writing its input (a value of the outer call)
    in place: between the passes remat holds the inner calls' copies of what they wrote over (one activation each,
    NOTE [outside writes]) and nothing else: neither the written values nor a save of them through the outer call
    (the first version of the twenty-seventh session's fix held as much as plain autograd). A census of live
    storages, outside remat."""
    n = 256
    W = _rand(n, n, seed=11).requires_grad_()
    x = _rand(n, n, seed=12).requires_grad_()
    act = n * n * 8

    def make(on: bool) -> Callable[..., Any]:
        def inner(h: torch.Tensor) -> torch.Tensor:
            h.mul_(2.0)
            return (h @ W).tanh()

        gi = remat(inner, policy=policies.nothing_saveable) if on else inner

        def outer(x: torch.Tensor) -> torch.Tensor:
            h = x.sin() * 1.5
            for _ in range(4):
                h = gi(h) * 1.0
            return h.sum()

        return remat(outer, policy=policies.nothing_saveable) if on else outer

    from remat.bench.measure import live_bytes_after

    loss, plain = live_bytes_after(lambda: make(False)(x))
    want = torch.autograd.grad(loss, [x, W])
    loss, held = live_bytes_after(lambda: make(True)(x))
    assert held <= 4 * act + act // 4, (held, plain, act)
    assert plain >= 8 * act, (held, plain)
    assert_tree_close(torch.autograd.grad(loss, [x, W]), want, **TOL)


def _split_written(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """What ``nn.GRU``'s cell does in float64 on the CPU: a product split by ``unsafe_chunk`` (pieces with version
    counters of their own) and a piece written in place."""
    a, b = (x @ W).unsafe_chunk(2, 1)
    return a.sigmoid_() * b.tanh()


@pytest.mark.parametrize("outer_pol", ["save-nothing", "save-matmuls"])
@pytest.mark.parametrize("case", ["unsafe_chunk", "nn.GRU"])
def test_a_double_backward_through_an_inner_call_keeping_a_value_written_through_a_split_is_exact(
        case: str, outer_pol: str) -> None:
    """Review (twenty-eighth session): an inner save-matmuls call keeps the product, which a piece of an
    ``unsafe_chunk`` writes in place, so it keeps a copy from before the write, routed through the outer call (NOTE
    [nested replay]); a replay that builds a graph (``create_graph=True``) read that copy, which has no history: the
    second-order gradients were off by up to 20 (``nn.GRU``), the first-order ones exact. Such a replay now makes the
    inner call's kept values again, as a call on its own does. Three calls."""
    torch.manual_seed(0)
    if case == "nn.GRU":
        gru = torch.nn.GRU(4, 4, batch_first=True, dtype=torch.float64)

        def inner(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(gru, {"weight_ih_l0": W}, (x,), strict=False)[0]

        W0, x0 = gru.weight_ih_l0.detach().clone(), torch.randn(2, 5, 4, dtype=torch.float64)
    else:
        inner, W0, x0 = _split_written, torch.randn(4, 8, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)

    def second_order(g_in: Callable[..., torch.Tensor], wrap: Callable[[Any], Any]) -> Any:
        f = wrap(lambda W, x: g_in(W, x) * 2)
        W, x = W0.clone().requires_grad_(), x0.clone().requires_grad_()
        g1 = torch.autograd.grad(f(W, x).sin().sum(), (W, x), create_graph=True)
        return g1, torch.autograd.grad(sum((g.cos() * g).sum() for g in g1), (W, x))

    ref = second_order(inner, lambda f: f)
    for _ in range(3):
        got = second_order(remat(inner, policy="save-matmuls"), lambda f: remat(f, policy=outer_pol))
        assert_tree_close(got, ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("outer", ["save-matmuls", "save-nothing", "save-everything"])
@pytest.mark.parametrize("depth", [2, 3])
def test_a_kept_value_written_in_place_replayed_twice_through_the_parent(outer, depth) -> None:
    """An inner call keeps a matmul's output (routed through the parent: NOTE [nested replay]) that it writes in place
    (``g.add_(1)``; ``nn.LSTM``'s cells do so): its replay wrote the parent's kept tensor itself, so a second backward
    pass (``retain_graph=True``) read it written twice (off by 0.53; LSTM/GRU by 0.02-0.06). Each replay writes a copy."""
    W = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def f(x):
        g = x @ W
        g.add_(1.0)
        return g.sigmoid() * g.tanh()

    fn = remat(f, policy="save-matmuls")
    for _ in range(depth - 1):
        fn = remat(lambda x, fn=fn: fn(x) * 1.5, policy=outer)

    def plain(x):
        out = f(x)
        for _ in range(depth - 1):
            out = out * 1.5
        return out

    grads = []
    for g in (plain, fn):
        x = torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        loss = g(x).pow(2).sum()
        first = torch.autograd.grad(loss, x, retain_graph=True)[0]
        second = torch.autograd.grad(loss, x)[0]
        grads.append((first, second))
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[1][1], grads[0][1], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("outer", ["save-nothing", "save-matmuls"])
def test_a_kept_value_the_enclosing_call_writes_after_the_inner_returns_it(outer) -> None:
    """An inner call keeps a matmul's output (``dots_saveable``) and returns it; the enclosing call writes it in
    place afterwards (``t[1].mul_(-1)``): the inner replay read the value the enclosing replay had written (off by
    1.76; with both keeping matmuls, a false "modified in place after it was saved"). A kept value the enclosing
    call wrote is made again."""

    def g(x):
        t = x.detach() @ x.detach().t()
        return t, (t + x[:, :3]).sin().sum()

    def make(inner):
        def f(x):
            t, r = inner(x)
            t[1].mul_(-1)
            return r + (t * x[:, :3]).sin().sum()

        return f

    x0 = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x = x0.clone().requires_grad_()
    want = torch.autograd.grad(make(g)(x), x)[0]
    rf = remat(make(remat(g, policy="save-matmuls")), policy=outer)
    for _ in range(3):
        x = x0.clone().requires_grad_()
        torch.testing.assert_close(torch.autograd.grad(rf(x), x)[0], want, rtol=1e-10, atol=1e-12)


class _AppendsToACache(torch.nn.Module):
    """A key/value cache as a plain attribute: each call writes its rows, then reads every row so far."""

    def __init__(self, read_before_write: bool = False) -> None:
        super().__init__()
        self.pos, self.read_before_write = 0, read_before_write
        self.cache = torch.zeros(12, 4, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.read_before_write:  # (saves a view of the cache, then writes it: plain autograd raises)
            y = (x @ self.cache[:3].t()).sin()
            self.cache[0:3] = x.detach()
            return y.sum() * x
        p = self.pos
        self.cache[p:p + 3] = x.detach()
        self.pos += 3
        kv = self.cache[: p + 3]
        return (x @ kv.t()).softmax(-1) @ kv * x


@pytest.mark.parametrize("inner", ["save-nothing", "save-matmuls", "budget"])
def test_a_nested_call_appending_to_a_cache_under_a_budget(inner: str) -> None:
    """An outer ``memory_budget`` (its first call measures, on the full engine) around a call appending to a key/value
    cache: the outer recompute's writes into its copy of the cache move the real cache's version counter, which is put
    back after it; the inner call's view of the cache, made by that recompute, moved back with it, and its check of
    the version it was made at raised "modified ... in place (version 2 -> 1)" on the first call (plain autograd is
    exact). Three calls, float64; a write after a save of the cache still raises, as plain autograd does."""
    pol = (lambda: policies.memory_budget(0.5)) if inner == "budget" else (lambda: inner)
    plain, m = _AppendsToACache(), _AppendsToACache()
    inner_fn = remat(m.forward, policy=pol())
    outer = remat(lambda x: inner_fn(x), policy=policies.memory_budget(0.5))
    for call in range(3):
        x0 = seeded_randn(3, 4, seed=call)
        xs = [x0.clone().requires_grad_() for _ in range(2)]
        plain(xs[0]).pow(2).sum().backward()
        outer(xs[1]).pow(2).sum().backward()
        torch.testing.assert_close(xs[1].grad, xs[0].grad, rtol=1e-10, atol=1e-12)
    writes = _AppendsToACache(read_before_write=True)
    inner_fn = remat(writes.forward, policy=pol())
    outer = remat(lambda x: inner_fn(x), policy=policies.memory_budget(0.5))
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _AppendsToACache(read_before_write=True)(x).pow(2).sum().backward()
    with pytest.raises(RematError, match="modified in place"):
        outer(x).pow(2).sum().backward()


def _leaves() -> tuple[torch.Tensor, torch.Tensor]:
    return (seeded_randn(4, 4, seed=0) * 0.5).requires_grad_(), seeded_randn(3, 4, seed=1).requires_grad_()


_COUNTER = torch.zeros(4, dtype=torch.float64)


def _reads_counter(w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return torch.tanh((h + _COUNTER) @ w) + h  # (an add: plain autograd saves nothing of the counter)


@pytest.mark.parametrize("after", [False, True], ids=["", "written-after"])
@pytest.mark.parametrize("outer_calls", [1, 2])
@pytest.mark.parametrize("policies_", [("save-nothing", "save-nothing"), ("save-everything", "save-nothing"),
                                       ("save-matmuls", "save-matmuls"), ("save-nothing", "save-matmuls")],
                         ids=lambda p: "-".join(p))
def test_a_global_the_outer_call_writes_between_inner_calls_read_by_them(policies_: tuple[str, str],
                                                                         outer_calls: int, after: bool) -> None:
    """The outer call writes a global counter in place (no gradient) between two inner calls that read it (and, with
    ``after``, once more after them). Called once before the backward pass: exact. Called twice, the inner call's
    read, saved through the outer call and version-checked, is refused ("modified in place after it was saved")
    where plain autograd is exact: a replay-only route for it, tried in the thirty-eighth session, handed back the
    value after the outer call's later write (silent, off by 1 to 137: its review), so a refusal it stays."""
    outer_p, inner_p = policies_
    inner = remat(_reads_counter, policy=inner_p)

    def make(f: Any) -> Any:
        def outer(w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
            y = f(w, h)
            _COUNTER.add_(1.0)
            z = f(w, y)
            if after:
                _COUNTER.add_(2.0)
            return z

        return outer

    def grads(f: Any) -> Any:
        _COUNTER.zero_()
        w, x = _leaves()
        h = x
        for _ in range(outer_calls):
            h = f(w, h)
        return torch.autograd.grad(h.pow(2).sum(), (w, x))

    want = grads(make(_reads_counter))
    ours = remat(make(inner), policy=outer_p)
    for _ in range(3):
        if outer_calls == 2 or after:  # (the value the inner call read was written since: refused, never silent)
            with pytest.raises(RematError, match="modified in place"):
                grads(ours)
        else:
            assert_tree_close(grads(ours), want, rtol=1e-10, atol=1e-10)


def _kept_inner(w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = checkpoint_name(torch.tanh(x) @ w, "h")  # (kept by save-matmuls and by the name)
    return h, torch.tanh(h)  # tanh saves its output: made from the kept h


@pytest.mark.parametrize("outer_p", ["save-matmuls", "names", "save-everything"])
@pytest.mark.parametrize("inner_p", ["save-matmuls", "names"])
def test_an_inner_kept_value_returned_through_the_outer_call_and_written_by_the_caller(inner_p: str,
                                                                                    outer_p: str) -> None:
    """The inner call keeps its matmul, which the outer call returns; the caller adds a residual into it in place
    before the backward pass. Plain autograd is exact (tanh saves its output, not h); one remat call was already
    (NOTE [kept values written after the call]). Nested, the inner call's kept value is held through the outer
    call, which checked it as an autograd save: "modified in place after it was saved" on every call until the
    thirty-eighth session. The outer call makes it again from its trace now."""
    pol = {"names": policies.save_only_these_names("h")}
    inner = remat(_kept_inner, policy=pol.get(inner_p, inner_p))

    def make(f: Any) -> Any:
        def outer(w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h, a = f(w, x)
            return h, a * 2

        return outer

    def grads(f: Any) -> Any:
        w, x = _leaves()
        h, a = f(w, x)
        h += x  # the caller's residual add
        return torch.autograd.grad((a * 1.5).sum() + (h ** 2).sum(), (w, x))

    want = grads(make(_kept_inner))
    ours = remat(make(inner), policy=pol.get(outer_p, outer_p))
    for _ in range(3):
        assert_tree_close(grads(ours), want, rtol=1e-10, atol=1e-10)


def test_an_inner_kept_value_a_name_of_the_outer_call_drops_then_written_inside_it() -> None:
    """The outer call's policy drops a name given to the inner call's kept result, which the outer call then writes
    in place: the first version of the thirty-eighth session's nested watch crashed here ('NoneType' object is not
    callable: a demoted save with no reference among the call's drops)."""

    def outer(w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, a = remat(_kept_inner, policy="save-matmuls")(w, x)
        h = checkpoint_name(h, "n")
        h.mul_(3.0)
        return h, a * 2

    def plain(w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, a = _kept_inner(w, x)
        h = h * 1.0  # (the same values: the in-place write on a fresh tensor, as the nested one's reads see it)
        h.mul_(3.0)
        return h, a * 2

    def grads(f: Any) -> Any:
        w, x = _leaves()
        h, a = f(w, x)
        return torch.autograd.grad((h ** 2).sum() + a.sum(), (w, x))

    ours = remat(outer, policy=policies.save_anything_except_these_names("n"))
    for _ in range(3):
        assert_tree_close(grads(ours), grads(plain), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("outer_write", [False, True], ids=["", "outer-writes-too"])
@pytest.mark.parametrize("caller", ["write", "free"])
@pytest.mark.parametrize("outer_p", ["save-matmuls", "save-everything"])
def test_an_innermost_kept_value_three_calls_deep_written_or_freed(outer_p: str, caller: str,
                                                                  outer_write: bool) -> None:
    """Three levels: the innermost call keeps its matmul, returned through both outer calls, and the caller writes
    it in place or frees its memory (and the outermost call's Python writes it once too). The thirty-eighth session's
    first nested fix marked only a value the direct parent kept: three deep, a freed one was read from the freed
    storage (off by 147 to 4e6, or NaN; the review of the fix), a written one refused. The call holding it makes it
    again; where that call wrote the storage itself it refuses (a replay would write it again: the review found a
    silent 84 there), never silent."""
    inner = remat(_kept_inner, policy="save-matmuls")

    def middle(w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return inner(w, x)

    def top_of(f: Any) -> Any:
        def top(w: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h, a = f(w, x)
            if outer_write:
                h.mul_(3.0)
            return h, a * 2

        return top

    def grads(f: Any) -> Any:
        w, x = _leaves()
        h, a = f(w, x)
        if caller == "write":
            h.mul_(2.0)
        else:
            h.detach().untyped_storage().resize_(0)
        loss = (a * 1.5).sum() + (a ** 3).sum() + ((h ** 2).sum() if caller == "write" else 0)
        return torch.autograd.grad(loss, (w, x))

    want = grads(top_of(_kept_inner))
    ours = remat(top_of(remat(middle, policy=outer_p)), policy=outer_p)
    for _ in range(3):
        if outer_write:
            with pytest.raises(RematError, match="modified in place"):
                grads(ours)
        else:
            assert_tree_close(grads(ours), want, rtol=1e-10, atol=1e-10)
