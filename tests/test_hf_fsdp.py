"""Hugging Face models sharded with FSDP2 (``fully_shard`` per decoder layer), remat'd, on two gloo processes.

GPT-2 and Llama built from configs with random weights (float64, eager
attention), each layer ``fully_shard``'ed, then the model; two SGD steps, each
rank on half the batch. The blocks are remat'd by ``remat_modules(model, "auto")``
(the classes the model declares in ``_no_split_modules``; FSDP2's hooks stay
outside the region), by Hugging Face's own hook with remat as its checkpoint
function (``model._set_gradient_checkpointing(gradient_checkpointing_func=...)``),
or checkpointed by ``gradient_checkpointing_enable()`` (``torch.utils.checkpoint``,
the peer). Per case: loss and gradients equal one process without sharding or
remat (1e-10), and bitwise the same sharded run without remat; the backward pass
recomputes: it runs every ATen op the run without remat's does and more (seen from
outside by ``OpLog``), while every layer's Python runs once per step under remat (the
replay engine replays the recorded ops) and twice under ``torch.utils.checkpoint``;
and a step all-gathers and reduce-scatters as often as without remat (a third step,
under ``CommDebugMode``, whose gradients are compared too).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist

import remat
from remat import policies

from .helpers import OpLog, assert_tree_close
from .spawned import result, spawn

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed or its gloo backend is not available in this torch build",
)

WORLD, BATCH, SEQ, VOCAB, STEPS, LR = 2, 4, 8, 64, 2, 0.1
MODELS = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": VOCAB,
                                               "n_positions": 32, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                                               "attn_pdrop": 0.0}),
    "llama": ("LlamaForCausalLM", "LlamaConfig", {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
                                                  "num_hidden_layers": 2, "num_attention_heads": 4,
                                                  "num_key_value_heads": 2, "max_position_embeddings": 32}),
}
POLICIES: dict[str, Any] = {"save-nothing": "save-nothing", "dots_saveable": policies.dots_saveable}


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    how: str  # "none", "auto" (remat_modules(model, "auto")), "hf-hook" (HF's hook, remat's function), "hf-torch"
    policy: str = "save-nothing"

    @property
    def id(self) -> str:
        return f"{self.model}-{self.how}" + (f"-{self.policy}" if self.how in ("auto", "hf-hook") else "")


CASES = [c for m in MODELS for c in (Case(m, "none"), Case(m, "auto"), Case(m, "auto", "dots_saveable"),
                                     Case(m, "hf-hook"), Case(m, "hf-torch"))]


def make_model(name: str) -> Any:
    model_cls, config_cls, config = MODELS[name]
    cfg = getattr(transformers, config_cls)(**config, use_cache=False, attn_implementation="eager")
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(cfg).double().train()


def layers(model: Any) -> Any:
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def make_ids() -> torch.Tensor:
    return torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


class Calls:
    """Counts each layer's forward calls through a forward pre-hook... of the layer's ``forward`` itself (hooks on
    the module would run once, outside the region): wraps the class's forward for the run."""

    def __init__(self, model: Any) -> None:
        self.counts = [0] * len(layers(model))
        for i, layer in enumerate(layers(model)):
            for sub in layer.children():  # the first child runs in every forward of the layer
                sub.register_forward_pre_hook(lambda m, a, i=i: self._hit(i))
                break

    def _hit(self, i: int) -> None:
        self.counts[i] += 1


def train(model: Any, ids: torch.Tensor, full_grad: Any, count_collectives: bool,
          full_loss: Any = lambda loss: loss) -> dict[str, Any]:
    from torch.distributed.tensor.debug import CommDebugMode

    calls = Calls(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out: dict[str, Any] = {"loss": [], "grads": [], "calls": [], "collectives": [], "backward_ops": []}
    for _ in range(STEPS):
        before = list(calls.counts)
        loss = model(input_ids=ids, labels=ids).loss
        with OpLog() as log:  # (aten.detach left out: autograd's own unpacking of saved tensors)
            loss.backward()
        out["backward_ops"].append(Counter(str(op) for op in log.ops if op is not torch.ops.aten.detach.default))
        out["calls"].append([c - b for c, b in zip(calls.counts, before)])
        out["loss"].append(full_loss(loss.detach().clone()))
        out["grads"].append({n: full_grad(p.grad).clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    if count_collectives:  # one more step, under a user's dispatch mode that counts the collectives
        with CommDebugMode() as comm:
            model(input_ids=ids, labels=ids).loss.backward()
        out["collectives"].append({str(k): v for k, v in comm.get_comm_counts().items()})
        out["grads"].append({n: full_grad(p.grad).clone() for n, p in model.named_parameters()})
    return out


def run_case(case: Case, rank: int, group: dist.ProcessGroup) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = make_model(case.model)
    ids = make_ids()
    share = BATCH // WORLD
    ids = ids[rank * share:(rank + 1) * share]
    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    policy = POLICIES[case.policy]
    if case.how == "auto":
        names = remat.remat_modules(model, "auto", policy=policy)
        assert len(names) == len(layers(model)), names
    elif case.how == "hf-hook":
        model._set_gradient_checkpointing(
            enable=True, gradient_checkpointing_func=lambda fn, *a, **k: remat.remat(fn, policy=policy)(*a, **k))
    elif case.how == "hf-torch":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    def full_loss(loss: torch.Tensor) -> torch.Tensor:  # (each rank's mean over its half: the mean of the two)
        dist.all_reduce(loss, group=group)
        return loss / WORLD

    return train(model, ids, lambda g: g.full_tensor() if isinstance(g, DTensor) else g, count_collectives=True,
                 full_loss=full_loss)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn(run_case, CASES, tmp_path_factory.mktemp("hf_fsdp"), WORLD, timeout_s=240)


@pytest.fixture(scope="module")
def single_process() -> dict[str, dict[str, Any]]:
    return {m: train(make_model(m), make_ids(), lambda g: g, count_collectives=False) for m in MODELS}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_one_process_without_sharding_or_remat(runs, single_process, case):
    want = single_process[case.model]
    for rank in range(WORLD):
        got = dict(result(runs, case, rank))
        got["grads"] = got["grads"][:STEPS]
        # (transformers computes the loss in float32, from float64 logits: float32's tolerance for it)
        assert_tree_close(got["loss"], want["loss"], rtol=1e-6, atol=1e-6, exact_float32=False)
        assert_tree_close(got["grads"], want["grads"], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("case", [c for c in CASES if c.how != "none"], ids=lambda c: c.id)
def test_matches_the_sharded_run_without_remat_and_gathers_as_often(runs, case):
    for rank in range(WORLD):
        got, want = result(runs, case, rank), result(runs, Case(case.model, "none"), rank)
        assert_tree_close((got["loss"], got["grads"]), (want["loss"], want["grads"]), rtol=0, atol=0)
        assert got["collectives"] == want["collectives"] and got["collectives"][0]
        # recomputed: the backward pass ran every op of the one without remat, and more
        for ops, plain in zip(got["backward_ops"], want["backward_ops"]):
            assert not plain - ops and (ops - plain).total() > 0, (dict(ops - plain), dict(plain - ops))
        # each layer's Python ran once a step under remat (its ops replayed), twice under torch's checkpoint
        python_runs = 2 if case.how == "hf-torch" else 1
        assert got["calls"] == [[python_runs] * len(got["calls"][0])] * STEPS
