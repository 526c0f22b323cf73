"""Small reference models for benchmarks, tests and examples, written as pure functions over parameter dicts.

Each ``make_*`` returns ``(params, inputs, block_fn, apply_fn)``: ``block_fn(p, h)``
is one block (the unit a user wraps in ``remat``), and ``apply_fn(params, x, wrap)``
runs the whole model with each block passed through ``wrap`` (``lambda f: f`` for
no remat, ``lambda f: remat(f, policy=p)`` for a policy) and returns a scalar loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .._policies.naming import checkpoint_name

__all__ = ["SIZES", "make_mlp", "make_transformer", "make_cnn", "make_model", "transformer_block",
           "mlp_block", "cnn_block"]

Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]

# size -> model -> config
SIZES: dict[str, dict[str, dict[str, int]]] = {
    # the main job's default (python -m remat.bench): activations that matter (tens of MiB held without remat), a
    # step short enough to time every configuration well in under a minute on 2 CPU cores
    "demo": {
        "mlp": {"layers": 8, "batch": 512, "width": 512},
        "transformer": {"blocks": 4, "batch": 4, "seq": 128, "d": 256, "heads": 4, "ff": 1024},
        "cnn": {"blocks": 4, "batch": 16, "channels": 32, "hw": 32},
    },
    "small": {
        "mlp": {"layers": 4, "batch": 128, "width": 256},
        "transformer": {"blocks": 2, "batch": 2, "seq": 64, "d": 128, "heads": 4, "ff": 512},
        "cnn": {"blocks": 2, "batch": 8, "channels": 16, "hw": 32},
    },
    "medium": {
        "mlp": {"layers": 8, "batch": 256, "width": 1024},
        "transformer": {"blocks": 4, "batch": 8, "seq": 256, "d": 512, "heads": 8, "ff": 2048},
        "cnn": {"blocks": 4, "batch": 16, "channels": 32, "hw": 64},
    },
    "large": {
        "mlp": {"layers": 16, "batch": 1024, "width": 2048},
        "transformer": {"blocks": 8, "batch": 8, "seq": 2048, "d": 2048, "heads": 16, "ff": 8192},
        "cnn": {"blocks": 8, "batch": 32, "channels": 64, "hw": 128},
    },
}


def _init(shape: tuple[int, ...], fan_in: int, gen: torch.Generator, dtype: torch.dtype,
          device: torch.device | str) -> torch.Tensor:
    w = torch.randn(shape, generator=gen, dtype=torch.float32) / math.sqrt(fan_in)
    return w.to(dtype=dtype, device=device)


# ---- MLP ------------------------------------------------------------------------


def mlp_block(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    """One MLP layer: gelu(h @ W + b)."""
    return F.gelu(torch.addmm(p["b"], h, p["W"]))


def make_mlp(layers: int = 4, batch: int = 128, width: int = 256, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu", seed: int = 0) -> tuple[Any, torch.Tensor, Any, Any]:
    g = torch.Generator().manual_seed(seed)
    params = [{"W": _init((width, width), width, g, dtype, device),
               "b": torch.zeros(width, dtype=dtype, device=device)} for _ in range(layers)]
    x = torch.randn(batch, width, generator=g).to(dtype=dtype, device=device)

    def apply(params: Any, x: torch.Tensor, wrap: Wrap = lambda f: f) -> torch.Tensor:
        blk = wrap(mlp_block)
        h = x
        for p in params:
            h = blk(p, h)
        return (h * h).mean()

    return params, x, mlp_block, apply


# ---- transformer ----------------------------------------------------------------


def transformer_block(p: dict[str, torch.Tensor], x: torch.Tensor, heads: int) -> torch.Tensor:
    """Pre-LayerNorm transformer block with explicit attention softmax(q k^T / sqrt(d)) v.

    Name policies see the attention probabilities as "attn" and the MLP's hidden
    activation (after gelu) as "ff" (``checkpoint_name`` tags; no-ops outside remat).
    No matmul output is tagged: a name decides for the op that computed the value,
    so a tag on a matmul would change what ``dots_saveable`` keeps.
    """
    B, S, D = x.shape
    dh = D // heads
    h = F.layer_norm(x, (D,), p["ln1_w"], p["ln1_b"])
    qkv = F.linear(h, p["wqkv"], p["bqkv"])
    q, k, v = qkv.split(D, dim=-1)
    q = q.reshape(B, S, heads, dh).transpose(1, 2)
    k = k.reshape(B, S, heads, dh).transpose(1, 2)
    v = v.reshape(B, S, heads, dh).transpose(1, 2)
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(dh)
    attn = checkpoint_name(torch.softmax(scores, dim=-1), "attn")
    o = torch.matmul(attn, v).transpose(1, 2).reshape(B, S, D)
    x = x + F.linear(o, p["wo"], p["bo"])
    h = F.layer_norm(x, (D,), p["ln2_w"], p["ln2_b"])
    h = checkpoint_name(F.gelu(F.linear(h, p["w1"], p["b1"])), "ff")
    return x + F.linear(h, p["w2"], p["b2"])


def make_transformer(blocks: int = 2, batch: int = 2, seq: int = 64, d: int = 128, heads: int = 4,
                     ff: int = 512, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                     seed: int = 0) -> tuple[Any, torch.Tensor, Any, Any]:
    g = torch.Generator().manual_seed(seed)

    def z(*s: int) -> torch.Tensor:
        return torch.zeros(s, dtype=dtype, device=device)

    def o(*s: int) -> torch.Tensor:
        return torch.ones(s, dtype=dtype, device=device)

    params = [{
        "ln1_w": o(d), "ln1_b": z(d), "wqkv": _init((3 * d, d), d, g, dtype, device), "bqkv": z(3 * d),
        "wo": _init((d, d), d, g, dtype, device), "bo": z(d), "ln2_w": o(d), "ln2_b": z(d),
        "w1": _init((ff, d), d, g, dtype, device), "b1": z(ff), "w2": _init((d, ff), ff, g, dtype, device),
        "b2": z(d),
    } for _ in range(blocks)]
    x = torch.randn(batch, seq, d, generator=g).to(dtype=dtype, device=device)

    def block(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return transformer_block(p, x, heads)

    def apply(params: Any, x: torch.Tensor, wrap: Wrap = lambda f: f) -> torch.Tensor:
        blk = wrap(block)
        h = x
        for p in params:
            h = blk(p, h)
        return (h * h).mean()

    return params, x, block, apply


# ---- CNN ------------------------------------------------------------------------


def cnn_block(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Residual conv block: x + conv(relu(group_norm(conv(x)))), the relu output tagged "act"."""
    h = F.conv2d(x, p["c1"], p["b1"], padding=1)
    h = checkpoint_name(F.relu(F.group_norm(h, 4, p["g_w"], p["g_b"])), "act")
    return x + F.conv2d(h, p["c2"], p["b2"], padding=1)


def make_cnn(blocks: int = 2, batch: int = 8, channels: int = 16, hw: int = 32, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu", seed: int = 0) -> tuple[Any, torch.Tensor, Any, Any]:
    g = torch.Generator().manual_seed(seed)
    c = channels
    params = [{
        "c1": _init((c, c, 3, 3), 9 * c, g, dtype, device), "b1": torch.zeros(c, dtype=dtype, device=device),
        "g_w": torch.ones(c, dtype=dtype, device=device), "g_b": torch.zeros(c, dtype=dtype, device=device),
        "c2": _init((c, c, 3, 3), 9 * c, g, dtype, device), "b2": torch.zeros(c, dtype=dtype, device=device),
    } for _ in range(blocks)]
    x = torch.randn(batch, c, hw, hw, generator=g).to(dtype=dtype, device=device)

    def apply(params: Any, x: torch.Tensor, wrap: Wrap = lambda f: f) -> torch.Tensor:
        blk = wrap(cnn_block)
        h = x
        for p in params:
            h = blk(p, h)
        return (h * h).mean()

    return params, x, cnn_block, apply


def make_model(name: str, size: str = "small", dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", seed: int = 0) -> tuple[Any, torch.Tensor, Any, Any]:
    """Build one of the reference models by name ("mlp", "transformer", "cnn") and size."""
    makers = {"mlp": make_mlp, "transformer": make_transformer, "cnn": make_cnn}
    if name not in makers:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(makers)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    return makers[name](**SIZES[size][name], dtype=dtype, device=device, seed=seed)  # type: ignore[operator]
