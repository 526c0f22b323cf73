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
without remat, counts the block's Python calls (once per block: the recompute
replays the calls the forward pass made, it does not run the Python again) and
its softmax ops (one more per block with remat: the recompute ran), and measures
the peak memory of the whole per-example-gradient call in a fresh process per
variant (peak RSS, ``VmHWM`` after a reset through ``/proc/self/clear_refs``,
with glibc told to return freed memory; see docs/policies.md).

What the peak shows: ``torch.func.grad`` always runs its backward pass with
``create_graph=True`` (so that it can be nested), and the graph of that backward
pass holds on to every tensor the backward pass reads, the recomputed ones
included, until ``grad`` returns. So under ``vmap(grad(...))`` remat lowers the
memory held between the forward and the backward pass, but the peak, reached at
the end of the backward pass, stays that of plain autograd. Computing the same
gradients with ``torch.func.vjp`` and ``create_graph=False`` (possible when no
higher derivative is taken) frees each block's tensors as soon as the backward
pass is done with them, and there remat lowers the peak.

Run: ``python examples/per_example_grads.py`` (Linux, about 20 s on one CPU thread).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from typing import Any

import optree
import torch
from torch.func import grad, vjp, vmap
from torch.utils._python_dispatch import TorchDispatchMode

from remat import remat
from remat.bench.models import make_transformer, transformer_block

# batch = number of examples; long sequences, so that activations outweigh the per-example gradients
CFG = {"blocks": 2, "batch": 8, "seq": 256, "d": 64, "heads": 4, "ff": 256}


class SoftmaxCount(TorchDispatchMode):
    """Count the softmax ops that run (under vmap, one batched op per block and pass)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.n += func is torch.ops.aten._softmax.default
        return func(*args, **(kwargs or {}))


def per_example_grads(use_remat: bool, method: str = "grad") -> tuple[Any, int, int]:
    """Gradients of each example's loss with respect to all parameters, the block's Python calls and the softmax
    ops that ran."""
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

    with SoftmaxCount() as softmaxes:
        if method == "grad":
            grads = vmap(grad(loss_one), in_dims=(None, 0))(params, xs)
        else:  # the same gradients without building a graph of the backward pass

            def grad_one(params: Any, x: torch.Tensor) -> Any:
                loss, pullback = vjp(lambda p: loss_one(p, x), params)
                return pullback(torch.ones_like(loss), retain_graph=False, create_graph=False)[0]

            grads = vmap(grad_one, in_dims=(None, 0))(params, xs)
    return grads, calls[0], softmaxes.n


def _peaks_mib(variant: str) -> dict[str, float]:
    """Run in a fresh process: peak RSS increase of one call per method, each after a warm-up call."""
    torch.set_num_threads(1)
    use = variant == "remat"

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key))

    peaks = {}
    for method in ("grad", "vjp"):
        per_example_grads(use, method)  # warm up
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
        before = status("VmRSS:")
        grads, _, _ = per_example_grads(use, method)
        peaks[method] = (status("VmHWM:") - before) / 1024
        del grads
    return peaks


def main() -> None:
    torch.set_num_threads(1)
    plain, plain_calls, plain_softmaxes = per_example_grads(False)
    rem, rem_calls, rem_softmaxes = per_example_grads(True)
    via_vjp, _, _ = per_example_grads(True, "vjp")
    leaves_p, leaves_r = optree.tree_leaves(plain), optree.tree_leaves(rem)
    leaves_v = optree.tree_leaves(via_vjp)
    equal = len(leaves_p) == len(leaves_r) == len(leaves_v) and all(
        torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(leaves_p, leaves_r, leaves_v))
    n = CFG["batch"]
    print(f"per-example gradients of {n} examples, {CFG['blocks']} transformer blocks "
          f"(seq {CFG['seq']}, d {CFG['d']}): shape of the first one {tuple(leaves_r[0].shape)}")
    print(f"block calls: without remat {plain_calls}, with remat {rem_calls} (the Python runs once per block)")
    print(f"softmax ops: without remat {plain_softmaxes}, with remat {rem_softmaxes} "
          f"({rem_softmaxes - plain_softmaxes} replayed in the backward pass)")
    print(f"per-example gradients bitwise equal with and without remat (vmap of grad, and of vjp): {equal}")

    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    print(f"peak memory of the call (RSS, MiB, including the {n} per-example gradients):")
    peaks = {}
    for variant in ("plain", "remat"):
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--peak", variant], env=env,
                             capture_output=True, text=True, check=True)
        peaks[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    for method, what in (("grad", "vmap(grad(loss))"), ("vjp", "vmap of vjp(loss), create_graph=False")):
        print(f"  {what:<40} without remat {peaks['plain'][method]:6.1f}, with remat {peaks['remat'][method]:6.1f}")
    if not equal:
        raise SystemExit("per-example gradients differ with remat")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--peak":
        print(json.dumps(_peaks_mib(sys.argv[2])))
    else:
        main()
