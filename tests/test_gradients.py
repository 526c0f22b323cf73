"""Gradients of ``remat(f, policy=p)`` equal those of plain ``f``, for every policy, on the reference models.

Each case runs the same model twice from the same parameters, plainly and with
every block wrapped in ``remat``, and compares the loss and all gradients:
bitwise in float32 (CPU), ``allclose(rtol=1e-12, atol=1e-12)`` in float64. Each
case also counts the ops the backward pass runs from outside remat, which proves the
recompute ran (more ops than plain autograd's backward pass) or, for policies that keep
everything the backward pass reads, that it did not; and the Python calls of the block,
once each: the recompute replays the trace.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from remat import checkpoint_name, policies, remat
from remat.bench.models import make_cnn, make_mlp, make_transformer
from remat.policies import Recompute, Saveable

from .helpers import Counted, OpCounter, OpLog, assert_tree_close, leaves, requires_grad_tree

aten = torch.ops.aten

# tiny configurations: every op of the real models, a few milliseconds per case
TINY = {
    "mlp": lambda dtype: make_mlp(layers=3, batch=6, width=8, dtype=dtype),
    "transformer": lambda dtype: make_transformer(blocks=2, batch=2, seq=5, d=8, heads=2, ff=16, dtype=dtype),
    "cnn": lambda dtype: make_cnn(blocks=2, batch=2, channels=4, hw=6, dtype=dtype),
}
HEADS = 2


def named_transformer_block(p, x, heads=HEADS):
    """The pre-LN transformer block of remat.bench.models, with checkpoint_name tags for the name policies."""
    B, S, D = x.shape
    dh = D // heads
    h = F.layer_norm(x, (D,), p["ln1_w"], p["ln1_b"])
    qkv = checkpoint_name(F.linear(h, p["wqkv"], p["bqkv"]), "qkv")
    q, k, v = qkv.split(D, dim=-1)
    q = q.reshape(B, S, heads, dh).transpose(1, 2)
    k = k.reshape(B, S, heads, dh).transpose(1, 2)
    v = v.reshape(B, S, heads, dh).transpose(1, 2)
    scores = checkpoint_name(torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(dh), "scores")
    attn = checkpoint_name(torch.softmax(scores, dim=-1), "attn")
    o = torch.matmul(attn, v).transpose(1, 2).reshape(B, S, D)
    x = x + checkpoint_name(F.linear(o, p["wo"], p["bo"]), "attn_out")
    h = F.layer_norm(x, (D,), p["ln2_w"], p["ln2_b"])
    h = checkpoint_name(F.gelu(checkpoint_name(F.linear(h, p["w1"], p["b1"]), "ff_in")), "ff")
    return x + F.linear(h, p["w2"], p["b2"])


def make_named_transformer(dtype):
    params, x, _, _ = TINY["transformer"](dtype)

    def apply(params, x, wrap=lambda f: f):
        blk = wrap(named_transformer_block)
        h = x
        for p in params:
            h = blk(p, h)
        return (h * h).mean()

    return params, x, named_transformer_block, apply


MODELS = {**TINY, "transformer_named": make_named_transformer}


def save_norms_and_softmax(op, *args, **kwargs):
    """A custom policy answering with decisions: keep normalisation and softmax outputs only."""
    if op in (aten.native_layer_norm.default, aten._softmax.default, aten.native_group_norm.default):
        return Saveable
    return Recompute


def save_matmul_ops_by_name(op, *args, **kwargs):
    """A custom policy answering with bools."""
    return "mm" in str(op)


POLICIES = {
    "default": None,
    "nothing_saveable": policies.nothing_saveable,
    "everything_saveable": policies.everything_saveable,
    "dots_saveable": policies.dots_saveable,
    "checkpoint_dots": policies.checkpoint_dots,
    "dots_no_batch": policies.dots_with_no_batch_dims_saveable,
    "save_only_names": policies.save_only_these_names("qkv", "ff"),
    "save_except_names": policies.save_anything_except_these_names("scores", "attn", "ff"),
    "save_names_but": policies.save_any_names_but_these("scores"),
    "save_from_both": policies.save_from_both_policies(policies.dots_with_no_batch_dims_saveable,
                                                       policies.save_only_these_names("attn")),
    "custom_decisions": save_norms_and_softmax,
    "custom_bools": save_matmul_ops_by_name,
    "str_save_nothing": "save-nothing",
    "str_save_everything": "save-everything",
    "str_save_matmuls": "save-matmuls",
}

# (model, policy) pairs where the policy keeps everything the backward pass reads, so no
# recompute may run; every other pair drops something, so each block runs once more in
# the backward pass. Worked out by hand from remat.bench.models, whose transformer tags
# the softmax output "attn" and the gelu output "ff" and whose CNN tags the relu output
# "act" (the MLP has no tag):
# - save-everything keeps everything;
# - the MLP block is gelu(addmm(b, h, W)): addmm saves its inputs, gelu the addmm output,
#   so every policy that saves the addmm output (the dots policies, "mm" in the op name)
#   saves all the backward reads; save_anything_except_these_names saves everything
#   untagged, so it recomputes nothing in the MLP and the CNN (whose tag is not in its list).
MLP_SAVES_ALL = ("dots_saveable", "checkpoint_dots", "str_save_matmuls", "dots_no_batch", "save_from_both",
                 "custom_bools", "save_except_names")
NO_RECOMPUTE = {
    *((m, p) for m in MODELS for p in ("everything_saveable", "str_save_everything")),
    *(("mlp", p) for p in MLP_SAVES_ALL),
    ("cnn", "save_except_names"),
}


def run(model, policy, dtype, api, double=False):
    """Loss and gradients of the model, plain (policy "plain") or with every block remat'd; block calls, and the ops
    the backward passes ran (seen from outside remat)."""
    params, x, block, apply = MODELS[model](dtype)
    params = requires_grad_tree(params)
    x = x.detach().clone().requires_grad_()
    counted = Counted(block)
    wrap = (lambda f: counted) if policy == "plain" else (lambda f: remat(counted, policy=POLICIES[policy]))
    loss = apply(params, x, wrap)
    inputs = [*leaves(params), x]
    log = OpLog()
    with log:
        if api == "grad":
            grads = torch.autograd.grad(loss, inputs, create_graph=double)
        else:
            loss.backward(create_graph=double)
            grads = [t.grad for t in inputs]
            for t in inputs:
                t.grad = None  # (create_graph) break the parameter <-> gradient cycle
        if double:  # a scalar of the gradients, differentiated again
            second = sum((g * g).sum() for g in grads)
            grads = [*grads, *torch.autograd.grad(second, inputs)]
    # (autograd detaches what a saved-tensor hook hands back: not a recompute)
    ops = sum(op is not torch.ops.aten.detach.default for op in log.ops)
    return loss.detach(), [g.detach() for g in grads], counted.calls, len(params), ops


@functools.cache
def reference(model, dtype, api, double=False):
    """The plain model's loss and gradients (computed once per configuration)."""
    return run(model, "plain", dtype, api, double)


def check(model, policy, dtype, api, double=False):
    loss0, grads0, calls0, blocks, ops0 = reference(model, dtype, api, double)
    loss, grads, calls, _, ops = run(model, policy, dtype, api, double)
    assert calls0 == blocks
    # the recompute replays the trace: each block's Python runs once, in the forward pass
    assert calls == blocks
    # proves remat happened (or, where the policy keeps all the backward reads, that nothing was recomputed): the
    # backward passes ran more ops than plain autograd's, or exactly as many
    if (model, policy) in NO_RECOMPUTE:
        assert ops == ops0
    else:
        assert ops > ops0
    assert_tree_close(loss, loss0)
    assert_tree_close(grads, grads0)


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
# the named transformer (more tags: "qkv", "scores", "attn_out", "ff_in") runs the name policies only
NAME_POLICIES = ["save_only_names", "save_except_names", "save_names_but", "save_from_both"]
GRAD_CASES = [(m, p) for m in ("mlp", "transformer", "cnn") for p in POLICIES] + [
    ("transformer_named", p) for p in NAME_POLICIES]
BACKWARD_CASES = [(m, p) for m in ("mlp", "transformer", "cnn") for p in ("default", "dots_saveable",
                                                                           "custom_decisions")] + [
    ("transformer_named", "save_only_names")]
DOUBLE_CASES = [(m, p) for m in ("mlp", "transformer", "cnn") for p in ("default", "dots_saveable")] + [
    ("mlp", "custom_decisions"), ("cnn", "everything_saveable"), ("transformer_named", "save_only_names")]


@DTYPES
@pytest.mark.parametrize("model,policy", GRAD_CASES)
def test_gradients_match_plain(model, policy, dtype):
    """torch.autograd.grad of remat'd blocks equals plain; the recompute ran (or, by design, did not)."""
    check(model, policy, dtype, "grad")


@DTYPES
@pytest.mark.parametrize("model,policy", BACKWARD_CASES)
def test_backward_accumulates_the_same_grads(model, policy, dtype):
    check(model, policy, dtype, "backward")


@DTYPES
@pytest.mark.parametrize("model,policy", DOUBLE_CASES)
@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")  # run() resets .grad
def test_double_backward_matches_plain(model, policy, dtype):
    """create_graph=True, then the gradient of a function of the gradients."""
    check(model, policy, dtype, "backward" if policy == "dots_saveable" else "grad", double=True)


@pytest.mark.parametrize("model", ["mlp", "transformer", "cnn"])
def test_dots_saveable_recomputes_no_matmul_in_the_models(model):
    """Matmul/convolution ATen ops run during the backward pass, counted by a mode outside remat."""
    counts = {}
    for policy in ("plain", "dots_saveable", "dots_no_batch", "default"):
        params, x, block, apply = MODELS[model](torch.float32)
        params = requires_grad_tree(params)
        pol = POLICIES.get(policy)
        wrap = (lambda f: f) if policy == "plain" else (lambda f: remat(f, policy=pol))  # noqa: B023
        loss = apply(params, x, wrap)
        with OpCounter() as oc:
            torch.autograd.grad(loss, leaves(params))
        counts[policy] = oc.count
    assert counts["dots_saveable"] == counts["plain"]
    assert counts["default"] > counts["plain"]  # save-nothing does recompute the products
    if model == "transformer":  # attention's batched products are recomputed, the linear layers' are not
        assert counts["plain"] < counts["dots_no_batch"] < counts["default"]


# ---- torch.func smoke tests (the full transform matrix lives in the transform tests) ----


def _mlp_loss(W, b, x):
    return (F.gelu(torch.addmm(b, x, W)) ** 2).sum()


@pytest.mark.parametrize("policy", ["save-nothing", "save-matmuls"])
def test_torch_func_grad_is_exact_and_recomputes_once(policy):
    W, b, x = torch.randn(5, 5, dtype=torch.float64), torch.randn(5, dtype=torch.float64), torch.randn(
        3, 5, dtype=torch.float64)
    counted = Counted(_mlp_loss)
    gelu = {torch.ops.aten.gelu.default}
    with OpCounter(gelu) as ours:
        got = torch.func.grad(remat(counted, policy=policy), argnums=(0, 1))(W, b, x)
    with OpCounter(gelu) as plain:
        want = torch.func.grad(_mlp_loss, argnums=(0, 1))(W, b, x)
    assert_tree_close(got, want)
    # gelu(...) ** 2 saves the gelu output, dropped by both policies: the Python runs once, the recompute replays
    # the gelu (NOTE [program replay])
    assert (counted.calls, ours.count - plain.count) == (1, 1)


def test_vmap_is_exact_and_recomputes_once():
    W = torch.randn(5, 5, dtype=torch.float64, requires_grad=True)
    xs = torch.randn(4, 3, 5, dtype=torch.float64)
    counted = Counted(lambda W, x: torch.tanh(x @ W).sin().sum())
    tanh = {torch.ops.aten.tanh.default}
    with OpCounter(tanh) as ours:
        out = torch.func.vmap(remat(counted), in_dims=(None, 0))(W, xs)
        (g,) = torch.autograd.grad(out.sum(), W)
    with OpCounter(tanh) as plain:
        out0 = torch.func.vmap(counted.fn, in_dims=(None, 0))(W, xs)
        (g0,) = torch.autograd.grad(out0.sum(), W)
    assert_tree_close((out, g), (out0, g0))
    assert (counted.calls, ours.count - plain.count) == (1, 1)  # the Python once, one replay of the tanh
