"""Per-example gradients of a transformer with ``torch.func.vmap(torch.func.grad(...))`` over remat'd blocks.

Per-example gradients (for differential privacy, gradient-noise or data-influence
studies) run the backward pass once per example, batched by ``vmap``; activation
memory then grows with the number of examples just as in ordinary training.
``torch.utils.checkpoint`` cannot help here: it raises under ``torch.func``
transforms. ``remat`` works under them: each block
(``remat.bench.models.transformer_block``) keeps only its input between the
forward and the backward pass and is recomputed, under the same ``vmap`` and
``grad`` levels, when the backward pass needs it.

The script checks that the per-example gradients are bitwise equal to those
without remat, counts the block's Python calls (the recompute ran), and measures
the peak memory of the whole ``vmap(grad(...))`` call in a fresh process per
variant (peak RSS, ``VmHWM`` after a reset through ``/proc/self/clear_refs``,
with glibc told to return freed memory; see docs/how-it-works.md).

Run: ``python examples/per_example_grads.py`` (Linux, about 20 s on one CPU thread).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from typing import Any

import torch
from torch.func import grad, vmap

from remat import remat
from remat.bench.models import make_transformer, transformer_block

CFG = {"blocks": 4, "batch": 16, "seq": 128, "d": 128, "heads": 4, "ff": 512}  # batch = number of examples


def per_example_grads(use_remat: bool) -> tuple[Any, int]:
    """Gradients of each example's loss with respect to all parameters, and the block's call count."""
    params, xs, _, _ = make_transformer(**CFG)
    calls = [0]

    def block(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return transformer_block(p, h, CFG["heads"])

    blk = remat(block) if use_remat else block

    def loss_one(params: Any, x: torch.Tensor) -> torch.Tensor:
        h = x[None]  # one example: (1, seq, d)
        for p in params:
            h = blk(p, h)
        return (h * h).mean()

    grads = vmap(grad(loss_one), in_dims=(None, 0))(params, xs)
    return grads, calls[0]


def _peak_mib(variant: str) -> float:
    """Run in a fresh process: peak RSS increase of one vmap(grad) call, after a warm-up call."""
    torch.set_num_threads(1)
    use = variant == "remat"
    per_example_grads(use)  # warm up
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS (VmHWM) to the current RSS

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key))

    before = status("VmRSS:")
    grads, _ = per_example_grads(use)
    peak = status("VmHWM:")
    del grads
    return (peak - before) / 1024


def main() -> None:
    torch.set_num_threads(1)
    plain, plain_calls = per_example_grads(False)
    rem, rem_calls = per_example_grads(True)
    leaves_p, leaves_r = torch.utils._pytree.tree_leaves(plain), torch.utils._pytree.tree_leaves(rem)
    equal = all(torch.equal(a, b) for a, b in zip(leaves_p, leaves_r)) and len(leaves_p) == len(leaves_r)
    n = CFG["batch"]
    print(f"per-example gradients of {n} examples, {CFG['blocks']} transformer blocks "
          f"(seq {CFG['seq']}, d {CFG['d']}): shape of the first one {tuple(leaves_r[0].shape)}")
    print(f"block calls: without remat {plain_calls}, with remat {rem_calls} "
          f"({CFG['blocks']} forward + {rem_calls - CFG['blocks']} recomputed in the backward pass)")
    print(f"per-example gradients bitwise equal with and without remat: {equal}")

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    peaks = {}
    for variant in ("plain", "remat"):
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--peak", variant], env=env,
                             capture_output=True, text=True, check=True)
        peaks[variant] = float(out.stdout.strip().splitlines()[-1])
    print(f"peak memory of vmap(grad(loss)) (RSS, MiB, includes the {n} per-example gradients): "
          f"without remat {peaks['plain']:.1f}, with remat {peaks['remat']:.1f}, "
          f"saved {peaks['plain'] - peaks['remat']:.1f}")
    if not equal:
        raise SystemExit("per-example gradients differ with remat")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--peak":
        print(_peak_mib(sys.argv[2]))
    else:
        main()
