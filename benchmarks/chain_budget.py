"""remat.sequential on a long chain of transformer blocks: memory budgets against equal segments and torch.

For a chain of N pre-LayerNorm transformer blocks (``remat/bench/models.py``) it measures, in one process
with interleaved timing rounds (``remat.bench.measure.measure``): activation bytes retained between
forward and backward (a live-storage census outside remat), the GFLOPs the backward pass recomputes, and
peak bytes of the step, and time per step, for

* plain autograd;
* ``remat.sequential(blocks, budget=f)`` at each budget fraction ``f``;
* ``remat.sequential(blocks)``: ceil(sqrt(N)) equal segments;
* ``remat.sequential(blocks, segments=2, levels=ceil(log2 N))``: nested halves (memory like log N);
* ``torch.utils.checkpoint.checkpoint_sequential`` with the same number of segments (non-reentrant).

Usage::

    python benchmarks/chain_budget.py                       # 24 blocks, batch 2, seq 64, d 128
    python benchmarks/chain_budget.py --blocks 48 --budgets 0.3,0.5
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint_sequential

import remat
from remat.bench.measure import Config, MiB, measure
from remat.bench.models import make_transformer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=24)
    p.add_argument("--budgets", default="0.05,0.1,0.15,0.25,0.5,0.75,1.0", help="comma-separated fractions")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    params, x, block, _ = make_transformer(blocks=a.blocks, batch=2, seq=64, d=128, heads=4, ff=512)
    for d in params:
        for t in d.values():
            t.requires_grad_(True)
    blocks = [functools.partial(block, d) for d in params]
    k = math.isqrt(a.blocks - 1) + 1

    def loss(chain: Any) -> Any:
        return lambda prm, inp: chain(inp).pow(2).mean()

    def plain(h: torch.Tensor) -> torch.Tensor:
        for b in blocks:
            h = b(h)
        return h

    configs = [Config("no-remat", loss(plain))]
    seqs = {}
    for f in [float(s) for s in a.budgets.split(",")]:
        seq = remat.sequential(blocks, budget=f)
        try:
            seq(x)  # the first call measures the blocks and solves
        except ValueError as e:
            print(f"budget {f:.0%} left out: {e}", file=sys.stderr)
            continue
        seqs[f] = seq
        configs.append(Config(f"budget {f:.0%}", loss(seq)))
    configs.append(Config(f"equal {k} segments", loss(remat.sequential(blocks))))
    levels = math.ceil(math.log2(a.blocks))
    configs.append(Config(f"nested halves, {levels} levels", loss(remat.sequential(blocks, segments=2, levels=levels))))
    configs.append(Config(f"torch checkpoint_sequential({k})",
                          loss(lambda h: checkpoint_sequential(blocks, k, h, use_reentrant=False))))
    rows = measure(configs, [params, x], steps=a.steps, progress=lambda s: print(s, file=sys.stderr))
    print(f"{a.blocks} transformer blocks (batch 2, seq 64, d 128), CPU float32, torch {torch.__version__}")
    print(f"{'configuration':34} {'retained MiB':>12} {'peak MiB':>9} {'recomputed GFLOP':>16} {'time vs plain':>13}"
          "  schedule")
    for r in rows:
        f = next((f for f in seqs if r.label == f"budget {f:.0%}"), None)
        sched = seqs[f].schedule(x) if f is not None else None
        shown = "" if sched is None else (str(sched) if sched.depth() < 2 else f"{sched.depth()} levels: {sched}")
        print(f"{r.label:34} {r.retained_bytes / MiB:12.2f} {r.peak_bytes / MiB:9.2f} {r.recomputed_flops / 1e9:16.3f} "
              f"{r.time_ratio:12.2f}x  {shown[:160]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
