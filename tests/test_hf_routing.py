"""Hugging Face's own checkpointing on remat: ``model.gradient_checkpointing_enable()`` (and its successor
``activation_checkpointing_enable``) inside ``remat.route_torch_checkpoint(policy=...)`` stores remat's checkpoint
in the model's layers (NOTE [routing torch's checkpoint] in remat/_api/checkpoint.py). Gradients against the model
without checkpointing (float64, 1e-10), each layer's Python once per step (HF's torch checkpointing runs it twice),
use_cache handled by HF's layers, and the routing undone on exit.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as tc

import remat
from remat import policies

from .helpers import assert_tree_close
from .test_hf import F64, SPECS, CallCount, autograd_grads, make, token_ids

transformers = pytest.importorskip("transformers")

POLICIES = {"save-nothing": policies.nothing_saveable, "save-matmuls": policies.dots_saveable}


def _enable(model: Any, kwargs: dict[str, Any] | None = None) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (the deprecated name, kept for the many who call it)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _blocks(model: Any, name: str) -> list[str]:
    cls = SPECS[name].block_cls()
    return [n for n, m in model.named_modules() if isinstance(m, cls)]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_hf_enable_routed_to_remat_is_exact_and_runs_each_layer_once(name: str, policy: str) -> None:
    model, ids = make(name), token_ids()
    want = autograd_grads(model, ids)
    torch_ckpt = make(name)
    torch_ckpt.train()
    _enable(torch_ckpt, {"use_reentrant": False})
    ours = make(name)
    ours.train()
    with remat.route_torch_checkpoint(policy=POLICIES[policy]):
        _enable(ours, {"use_reentrant": False})
    assert tc.checkpoint.__module__ == "torch.utils.checkpoint"  # undone on exit
    blocks = _blocks(ours, name)
    from remat._context import CACHES

    _CACHE = CACHES.get().wrappers

    assert all(ours.get_submodule(b) not in _CACHE for b in blocks)
    for m, runs in ((torch_ckpt, 2), (ours, 1)):  # torch's runs each layer's Python again; remat replays
        count = CallCount(m, name, blocks, pre=True)
        try:
            got = autograd_grads(m, ids)
        finally:
            count.remove()
        assert count.calls == runs * len(blocks), (m is ours, count.calls)
        assert_tree_close(got, want, **F64)
    # remat's wrapper of each layer made once, on its first call, not per call
    assert all(len(_CACHE[ours.get_submodule(b)]) == 1 for b in blocks)


def test_the_successor_method_and_reentrant_kwargs() -> None:
    """``activation_checkpointing_enable`` (transformers' new name) and ``use_reentrant=True`` (which old code
    passes): remat's hooks either way."""
    model, ids = make("llama"), token_ids()
    want = autograd_grads(model, ids)
    ours = make("llama")
    ours.train()
    with remat.route_torch_checkpoint(policy="save-matmuls"):
        if hasattr(ours, "activation_checkpointing_enable"):
            ours.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
        else:
            _enable(ours, {"use_reentrant": True})
    count = CallCount(ours, "llama", _blocks(ours, "llama"), pre=True)
    try:
        assert_tree_close(autograd_grads(ours, ids), want, **F64)
    finally:
        count.remove()
    assert count.calls == 2  # two layers, once each


def test_use_cache_as_hf_handles_it() -> None:
    """A model configured with use_cache=True: in training with checkpointing HF's layers turn the cache off (with
    their warning); the gradient is the model's without checkpointing."""
    model, ids = make("llama", use_cache=True), token_ids()
    want = autograd_grads(model, ids)
    ours = make("llama", use_cache=True)
    ours.train()
    with remat.route_torch_checkpoint():
        _enable(ours)
    assert_tree_close(autograd_grads(ours, ids), want, **F64)


def test_routing_reaches_names_bound_at_import_and_is_undone() -> None:
    """Code that did ``from torch.utils.checkpoint import checkpoint`` before the block is routed too (a module of
    transformers does); every name is put back on exit, also when the block raises."""
    import transformers.modeling_utils as mu

    before = (tc.checkpoint, tc.checkpoint_sequential, mu.checkpoint)
    with pytest.raises(KeyError, match="raised inside"):
        with remat.route_torch_checkpoint(policy="save-matmuls") as r:
            assert tc.checkpoint is not before[0] and mu.checkpoint is not before[2]
            assert tc.checkpoint_sequential is not before[1]
            assert r is not None
            raise KeyError("raised inside")
    assert (tc.checkpoint, tc.checkpoint_sequential, mu.checkpoint) == before


def test_routed_calls_keep_their_own_selective_checkpointing() -> None:
    """A routed call that passes torch's selective checkpointing keeps that policy: the backward pass replays no
    matmul it saved."""
    import functools

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from .helpers import OpCounter

    W = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 8, dtype=torch.float64)
    cf = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    with remat.route_torch_checkpoint(policy="save-nothing"):
        y = tc.checkpoint(lambda x: torch.tanh(x @ W) @ W, x, use_reentrant=False, context_fn=cf)
        z = tc.checkpoint(lambda x: torch.tanh(x @ W) @ W, x, use_reentrant=False)
    with OpCounter({torch.ops.aten.mm.default}) as kept:
        y.sum().backward()
    with OpCounter({torch.ops.aten.mm.default}) as dropped:
        z.sum().backward()
    assert dropped.count == kept.count + 1  # the first product, replayed where nothing was kept


def test_routed_method_under_torch_func() -> None:
    """Under torch.func.grad over functional_call (parameters other than the module's own): torch's checkpoint
    raises there; the layers routed to remat give the model's gradient without checkpointing."""
    from .test_hf import func_grads, shifted_params

    model, ids = make("gpt2"), token_ids()
    model.train()
    params = shifted_params(model)
    want = func_grads(model, params, ids)
    ours = make("gpt2")
    ours.train()
    with remat.route_torch_checkpoint(policy="save-matmuls"):
        _enable(ours, {"use_reentrant": False})
    ours.disable_input_require_grads()  # (HF's method turns it on; its hook calls requires_grad_, which torch.func
    # forbids with or without remat: docs/models.md)
    assert_tree_close(func_grads(ours, params, ids), want, **F64)
