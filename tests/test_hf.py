"""``remat_modules`` on Hugging Face transformers models: GPT-2, Llama, Mistral, BERT and T5.

Every correctness test compares a model whose blocks are remat'd in place
(``remat.remat_modules(copy.deepcopy(model), where=<block class>, policy=p)``)
against the untransformed model under the same transform: plain autograd,
``torch.func.grad`` over a parameter dict with ``functional_call`` (the dict's
parameters differ from the module's own, so a recompute that read the module's
parameters would give wrong gradients), and per-example ``vmap(grad)``. Float64
to 1e-10; float32 bitwise where the recompute runs the same kernels. Each test
proves that the recompute ran. Under ``torch.func`` (the engine that re-runs the
block's Python) by counting the calls of a submodule of every block (a forward
hook, which runs again when the block's forward is recomputed). Under plain
autograd (the replay engine, which runs the Python once and replays the recorded
ops in the backward pass) by the same hook counting one call per block, and the
ATen ops of the backward pass seen from outside (``OpLog``, ``OpCounter``): more
than plain autograd's backward pass of the same model runs.

Tiny configs with random weights (nothing is downloaded), ``use_cache=False``,
dropout 0. Also: what ``use_cache=True`` does in training, HF's
``enable_input_require_grads`` under ``torch.func``, and the memory retained
between forward and backward, measured from outside the library
(``remat.bench.measure.live_bytes_after``; ``benchmarks/hf_memory.py`` for a larger model).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import remat
from remat import RematError, policies
from remat.bench.measure import live_bytes_after

from .helpers import OpCounter, OpLog, assert_tree_close, tree_allclose

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ = 64, 2, 8
POLICIES = {"save-nothing": policies.nothing_saveable, "save-matmuls": policies.dots_saveable}
F64 = {"rtol": 1e-10, "atol": 1e-10}


@dataclasses.dataclass(frozen=True)
class Spec:
    """A model family: how to build a tiny one, its block class and the submodule of a block that is counted."""

    model_cls: str  # a class in ``transformers``
    config_cls: str
    block: str  # "module:Class" under transformers.models
    probe: str  # a submodule of every block whose forward runs once per block forward
    config: dict[str, Any]
    # matmuls per block whose output no backward formula reads (NOTE [dead ops]): a pre-LN block's last
    # projection feeds only the residual add; BERT's (post-LN) feeds a LayerNorm, which reads it
    dead_matmuls: int = 1

    def block_cls(self) -> type[nn.Module]:
        mod, cls = self.block.split(":")
        return getattr(importlib.import_module(f"transformers.models.{mod}"), cls)


_DECODER = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
            "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}

SPECS = {
    "gpt2": Spec("GPT2LMHeadModel", "GPT2Config", "gpt2.modeling_gpt2:GPT2Block", "mlp",
                 {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": VOCAB, "n_positions": 32,
                  "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}),
    "llama": Spec("LlamaForCausalLM", "LlamaConfig", "llama.modeling_llama:LlamaDecoderLayer", "mlp", _DECODER),
    # a sliding window shorter than the sequence: the mask, made outside the blocks, is an input of each
    "mistral": Spec("MistralForCausalLM", "MistralConfig", "mistral.modeling_mistral:MistralDecoderLayer", "mlp",
                    {**_DECODER, "sliding_window": 4}),
    "bert": Spec("BertForMaskedLM", "BertConfig", "bert.modeling_bert:BertLayer", "intermediate",
                 {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "intermediate_size": 64, "max_position_embeddings": 32, "hidden_dropout_prob": 0.0,
                  "attention_probs_dropout_prob": 0.0, "pad_token_id": 0}, dead_matmuls=0),
    # encoder and decoder stacks: T5Block is both (the decoder's has cross-attention); the first block of
    # each stack computes the relative position bias that it returns to the next ones
    "t5": Spec("T5ForConditionalGeneration", "T5Config", "t5.modeling_t5:T5Block", "layer.0",
               {"vocab_size": VOCAB, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4,
                "relative_attention_num_buckets": 8, "dropout_rate": 0.0, "decoder_start_token_id": 0,
                "pad_token_id": 0, "eos_token_id": 1}),
}


@functools.cache
def _build(name: str, attn: str, dtype: torch.dtype, use_cache: bool = False) -> nn.Module:
    spec = SPECS[name]
    cfg = getattr(transformers, spec.config_cls)(**spec.config, use_cache=use_cache, attn_implementation=attn)
    torch.manual_seed(0)
    model = getattr(transformers, spec.model_cls)(cfg).to(dtype)
    assert model.config._attn_implementation == attn
    return model


def make(name: str, attn: str = "eager", dtype: torch.dtype = torch.float64, use_cache: bool = False) -> nn.Module:
    """A fresh copy of a tiny model with random weights (built once per configuration)."""
    return copy.deepcopy(_build(name, attn, dtype, use_cache))


def rematted(model: nn.Module, name: str, policy: Any, debug: bool = False) -> tuple[nn.Module, list[str]]:
    r = copy.deepcopy(model)
    names = remat.remat_modules(r, where=SPECS[name].block_cls(), policy=policy, debug=debug)
    return r, names


def token_ids(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)


def loss_of(model: nn.Module, ids: torch.Tensor, **kw: Any) -> torch.Tensor:
    return model(input_ids=ids, labels=ids, **kw).loss


def shifted_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters that differ from the module's own: a recompute reading the module's would be wrong."""
    return {k: v.detach() + 0.01 for k, v in model.named_parameters()}


def logged_backward(loss: torch.Tensor, log: list[Any] | None = None) -> None:
    """``loss.backward()``; the ATen ops it runs, seen from outside remat, appended to ``log`` if given
    (``aten.detach`` left out: autograd's own unpacking of saved tensors, not a recompute)."""
    with OpLog() as mode:
        loss.backward()
    if log is not None:
        log.extend(op for op in mode.ops if op is not torch.ops.aten.detach.default)


def autograd_grads(model: nn.Module, ids: torch.Tensor, log: list[Any] | None = None) -> dict[str, torch.Tensor]:
    """Plain autograd's gradients; the backward pass's ops appended to ``log`` if given (``logged_backward``)."""
    model.zero_grad(set_to_none=True)
    logged_backward(loss_of(model, ids), log)
    return {k: p.grad for k, p in model.named_parameters()}


def func_grads(model: nn.Module, params: dict[str, torch.Tensor], ids: torch.Tensor) -> dict[str, torch.Tensor]:
    return grad(lambda p: loss_of_params(model, p, ids))(params)


def loss_of_params(model: nn.Module, p: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    return functional_call(model, p, (), {"input_ids": ids, "labels": ids}).loss


def per_example_grads(model: nn.Module, params: dict[str, torch.Tensor], ids: torch.Tensor) -> dict[str, torch.Tensor]:
    per_example = grad(lambda p, x: loss_of_params(model, p, x[None]))
    return vmap(per_example, in_dims=(None, 0))(params, ids)


class CallCount:
    """Counts the forward calls of one submodule of every remat'd block (a recompute runs them again); ``pre``: as
    they start (torch's recompute stops early, before the submodule's forward hook would fire)."""

    def __init__(self, model: nn.Module, name: str, block_names: list[str], pre: bool = False) -> None:
        self.calls = 0
        self.blocks = len(block_names)
        assert self.blocks > 0
        probe = SPECS[name].probe
        self.handles = [getattr(model.get_submodule(f"{b}.{probe}"),
                                "register_forward_pre_hook" if pre else "register_forward_hook")(self._hook)
                        for b in block_names]

    def _hook(self, *args: Any) -> None:
        self.calls += 1

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def counted_step(model: nn.Module, name: str, blocks: list[str], step: Callable[[], Any], runs: int = 1) -> Any:
    """Run a forward+backward ``step`` of a remat'd model; check each block's Python ran ``runs`` times: once, under
    plain autograd and under torch.func alike (the recompute replays: NOTE [program replay])."""
    count = CallCount(model, name, blocks)
    try:
        out = step()
    finally:
        count.remove()
    assert count.calls == runs * len(blocks), f"{count.calls} calls for {len(blocks)} blocks, expected {runs} each"
    return out


def replayed_step(model: nn.Module, name: str, blocks: list[str], step: Callable[[list[Any]], Any],
                  plain_ops: list[Any]) -> Any:
    """Run a forward+backward ``step(log)`` of a remat'd model under plain autograd, which appends its backward
    pass's ops to ``log``: each block's Python ran once, and the backward pass ran more ops than plain autograd's
    (``plain_ops``, the same step on the model without remat): the recorded ops replayed."""
    ops: list[Any] = []
    out = counted_step(model, name, blocks, lambda: step(ops), runs=1)
    assert_recomputed(ops, plain_ops)
    return out


def func_step(model: nn.Module, plain: nn.Module, name: str, blocks: list[str],
              step: Callable[[nn.Module], Any]) -> tuple[Any, Any]:
    """Run a torch.func ``step`` on the remat'd ``model`` and on ``plain``; check each block's Python ran once and
    the remat'd step ran every op the plain one did, and more (its recompute replayed the blocks' calls)."""
    with OpLog() as plain_log:
        want = step(plain)
    with OpLog() as log:
        got = counted_step(model, name, blocks, lambda: step(model))
    assert_recomputed(log.ops, plain_log.ops)
    return got, want


def assert_recomputed(ops: list[Any], plain_ops: list[Any]) -> None:
    """The backward pass that logged ``ops`` ran every op plain autograd's (``plain_ops``) did, and more."""
    extra, missing = Counter(ops) - Counter(plain_ops), Counter(plain_ops) - Counter(ops)
    assert not missing and extra.total() > 0, f"no recompute? extra {dict(extra)}, missing {dict(missing)}"


MODELS = list(SPECS)
CASES = [(m, "eager") for m in MODELS] + [("gpt2", "sdpa"), ("llama", "sdpa")]
CASE_IDS = [f"{m}-{a}" for m, a in CASES]


def test_block_names_and_state_dict_keys_unchanged() -> None:
    model = make("gpt2")
    r, names = rematted(model, "gpt2", policies.nothing_saveable)
    assert names == ["transformer.h.0", "transformer.h.1"]
    assert list(r.state_dict()) == list(model.state_dict())
    assert type(r.transformer.h[0]) is SPECS["gpt2"].block_cls()
    # "sdpa" is what a model gets when attn_implementation is not given: the tests below cover it explicitly
    cfg = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=VOCAB, n_positions=8)
    assert transformers.GPT2LMHeadModel(cfg).config._attn_implementation == "sdpa"


# ---- exact gradients: autograd, torch.func.grad, vmap(grad) ---------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name,attn", CASES, ids=CASE_IDS)
def test_autograd_gradients_equal_the_model_without_remat(name: str, attn: str, policy: str) -> None:
    model, ids = make(name, attn), token_ids()
    plain_ops: list[Any] = []
    want = autograd_grads(model, ids, plain_ops)
    r, blocks = rematted(model, name, POLICIES[policy])
    got = replayed_step(r, name, blocks, lambda ops: autograd_grads(r, ids, ops), plain_ops)
    assert_tree_close(got, want, **F64)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name,attn", CASES, ids=CASE_IDS)
def test_func_grad_with_parameters_other_than_the_modules(name: str, attn: str, policy: str) -> None:
    """functional_call swaps the parameters in for the forward pass only: the recompute must use them too."""
    model, ids = make(name, attn), token_ids()
    params = shifted_params(model)
    r, blocks = rematted(model, name, POLICIES[policy])
    got, want = func_step(r, model, name, blocks, lambda m: func_grads(m, params, ids))
    assert_tree_close(got, want, **F64)


@pytest.mark.parametrize("name", MODELS)
def test_shifted_parameters_change_the_gradient(name: str) -> None:
    """The test above can fail: a recompute with the module's own parameters would give other gradients."""
    model, ids = make(name), token_ids()
    own = {k: v.detach() for k, v in model.named_parameters()}
    assert not tree_allclose(func_grads(model, own, ids), func_grads(model, shifted_params(model), ids), **F64)


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # sdpa on CPU: vmap's fallback, a loop
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name,attn", CASES, ids=CASE_IDS)
def test_vmap_grad_per_example(name: str, attn: str, policy: str) -> None:
    model, ids = make(name, attn), token_ids()
    params = shifted_params(model)
    r, blocks = rematted(model, name, POLICIES[policy])
    got, want = func_step(r, model, name, blocks, lambda m: per_example_grads(m, params, ids))
    assert next(iter(want.values())).shape[0] == BATCH
    assert_tree_close(got, want, **F64)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name,attn", CASES, ids=CASE_IDS)
def test_float32_bitwise(name: str, attn: str, policy: str) -> None:
    """In float32 the recompute runs the same kernels on the same values: the same bits, not merely close."""
    model, ids = make(name, attn, torch.float32), token_ids()
    plain_ops: list[Any] = []
    want = autograd_grads(model, ids, plain_ops)
    r, blocks = rematted(model, name, POLICIES[policy])
    got = replayed_step(r, name, blocks, lambda ops: autograd_grads(r, ids, ops), plain_ops)
    assert_tree_close(got, want)  # torch.equal for float32 leaves


# ---- what the backward pass recomputes, counted from outside ----------------------------------------------------


def matmuls_in_blocks(model: nn.Module, name: str, ids: torch.Tensor) -> int:
    """Matmuls that the forward pass of the plain model runs inside its blocks."""
    counter = OpCounter()

    def enter(*args: Any) -> None:  # a hook's return value would replace the block's inputs or output
        counter.__enter__()

    def leave(*args: Any) -> None:
        counter.__exit__(None, None, None)

    handles = []
    for m in model.modules():
        if isinstance(m, SPECS[name].block_cls()):
            handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    try:
        with torch.no_grad():
            loss_of(model, ids)
    finally:
        for h in handles:
            h.remove()
    return counter.count


def backward_matmuls(model: nn.Module, ids: torch.Tensor) -> int:
    loss = loss_of(model, ids)
    with OpCounter() as counter:
        loss.backward()
    return counter.count


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", MODELS)
def test_backward_recomputes_the_block_matmuls_unless_saved(name: str, policy: str) -> None:
    """Save-nothing runs the blocks' matmuls again in the backward pass (but those whose output nothing
    reads); save-matmuls runs none of them again."""
    model, ids = make(name), token_ids()
    in_blocks = matmuls_in_blocks(model, name, ids)
    r, blocks = rematted(model, name, POLICIES[policy])
    assert in_blocks >= 6 * len(blocks)
    extra = backward_matmuls(r, ids) - backward_matmuls(model, ids)
    assert extra == (in_blocks - SPECS[name].dead_matmuls * len(blocks) if policy == "save-nothing" else 0)


# ---- use_cache=True in training ---------------------------------------------------------------------------------
#
# transformers 5.24 turns the KV cache off in training only under its own gradient checkpointing
# (GradientCheckpointingLayer sets use_cache=False, cache=None when model.gradient_checkpointing is on). With
# remat_modules it does not know: with config.use_cache=True a forward pass in training creates a DynamicCache and
# every block appends its keys and values to it. Under plain autograd the replay engine replays the ops the forward
# pass ran, so the longer cache is never read: plain autograd's gradients. An engine that re-runs the block's
# Python (debug=True; torch.func) appends again and sees a longer cache: it raises a RematError whose message says
# to pass use_cache=False. Never a wrong gradient.


@pytest.mark.parametrize("engine", ["replay", "debug"])
@pytest.mark.parametrize("cache", ["made-by-model", "empty"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_use_cache_true_in_training_is_exact_or_raises_with_the_fix(name: str, policy: str, cache: str,
                                                                    engine: str) -> None:
    model = make(name, use_cache=True)
    r, blocks = rematted(model, name, POLICIES[policy], debug=engine == "debug")

    def step(m: nn.Module, log: list[Any] | None = None) -> dict[str, torch.Tensor]:
        kw: dict[str, Any] = {}
        if cache != "made-by-model":
            kw["cache"] = transformers.DynamicCache(config=model.config)
        m.zero_grad(set_to_none=True)
        out = m(input_ids=token_ids(), labels=token_ids(), **kw)
        assert isinstance(out.cache, transformers.DynamicCache)  # HF did not turn the cache off
        logged_backward(out.loss, log)
        return {k: p.grad for k, p in m.named_parameters()}

    if engine == "replay":
        plain_ops: list[Any] = []
        want = step(model, plain_ops)
        assert_tree_close(replayed_step(r, name, blocks, lambda ops: step(r, ops), plain_ops), want, **F64)
    else:
        with pytest.raises(RematError, match=r"use_cache=False \(model\.config\.use_cache = False\)"):
            step(r)


def test_use_cache_true_under_a_memory_budget_is_exact_from_the_first_step() -> None:
    """BLOOM with its default ``use_cache=True`` in training, each block under a memory budget: the first call of a
    block measures it, on the full engine until the thirty-seventh session, whose re-run of the block's Python
    appended to the cache again: "diverged ... aten.lift_fresh ... but aten.cat now" on the first step (found by that
    session's review; save-nothing was exact). It measures on the replay engine now: every step exact, the plans
    learnt on the first."""
    cfg = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=16, n_layer=2, n_head=2, use_cache=True)
    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(cfg).double().train()
    block_cls = importlib.import_module("transformers.models.bloom.modeling_bloom").BloomBlock
    budget = policies.memory_budget(0.5)
    r = copy.deepcopy(model)
    assert remat.remat_modules(r, where=block_cls, policy=budget)

    def step(m: nn.Module) -> dict[str, torch.Tensor]:
        m.zero_grad(set_to_none=True)
        loss_of(m, token_ids()).backward()
        return {k: p.grad for k, p in m.named_parameters()}

    want = step(model)
    for _ in range(2):
        assert_tree_close(step(r), want, **F64)
    assert budget.solves >= 1 and all(p is not None for p in budget.plans.values())


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_prefilled_small_cache_is_read_as_in_the_forward(name: str, policy: str) -> None:
    """A cache prefilled under no_grad, which the forward pass then grows: the recompute reads what the forward
    read (the replay engine replays its ops; NOTE [outside tensors]), so the gradients are exact."""

    def grads(m: nn.Module, log: list[Any] | None = None) -> dict[str, torch.Tensor]:
        cache = transformers.DynamicCache(config=m.config)
        with torch.no_grad():
            m(input_ids=token_ids(2), cache=cache)
        m.zero_grad(set_to_none=True)
        logged_backward(loss_of(m, token_ids(), cache=cache), log)
        return {k: p.grad for k, p in m.named_parameters()}

    model = make(name, use_cache=True)
    r, blocks = rematted(model, name, POLICIES[policy])
    plain_ops: list[Any] = []
    want = grads(model, plain_ops)
    ops: list[Any] = []
    got = counted_step(r, name, blocks, lambda: grads(r, ops), runs=2)  # the prefill, the forward (Python once)
    assert_recomputed(ops, plain_ops)  # the recompute: the forward's ops replayed in the backward pass
    assert_tree_close(got, want, **F64)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_use_cache_true_save_everything_or_use_cache_false_is_exact(name: str) -> None:
    """Nothing to recompute (save-everything) or no cache (the fix): exact gradients despite config.use_cache."""
    model, ids = make(name, use_cache=True), token_ids()
    plain_ops: list[Any] = []
    want = autograd_grads(make(name), ids, plain_ops)
    r, _ = rematted(model, name, policies.everything_saveable)
    r.zero_grad(set_to_none=True)
    loss_of(r, ids, cache=transformers.DynamicCache(config=model.config)).backward()
    assert_tree_close({k: p.grad for k, p in r.named_parameters()}, want, **F64)
    r, blocks = rematted(model, name, policies.nothing_saveable)
    r.zero_grad(set_to_none=True)
    replayed_step(r, name, blocks, lambda ops: logged_backward(loss_of(r, ids, use_cache=False), ops), plain_ops)
    assert_tree_close({k: p.grad for k, p in r.named_parameters()}, want, **F64)


@pytest.mark.parametrize("policy", POLICIES)
def test_prefilled_sliding_window_cache_is_exact(policy: str) -> None:
    """The cache replaces its keys by a same-shaped slice during the call, so the recompute reads other keys of
    the same shape (a silent wrong gradient once): it reads copies of the small, gradient-free keys the forward
    read (NOTE [outside tensors]), and the gradients are exact. Larger ones are checked: test_modules.py."""
    spec = SPECS["mistral"]
    cfg = transformers.MistralConfig(**spec.config, use_cache=True, attn_implementation="eager")
    assert cfg.sliding_window == 4
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(cfg).double()
    ids = token_ids()

    def grads(m: nn.Module) -> dict[str, torch.Tensor]:
        cache = transformers.DynamicCache(config=cfg)
        with torch.no_grad():
            m(input_ids=token_ids(2), cache=cache)  # prefill: the cache holds the last 3 keys
        m.zero_grad(set_to_none=True)
        loss_of(m, ids, cache=cache).backward()
        return {k: p.grad for k, p in m.named_parameters()}

    want = grads(model)
    assert want  # the plain model trains with this cache
    r, _ = rematted(model, "mistral", POLICIES[policy])
    assert_tree_close(grads(r), want, **F64)


# ---- enable_input_require_grads -----------------------------------------------------------------------------------
#
# Recipe. HF's model.enable_input_require_grads() (for reentrant gradient checkpointing with frozen embeddings,
# e.g. PEFT adapters) registers a forward hook that calls requires_grad_(True) on the embedding output. remat does
# not need it: a remat'd block's parameters are inputs of the call, so frozen embeddings still give the blocks'
# parameters their gradients. Under torch.func the hook breaks grad/vmap (requires_grad_ inside a transform is
# unsupported, with or without remat): call model.disable_input_require_grads() first. Under plain autograd it is
# harmless.


def test_enable_input_require_grads_breaks_torch_func_disable_fixes_it() -> None:
    model, ids = make("gpt2"), token_ids()
    params = shifted_params(model)
    want = func_grads(model, params, ids)
    plain_ops: list[Any] = []
    want_eager = autograd_grads(model, ids, plain_ops)
    r, blocks = rematted(model, "gpt2", policies.nothing_saveable)
    for m in (model, r):  # the hook's fault, not remat's: the plain model fails alike
        m.enable_input_require_grads()  # once: a second call would leak the first hook (HF keeps one list)
        with pytest.raises(RuntimeError, match=r"requires_grad_\(\)"):
            func_grads(m, params, ids)
    got = replayed_step(r, "gpt2", blocks, lambda ops: autograd_grads(r, ids, ops), plain_ops)
    assert_tree_close(got, want_eager, **F64)
    for m in (model, r):
        m.disable_input_require_grads()
    got, want2 = func_step(r, model, "gpt2", blocks, lambda m: func_grads(m, params, ids))
    assert_tree_close(got, want, **F64)
    assert_tree_close(want2, want, **F64)


def test_frozen_embeddings_need_no_input_require_grads() -> None:
    """The case enable_input_require_grads exists for: embeddings frozen, only the blocks train."""
    model, ids = make("llama"), token_ids()
    r, blocks = rematted(model, "llama", policies.nothing_saveable)
    for m in (model, r):
        m.get_input_embeddings().weight.requires_grad_(False)
    plain_ops: list[Any] = []
    want = {k: g for k, g in autograd_grads(model, ids, plain_ops).items() if g is not None}
    got = replayed_step(r, "llama", blocks, lambda ops: autograd_grads(r, ids, ops), plain_ops)
    assert_tree_close({k: got[k] for k in want}, want, **F64)
    assert got["model.embed_tokens.weight"] is None
    # under torch.func: differentiate with respect to the trainable parameters only
    params = shifted_params(model)
    frozen = {k: v for k, v in params.items() if "embed_tokens" in k}
    trainable = {k: v for k, v in params.items() if k not in frozen}
    f = lambda m: grad(lambda p: loss_of_params(m, {**frozen, **p}, ids))(trainable)  # noqa: E731
    got, want = func_step(r, model, "llama", blocks, f)
    assert_tree_close(got, want, **F64)


# ---- memory retained between forward and backward, measured from outside ---------------------------------------


def retained_bytes(model: nn.Module, ids: torch.Tensor) -> int:
    """Bytes of op-allocated storages alive after the forward pass (LiveCensus, not remat's bookkeeping)."""
    model.zero_grad(set_to_none=True)
    loss, held = live_bytes_after(lambda: loss_of(model, ids))
    loss.backward()
    return held


def test_memory_retained_by_remat_modules() -> None:
    cfg = transformers.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                                  use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(1, VOCAB, (2, 64), generator=torch.Generator().manual_seed(0))
    block = SPECS["gpt2"].block_cls()
    plain = retained_bytes(model, ids)
    held = {}
    for label, policy in POLICIES.items():
        r = copy.deepcopy(model)
        remat.remat_modules(r, where=block, policy=policy)
        held[label] = retained_bytes(r, ids)
    # per block plain autograd keeps ~ 12 activations of [2, 64, 64] plus 2-3 attention maps of [2, 4, 64, 64]
    # and the MLP's [2, 64, 256]; remat keeps the blocks' inputs only
    assert plain > 1 << 20
    assert held["save-nothing"] < 0.25 * plain
    assert held["save-nothing"] < held["save-matmuls"] < 0.9 * plain


def test_benchmark_script_runs() -> None:
    root = Path(__file__).resolve().parent.parent
    # one thread: the bitwise column compares runs of CPU kernels whose reductions may split differently across
    # threads on a loaded machine (seen once in CI: even no remat against itself differed)
    args = ["--layers", "1", "--embd", "32", "--heads", "2", "--seq", "16", "--batch", "2", "--vocab", "64",
            "--rounds", "1", "--threads", "1"]
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "hf_memory.py"), *args], cwd=root,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and "MiB" not in line]
    # no remat, remat_modules twice, HF's own method, HF's method routed to remat twice
    assert len(rows) == 6 and all(row.endswith("| yes |") for row in rows), r.stdout


def _wrapped_through_defaults(model: nn.Module, name: str, policy: Any) -> nn.Module:
    """Each block's forward replaced by a remat'd function that reaches the block only through a default argument
    (issue 38: the idiom that binds a loop variable; the state walk follows ``__defaults__``)."""
    r = copy.deepcopy(model)
    for blk in [m for m in r.modules() if isinstance(m, SPECS[name].block_cls())]:
        def counted(*a: Any, _fwd: Any = blk.forward, **k: Any) -> Any:
            return _fwd(*a, **k)

        blk.forward = remat.remat(counted, policy=policy)
    return r


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("name", MODELS)
def test_blocks_reached_through_a_default_argument_are_exact_under_func(name: str) -> None:
    """functional_call with swapped parameters under grad and vmap(grad): the block's state, reached through the
    wrapper's default argument, is an input of each call and is put back for the recompute."""
    model = make(name)
    r = _wrapped_through_defaults(model, name, policies.nothing_saveable)
    params, ids = shifted_params(model), token_ids()
    assert_tree_close(func_grads(r, params, ids), func_grads(model, params, ids), **F64)
    assert_tree_close(per_example_grads(r, params, ids), per_example_grads(model, params, ids), **F64)


@pytest.mark.parametrize("name", MODELS)
def test_auto_picks_the_blocks_the_model_declares(name: str) -> None:
    """remat_modules(model, "auto") (issue 39): the outermost modules of the classes in _no_split_modules, the
    blocks remat_modules(model, Block) picks (BERT also declares its embeddings); float32 gradients bitwise."""
    model = make(name, dtype=torch.float32)
    auto = copy.deepcopy(model)
    names = remat.remat_modules(auto, "auto", policy="save-matmuls")
    by_class, _ = rematted(model, name, "save-matmuls")
    declared = [n for n, m in by_class.named_modules() if "forward" in vars(m)]
    assert [n for n in names if not n.endswith("embeddings")] == declared and declared
    ids = token_ids()
    assert_tree_close(autograd_grads(auto, ids), autograd_grads(model, ids), rtol=0, atol=0)


def test_auto_on_a_model_that_declares_no_blocks_says_to_pass_a_class() -> None:
    with pytest.raises(TypeError, match=r"declares no block classes .* pass the block class"):
        remat.remat_modules(nn.Sequential(nn.Linear(2, 2)), "auto")
