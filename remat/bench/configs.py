"""The configurations the benchmarks compare, each a ``wrap`` applied to every block of a reference model.

``wrap(block)`` returns the function the model calls in place of ``block``:
the identity (plain autograd), a remat policy, or torch's own
``torch.utils.checkpoint`` (non-reentrant), plain or selective.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from .. import policies
from .._api.transform import remat

__all__ = ["CONFIGS", "COMPILED", "NAMES", "TORCH_MATMULS", "make_wrap", "applies", "default_configs", "label"]

Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]

# key -> description (the key is what --policies takes and what tables show)
CONFIGS: dict[str, str] = {
    "no-remat": "plain autograd",
    "save-nothing": "remat, policy save-nothing (nothing_saveable)",
    "save-matmuls": "remat, policy save-matmuls (dots_saveable)",
    "names": "remat, save_only_these_names(<the model's tags>)",
    "offload-to-cpu": "remat, policy offload-to-cpu (needs a GPU)",
    "torch-checkpoint": "torch.utils.checkpoint(use_reentrant=False)",
    "torch-sac-matmuls": "torch selective checkpointing saving mm/addmm/bmm/baddbmm",
}

# the configurations --compile adds, each the whole model under torch.compile
COMPILED = ["no-remat", "save-nothing", "save-matmuls", "torch-checkpoint", "torch-sac-matmuls"]

# the checkpoint_name tags of each reference model's block (remat/bench/models.py)
NAMES: dict[str, tuple[str, ...]] = {"transformer": ("attn", "ff"), "cnn": ("act",)}

TORCH_MATMULS = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                 torch.ops.aten.baddbmm.default]


def label(key: str, model: str) -> str:
    """The row label of a configuration (names show which tags are saved)."""
    return f"names({','.join(NAMES[model])})" if key == "names" else key


def applies(key: str, model: str, device: torch.device | str) -> str | None:
    """Why configuration ``key`` does not apply to ``model`` on ``device`` (None: it does)."""
    if key == "offload-to-cpu" and torch.device(device).type != "cuda":
        return ("offloading to the CPU needs a GPU (on a CPU it only copies memory to memory: its retained column counts "
                "device memory, not the host copies, which here are the same memory)")
    if key == "names" and model not in NAMES:
        return f"the {model} model has no checkpoint_name tags"
    return None


def default_configs(model: str, device: torch.device | str) -> list[str]:
    """Every configuration that applies to ``model`` on ``device``."""
    return [k for k in CONFIGS if applies(k, model, device) is None]


def _remat_wrap(policy: Any) -> Wrap:
    return lambda f: remat(f, policy=policy)


def _torch_wrap(selective: bool) -> Wrap:
    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        kw: dict[str, Any] = {"use_reentrant": False}
        if selective:
            kw["context_fn"] = functools.partial(create_selective_checkpoint_contexts, TORCH_MATMULS)

        @functools.wraps(f)
        def run(*args: Any) -> Any:
            return torch_checkpoint(f, *args, **kw)

        return run

    return wrap


def make_wrap(key: str, model: str) -> Wrap:
    """The wrap of configuration ``key`` (see :data:`CONFIGS`) for ``model``.

    Example:
        >>> import torch
        >>> from remat.bench.configs import make_wrap
        >>> from remat.bench.models import make_model
        >>> params, x, block, apply = make_model("mlp", "small")
        >>> loss = apply(params, x, make_wrap("save-matmuls", "mlp"))
        >>> loss.dim()
        0
    """
    if key == "no-remat":
        return lambda f: f
    if key == "save-nothing":
        return _remat_wrap("save-nothing")
    if key == "save-matmuls":
        return _remat_wrap("save-matmuls")
    if key == "names":
        if model not in NAMES:
            raise ValueError(f"configuration 'names': the {model} model has no checkpoint_name tags")
        return _remat_wrap(policies.save_only_these_names(*NAMES[model]))
    if key == "offload-to-cpu":
        return _remat_wrap("offload-to-cpu")
    if key == "torch-checkpoint":
        return _torch_wrap(selective=False)
    if key == "torch-sac-matmuls":
        return _torch_wrap(selective=True)
    raise ValueError(f"unknown configuration {key!r}; choose from {', '.join(CONFIGS)}")
