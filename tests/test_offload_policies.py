"""Offload policies: what each decides and offloads, that the device memory is freed and nothing is
recomputed that the policy offloads, on every reference model under autograd, ``grad`` and ``vmap``; tensors that
are kept rather than offloaded; the examples of docs/offloading.md.
"""

from __future__ import annotations

import gc
import pathlib
import re
import weakref
from collections import Counter
from typing import Any

import pytest
import torch
from torch.func import grad, vmap

from remat import checkpoint_name, policies, remat
from remat.bench.models import make_model
from remat.offload import OffloadEngine, use_engine
from remat.policies import Offloadable, Recompute, Saveable

from .helpers import MATMUL_OPS, Counted, OpCounter, OpLog, assert_tree_close, leaves, requires_grad_tree

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = pathlib.Path(__file__).resolve().parent.parent
aten = torch.ops.aten
NO_BATCH_DOTS = {aten.mm.default, aten.addmm.default}
# what a backward pass runs besides plain autograd's ops without recomputing anything: autograd's own unpacking
# (detach) and the offload engine's copies back from the host (a host buffer, the copy, set_ onto it)
NOT_A_RECOMPUTE = {aten.detach.default, aten._to_copy.default, aten.copy_.default, aten.empty.memory_format,
                   aten.set_.source_Storage_storage_offset}


def recomputed_ops(log: OpLog, plain: OpLog) -> Counter[Any]:
    """The ops a backward pass ran beyond plain autograd's backward of the same model, copies left out: what a
    recompute ran."""
    extra = Counter(log.ops) - Counter(plain.ops)
    return Counter({op: n for op, n in extra.items() if op not in NOT_A_RECOMPUTE})


def mixed_policy(op: Any, *args: Any, **kwargs: Any) -> Any:
    """Offload products and convolutions, save the softmax, recompute the rest (one policy, three decisions)."""
    if op in NO_BATCH_DOTS or op is aten.convolution.default:
        return Offloadable("cpu", "cpu")
    if op is aten._softmax.default:
        return Saveable
    return Recompute


OFFLOAD_POLICIES = {
    "offload_to_cpu": policies.offload_to_cpu(min_bytes=0),
    "offload_dot_with_no_batch_dims": policies.offload_dot_with_no_batch_dims("cpu", "cpu"),
    "mixed": mixed_policy,
    # the models tag "attn" and "ff" (transformer), "act" (CNN)
    "names": policies.save_and_offload_only_these_names(names_which_can_be_saved=["attn"],
                                                        names_which_can_be_offloaded=["ff", "act"],
                                                        offload_src="cpu", offload_dst="cpu"),
}


# ---- policies: decisions and argument errors -----------------------------------------------------------------------


def test_policy_decisions() -> None:
    p = policies.offload_to_cpu()
    assert p.min_bytes == policies.DEFAULT_MIN_OFFLOAD_BYTES == 1 << 20
    assert p(aten.sin.default) == Offloadable(None, "cpu", 1 << 20)
    assert remat(lambda x: x, policy="offload-to-cpu").policy == policies.offload_to_cpu()  # type: ignore[attr-defined]
    d = policies.offload_dot_with_no_batch_dims("cuda", "cpu")
    assert d(aten.addmm.default) == Offloadable("cuda", "cpu")
    assert d(aten.bmm.default) is Recompute and d(aten.sin.default) is Recompute
    n = policies.save_and_offload_only_these_names(names_which_can_be_saved=["s"], names_which_can_be_offloaded=["o"],
                                                   offload_src="cpu", offload_dst="cpu")
    assert n(checkpoint_name, name="s") is Saveable
    assert n(checkpoint_name, name="o") == Offloadable("cpu", "cpu")
    assert n(checkpoint_name, name="other") is Recompute and n(aten.mm.default) is Recompute


def test_policy_argument_errors() -> None:
    with pytest.raises(ValueError, match="min_bytes must be a non-negative int"):
        policies.offload_to_cpu(min_bytes=-1)
    with pytest.raises(ValueError, match="both saved and offloaded"):
        policies.save_and_offload_only_these_names(names_which_can_be_saved=["a"], names_which_can_be_offloaded=["a"])
    with pytest.raises(TypeError, match="names must be strings"):
        policies.save_and_offload_only_these_names(names_which_can_be_offloaded=[3])
    with pytest.raises(ValueError, match="is not a device"):
        Offloadable("cuda", "nowhere")
    with pytest.raises(ValueError, match="max_inflight_bytes"):
        OffloadEngine(max_inflight_bytes=0)


# ---- what is offloaded, and that it is freed -----------------------------------------------------------------------


def _probe(refs: list[weakref.ref[Any]]) -> Any:
    def f(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = x @ W  # mm saves x and W: an input and a parameter, never offloaded
        a = torch.tanh(h)  # tanh saves its output a
        refs.append(weakref.ref(a.untyped_storage()))  # the memory, not the Python tensor (detach makes new ones)
        return (a * a).sum()  # mul saves a twice more: the three share one host copy

    return f


@pytest.mark.parametrize("policy", ["offload", "save-everything", "plain"])
def test_offload_frees_the_saved_tensor_and_recomputes_nothing(policy: str) -> None:
    W = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64, requires_grad=True)
    refs: list[weakref.ref[Any]] = []
    f = Counted(_probe(refs))
    g = f if policy == "plain" else remat(f, policy=policies.offload_to_cpu(min_bytes=0) if policy == "offload"
                                          else "save-everything")
    eng = OffloadEngine()
    with use_engine(eng):
        loss = g(W, x)
        gc.collect()
        alive = refs[0]() is not None
        with OpLog() as log:
            grads = torch.autograd.grad(loss, (W, x))
    loss0 = _probe([])(W, x)
    with OpLog() as log0:
        ref_grads = torch.autograd.grad(loss0, (W, x))
    assert_tree_close(grads, ref_grads)
    assert f.calls == 1  # the Python ran once
    assert not recomputed_ops(log, log0)  # nothing recomputed: the backward pass ran plain autograd's ops
    if policy == "offload":
        assert not alive, "the offloaded tensor is still alive after the forward pass"
        assert (eng.stats["offloaded"], eng.stats["shared"], eng.stats["copies"]) == (3, 2, 1)
        assert eng.stats["offloaded_bytes"] == 32 * 64 * 4  # only a: not x, not W
        assert eng.stats["fetched"] == 3
    else:
        assert alive  # the control: the same probe sees a saved tensor held
        assert eng.stats["offloaded"] == 0


def test_string_policy_offloads_only_tensors_of_at_least_1_mib() -> None:
    refs: list[weakref.ref[torch.Tensor]] = []

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        big, small = x.exp(), y.exp()  # exp saves its output: 1 MiB and 4 KiB
        refs.extend([weakref.ref(big.untyped_storage()), weakref.ref(small.untyped_storage())])
        return big.sum() + small.sum()

    x = torch.randn(512, 512, requires_grad=True)
    y = torch.randn(1024, requires_grad=True)
    eng = OffloadEngine()
    with use_engine(eng):
        loss = remat(f, policy="offload-to-cpu")(x, y)
        gc.collect()
        assert [r() is None for r in refs] == [True, False]
        gx, gy = torch.autograd.grad(loss, (x, y))
    assert eng.stats["offloaded_bytes"] == 512 * 512 * 4
    assert torch.equal(gx, x.exp()) and torch.equal(gy, y.exp())


def test_names_policy_saves_offloads_and_recomputes_in_one_function() -> None:
    refs: list[weakref.ref[Any]] = []

    def f(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint_name(x @ W, "saved")
        a = torch.tanh(h)  # neither named: recomputed from h
        o = checkpoint_name(a @ W, "offloaded")
        refs.append(weakref.ref(o.untyped_storage()))
        return torch.sin(o).sum()  # sin saves o: offloaded

    W = torch.randn(48, 48, dtype=torch.float64, requires_grad=True)
    x = torch.randn(16, 48, dtype=torch.float64, requires_grad=True)
    pol = policies.save_and_offload_only_these_names(names_which_can_be_saved=["saved"],
                                                     names_which_can_be_offloaded=["offloaded"],
                                                     offload_src="cpu", offload_dst="cpu")
    fc = Counted(f)
    eng = OffloadEngine()
    with use_engine(eng):
        loss = remat(fc, policy=pol)(W, x)
        gc.collect()
        assert refs[0]() is None
        with OpLog() as log, OpCounter() as oc:
            grads = torch.autograd.grad(loss, (W, x))
    loss0 = f(W, x)
    with OpLog() as log0, OpCounter() as oc0:
        ref_grads = torch.autograd.grad(loss0, (W, x))
    assert_tree_close(grads, ref_grads)
    assert fc.calls == 1  # the Python ran once: the backward pass replays the recorded ops
    assert recomputed_ops(log, log0)[aten.tanh.default] == 1  # the rest was recomputed (a, from the saved h)...
    assert oc.count == oc0.count  # ...but no matmul: h was saved, o came back from the host
    assert eng.stats["offloaded_bytes"] == 16 * 48 * 8 and eng.stats["fetched"] >= 1


# ---- every offload policy on the reference models: exact, no product run again -------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("model", ["mlp", "transformer", "cnn"])
@pytest.mark.parametrize("pname", list(OFFLOAD_POLICIES))
def test_each_offload_policy_on_each_model_is_exact_and_runs_no_product_again(pname: str, model: str, dtype: torch.dtype) -> None:
    if pname == "names" and model == "mlp":
        pytest.skip("the MLP block tags no names")
    params, x, block, apply = make_model(model, "small", dtype, "cpu")
    params = requires_grad_tree(params)
    blk = Counted(block)
    # what must not run again in the backward pass: every product (offload_to_cpu), those without batch
    # dims (offload_dot_with_no_batch_dims recomputes attention's bmm and convolutions), products and convs (mixed)
    ops = {"offload_to_cpu": MATMUL_OPS, "offload_dot_with_no_batch_dims": NO_BATCH_DOTS,
           "mixed": NO_BATCH_DOTS | {aten.convolution.default},
           "names": set()}[pname]  # recomputes the untagged products
    eng = OffloadEngine()
    with use_engine(eng):
        loss = apply(params, x, lambda f: remat(blk, policy=OFFLOAD_POLICIES[pname]))
        fwd_calls = blk.calls
        with OpLog() as log, OpCounter(ops) as oc:
            grads = torch.autograd.grad(loss, leaves(params))
    loss0 = apply(params, x)
    with OpLog() as log0, OpCounter(ops) as oc0:
        ref = torch.autograd.grad(loss0, leaves(params))
    assert_tree_close(grads, ref)
    assert fwd_calls > 0 and blk.calls == fwd_calls  # the Python ran once per block: a recompute replays ops
    # the MLP block (addmm, gelu) saves only the product and its inputs: nothing left to recompute
    recomputes = not (pname == "offload_to_cpu" or (model == "mlp" and pname != "names"))
    assert bool(recomputed_ops(log, log0)) == recomputes, recomputed_ops(log, log0)
    assert oc.count == oc0.count  # no product recomputed (offloaded, or saved)
    if pname == "offload_dot_with_no_batch_dims" and model == "cnn":
        assert eng.stats["offloaded"] == 0  # JAX's meaning: convolutions are not dots
    else:
        assert eng.stats["offloaded"] > 0 and eng.stats["fetched"] > 0


@pytest.mark.parametrize("model", ["mlp", "transformer", "cnn"])
@pytest.mark.parametrize("pname", ["offload_to_cpu", "offload_dot_with_no_batch_dims"])
def test_offload_policies_on_models_are_exact_under_grad_and_vmap(pname: str, model: str) -> None:
    params, x, _, apply = make_model(model, "small", torch.float64, "cpu")
    pol = OFFLOAD_POLICIES[pname]
    eng = OffloadEngine()
    with use_engine(eng), OpCounter() as oc:
        g = grad(lambda p: apply(p, x, lambda f: remat(f, policy=pol)))(params)
    with OpCounter() as oc0:
        g0 = grad(lambda p: apply(p, x))(params)
    assert_tree_close(g, g0)
    if pname == "offload_to_cpu":
        assert oc.count == oc0.count  # replayed from the host, not recomputed
        assert eng.stats["offloaded"] > 0 and eng.stats["fetched"] > 0
    xs = torch.stack([x, 2 * x])
    eng = OffloadEngine()
    with use_engine(eng):
        v = vmap(grad(lambda p, xx: apply(p, xx, lambda f: remat(f, policy=pol))), in_dims=(None, 0))(params, xs)
    v0 = vmap(grad(lambda p, xx: apply(p, xx)), in_dims=(None, 0))(params, xs)
    assert_tree_close(v, v0)
    if model != "cnn" or pname == "offload_to_cpu":
        assert eng.stats["offloaded"] > 0


# ---- kept, not offloaded: autocast's casts of parameters, conjugate and negative views -----------------------------


def test_autocast_casts_of_parameters_are_recomputed_not_offloaded() -> None:
    """Autocast's bf16 copy of a weight (``_to_copy`` of a parameter) would move a parameter-sized copy every
    step: it is recast in the recompute instead (issue 13, item 6)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 256)
    x = torch.randn(4, 256)
    f = remat(lambda x: lin(x).relu().square().sum(), policy=policies.offload_to_cpu(min_bytes=0))
    eng = OffloadEngine()
    with use_engine(eng), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = f(x)
    loss.backward()
    weight_cast = 256 * 256 * 2
    assert 0 < eng.stats["offloaded_bytes"] < weight_cast, eng.stats
    got = lin.weight.grad.clone()  # type: ignore[union-attr]
    lin.weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = lin(x).relu().square().sum()
    loss.backward()
    assert torch.equal(got, lin.weight.grad)  # type: ignore[arg-type]


@pytest.mark.parametrize("view", ["conj", "neg"])
def test_conjugate_and_negative_views_are_not_offloaded_raw(view: str) -> None:
    """Rebuilt from raw storage, a conj/neg view lost its bit (gradient error 5.4): such tensors are kept."""
    def f(h: torch.Tensor) -> torch.Tensor:
        s = (h * 2).sin()
        c = s.conj() if view == "conj" else torch._neg_view(s)
        out = c.exp() * c
        return (out.real if out.is_complex() else out).sum()

    dtype = torch.complex128 if view == "conj" else torch.float64
    h = torch.randn(6, dtype=dtype, generator=torch.Generator().manual_seed(0))
    a, b = h.clone().requires_grad_(), h.clone().requires_grad_()
    f(a).backward()
    remat(f, policy=policies.offload_to_cpu(min_bytes=0))(b).backward()
    assert torch.allclose(a.grad, b.grad, rtol=1e-12, atol=1e-12)


# ---- the examples of docs/offloading.md run ------------------------------------------------------------------------


def test_offloading_page_examples_run() -> None:
    text = (ROOT / "docs" / "offloading.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    for code in blocks:
        exec(compile(code, "docs/offloading.md", "exec"), {})


@pytest.mark.parametrize("named", [False, True])
def test_offload_dot_with_no_batch_dims_offloads_a_named_product_too(named) -> None:
    """A policies review (thirty-sixth session): the policy answered ``Recompute`` for every ``checkpoint_name``,
    which drops a named value even where its op is kept (NOTE [names decide for the value]): ``tanh(checkpoint_name(x
    @ W, "h"))`` recomputed the product in the backward pass instead of offloading it. JAX's policy offloads a dot
    whatever its name: a name is no reason to drop it. Matmuls counted from outside in the backward pass (1: the
    weight's gradient alone), copies by the engine; gradients against plain autograd."""
    W = torch.randn(64, 64, dtype=torch.float64, requires_grad=True)
    x = torch.randn(32, 64, dtype=torch.float64)

    def block(W, x):
        h = x @ W
        return torch.tanh(checkpoint_name(h, "h") if named else h).sum()

    f = remat(block, policy=policies.offload_dot_with_no_batch_dims("cpu", "cpu"))
    (want,) = torch.autograd.grad(block(W, x), W)
    eng = OffloadEngine()
    with use_engine(eng), pytest.warns(UserWarning, match="cpu to cpu"):
        out = f(W, x)
        counter = OpCounter()
        with counter:
            (got,) = torch.autograd.grad(out, W)
    assert counter.count == 1, counter.seen
    assert eng.stats["offloaded"] == 1
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
