"""remat under every torch.func transform and nesting, for every kind of policy.

Each case runs a transform over plain ``f`` and over ``remat(f, policy=p)`` and
compares the results (float64, 1e-10), then proves from outside the library
that remat did what its policy says:

* recomputes: under torch.func transforms (the full engine) Python calls of the
  wrapped function (``Counted``): the plain transform calls ``f`` ``base``
  times (vmap runs it once for the whole batch, ``chunk_size`` once per chunk);
  under save-nothing each saving level whose saved tensors a backward pass
  reads re-runs it once per such backward pass, so the count is exactly
  ``base + recomputes`` (the ``recomputes`` column of the case table: 2 for a
  vjp function called twice; 1 for ``grad(grad)``, whose outer backward pass
  walks the recompute's graph, not the forward's); save-everything never
  re-runs it. Under plain autograd (``backward_mixed``, ``double_backward``:
  the replay engine, remat/_engine/traced.py) ``f`` runs once per call and a
  recompute replays the recorded ATen ops: counted by the ``sin`` ops run
  beyond plain ``f``'s (one per recompute: every policy that recomputes
  anything needs ``sin``'s output again; 2 for eager double backward, whose
  second backward pass replays again);
* matrix products seen by an ``OpCounter`` around the transformed computation:
  save-everything, dots_saveable and offload run exactly as many as plain ``f``
  (no matmul recomputed), save-nothing and save_only_these_names run more
  wherever a backward pass runs (exactly as many otherwise),
  dots_with_no_batch_dims_saveable runs more exactly when the forward pass has a
  batched matmul (bmm, convolution) and a backward pass runs.

Forward-mode-only transforms (jvp, jacfwd, vmap, linearize) save nothing for a
backward pass, so nothing is recomputed there under any policy
(``recomputes == 0``); the table says so explicitly.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.func import (
    functional_call,
    grad,
    grad_and_value,
    hessian,
    jacfwd,
    jacrev,
    jvp,
    linearize,
    vjp,
    vmap,
)

from remat import RematError, checkpoint_name, policies, remat
from remat.bench.models import cnn_block, transformer_block
from remat.offload import OffloadEngine, use_engine

from .helpers import Counted, OpCounter, OpLog, assert_tree_close

DT = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}

POLICIES: dict[str, Any] = {
    "nothing": policies.nothing_saveable,
    "dots": policies.dots_saveable,
    "everything": policies.everything_saveable,
    "dots_no_batch": policies.dots_with_no_batch_dims_saveable,
    "names": policies.save_only_these_names("h1"),
    "offload_cpu": policies.offload_to_cpu(min_bytes=0),
}
POLICY_IDS = list(POLICIES)


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1000 * len(shape) + sum(shape))
    return torch.randn(*shape, generator=g, dtype=DT)


D, H, B = 4, 5, 3
P = {"W1": _rand(D, H), "b1": _rand(H), "W2": _rand(H, D)}
PB = {k: torch.stack([v + 0.1 * i for i in range(2)]) for k, v in P.items()}  # a batch of 2 parameter sets
X = _rand(D)
XB = _rand(B, D, seed=1)
XBB = _rand(2, B, D, seed=2)
T = _rand(D, seed=3)


# ---- the test functions ---------------------------------------------------------


def mlp(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Scalar MLP loss with a named hidden value (for the names policy)."""
    h = checkpoint_name(torch.tanh(x @ p["W1"] + p["b1"]), "h1")
    h = F.gelu(h @ p["W2"])
    return (torch.sin(h) ** 2).sum()


def mlp_vec(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Vector-valued MLP (for Jacobians and jvp)."""
    h = checkpoint_name(torch.tanh(x @ p["W1"] + p["b1"]), "h1")
    return torch.sin(h @ p["W2"]) * x


def mlp_aux(p: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    h = checkpoint_name(torch.tanh(x @ p["W1"] + p["b1"]), "h1")
    y = torch.sin(h @ p["W2"])
    return (y**2).sum(), {"h": h, "y": y}


Case = collections.namedtuple("Case", "name fn run recomputes")

# run(g) applies the transform to g (plain or remat'd) and returns a pytree of results.
# recomputes: how many times save-nothing re-runs the function (once per saving level).
CASES = [
    Case("grad", mlp, lambda g: grad(g)(P, X), 1),
    Case("grad_argnums_tuple", mlp, lambda g: grad(g, argnums=(0, 1))(P, X), 1),
    Case("grad_has_aux", mlp_aux, lambda g: grad(g, has_aux=True)(P, X), 1),
    Case("grad_and_value", mlp, lambda g: grad_and_value(g, argnums=(0, 1))(P, X), 1),
    Case("vjp_called_twice", mlp_vec, lambda g: _vjp_twice(g), 2),
    Case("jacrev", mlp_vec, lambda g: jacrev(g, argnums=(0, 1))(P, X), 1),
    Case("jacfwd", mlp_vec, lambda g: jacfwd(g, argnums=(0, 1))(P, X), 0),
    Case("hessian", mlp, lambda g: hessian(g, argnums=1)(P, X), 1),
    Case("jvp", mlp_vec, lambda g: jvp(lambda x: g(P, x), (X,), (T,)), 0),
    Case("linearize", mlp_vec, lambda g: _linearize(g), 0),
    Case("vmap_in_dims_inputs", mlp, lambda g: vmap(g, in_dims=(None, 0))(P, XB), 0),
    Case("vmap_in_dims_params", mlp, lambda g: vmap(g, in_dims=(0, None))(PB, X), 0),
    Case("vmap_chunk_size", mlp, lambda g: vmap(g, in_dims=(None, 0), chunk_size=2)(P, XB), 0),
    Case("vmap(grad)", mlp, lambda g: vmap(grad(g), in_dims=(None, 0))(P, XB), 1),
    Case("vmap(grad)_params", mlp, lambda g: vmap(grad(g), in_dims=(0, None))(PB, X), 1),
    Case("vmap(grad)_chunk_size", mlp, lambda g: vmap(grad(g), in_dims=(None, 0), chunk_size=2)(P, XB), 2),
    Case("grad(vmap)", mlp, lambda g: grad(lambda p: vmap(g, in_dims=(None, 0))(p, XB).sum())(P), 1),
    Case("vmap(vmap(grad))", mlp, lambda g: vmap(vmap(grad(g), in_dims=(None, 0)), in_dims=(0, None))(PB, XB), 1),
    Case("grad(grad)", mlp, lambda g: grad(lambda x: grad(g, argnums=1)(P, x).sin().sum())(X), 1),
    Case("jacrev(jacrev)", mlp_vec, lambda g: jacrev(jacrev(g, argnums=1))(P, X), 1),
    Case("vmap(jacrev)", mlp_vec, lambda g: vmap(jacrev(g, argnums=1), in_dims=(0, None))(PB, X), 1),
    Case("jacfwd(grad)", mlp, lambda g: jacfwd(grad(g, argnums=1))(P, X), 1),
    Case("backward_mixed", mlp_vec, lambda g: _backward_mixed(g), 1),
    Case("double_backward", mlp, lambda g: _double_backward(g), 2),
]
CASE_IDS = [c.name for c in CASES]
# every case replays: the ATen trace under plain autograd, the call's program under torch.func (NOTE [program
# replay]): f runs once per call, and each recompute replays f's one sin


def _vjp_twice(g: Callable[..., Any]) -> Any:
    out, fn = vjp(g, P, X)
    ct = torch.linspace(-1, 1, D, dtype=DT)
    return out, fn(ct), fn(2 * ct)


def _linearize(g: Callable[..., Any]) -> Any:
    out, fn = linearize(lambda x: g(P, x), X)
    return out, fn(T), fn(2 * T)


def _backward_mixed(g: Callable[..., Any]) -> Any:
    """Plain autograd over a graph mixing remat and non-remat parts."""
    p = {k: v.clone().requires_grad_() for k, v in P.items()}
    x = X.clone().requires_grad_()
    y = torch.cos(x) * 2  # non-remat part before
    z = g(p, y)
    loss = (z.exp() * y).sum()  # non-remat part after (reads the remat input too)
    loss.backward()
    return loss.detach(), x.grad, {k: v.grad for k, v in p.items()}


def _double_backward(g: Callable[..., Any]) -> Any:
    x = X.clone().requires_grad_()
    (gx,) = torch.autograd.grad(g(P, x), x, create_graph=True)
    (ggx,) = torch.autograd.grad(gx.sin().sum(), x)
    return gx.detach(), ggx


# ---- the harness -------------------------------------------------------------------


def _measure(run: Callable[[Callable[..., Any]], Any], fn: Callable[..., Any], policy: Any,
             seed: int = 0) -> tuple[Any, int, int, int]:
    """(result, Python calls of fn, matmuls run, sins run) for run(fn) or run(remat(fn, policy))."""
    counted = Counted(fn)
    g = counted if policy is None else remat(counted, policy=policy)
    torch.manual_seed(seed)
    with OpCounter() as oc, OpLog() as log:
        out = run(g)
    return out, counted.calls, oc.count, log.ops.count(torch.ops.aten.sin.default)


BATCHED_MATMULS = {torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default, torch.ops.aten.convolution.default}


def _forward_matmuls(run: Callable[[Callable[..., Any]], Any], fn: Callable[..., Any]) -> set[Any]:
    """The matmul ops plain ``fn`` runs in its forward pass under the transform (seen inside its calls)."""
    seen: set[Any] = set()

    def counted(*args: Any, **kwargs: Any) -> Any:
        with OpCounter() as oc:
            out = fn(*args, **kwargs)
        seen.update(oc.seen)
        return out

    torch.manual_seed(0)
    run(counted)
    return seen


def check_case(case: Case, pol: str) -> None:
    ref, base_calls, base_mm, base_sins = _measure(case.run, case.fn, None)
    eng = OffloadEngine()
    with use_engine(eng):
        out, calls, mm, sins = _measure(case.run, case.fn, POLICIES[pol])
    assert_tree_close(out, ref, **TOL)
    backward = case.recomputes > 0
    assert calls == base_calls, f"f ran {calls} times, plain {base_calls}: its Python ran again"
    reruns = sins - base_sins  # each recompute replays f's sin
    if pol == "everything":
        assert (reruns, mm) == (0, base_mm), "save-everything recomputed"
    elif pol == "nothing":
        assert reruns == case.recomputes, f"save-nothing recomputed {reruns} times, expected {case.recomputes}"
        # every matmul of these functions feeds a value some backward formula reads: each is recomputed
        assert mm > base_mm if backward else mm == base_mm, f"save-nothing ran {mm} matmuls, plain {base_mm}"
    elif pol == "dots" and case.name == "double_backward":
        # a backward pass that builds a graph replays from the inputs, products included, so that the dropped
        # values carry their history (NOTE [graph replay] in remat/_engine/traced.py): more matmuls, never fewer
        assert mm > base_mm, f"dots_saveable under create_graph: {mm} vs plain {base_mm}"
        assert reruns > 0, "dots_saveable did not recompute the elementwise ops"
    elif pol == "dots":
        assert mm == base_mm, f"dots_saveable recomputed matmuls: {mm} vs plain {base_mm}"
        assert (reruns > 0) == backward, "dots_saveable did not recompute the elementwise ops"
    elif pol == "dots_no_batch":
        assert (reruns > 0) == backward, f"{pol}: no recompute ran"
        # matmuls without batch dims (mm, addmm) are saved; a batched one in the forward (bmm under vmap over
        # the weights or jacfwd's tangents, attention, convolution) is recomputed when a backward pass runs
        batched = bool(_forward_matmuls(case.run, case.fn) & BATCHED_MATMULS)
        if case.name == "double_backward":  # (NOTE [graph replay], as for dots above)
            assert mm > base_mm, f"{pol} under create_graph: {mm} vs plain {base_mm}"
        elif backward and batched:
            assert mm > base_mm, f"dots_no_batch did not recompute the batched matmuls: {mm} vs plain {base_mm}"
        else:
            assert mm == base_mm, f"dots_no_batch recomputed unbatched matmuls: {mm} vs plain {base_mm}"
    elif pol == "names":
        assert (reruns > 0) == backward, f"{pol}: no recompute ran"
        # everything but h1 is recomputed, matmuls included
        assert mm > base_mm if backward else mm == base_mm, f"names: {mm} matmuls vs plain {base_mm}"
    elif pol == "offload_cpu":
        assert mm == base_mm, "offload recomputed matmuls"
        if backward:  # (a forward-only transform may still pack a tensor nobody reads)
            assert eng.stats["offloaded"] > 0, f"nothing offloaded: {dict(eng.stats)}"
    if not backward:
        assert reruns == 0, "a forward-only transform re-ran the function"


@pytest.mark.parametrize("pol", POLICY_IDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_transform_matrix(case: Case, pol: str) -> None:
    check_case(case, pol)


# ---- other test functions: transformer block, CNN block, functional_call -------------

TP = {
    "ln1_w": 1 + 0.1 * _rand(8), "ln1_b": 0.1 * _rand(8, seed=1), "wqkv": _rand(24, 8) / 3,
    "bqkv": 0.1 * _rand(24), "wo": _rand(8, 8) / 3, "bo": 0.1 * _rand(8, seed=2),
    "ln2_w": 1 + 0.1 * _rand(8, seed=3), "ln2_b": 0.1 * _rand(8, seed=4), "w1": _rand(16, 8) / 3,
    "b1": 0.1 * _rand(16), "w2": _rand(8, 16) / 4, "b2": 0.1 * _rand(8, seed=5),
}
TX = _rand(2, 3, 8, seed=7)  # batch 2, seq 3, d 8


def tblock(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return (torch.sin(transformer_block(p, x, 2)) ** 2).mean()  # (one sin: the harness counts replays by it)


CP = {"c1": _rand(4, 4, 3, 3) / 6, "b1": 0.1 * _rand(4), "g_w": 1 + 0.1 * _rand(4, seed=1),
      "g_b": 0.1 * _rand(4, seed=2), "c2": _rand(4, 4, 3, 3, seed=1) / 6, "b2": 0.1 * _rand(4, seed=3)}
CX = _rand(2, 4, 5, 5, seed=9)


def cblock(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return (torch.sin(cnn_block(p, x)) ** 2).mean()  # (one sin: the harness counts replays by it)


MODEL_CASES = [
    Case("transformer:grad", tblock, lambda g: grad(g)(TP, TX), 1),
    Case("transformer:vmap(grad)", tblock,
         lambda g: vmap(grad(g), in_dims=(None, 0))(TP, TX.unsqueeze(1)), 1),
    Case("transformer:vjp", tblock, lambda g: vjp(g, TP, TX)[1](torch.tensor(1.0, dtype=DT)), 1),
    Case("cnn:grad", cblock, lambda g: grad(g, argnums=(0, 1))(CP, CX), 1),
    Case("cnn:vmap(grad)", cblock, lambda g: vmap(grad(g), in_dims=(None, 0))(CP, CX.unsqueeze(1)), 1),
]


@pytest.mark.parametrize("pol", ["nothing", "dots", "everything", "offload_cpu"])
@pytest.mark.parametrize("case", MODEL_CASES, ids=[c.name for c in MODEL_CASES])
def test_reference_models_equal_plain_under_each_transform(case: Case, pol: str) -> None:
    check_case(case, pol)


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(D, H, dtype=DT)
        self.l2 = torch.nn.Linear(H, 1, dtype=DT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.sin(self.l2(torch.tanh(self.l1(x)))) ** 2).sum()  # (the harness counts replays by sin)


def _module_cases() -> list[Case]:
    torch.manual_seed(0)
    net = TinyNet()
    params = {k: v.detach() for k, v in net.named_parameters()}

    def call(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(net, p, (x,))

    return [
        Case("module:grad", call, lambda g: grad(g)(params, X), 1),
        Case("module:vmap(grad)", call, lambda g: vmap(grad(g), in_dims=(None, 0))(params, XB), 1),
        Case("module:jacrev(jacrev)", call, lambda g: jacrev(jacrev(g, argnums=1), argnums=1)(params, X), 1),
        Case("module:jacfwd(grad)", call, lambda g: jacfwd(grad(g, argnums=1), argnums=1)(params, X), 1),
    ]


MODULE_CASES = _module_cases()


@pytest.mark.parametrize("pol", ["nothing", "dots", "everything"])
@pytest.mark.parametrize("case", MODULE_CASES, ids=[c.name for c in MODULE_CASES])
def test_functional_call(case: Case, pol: str) -> None:
    check_case(case, pol)


# ---- randomness: dropout and torch.rand under each vmap randomness mode ---------------


def noisy(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    h = checkpoint_name(torch.tanh(x @ p["W1"] + p["b1"]), "h1")
    h = F.dropout(h, 0.5, training=True) + 0.5 * torch.rand_like(h)
    return torch.sin(h @ p["W2"]).pow(2).sum()


RANDOM_CASES = [
    Case("grad", noisy, lambda g: grad(g)(P, X), 1),
    Case("vjp", noisy, lambda g: vjp(g, P, X)[1](torch.tensor(1.0, dtype=DT)), 1),
    Case("vmap(grad)_same", noisy, lambda g: vmap(grad(g), in_dims=(None, 0), randomness="same")(P, XB), 1),
    Case("vmap(grad)_different", noisy,
         lambda g: vmap(grad(g), in_dims=(None, 0), randomness="different")(P, XB), 1),
    Case("grad(vmap)_same", noisy,
         lambda g: grad(lambda p: vmap(g, in_dims=(None, 0), randomness="same")(p, XB).sum())(P), 1),
    Case("grad(vmap)_different", noisy,
         lambda g: grad(lambda p: vmap(g, in_dims=(None, 0), randomness="different")(p, XB).sum())(P), 1),
    Case("vmap(vmap(grad))_different", noisy, lambda g: vmap(
        vmap(grad(g), in_dims=(None, 0), randomness="different"), in_dims=(0, None), randomness="different")(PB, XB), 1),
    Case("hessian_same", noisy, lambda g: jacfwd(jacrev(g, argnums=1), argnums=1, randomness="same")(P, X), 1),
    Case("hessian_different", noisy,
         lambda g: jacfwd(jacrev(g, argnums=1), argnums=1, randomness="different")(P, X), 1),
]


@pytest.mark.parametrize("pol", POLICY_IDS)
@pytest.mark.parametrize("case", RANDOM_CASES, ids=[c.name for c in RANDOM_CASES])
def test_random_ops_equal_plain_under_each_transform(case: Case, pol: str) -> None:
    check_case(case, pol)


def test_randomness_negative_control() -> None:
    """Other masks give another gradient: the comparison above can fail (a replay that drew new numbers would)."""
    ref = _measure(lambda g: grad(g)(P, X), noisy, None)[0]
    torch.manual_seed(1)
    out = grad(noisy)(P, X)
    assert not all(torch.allclose(out[k], ref[k]) for k in ref)


@pytest.mark.parametrize("pol", ["nothing", "dots"])
def test_randomness_error_mode(pol: str) -> None:
    """vmap(randomness="error") rejects random ops with remat exactly as without it."""
    run = lambda g: vmap(grad(g), in_dims=(None, 0))(P, XB)  # noqa: E731
    with pytest.raises(RuntimeError, match="randomness") as plain:
        run(noisy)
    with pytest.raises(RuntimeError, match="randomness") as ours:
        run(remat(noisy, policy=POLICIES[pol]))
    assert str(ours.value) == str(plain.value)
    # and a deterministic function runs fine under randomness="error" (the default of the matrix)


# ---- pytrees, static arguments, keyword tensors --------------------------------------

Pair = collections.namedtuple("Pair", "a b")


def tree_fn(inp: dict[str, Any], act: Callable[[torch.Tensor], torch.Tensor], n: int, *,
            scale: torch.Tensor) -> dict[str, Any]:
    """Pytree in and out: a dict holding a namedtuple, non-tensor leaves, a static callable and int."""
    h = act(inp["pair"].a @ inp["W"] + inp["pair"].b) * scale
    for _ in range(n):
        h = checkpoint_name(torch.tanh(h), "h1")
    return {"loss": (h**2).sum() * inp["coef"], "out": Pair(h.sum(-1), inp["tag"]), "none": None}


def _tree_inputs(batched: bool = False) -> dict[str, Any]:
    x = XB if batched else X
    return {"W": P["W1"], "pair": Pair(x, P["b1"]), "coef": 0.5, "tag": "static-text"}


SCALE = _rand(H, seed=11)


def _tree_loss(g: Callable[..., Any], inp: dict[str, Any], scale: torch.Tensor) -> Any:
    out = g(inp, torch.sin, 2, scale=scale)
    assert out["out"].b == "static-text" and out["none"] is None
    return out["loss"] + out["out"].a.sum(), out["out"].a


TREE_CASES = [
    Case("grad_has_aux", tree_fn, lambda g: grad(
        lambda W, s: _tree_loss(g, {**_tree_inputs(), "W": W}, s), argnums=(0, 1), has_aux=True)(P["W1"], SCALE), 1),
    Case("vjp", tree_fn, lambda g: vjp(lambda W, s: _tree_loss(g, {**_tree_inputs(), "W": W}, s)[1], P["W1"], SCALE)[1](
        torch.ones((), dtype=DT)), 1),
    Case("vmap(grad)_kwarg", tree_fn, lambda g: vmap(
        grad(lambda i, s: _tree_loss(g, i, s)[0], argnums=1), in_dims=({"W": None, "pair": Pair(0, None),
                                                                          "coef": None, "tag": None}, None))(
        _tree_inputs(batched=True), SCALE), 1),
    Case("jacrev_kwarg", tree_fn, lambda g: jacrev(lambda s: _tree_loss(g, _tree_inputs(), s)[1])(SCALE), 1),
]


@pytest.mark.parametrize("pol", POLICY_IDS)
@pytest.mark.parametrize("case", TREE_CASES, ids=[c.name for c in TREE_CASES])
def test_pytrees_static_kwargs(case: Case, pol: str) -> None:
    # remat(tree_fn, static_argnums=(1, 2)): the activation function and the loop count are static
    ref, base_calls, base_mm, base_sins = _measure(case.run, case.fn, None)
    counted = Counted(case.fn)
    g = remat(counted, policy=POLICIES[pol], static_argnums=(1, 2))
    torch.manual_seed(0)
    with OpCounter() as oc, OpLog() as log, use_engine(OffloadEngine()):
        out = case.run(g)
    assert_tree_close(out, ref, **TOL)
    assert counted.calls == base_calls, "the Python ran again (NOTE [program replay]: the recompute replays)"
    reruns = log.ops.count(torch.ops.aten.sin.default) - base_sins  # (act is torch.sin: one per replay)
    if pol == "everything":
        assert (reruns, oc.count) == (0, base_mm)
    elif pol == "nothing":
        assert reruns == case.recomputes and oc.count > base_mm
    elif pol == "dots":
        assert reruns > 0 and oc.count == base_mm
    elif pol == "names":  # only the tanh outputs named h1 are kept: the matmul is recomputed
        assert reruns > 0 and oc.count > base_mm
    elif pol == "offload_cpu":
        assert oc.count == base_mm, "offload recomputed matmuls"
    elif pol == "dots_no_batch":
        assert reruns > 0
        batched = bool(_forward_matmuls(case.run, case.fn) & BATCHED_MATMULS)
        assert oc.count > base_mm if batched else oc.count == base_mm


# ---- in-place mutation between forward and backward -----------------------------------


def _mutate_inside(g: Callable[..., Any]) -> Callable[..., Any]:
    def body(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        xc = x.clone()
        y = g(p, xc)
        xc.mul_(2)  # an input of the remat'd call changes before the backward pass reads it
        return y

    return body


def _mut_vjp(g: Callable[..., Any]) -> Any:
    xc = X.clone()
    _, fn = vjp(lambda p: g(p, xc), P)
    xc.mul_(2)
    return fn(torch.tensor(1.0, dtype=DT))


def _mut_backward(g: Callable[..., Any]) -> Any:
    x = X.clone().requires_grad_()
    xc = x * 1.0
    y = g(P, xc)
    xc.mul_(2)
    y.backward()
    return x.grad


MUTATION_CASES = {
    "grad": lambda g: grad(_mutate_inside(g))(P, X),
    "vjp": _mut_vjp,
    "jacrev": lambda g: jacrev(_mutate_inside(g))(P, X),
    "vmap(grad)": lambda g: vmap(grad(_mutate_inside(g)), in_dims=(None, 0))(P, XB),
    "grad(vmap)": lambda g: grad(lambda p: vmap(_mutate_inside(g), in_dims=(None, 0))(p, XB).sum())(P),
    "grad(grad)": lambda g: grad(lambda x: grad(_mutate_inside(g), argnums=1)(P, x).sum())(X),
    "hessian": lambda g: hessian(_mutate_inside(g), argnums=1)(P, X),
    "backward": _mut_backward,
}


# nothing is recomputed (save-everything; offload outside torch.func), or, under plain autograd (the replay engine),
# the replay starts from the kept matmul output (dots_saveable), and the backward pass does not read the mutated
# tensor, exactly as for plain f: no error, same gradients
_NOTHING_READS_THE_MUTATED_VALUE = {("everything", "grad(grad)"), ("everything", "hessian"),
                                    ("everything", "backward"), ("offload_cpu", "backward"), ("dots", "backward")}


@pytest.mark.parametrize("pol", ["nothing", "dots", "everything", "offload_cpu"])
@pytest.mark.parametrize("name", list(MUTATION_CASES))
def test_mutated_input_raises(name: str, pol: str) -> None:
    # plain autograd notices only where it saved the mutated tensor itself (not always: it
    # may not need it), remat does wherever its recompute reads the input (under torch.func, where
    # the full engine runs the function again, always). Under vjp
    # plain torch.func misses it (the saved wrapper has its own version counter) and silently
    # uses the new value; remat checks the plain tensor's version, so even save-everything raises.
    run = MUTATION_CASES[name]
    try:
        ref, plain_raised = run(mlp), False
    except RuntimeError as e:
        assert "modified by an inplace operation" in str(e)
        ref, plain_raised = None, True
    g = remat(mlp, policy=POLICIES[pol])
    with use_engine(OffloadEngine()):
        if not plain_raised and (pol, name) in _NOTHING_READS_THE_MUTATED_VALUE:
            assert_tree_close(run(g), ref, **TOL)  # nothing recomputed, nothing read the mutated value
        else:
            with pytest.raises(RematError, match="modified in place"):
                run(g)


# ---- functionalize -------------------------------------------------


def test_functionalize_outside_remat_raises() -> None:
    with pytest.raises(RematError, match="torch.func.functionalize, which remat does not support"):
        grad(torch.func.functionalize(remat(mlp)))(P, X)


def test_functionalize_inside_remat_works() -> None:
    counted = Counted(mlp)
    out = grad(remat(torch.func.functionalize(counted)))(P, X)
    assert_tree_close(out, grad(mlp)(P, X), **TOL)
    assert counted.calls == 2  # forward + recompute


# torch.compile: tests/test_compile.py


# ---- CUDA RNG of every device touched ------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("transform", ["grad", "vmap(grad)_different", "backward"])
def test_cuda_rng_every_device(transform: str) -> None:
    devs = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    pc = {k: v.to(devs[0]) for k, v in P.items()}

    def f(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        out = noisy(p, x)
        for d in devs[1:]:  # draw on every other device too
            out = out + torch.rand((), device=d, dtype=DT).to(devs[0])
        return out + torch.rand((), dtype=DT).to(devs[0])  # and on the CPU

    def run(g: Callable[..., Any]) -> Any:
        torch.manual_seed(0)
        if transform == "grad":
            return grad(g)(pc, X.to(devs[0]))
        if transform == "vmap(grad)_different":
            return vmap(grad(g), in_dims=(None, 0), randomness="different")(pc, XB.to(devs[0]))
        p = {k: v.clone().requires_grad_() for k, v in pc.items()}
        g(p, X.to(devs[0])).backward()
        return {k: v.grad for k, v in p.items()}

    ref = run(f)
    counted = Counted(f)
    out = run(remat(counted))
    assert counted.calls == 2
    assert_tree_close(out, ref, **TOL)


# ---- debug=True under every transform ---------------------------------------------------

DEBUG_TRANSFORMS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "grad": lambda g: grad(g),
    "vjp": lambda g: lambda w, x: vjp(g, w, x)[1](torch.ones((), dtype=DT)),
    "jacrev": lambda g: jacrev(g),
    "hessian": lambda g: hessian(g),
    "vmap(grad)": lambda g: vmap(grad(g), in_dims=(None, 0)),
    "jacfwd(jacrev)": lambda g: jacfwd(jacrev(g)),
}


@pytest.mark.parametrize("pol", ["nothing", "dots"])
@pytest.mark.parametrize("transform", list(DEBUG_TRANSFORMS))
def test_debug_mode_under_each_transform_equals_plain(transform: str, pol: str) -> None:
    """``debug=True`` (the re-run with its checks, and a hash of every input when the forward pass ends) under each
    torch.func transform, on the first call and later ones: plain ``f``'s result. The hash ran ops on plain tensors
    with the transform's level still active, which made wrappers without storage: every call raised RuntimeError."""

    def f(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(F.conv1d(torch.sin(x).unsqueeze(1), w.unsqueeze(0).unsqueeze(0), padding=1))
        return (h * h).sum() + (x @ w).sin().sum()

    t = DEBUG_TRANSFORMS[transform]
    rf = remat(f, policy=POLICIES[pol], debug=True)
    for i in range(3):
        w = _rand(3, seed=i)
        x = _rand(2, 3, seed=10 + i) if transform != "vmap(grad)" else _rand(4, 2, 3, seed=10 + i)
        assert_tree_close(t(rf)(w, x), t(f)(w, x), **TOL)


# ---- an output the offload engine declined, written in place under a forward-mode transform -----------------

@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "hessian", "jacfwd(jacrev)", "grad"])
def test_offload_with_layer_norm_under_forward_mode_transforms_equals_plain(transform: str) -> None:
    """LayerNorm's forward-mode formula divides a sum it made, in place (``mean``); under an offload policy that
    sum is an output to offload not yet handed to the offload engine, and the write made the call raise
    ``RematError`` ("writes in place into a tensor that its offload policy offloads") under jvp, jacfwd and hessian,
    where plain torch.func is exact (NOTE [written before offloaded] in remat/_engine/outside_writes.py); grad is the
    control."""
    torch.manual_seed(0)
    ln = torch.nn.LayerNorm(4, dtype=DT)

    def f(x: torch.Tensor) -> torch.Tensor:
        return (torch.sin(ln(x)) * x).sum()

    ts: dict[str, Callable[[Callable[..., Any]], Any]] = {
        "jvp": lambda g: lambda x: jvp(g, (x,), (torch.ones_like(x),)),
        "jacfwd": lambda g: jacfwd(g),
        "hessian": lambda g: hessian(g),
        "jacfwd(jacrev)": lambda g: jacfwd(jacrev(g)),
        "grad": lambda g: grad(g),
    }
    t = ts[transform]
    rf = remat(f, policy=policies.offload_to_cpu(min_bytes=0))
    for i in range(2):
        x = _rand(3, 4, seed=i)
        assert_tree_close(t(rf)(x), t(f)(x), **TOL)


# ---- a name that drops one output of a multi-output op, under a higher-order grad ---------------------------------

NAME_POLICIES: dict[str, Any] = {
    "except": policies.save_anything_except_these_names("h"),
    "only": policies.save_only_these_names("h"),
    "any-but": policies.save_any_names_but_these("h"),
}


@pytest.mark.parametrize("pol", list(NAME_POLICIES))
@pytest.mark.parametrize("transform", ["jacrev(grad)", "hessian", "jacfwd(grad)", "grad(grad)"])
def test_a_named_layer_norm_output_under_a_higher_order_grad_equals_plain(transform: str, pol: str) -> None:
    """``layer_norm`` returns its output and the mean and rstd it saves; a name on the output that the policy drops
    makes the op run in the recompute, while its other outputs were saved as kept at a level above a grad level
    (NOTE [kept under higher-order grad] in remat/_engine/full.py): turning those into recomputed ones read the op's
    stash, which the name had taken away, and every call raised TypeError under ``save_anything_except_these_names``.
    First and later calls: plain ``f``'s result."""

    def f(x: torch.Tensor) -> torch.Tensor:
        h = checkpoint_name(F.layer_norm(x, (3,)), "h")
        return h.sin().sum()

    def f2(x: torch.Tensor) -> torch.Tensor:
        a = x.exp()
        h = checkpoint_name(F.layer_norm(a, (3,)), "h")
        return (h.tanh() * a.cos()).sum()

    ts: dict[str, Callable[[Callable[..., Any]], Any]] = {
        "jacrev(grad)": lambda g: jacrev(grad(g)),
        "hessian": lambda g: hessian(g),
        "jacfwd(grad)": lambda g: jacfwd(grad(g)),
        "grad(grad)": lambda g: grad(lambda y: grad(g)(y).sum()),
    }
    t = ts[transform]
    for fn in (f, f2):
        rf = remat(fn, policy=NAME_POLICIES[pol])
        for i in range(2):
            x = _rand(2, 3, seed=i)
            assert_tree_close(t(rf)(x), t(fn)(x), **TOL)
