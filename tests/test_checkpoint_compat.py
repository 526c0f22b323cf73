"""torch's call forms on remat (NOTE [torch's policies] in remat/_api/checkpoint.py): ``remat.checkpoint(fn, *args,
use_reentrant=False, context_fn=...)``, ``remat.checkpoint_sequential``, and torch's selective-checkpointing policies
translated. Every gradient is compared with plain autograd's (float64, 1e-10); what a policy keeps is checked from
outside (matmuls run in the backward pass, bytes held between the passes). The section "ported from torch" restates
the cases of torch's own tests for these call forms (test_utils.py's TestCheckpoint, test_autograd.py's selective
checkpointing) and runs them against remat.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import remat
from remat import RematError
from remat.offload import OffloadEngine, use_engine

from .helpers import OpCounter, census

f64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}
MM = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x)))) * scale


def _block(seed: int = 0) -> Block:
    torch.manual_seed(seed)
    return Block().to(f64)


def _grads(run: Any, block: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    y = run(block, x)
    return list(torch.autograd.grad(y.sin().sum(), [x, *block.parameters()]))


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, **TOL)


X = torch.randn(4, 16, dtype=f64, generator=torch.Generator().manual_seed(1))


def test_torch_s_call_form_gives_plain_autograds_gradient() -> None:
    block = _block()
    want = _grads(lambda b, x: b(x), block, X)
    _close(_grads(lambda b, x: remat.checkpoint(b, x, use_reentrant=False), block, X), want)
    _close(_grads(lambda b, x: remat.checkpoint(b, x), block, X), want)  # (use_reentrant left out)
    # keywords other than remat's and torch's go to the function, as in torch
    want2 = _grads(lambda b, x: b(x, scale=0.5), block, X)
    _close(_grads(lambda b, x: remat.checkpoint(b, x, use_reentrant=False, scale=0.5), block, X), want2)
    _close(_grads(lambda b, x: remat.checkpoint(b.forward, x, 0.5, use_reentrant=False), block, X), want2)


def test_the_call_form_drops_what_torch_checkpoint_drops() -> None:
    """Bytes the forward pass allocated that are alive between the passes, counted from outside: plain autograd
    holds the block's activations; remat.checkpoint, like torch's, none of them."""
    block = _block()
    x = torch.randn(256, 16, dtype=f64, requires_grad=True)
    with census() as c:
        y = block(x)
    plain = c.live
    del y
    with census() as c:
        y = remat.checkpoint(block, x, use_reentrant=False)
    assert plain > 256 * 64 * 8 and c.live <= 256 * 16 * 8, (plain, c.live)  # (at most the output)
    y.sum().backward()


def test_the_decorator_form_is_unchanged() -> None:
    f = remat.checkpoint(lambda x: torch.sin(x).exp().sum())
    assert isinstance(f, remat._api.transform.Rematted)
    g = remat.checkpoint(policy="save-matmuls")(lambda x: torch.sin(x).sum())
    assert isinstance(g, remat._api.transform.Rematted)
    x = torch.randn(5, dtype=f64, requires_grad=True)
    f(x).backward()
    torch.testing.assert_close(x.grad, x.cos() * x.sin().exp(), **TOL)


def test_the_wrapper_is_made_once_per_module_and_lets_it_go() -> None:
    """A training loop calls checkpoint on every step, Hugging Face's layers with ``partial(super().__call__,
    **kwargs)`` made anew: remat's wrapper is made once per module and settings, and holds no reference to the
    module (a module let go is freed)."""
    import gc
    import weakref

    from remat._context import CACHES

    _CACHE = CACHES.get().wrappers

    block = _block()
    for _ in range(2):
        remat.checkpoint(block, X, use_reentrant=False)
        remat.checkpoint(functools.partial(nn.Module.__call__.__get__(block), scale=0.5), X, use_reentrant=False)
    assert len(_CACHE[block]) == 1
    cf = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.addmm.default])
    remat.checkpoint(block, X, use_reentrant=False, context_fn=cf)
    remat.checkpoint(block, X, use_reentrant=False, context_fn=cf)
    assert len(_CACHE[block]) == 2
    ref = weakref.ref(block)
    del block
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("how", ["list", "policy_fn"])
def test_a_selective_checkpointing_context_fn_is_translated(how: str) -> None:
    """torch's SAC saving the matmuls: remat keeps them, so the backward pass runs no product of the forward pass
    again (counted from outside), and the gradient is plain autograd's."""
    block = _block()

    def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        assert ctx.is_recompute is False
        return CheckpointPolicy.MUST_SAVE if op in MM else CheckpointPolicy.PREFER_RECOMPUTE

    cf = functools.partial(create_selective_checkpoint_contexts, sorted(MM, key=str) if how == "list" else policy_fn)
    x = X.detach().requires_grad_()
    want = _grads(lambda b, x: b(x), block, x)
    y = block(x)
    with OpCounter(MM) as plain_mm:
        y.sin().sum().backward()
    got = _grads(lambda b, x: remat.checkpoint(b, x, use_reentrant=False, context_fn=cf), block, x)
    _close(got, want)
    y = remat.checkpoint(block, x, use_reentrant=False, context_fn=cf)
    with OpCounter(MM) as sac_mm:
        y.sin().sum().backward()
    y = remat.checkpoint(block, x, use_reentrant=False)
    with OpCounter(MM) as none_mm:
        y.sin().sum().backward()
    assert sac_mm.count == plain_mm.count < none_mm.count  # kept: no product replayed; plain checkpoint: replayed


@pytest.mark.parametrize("route", ["plain", "torch.func", "subclass"])
def test_a_policy_reading_ctx_op_output_sees_what_the_op_returned(route: str) -> None:
    """torch hands a selective-checkpointing policy the op's output (``ctx.op_output``); so does remat, on each engine
    (the replay engine's short and general paths, the full engine under torch.func and for a subclass): a policy that
    keeps what is at least 64 elements wide keeps the up projection's product and its gelu, and recomputes the rest;
    plain autograd's gradient."""
    from torch.testing._internal.two_tensor import TwoTensor

    block = _block()
    seen: list[tuple[Any, tuple[int, ...]]] = []

    def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        out = ctx.op_output
        t = out[0] if isinstance(out, (tuple, list)) else out
        assert isinstance(t, torch.Tensor), (op, out)
        seen.append((op, tuple(t.shape)))
        return CheckpointPolicy.MUST_SAVE if t.shape[-1] >= 64 else CheckpointPolicy.PREFER_RECOMPUTE

    cf = functools.partial(create_selective_checkpoint_contexts, policy_fn)
    x0 = X.detach()
    if route == "subclass":
        x0 = TwoTensor(x0, x0.clone())
    x = x0.clone().requires_grad_()

    def loss(use: bool) -> Any:
        def f(x: torch.Tensor) -> torch.Tensor:
            y = remat.checkpoint(block, x, use_reentrant=False, context_fn=cf) if use else block(x)
            return y.sin().sum()
        return f

    if route == "torch.func":
        got, want = torch.func.grad(loss(True))(X), torch.func.grad(loss(False))(X)
    else:
        (got,) = torch.autograd.grad(loss(True)(x), x)
        (want,) = torch.autograd.grad(loss(False)(x), x)
    for g, w in zip(*(([t.a, t.b] if isinstance(t, TwoTensor) else [t]) for t in (got, want))):
        torch.testing.assert_close(g, w, **TOL)
    assert (torch.ops.aten.addmm.default, (4, 64)) in seen  # the up projection's product, as it came out
    assert (torch.ops.aten.addmm.default, (4, 16)) in seen
    if route == "plain":  # what the policy keeps is kept: fewer products replayed than saving nothing
        out = loss(True)(x)
        with OpCounter(MM) as kept:
            torch.autograd.grad(out, x)
        out = remat.checkpoint(block, x, use_reentrant=False).sin().sum()
        with OpCounter(MM) as none:
            torch.autograd.grad(out, x)
        assert kept.count < none.count


def test_a_cpu_offload_answer_offloads() -> None:
    if not hasattr(CheckpointPolicy, "MUST_CPU_OFFLOAD"):
        pytest.skip("this torch has no offload answer")
    block = _block()

    def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_CPU_OFFLOAD if op in MM else CheckpointPolicy.PREFER_RECOMPUTE

    eng = OffloadEngine()
    with use_engine(eng):
        got = _grads(lambda b, x: remat.checkpoint(b, x, use_reentrant=False, context_fn=functools.partial(
            create_selective_checkpoint_contexts, policy_fn)), block, X)
    _close(got, _grads(lambda b, x: b(x), block, X))
    assert eng.stats["offloaded"] > 0


@pytest.mark.parametrize("transform", ["grad", "vmap(grad)", "jacrev"])
def test_the_call_form_under_torch_func(transform: str) -> None:
    """Where torch's checkpoint raises (saved-tensor hooks under torch.func), remat's gives plain's gradient."""
    block = _block()
    cf = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.addmm.default])

    def loss(use: bool) -> Any:
        def f(x: torch.Tensor) -> torch.Tensor:
            y = remat.checkpoint(block, x, use_reentrant=False, context_fn=cf) if use else block(x)
            return y.sin().sum()
        return f

    def run(f: Any) -> Any:
        if transform == "grad":
            return torch.func.grad(f)(X)
        if transform == "jacrev":
            return torch.func.jacrev(f)(X)
        return torch.func.vmap(torch.func.grad(lambda x: f(x[None])))(X)

    torch.testing.assert_close(run(loss(True)), run(loss(False)), **TOL)


def test_checkpoint_sequential_is_torchs() -> None:
    """Segments as torch cuts them, the last one run plainly: the same outputs and gradients as torch's
    checkpoint_sequential and as plain autograd; the last segment's matmul is not replayed."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(5)]).to(f64)
    x = torch.randn(3, 8, dtype=f64)
    for segments in (1, 2, 3, 5):
        want = _grads(lambda m, x: m(x), model, x)
        got = _grads(lambda m, x, s=segments: remat.checkpoint_sequential(m, s, x, use_reentrant=False), model, x)
        _close(got, want)
        x1 = x.detach().requires_grad_()
        y = remat.checkpoint_sequential(model, segments, x1, use_reentrant=False)
        with OpCounter(MM) as mm:
            y.sin().sum().backward()
        x2 = x.detach().requires_grad_()
        y2 = torch.utils.checkpoint.checkpoint_sequential(model, segments, x2, use_reentrant=False)
        with OpCounter(MM) as torch_mm:
            y2.sin().sum().backward()
        assert mm.count == torch_mm.count, (segments, mm.count, torch_mm.count)  # the same segments recomputed
    # a list of functions, and remat's policy for the segments
    fns = [torch.sin, torch.tanh, torch.cos, torch.exp]
    xs = torch.randn(3, dtype=f64, requires_grad=True)
    out = remat.checkpoint_sequential(fns, 2, xs, use_reentrant=False, policy="save-everything")
    torch.testing.assert_close(out, torch.exp(torch.cos(torch.tanh(torch.sin(xs)))), **TOL)


# ---- misuse: the moment and the message -------------------------------------------------------------------


def test_use_reentrant_true_says_why_it_is_not_needed() -> None:
    with pytest.raises(RematError, match="use_reentrant=True is torch's older variant.*use_reentrant=False"):
        remat.checkpoint(_block(), X, use_reentrant=True)
    with pytest.raises(RematError, match="use_reentrant=True"):
        remat.checkpoint_sequential(nn.Sequential(nn.Linear(16, 16)).to(f64), 1, X, use_reentrant=True)


def test_a_context_fn_remat_cannot_translate_raises_with_what_to_pass() -> None:
    import contextlib

    def my_contexts() -> Any:
        return contextlib.nullcontext(), contextlib.nullcontext()

    with pytest.raises(RematError, match="create_selective_checkpoint_contexts.*policy="):
        remat.checkpoint(_block(), X, use_reentrant=False, context_fn=my_contexts)


def test_bad_policies_raise_at_the_call() -> None:
    with pytest.raises(ValueError, match=r"op packet.*aten\.mm\.default"):
        remat.checkpoint(_block(), X, use_reentrant=False, context_fn=functools.partial(
            create_selective_checkpoint_contexts, [torch.ops.aten.mm]))
    with pytest.raises(TypeError, match="a function policy_fn.*or a list of ops"):
        remat.checkpoint(_block(), X, use_reentrant=False, context_fn=functools.partial(
            create_selective_checkpoint_contexts, 3))
    cf = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    with pytest.raises(ValueError, match="either as torch's context_fn or as remat's policy"):
        remat.checkpoint(_block(), X, use_reentrant=False, context_fn=cf, policy="save-nothing")
    with pytest.raises(ValueError, match="determinism_check"):
        remat.checkpoint(_block(), X, determinism_check="everything")
    with pytest.raises(TypeError, match="the first argument must be the function"):
        remat.checkpoint(X, X, use_reentrant=False)

    def wrong(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> str:
        return "save"

    with pytest.raises(RematError, match="returned 'save'.*CheckpointPolicy") as info:
        remat.checkpoint(_block(), X.requires_grad_(), use_reentrant=False, context_fn=functools.partial(
            create_selective_checkpoint_contexts, wrong))
    # every answer remat takes, the offload ones where torch has them; the error is its own, not chained to itself
    for member in CheckpointPolicy:
        assert member.name in str(info.value)
    assert info.value.__cause__ is None


def test_a_context_fn_made_anew_each_step_finds_its_wrapper_again() -> None:
    """torch's docs write ``context_fn=functools.partial(create_selective_checkpoint_contexts, policy_fn)`` inline in
    the training step: a new partial every step around the same function (or list of ops) is one policy, and remat's
    wrapper for the module is found again, not added to every step (an unbounded cache before); a remat policy made
    anew every step (``save_only_these_names("h")`` inside the loop) keeps at most a few."""
    from remat._context import CACHES

    cache = CACHES.get().wrappers
    block = _block()

    def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in MM else CheckpointPolicy.PREFER_RECOMPUTE

    class Owner:
        def policy_fn(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            return policy_fn(ctx, op, *args, **kwargs)

    owner = Owner()
    want = _grads(lambda b, x: b(x), block, X)
    for make in (lambda: policy_fn, lambda: [torch.ops.aten.addmm.default], lambda: owner.policy_fn):
        for _ in range(5):  # (a bound method is made anew at each access, as a list is)
            got = _grads(lambda b, x, how=make(): remat.checkpoint(b, x, use_reentrant=False, context_fn=functools.partial(
                create_selective_checkpoint_contexts, how)), block, X)
            _close(got, want)
    assert len(cache[block]) == 3
    for _ in range(30):
        with remat.route_torch_checkpoint(policy=remat.policies.save_only_these_names("h")):
            got = _grads(lambda b, x: torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False), block, X)
        _close(got, want)
    assert len(cache[block]) <= 8


def test_a_module_first_imported_inside_the_routing_gets_torchs_checkpoint_back(tmp_path: Any,
                                                                               monkeypatch: Any) -> None:
    """A module imported for the first time inside ``route_torch_checkpoint`` that binds ``checkpoint`` by name (as
    ``transformers.modeling_utils`` does) got the routed function; after the block it kept it, so a model enabled
    later, outside any block, checkpointed on remat with the old block's policy. On exit it gets torch's back."""
    import importlib
    import sys

    import torch.utils.checkpoint as tc

    (tmp_path / "late_ckpt_user.py").write_text("from torch.utils.checkpoint import checkpoint, checkpoint_sequential\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "late_ckpt_user", raising=False)
    torch_fns = (tc.checkpoint, tc.checkpoint_sequential)
    with remat.route_torch_checkpoint():
        late = importlib.import_module("late_ckpt_user")
        assert (late.checkpoint, late.checkpoint_sequential) == (tc.checkpoint, tc.checkpoint_sequential)
        assert late.checkpoint is not torch_fns[0]
    assert (late.checkpoint, late.checkpoint_sequential) == torch_fns
    assert (tc.checkpoint, tc.checkpoint_sequential) == torch_fns


# ---- ported from torch (restated, run against remat) ---------------------------------------------------------


@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_ported_checkpoint_sequential_relu_mlp(chunks: int) -> None:
    """torch's TestCheckpoint.test_checkpoint: a Sequential of Linear and ReLU layers, checkpointed in chunks: the
    outputs and every gradient equal the model's without checkpointing."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 20), nn.ReLU(), nn.Linear(20, 5),
                          nn.ReLU()).to(f64)
    x = torch.randn(1, 100, dtype=f64, requires_grad=True)
    out = model(x)
    out.sum().backward()
    want = [x.grad.clone(), *(p.grad.clone() for p in model.parameters())]
    model.zero_grad()
    x.grad = None
    out2 = remat.checkpoint_sequential(model, chunks, x, use_reentrant=False)
    torch.testing.assert_close(out2, out, **TOL)
    out2.sum().backward()
    _close([x.grad, *(p.grad for p in model.parameters())], want)


def test_ported_checkpoint_module_list() -> None:
    """torch's test_checkpoint_module_list: a list of modules instead of a Sequential."""
    torch.manual_seed(0)
    mods = [nn.Linear(10, 10).to(f64), nn.ReLU(), nn.Linear(10, 10).to(f64), nn.ReLU()]
    x = torch.randn(2, 10, dtype=f64, requires_grad=True)
    h = x
    for m in mods:
        h = m(h)
    (gx,) = torch.autograd.grad(h.sum(), x)
    y = remat.checkpoint_sequential(mods, 2, x, use_reentrant=False)
    torch.testing.assert_close(torch.autograd.grad(y.sum(), x)[0], gx, **TOL)


def test_ported_non_tensor_arguments_and_outputs() -> None:
    """torch's test_checkpoint_non_tensor and test_checkpoint_non_tensor_inputs_outputs: None and numbers among the
    arguments, numbers among the outputs."""
    x = torch.randn(3, dtype=f64, requires_grad=True)
    w = torch.randn(3, dtype=f64, requires_grad=True)

    def run(a: torch.Tensor, none: Any, b: torch.Tensor, k: int) -> tuple[torch.Tensor, int, torch.Tensor]:
        assert none is None
        return a.sin() * b, k + 1, (a * k).cos()

    y, k, z = remat.checkpoint(run, x, None, w, 3, use_reentrant=False)
    assert k == 4
    g = torch.autograd.grad((y + z).sum(), (x, w))
    y0, _, z0 = run(x, None, w, 3)
    _close(list(g), list(torch.autograd.grad((y0 + z0).sum(), (x, w))))


def test_ported_no_tensor_requires_grad() -> None:
    """torch's test_checkpoint_no_tensors and test_checkpoint_partial_grad: inputs that need no gradient give an
    output that needs none; one input of two that needs it gets its gradient."""
    a, b = torch.randn(3, dtype=f64), torch.randn(3, dtype=f64)
    out = remat.checkpoint(lambda a, b: a.sin() + b, a, b, use_reentrant=False)
    assert not out.requires_grad
    b.requires_grad_()
    out = remat.checkpoint(lambda a, b: (a.sin() * b).exp(), a, b, use_reentrant=False)
    (gb,) = torch.autograd.grad(out.sum(), b)
    torch.testing.assert_close(gb, a.sin() * (a.sin() * b).exp(), **TOL)


def test_ported_sac_policy_with_state() -> None:
    """torch's selective checkpointing test_policy_with_state: a policy that saves every other matmul, by a counter it
    keeps; asked in the forward pass only, so the decisions are the forward pass's, and the gradient is plain's."""
    torch.manual_seed(0)
    counter = [0]

    def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op is torch.ops.aten.mm.default:
            counter[0] += 1
            return CheckpointPolicy.MUST_SAVE if counter[0] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.PREFER_RECOMPUTE

    W = torch.randn(6, 6, dtype=f64, requires_grad=True)

    def fn(x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            x = torch.sin(x @ W)
        return x

    x = torch.randn(3, 6, dtype=f64)
    cf = functools.partial(create_selective_checkpoint_contexts, policy_fn)
    y = remat.checkpoint(fn, x, use_reentrant=False, context_fn=cf)
    asked = counter[0]
    with OpCounter({torch.ops.aten.mm.default}) as mm:
        (g,) = torch.autograd.grad(y.sum(), W)
    assert asked == 4 and counter[0] == 4  # in the forward pass only
    torch.testing.assert_close(g, torch.autograd.grad(fn(x).sum(), W)[0], **TOL)
    # the backward pass's own 7 matmuls (W's gradient per layer, and the gradient of each layer's input but the first,
    # which needs none), and the 2 products the policy let go, replayed
    assert mm.count == 7 + 2


@pytest.mark.parametrize("kw", [{}, {"preserve_rng_state": False}, {"debug": True}], ids=["plain", "rng", "debug"])
def test_a_function_of_no_arguments_is_called_as_torch_calls_it(kw: dict[str, Any]) -> None:
    """torch's ``checkpoint(closure)`` runs the closure. Routed, remat added its policy and returned its decorator
    (a ``Rematted``: "'Rematted' object has no attribute 'sum'" on the caller's next line); ``remat.checkpoint``
    with a torch keyword alone (``preserve_rng_state``, ``debug``) did too. Only remat's own keywords (``policy``,
    ``static_argnums``) or nothing make the decorator."""
    W = torch.randn(4, 4, dtype=f64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    x = torch.randn(3, 4, dtype=f64, generator=torch.Generator().manual_seed(1))

    def closure() -> torch.Tensor:
        return torch.tanh(x @ W).sin()

    (want,) = torch.autograd.grad(closure().sum(), W)
    with remat.route_torch_checkpoint(policy="save-nothing"):
        outs = [torch.utils.checkpoint.checkpoint(closure, use_reentrant=False, **kw),
                torch.utils.checkpoint.checkpoint(closure, **kw)]  # (torch refuses debug without use_reentrant)
    outs.append(remat.checkpoint(closure, **kw) if kw else remat.checkpoint(closure)())
    for out in outs:
        assert isinstance(out, torch.Tensor)
        torch.testing.assert_close(torch.autograd.grad(out.sum(), W)[0], want, **TOL)
    assert isinstance(remat.checkpoint(closure, policy="save-nothing", **kw), remat._api.transform.Rematted)


def test_checkpoint_sequential_with_more_segments_than_functions_says_so() -> None:
    with pytest.raises(ValueError, match="segments=5 is more than the 3 functions"):
        remat.checkpoint_sequential(nn.Sequential(nn.Tanh(), nn.Tanh(), nn.Tanh()), 5, X.requires_grad_())


def test_a_context_fn_that_makes_torchs_contexts_itself_is_translated() -> None:
    """torchtitan's pattern: ``context_fn`` is a function that returns ``create_selective_checkpoint_contexts(policy)``
    with a policy of per-call state (every other matmul saved). Called once per call, as torch calls it; the policy
    decides (the matmuls it kept are not replayed, counted from outside) and the gradient is plain autograd's, on the
    first call and later ones."""
    W = torch.randn(6, 6, dtype=f64, requires_grad=True)
    made = [0]

    def context_fn() -> Any:
        made[0] += 1
        count = [0]

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            assert ctx.is_recompute is False
            if op is torch.ops.aten.mm.default:
                count[0] += 1
                return CheckpointPolicy.MUST_SAVE if count[0] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    def fn(x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            x = torch.sin(x @ W)
        return x

    x = torch.randn(3, 6, dtype=f64)
    want = torch.autograd.grad(fn(x).sum(), W)[0]
    for call in range(3):
        y = remat.checkpoint(fn, x, use_reentrant=False, context_fn=context_fn)
        assert made[0] == call + 1
        with OpCounter({torch.ops.aten.mm.default}) as mm:
            (g,) = torch.autograd.grad(y.sum(), W)
        torch.testing.assert_close(g, want, **TOL)
        assert mm.count == 7 + 2  # the backward pass's own 7, and the 2 products the policy let go, replayed
    y = remat.checkpoint(fn, x, use_reentrant=False)
    with OpCounter({torch.ops.aten.mm.default}) as mm:
        torch.autograd.grad(y.sum(), W)
    assert mm.count == 7 + 4  # (save-nothing: the 4 products the sines read, replayed)


def test_a_list_of_ops_context_fn_under_torch_compile() -> None:
    """A list of ops in torch's ``context_fn`` under ``torch.compile`` (Dynamo rebuilds the translated policy after a
    graph break: it failed on a frozenset of ops): the gradient is plain autograd's."""
    block = _block()
    cf = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.addmm.default])
    torch._dynamo.reset()
    try:
        f = torch.compile(lambda x: remat.checkpoint(block, x, use_reentrant=False, context_fn=cf), backend="eager")
        _close(_grads(lambda b, x: f(x), block, X), _grads(lambda b, x: b(x), block, X))
    finally:
        torch._dynamo.reset()


class _Layer(nn.Module):
    """A layer that calls the checkpoint function it stores, as Hugging Face's layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.block = _block()
        self.ckpt: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ckpt(self.block, x)


def test_a_model_routed_inside_the_block_is_copied_and_saved_there() -> None:
    """What Hugging Face's ``gradient_checkpointing_enable()`` stores inside the block (a partial of the routed
    checkpoint) is copied and pickled inside the block too (an EMA model copied after enabling; ``torch.save``): the
    copies keep checkpointing with remat, with plain autograd's gradient."""
    import copy
    import io

    import torch.utils.checkpoint as tc

    m = _Layer()
    want = _grads(lambda b, x: b.block(x), m, X)
    with remat.route_torch_checkpoint(policy="save-matmuls"):
        m.ckpt = functools.partial(tc.checkpoint, use_reentrant=False)
        copied = copy.deepcopy(m)
        buf = io.BytesIO()
        torch.save(m, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert tc.checkpoint is not m.ckpt.func  # (torch's again outside the block; the layers keep remat's)
    for model in (m, copied, loaded):
        assert "remat" in repr(model.ckpt.func)
        _close(_grads(lambda b, x: b(x), model, X), want)
        # remat's save-matmuls runs, counted from outside: its backward pass computes no product of the forward pass
        # again, where torch's checkpoint (which a copy holding torch's function would run) computes both again
        y = model(X.detach().requires_grad_())
        with OpCounter({torch.ops.aten.addmm.default}) as again:
            y.sum().backward()
        assert again.count == 0
    with OpCounter({torch.ops.aten.addmm.default}) as torchs:
        tc.checkpoint(m.block, X.detach().requires_grad_(), use_reentrant=False).sum().backward()
    assert torchs.count >= 2  # (the check above can fail: torch's checkpoint computes the products again)


def test_routing_blocks_closed_out_of_order_put_torchs_checkpoint_back() -> None:
    """Two routing blocks closed in the order they were entered (``a``, ``b``, then ``a`` closed, ``b`` closed): ``b``'s
    functions stay in place until it closes, and then torch's come back, not ``a``'s."""
    import torch.utils.checkpoint as tc
    import transformers.modeling_utils as mu

    before = (tc.checkpoint, tc.checkpoint_sequential, mu.checkpoint)
    a, b = remat.route_torch_checkpoint(policy="save-matmuls"), remat.route_torch_checkpoint(policy="save-nothing")
    a.__enter__()
    b.__enter__()
    routed_b = tc.checkpoint
    a.__exit__(None, None, None)
    assert tc.checkpoint is routed_b and mu.checkpoint is routed_b
    b.__exit__(None, None, None)
    assert (tc.checkpoint, tc.checkpoint_sequential, mu.checkpoint) == before
    with remat.route_torch_checkpoint():  # (and blocks opened after work as before)
        assert tc.checkpoint is not before[0]
    assert (tc.checkpoint, tc.checkpoint_sequential, mu.checkpoint) == before


def test_the_routed_function_looks_like_torchs() -> None:
    """Code that names or inspects what it wraps (``__name__``, ``inspect.signature``) sees torch's function's, inside
    the block; a ``context_fn`` that takes arguments is not torch's kind, and says so."""
    import inspect

    import torch.utils.checkpoint as tc

    want = inspect.signature(tc.checkpoint)
    with remat.route_torch_checkpoint():
        assert tc.checkpoint.__name__ == "checkpoint" and tc.checkpoint_sequential.__name__ == "checkpoint_sequential"
        assert inspect.signature(tc.checkpoint) == want

    def needs_an_argument(extra: Any) -> Any:
        return create_selective_checkpoint_contexts([torch.ops.aten.mm.default])

    with pytest.raises(RematError, match="does not make torch's selective-checkpointing contexts"):
        remat.checkpoint(_block(), X, use_reentrant=False, context_fn=needs_an_argument)
