"""JAX cross-check: the residuals ``jax.checkpoint`` keeps for remat's reference transformer.

The model mirrors ``remat.bench.models.transformer_block`` ("medium": 4 pre-LayerNorm blocks,
batch 8, sequence 256, width 512, 8 heads, MLP 2048, float32, explicit attention
``softmax(q k^T / sqrt(dh)) v``), written in ``jax.numpy``; each block is wrapped in
``jax.checkpoint(policy=...)``. For each policy the script asks JAX which residuals the
backward pass keeps (the machinery behind ``jax.ad_checkpoint.print_saved_residuals``) and
sums their bytes, with the parameters and the model input counted separately from the
intermediates. Only the intermediates compare with remat's retained-memory figures (RSS
growth over the forward pass, where parameters and input already exist).

Runs only in a separate environment with JAX (never a dependency of remat)::

    python3 -m venv /tmp/jaxenv && /tmp/jaxenv/bin/pip install jax
    /tmp/jaxenv/bin/python benchmarks/jax_residuals.py            # add --verbose to list each residual

It only traces (``make_jaxpr``), so it takes a few seconds on a CPU.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

CONFIG = {"blocks": 4, "batch": 8, "seq": 256, "d": 512, "heads": 8, "ff": 2048}
MIB = 2**20


def layer_norm(x: Any, w: Any, b: Any, eps: float = 1e-5) -> Any:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * w + b


def linear(x: Any, w: Any, b: Any) -> Any:
    # torch layout: w is (out, in), y = x w^T + b (a dot_general without batch dimensions)
    return jnp.dot(x, w.T) + b


def transformer_block(p: dict[str, Any], x: Any, heads: int) -> Any:
    B, S, D = x.shape
    dh = D // heads
    h = layer_norm(x, p["ln1_w"], p["ln1_b"])
    qkv = linear(h, p["wqkv"], p["bqkv"])
    q, k, v = jnp.split(qkv, 3, axis=-1)
    q = q.reshape(B, S, heads, dh).transpose(0, 2, 1, 3)
    k = k.reshape(B, S, heads, dh).transpose(0, 2, 1, 3)
    v = v.reshape(B, S, heads, dh).transpose(0, 2, 1, 3)
    scores = jnp.matmul(q, jnp.swapaxes(k, -2, -1)) / math.sqrt(dh)
    attn = jax.nn.softmax(scores, axis=-1)
    o = jnp.matmul(attn, v).transpose(0, 2, 1, 3).reshape(B, S, D)
    x = x + linear(o, p["wo"], p["bo"])
    h = layer_norm(x, p["ln2_w"], p["ln2_b"])
    h = jax.nn.gelu(linear(h, p["w1"], p["b1"]), approximate=False)  # torch's F.gelu default: exact erf
    return x + linear(h, p["w2"], p["b2"])


def make_model(blocks: int, batch: int, seq: int, d: int, heads: int, ff: int,
               seed: int = 0) -> tuple[list[dict[str, Any]], Any]:
    rng = np.random.default_rng(seed)

    def init(shape: tuple[int, int], fan_in: int) -> Any:
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) / math.sqrt(fan_in))

    def z(n: int) -> Any:
        return jnp.zeros((n,), jnp.float32)

    def o(n: int) -> Any:
        return jnp.ones((n,), jnp.float32)

    params = [{
        "ln1_w": o(d), "ln1_b": z(d), "wqkv": init((3 * d, d), d), "bqkv": z(3 * d),
        "wo": init((d, d), d), "bo": z(d), "ln2_w": o(d), "ln2_b": z(d),
        "w1": init((ff, d), d), "b1": z(ff), "w2": init((d, ff), ff), "b2": z(d),
    } for _ in range(blocks)]
    x = jnp.asarray(rng.standard_normal((batch, seq, d), dtype=np.float32))
    return params, x


def make_loss(policy: Callable[..., Any], heads: int) -> Callable[..., Any]:
    blk = jax.checkpoint(lambda p, h: transformer_block(p, h, heads), policy=policy)

    def loss(params: list[dict[str, Any]], x: Any) -> Any:
        h = x
        for p in params:
            h = blk(p, h)
        return jnp.mean(h * h)

    return loss


def residuals(f: Callable[..., Any], *args: Any) -> list[tuple[Any, str]]:
    """(aval, source) of each residual the VJP of ``f`` keeps.

    ``jax.ad_checkpoint`` exports only ``print_saved_residuals``; the list behind it is
    ``jax._src.ad_checkpoint.saved_residuals`` (private, present in JAX 0.4 through 0.10).
    """
    from jax._src.ad_checkpoint import saved_residuals

    return list(saved_residuals(f, *args))


def nbytes(aval: Any) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def classify(src: str) -> str:
    if src.startswith("from the argument"):
        return "input" if src.split()[-1].startswith("x") else "params"
    if src.startswith("from a constant") or src.startswith("from a literal"):
        return "constants"
    return "intermediates"


POLICIES = ["nothing_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable"]
REMAT_MIB = {"nothing_saveable": 16, "dots_saveable": 224, "dots_with_no_batch_dims_saveable": 144}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verbose", action="store_true", help="list every residual")
    args = ap.parse_args()

    params, x = make_model(**CONFIG)
    print(f"JAX {jax.__version__}, backend {jax.default_backend()}; model {CONFIG}, float32, each block "
          "in jax.checkpoint")
    rows = []
    for name in POLICIES:
        res = residuals(make_loss(getattr(jax.checkpoint_policies, name), CONFIG["heads"]), params, x)
        sums = {"intermediates": 0, "params": 0, "input": 0, "constants": 0}
        counts = dict.fromkeys(sums, 0)
        for aval, src in res:
            kind = classify(src)
            sums[kind] += nbytes(aval)
            counts[kind] += 1
            if args.verbose:
                print(f"  [{name}] {kind:13s} {nbytes(aval) / MIB:8.3f} MiB  {aval.str_short()}  {src}")
        rows.append((name, sums, counts))

    print()
    print("| JAX policy | intermediates MiB (count) | parameters MiB (count) | input MiB | remat MiB (RSS) |")
    print("|---|---|---|---|---|")
    for name, sums, counts in rows:
        extra = f" + constants {sums['constants'] / MIB:g} MiB" if counts["constants"] else ""
        print(f"| `{name}` | {sums['intermediates'] / MIB:g} ({counts['intermediates']}){extra} "
              f"| {sums['params'] / MIB:.2f} ({counts['params']}) | {sums['input'] / MIB:g} "
              f"| {REMAT_MIB[name]} |")


if __name__ == "__main__":
    main()
