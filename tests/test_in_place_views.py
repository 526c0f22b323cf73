"""In-place view ops (``t_``, ``transpose_``, ``unsqueeze_``, ``detach_``) on values a policy keeps or names, and
batch norm statistics passed as arguments: plain autograd's gradients and state on every route, first call and later
ones (float64, against plain ``f`` under the same transform).

Each case was a wrong gradient without an error, a crash or a false error before its fix (the twenty-fifth session's
review): a kept value was held at the geometry it had when the forward pass ended, not the one its op made, so the
replay's ``t_`` undid the forward's; ``checkpoint_name`` returned an alias inside ``remat`` and the tensor itself
outside, so an in-place view op on the returned name changed the original only in plain code; the full engine
(``torch.func``, ``debug=True``) updated running statistics passed as arguments twice.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, hessian, jacfwd, jacrev, vjp, vmap

from remat import RematError, checkpoint_name, policies, remat, remat_module

from .helpers import assert_tree_close, seeded_randn

D = torch.float64


def keep_sin(op: Any, *a: Any, **k: Any) -> bool:
    return "sin" in str(op)


def kept_then_transposed(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    t = x.sin()
    t.t_()
    return torch.tanh(t @ W)


def transposed_then_named(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    t = x.sin()
    t.t_()
    return torch.tanh(checkpoint_name(t, "n") @ W)


def unsqueezed(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    t = x.sin()
    t.unsqueeze_(0)
    return torch.tanh(t[0] @ W)


def name_transposed(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    t = x.sin()
    n = checkpoint_name(t, "n")
    n.t_()  # (n is t: t is transposed too, as in plain code)
    return torch.tanh(n @ W) + t


def transposed_twice(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
    t = x * W
    t.t_()
    t = t.sin()
    t.transpose_(0, 1)
    h = checkpoint_name(t, "n")
    return torch.tanh(h @ W) + h


CASES = {
    "kept, then t_": (kept_then_transposed, keep_sin),
    "t_, then named": (transposed_then_named, policies.save_only_these_names("n")),
    "kept, then unsqueeze_": (unsqueezed, keep_sin),
    "the name reshaped": (name_transposed, policies.save_only_these_names("n")),
    "the name reshaped, save-nothing": (name_transposed, policies.nothing_saveable),
    "two in-place views, named": (transposed_twice, policies.save_only_these_names("n")),
    "t_, then named, offloaded": (transposed_then_named, policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["n"], offload_src=None)),
}

C = seeded_randn(4, 4, seed=3)


def _routes(f: Callable[..., torch.Tensor]) -> dict[str, Callable[[], Any]]:
    x0, W0 = seeded_randn(4, 4, seed=1), seeded_randn(4, 4, seed=2)

    def loss(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        return (f(x, W) * C).sum()

    def autograd() -> Any:
        x, W = x0.clone().requires_grad_(), W0.clone().requires_grad_()
        return torch.autograd.grad(loss(x, W), (x, W))

    def double() -> Any:
        x, W = x0.clone().requires_grad_(), W0.clone().requires_grad_()
        gx, gW = torch.autograd.grad(loss(x, W), (x, W), create_graph=True)
        return torch.autograd.grad((gx * C).sum() + (gW * gW).sum(), (x, W))

    return {
        "autograd": autograd,
        "double backward": double,
        "grad": lambda: grad(loss, argnums=(0, 1))(x0, W0),
        "vjp": lambda: vjp(f, x0, W0)[1](C),
        "jacrev": lambda: jacrev(f, argnums=(0, 1))(x0, W0),
        "jacfwd": lambda: jacfwd(f, argnums=(0, 1))(x0, W0),
        "hessian": lambda: hessian(loss)(x0, W0),
        "vmap(grad)": lambda: vmap(grad(loss), in_dims=(0, None))(torch.stack([x0, 2 * x0]), W0),
    }


@pytest.mark.parametrize("debug", [False, True], ids=["replay", "debug"])
@pytest.mark.parametrize("route", list(_routes(kept_then_transposed)))
@pytest.mark.parametrize("case", list(CASES))
def test_an_in_place_view_op_on_a_kept_or_named_value_equals_plain(case: str, route: str, debug: bool) -> None:
    f, policy = CASES[case]
    expected = _routes(f)[route]()
    g = remat(f, policy=policy, debug=debug)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (an offload from the CPU to the CPU frees nothing, and says so)
        for _ in range(3):
            assert_tree_close(_routes(g)[route](), expected)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.W = torch.nn.Parameter(seeded_randn(4, 4, seed=2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return transposed_then_named(x, self.W)


@pytest.mark.parametrize("how", ["remat_module", "bound method"])
def test_an_in_place_view_op_on_a_named_value_equals_plain_through_a_module(how: str) -> None:
    plain = _Block()
    x = seeded_randn(4, 4, seed=1)
    expected = torch.autograd.grad((plain(x) * C).sum(), plain.W)
    block = _Block()
    policy = policies.save_only_these_names("n")
    fn = remat_module(block, policy=policy) if how == "remat_module" else remat(block.forward, policy=policy)
    for _ in range(3):
        assert_tree_close(torch.autograd.grad((fn(x) * C).sum(), block.W), expected)


def test_checkpoint_name_returns_the_tensor_itself_inside_remat() -> None:
    seen = []

    def f(x: torch.Tensor) -> torch.Tensor:
        t = x.sin()
        seen.append(checkpoint_name(t, "n") is t)
        return t.sum()

    f(seeded_randn(3))
    remat(f, policy=policies.save_only_these_names("n"))(seeded_randn(3))
    grad(remat(f))(seeded_randn(3))
    assert seen == [True, True, True]


def test_detach_in_place_of_a_named_value_under_jacfwd_equals_plain() -> None:
    """``detach_`` of the name raised "Can't detach views in-place" (the name was an alias)."""
    def f(x: torch.Tensor) -> torch.Tensor:
        t = checkpoint_name(x.sin(), "n")
        u = t * x
        t.detach_()
        return u * t

    x = seeded_randn(3, 4)
    assert_tree_close(jacfwd(remat(f, policy="save-nothing"))(x), jacfwd(f)(x))


# ---- batch norm statistics passed as arguments ------------------------------------------------------------------


def _bn_twice(w: torch.Tensor, rm: torch.Tensor, rv: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    h = F.batch_norm(x, rm, rv, w, None, training=True, momentum=0.1)
    h = F.batch_norm(h.sin(), rm, rv, w, None, training=True, momentum=0.1)
    return (h.sin() * rm.sum()).sum()


def _bn_run(route: str, f: Callable[..., torch.Tensor]) -> tuple[Any, torch.Tensor, torch.Tensor]:
    w, x = seeded_randn(3, seed=1), seeded_randn(4, 3, seed=2)
    rm, rv = torch.zeros(3, dtype=D), torch.ones(3, dtype=D)
    if route == "grad":
        g = grad(f)(w, rm, rv, x)
    elif route == "vjp":
        g = vjp(lambda w: f(w, rm, rv, x), w)[1](torch.tensor(1.0, dtype=D))[0]
    elif route == "jacrev":
        g = jacrev(f)(w, rm, rv, x)
    else:
        w = w.clone().requires_grad_()
        f(w, rm, rv, x).backward()
        g = w.grad
    return g, rm, rv


@pytest.mark.parametrize("debug", [False, True], ids=["default", "debug"])
@pytest.mark.parametrize("route", ["autograd", "grad", "vjp", "jacrev"])
def test_batch_norm_statistics_passed_as_arguments_are_updated_once(route: str, debug: bool) -> None:
    """The full engine (torch.func, debug=True) updated them twice: off by one momentum step, gradients equal."""
    expected = _bn_run(route, _bn_twice)
    g = remat(_bn_twice, debug=debug)
    for _ in range(3):
        assert_tree_close(_bn_run(route, g), expected)


def test_batch_norm_statistics_read_before_their_update_raise_on_the_full_engine() -> None:
    def f(w: torch.Tensor, rm: torch.Tensor, rv: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = x * rm.sum()
        return F.batch_norm(y, rm, rv, w, None, training=True, momentum=0.1).sin().sum()

    expected = _bn_run("autograd", f)
    assert_tree_close(_bn_run("autograd", remat(f)), expected)  # (the replay: exact)
    with pytest.raises(RematError, match="reads an input .* then writes it in place"):
        _bn_run("grad", remat(f))


@pytest.mark.parametrize("outer", ["save-nothing", "save-matmuls", "save-everything"])
@pytest.mark.parametrize("route", ["autograd", "double backward"])
def test_an_in_place_view_op_on_a_value_a_nested_call_keeps_equals_plain(route: str, outer: str) -> None:
    """The inner call's kept value goes to the outer call (NOTE [nested replay]) as the tensor itself, and comes
    back at the geometry its op made; ``x @ W`` of a 1-D ``x`` squeezes the product in place (torch's matmul)."""
    def inner(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        return kept_then_transposed(x, W) + (x[0] @ W).sin()

    def plain(x: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        return inner(inner(x, W).exp(), W)

    rin = remat(inner, policy=keep_sin)
    g = remat(lambda x, W: rin(rin(x, W).exp(), W), policy=outer)
    expected = _routes(plain)[route]()
    for _ in range(3):
        assert_tree_close(_routes(g)[route](), expected)


def _t_twice(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    z.t_()
    z.t_()
    return (x * z).sin()


def _unsqueeze(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    z.unsqueeze_(0)
    return (x * z[0]).sin() * z.sum()


def _read_then_t(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    a = (x + z).sin()  # (add saves nothing: z is read by the replay, before the t_)
    z.t_()
    return a * (x + z).cos()


@pytest.mark.parametrize("fn", [_t_twice, _unsqueeze, _read_then_t])
@pytest.mark.parametrize("policy", ["save-nothing", "save-matmuls", "offload"])
def test_an_in_place_view_op_on_an_input_that_needs_no_gradient_equals_plain(fn: Callable[..., Any],
                                                                             policy: str) -> None:
    """``z.t_()`` on an input moves its version but not its values: the replay refused the input as "modified in
    place after its forward pass and before its backward pass" when nothing was written then; a step before the
    ``t_`` now reads the input at the geometry it had then (square, a transposed read would be silently wrong).
    Plain autograd's gradient and the input's shape after the call, every call; a write between the passes still
    raises."""
    g = remat(fn, policy=policies.offload_to_cpu(min_bytes=0) if policy == "offload" else policy)
    for call in range(3):
        x = seeded_randn(6, 6, seed=call).requires_grad_()
        z0 = seeded_randn(6, 6, seed=call + 10)
        z1, z2 = z0.clone(), z0.clone()
        want = torch.autograd.grad(fn(x, z1).sum(), x)
        got = torch.autograd.grad(g(x, z2).sum(), x)
        assert_tree_close(got, want, rtol=1e-10, atol=1e-10)
        assert z1.shape == z2.shape and torch.equal(z1, z2)
    outs = fn(x, z1), g(x, z2)
    with torch.no_grad():
        z1.add_(1)
        z2.add_(1)
    try:
        want = torch.autograd.grad(outs[0].sum(), x)
    except RuntimeError:  # (plain autograd saved z, or a view of it: it refuses)
        want = None
    if want is None:
        with pytest.raises(RematError, match="modified in place after"):
            torch.autograd.grad(outs[1].sum(), x)
        return
    try:
        got = torch.autograd.grad(outs[1].sum(), x)
    except RematError as e:  # (a replay that reads z, which plain autograd does not need, refuses it: never differs)
        assert "modified in place after its forward pass" in str(e)
    else:
        assert_tree_close(got, want, rtol=1e-10, atol=1e-10)


_GLOBAL = {"G": torch.zeros(6, 6, dtype=torch.float64)}


@pytest.mark.parametrize("op", ["t_", "as_strided_"])
@pytest.mark.parametrize("policy", ["save-nothing", "save-matmuls", "budget"])
def test_an_in_place_view_op_on_a_small_global_read_before_and_after_equals_plain(op: str, policy: str) -> None:
    """A small global that needs no gradient is copied for the replay when the forward pass ends, at the geometry it
    had then: a step that read it before ``G.t_()`` (or ``as_strided_``) in the call read the transpose in the replay
    (off by ~1.8 on every call; a memory budget's later calls too). It is copied at the geometry the call first read
    it at. Plain autograd's gradient on every call (a memory budget's first call, which re-runs the function, may
    refuse instead: never a different value)."""

    def f(x: torch.Tensor) -> torch.Tensor:
        G = _GLOBAL["G"]
        a = (x + G).sin()
        if op == "t_":
            G.t_()
        else:
            G.as_strided_((6, 6), (1, 6))
        return (a * (x + G).cos()).sum()

    g = remat(f, policy=policies.memory_budget(0.5) if policy == "budget" else policy)
    for call in range(3):
        x = seeded_randn(6, 6, seed=call).requires_grad_()
        z0 = seeded_randn(6, 6, seed=call + 10)
        _GLOBAL["G"] = z0.clone()
        want = torch.autograd.grad(f(x), x)
        _GLOBAL["G"] = z0.clone()
        try:
            got = torch.autograd.grad(g(x), x)
        except RematError:
            assert policy == "budget" and call == 0
            continue
        assert_tree_close(got, want, rtol=1e-10, atol=1e-10)
