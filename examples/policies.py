"""One transformer block under every policy of ``remat.policies``: what each keeps, what each recomputes.

A policy decides, for each ATen op the wrapped function runs in its forward pass,
whether the op's outputs are kept until the backward pass, dropped and recomputed,
or offloaded. This script runs the same two-block transformer (a pre-LayerNorm
block whose intermediate values are tagged with ``checkpoint_name``) plainly and
under each policy, and for each one prints:

* ``remat.print_saved_residuals``: what the policy keeps for one block;
* the bytes of tensors allocated in the forward pass and still alive when it
  ends (activation memory held until the backward pass), counted from outside
  remat by a dispatch mode that watches which storages stay alive;
* how many times the block's Python function ran (2: once per block under every
  policy, since the backward pass replays the ATen ops the forward pass recorded
  and never runs the Python again) and how many matrix products the backward
  pass ran (plain autograd runs 2 per forward product; more means products were
  recomputed);
* whether the loss and every gradient are bitwise equal to plain autograd.

Run::

    python examples/policies.py              # small model, a few seconds
    python examples/policies.py --rss medium # retained RSS per policy on the benchmark transformer
                                             # (4 blocks, batch 8, seq 256, d 512), one fresh process each

On a CPU-only machine the offload policies copy to the same host memory, so
they save nothing there; on CUDA (``src="cuda"``) those bytes move to host memory.
The held column counts storages allocated by ATen ops of the forward pass; the
offload engine's host copies are not among them (the ``--rss`` table counts them).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from typing import Any

import optree
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import remat
from remat import checkpoint_name, policies
from remat.bench.measure import live_bytes_after
from remat.bench.models import SIZES, make_transformer

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.baddbmm.default}


def named_block(p: dict[str, torch.Tensor], x: torch.Tensor, heads: int) -> torch.Tensor:
    """``remat.bench.models.transformer_block`` with its intermediate values named for name policies."""
    B, S, D = x.shape
    dh = D // heads
    h = F.layer_norm(x, (D,), p["ln1_w"], p["ln1_b"])
    qkv = checkpoint_name(F.linear(h, p["wqkv"], p["bqkv"]), "qkv")
    q, k, v = qkv.split(D, dim=-1)
    q = q.reshape(B, S, heads, dh).transpose(1, 2)
    k = k.reshape(B, S, heads, dh).transpose(1, 2)
    v = v.reshape(B, S, heads, dh).transpose(1, 2)
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(dh)
    attn = checkpoint_name(torch.softmax(scores, dim=-1), "attn_probs")
    o = checkpoint_name(torch.matmul(attn, v).transpose(1, 2).reshape(B, S, D), "attn_out")
    x = x + F.linear(o, p["wo"], p["bo"])
    h = F.layer_norm(x, (D,), p["ln2_w"], p["ln2_b"])
    h = checkpoint_name(F.gelu(F.linear(h, p["w1"], p["b1"])), "mlp_hidden")
    return x + F.linear(h, p["w2"], p["b2"])


def all_policies(device: str) -> dict[str, Any]:
    """Every public policy, built for ``device`` (offloading from it to the CPU)."""
    src = device
    return {
        "nothing_saveable": policies.nothing_saveable,
        "everything_saveable": policies.everything_saveable,
        "dots_saveable": policies.dots_saveable,
        "dots_with_no_batch_dims_saveable": policies.dots_with_no_batch_dims_saveable,
        'save_only_these_names("qkv", "attn_out")': policies.save_only_these_names("qkv", "attn_out"),
        'save_any_names_but_these("attn_probs")': policies.save_any_names_but_these("attn_probs"),
        'save_anything_except_these_names("attn_probs")': policies.save_anything_except_these_names("attn_probs"),
        'save_from_both_policies(dots_with_no_batch_dims, names("attn_out"))': policies.save_from_both_policies(
            policies.dots_with_no_batch_dims_saveable, policies.save_only_these_names("attn_out")),
        "offload_to_cpu(min_bytes=0)": policies.offload_to_cpu(min_bytes=0, src=src),
        'save_and_offload_only_these_names(save attn_out, offload mlp_hidden)':
            policies.save_and_offload_only_these_names(
                names_which_can_be_saved=["attn_out"], names_which_can_be_offloaded=["mlp_hidden"],
                offload_src=src, offload_dst="cpu"),
        "offload_dot_with_no_batch_dims": policies.offload_dot_with_no_batch_dims(src, "cpu"),
    }


class CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += func in MATMULS
        return func(*args, **(kwargs or {}))


def run(params: Any, x: torch.Tensor, heads: int, policy: Any) -> dict[str, Any]:
    """Loss, gradients, held bytes, block calls and backward matmuls of one step under ``policy``."""
    calls = [0]

    def block(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return named_block(p, h, heads)

    f = block if policy is None else remat.remat(block, policy=policy)
    params = optree.tree_map(lambda t: t.detach().requires_grad_(), params)
    def forward() -> torch.Tensor:
        h = x
        for p in params:
            h = f(p, h)
        return (h * h).mean()

    loss, held = live_bytes_after(forward)
    fwd_calls = calls[0]
    with CountMatmuls() as mm:
        grads = torch.autograd.grad(loss, optree.tree_leaves(params))
    return {"loss": loss.detach(), "grads": grads, "held": held, "fwd_calls": fwd_calls,
            "calls": calls[0], "bwd_matmuls": mm.count}


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    device = "cpu"
    cfg = SIZES["small"]["transformer"]
    params, x, _, _ = make_transformer(**cfg)
    heads = cfg["heads"]

    print("What each policy keeps for one block (remat.print_saved_residuals):")
    p0 = {k: v.detach().requires_grad_() for k, v in params[0].items()}
    for name, pol in all_policies(device).items():
        print(f"\n=== {name}")
        remat.print_saved_residuals(remat.remat(lambda p, h: named_block(p, h, heads), policy=pol), p0, x)

    base = run(params, x, heads, None)
    rows = [("plain autograd", base, True)]
    for name, pol in all_policies(device).items():
        r = run(params, x, heads, pol)
        same = torch.equal(r["loss"], base["loss"]) and all(
            torch.equal(a, b) for a, b in zip(r["grads"], base["grads"]))
        rows.append((name, r, same))

    blocks = len(params)
    print(f"\nTwo-block transformer (batch {cfg['batch']}, seq {cfg['seq']}, d {cfg['d']}), one training step:")
    print(f"{'policy':<72} {'held MiB':>9} {'block calls':>11} {'bwd matmuls':>11}  equal")
    for name, r, same in rows:
        print(f"{name:<72} {r['held'] / 2**20:>9.2f} {r['calls']:>11} {r['bwd_matmuls']:>11}  {same}")
    print(f"(block calls: {blocks} = once per block; a recompute replays the recorded ops, not the Python. "
          f"bwd matmuls: {base['bwd_matmuls']} = no product recomputed.)")
    bad = [name for name, _, same in rows if not same]
    if bad:
        raise SystemExit(f"gradients differ from plain autograd under: {bad}")
    print("every policy: loss and gradients bitwise equal to plain autograd")


# ---- --rss: retained memory on a larger model, measured in fresh processes -----------------------

_RSS_CHILD = r"""
import gc, sys, torch
sys.path.insert(0, {here!r})
from policies import all_policies, named_block
from remat import remat
from remat.bench.models import SIZES, make_transformer
torch.set_num_threads(1)
cfg = SIZES[{size!r}]["transformer"]
params, x, _, _ = make_transformer(**cfg)
for p in params:
    for t in p.values():
        t.requires_grad_()
name = {name!r}
blk = lambda p, h: named_block(p, h, cfg["heads"])
f = blk if name == "plain" else remat(blk, policy=all_policies("cpu")[name])

def rss():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096

def step():
    h = x
    for p in params:
        h = f(p, h)
    return (h * h).mean()

step().backward()  # warm up
for p in params:
    for t in p.values():
        t.grad = None
gc.collect()
r0 = rss()
loss = step()
gc.collect()
r1 = rss()
loss.backward()
print((r1 - r0) / 2**20)
"""


def rss_table(size: str) -> None:
    """Retained RSS between forward and backward, one fresh process per policy (see docs/policies.md)."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    print(f"transformer {size}: activation memory retained between forward and backward (RSS, MiB)")
    for name in ["plain", *all_policies("cpu")]:
        code = _RSS_CHILD.format(here=here, size=size, name=name)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        print(f"{name:<72} {float(out.stdout.strip().splitlines()[-1]):>8.0f}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rss", metavar="SIZE", choices=["small", "medium", "large"],
                    help="measure retained RSS per policy on the transformer of this size")
    args = ap.parse_args()
    if args.rss:
        rss_table(args.rss)
    else:
        main()
