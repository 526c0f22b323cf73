"""remat under ``torch.compile(backend="inductor")`` on every reference model, every policy (the slow tier).

Inductor compiles C++ kernels for each graph, which takes minutes on a 2-core CPU for
these models: far more than the suite's time budget. So these tests run only with
``REMAT_SLOW=1`` (``REMAT_SLOW=1 python -m pytest tests/test_compile_inductor.py -q``);
``tests/test_compile.py`` covers the same models and policies on ``aot_eager`` in
float64 in every run, and inductor on a small MLP.

Each model has one block per policy (save-nothing, save-matmuls, names), compiled in one
graph (a counting backend), with gradients compared in float32 at torch's own compile-test
tolerance against the same model compiled by inductor without remat.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import remat
from remat.bench import models

from .helpers import assert_tree_close
from .test_compile import F32_INDUCTOR, POLICIES, Counting, grads_of

pytestmark = pytest.mark.skipif(not os.environ.get("REMAT_SLOW"),
                                reason="inductor compiles for minutes on a CPU: set REMAT_SLOW=1 to run")


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("model", ["transformer", "cnn"])
def test_reference_model_one_block_per_policy(model: str) -> None:
    cfg = {"transformer": {"blocks": 3, "batch": 2, "seq": 8, "d": 16, "heads": 2, "ff": 32},
           "cnn": {"blocks": 3, "batch": 2, "channels": 4, "hw": 8}}[model]
    params, x, block, apply = getattr(models, f"make_{model}")(**cfg, dtype=torch.float32)
    for p in params:
        for t in p.values():
            t.requires_grad_(True)
    rematted = [remat.remat(block, policy=pol) for pol in POLICIES.values()]

    def mixed(params: Any, x: torch.Tensor) -> torch.Tensor:
        h = x
        for p, blk in zip(params, rematted):
            h = blk(p, h)
        return (h * h).mean()

    ref = grads_of(torch.compile(apply, backend="inductor", fullgraph=True), params, x)
    be = Counting("inductor")
    got = grads_of(torch.compile(mixed, backend=be, fullgraph=True), params, x)
    assert be.graphs == 1
    assert_tree_close(got, ref, **F32_INDUCTOR)


def test_gpt2_one_block_per_policy() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=4, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    r = copy.deepcopy(model)
    for blk, pol in zip(r.transformer.h, ["save-nothing", "save-matmuls"]):
        remat.remat_module(blk, policy=pol)
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    be = Counting("inductor")
    torch.compile(r, backend=be)(input_ids=ids, labels=ids).loss.backward()
    torch.compile(model, backend="inductor")(input_ids=ids, labels=ids).loss.backward()
    assert be.graphs >= 1
    assert_tree_close({k: p.grad for k, p in r.named_parameters()},
                      {k: p.grad for k, p in model.named_parameters()}, **F32_INDUCTOR)
