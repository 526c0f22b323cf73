"""Memory of per-example gradients ``vmap(grad(loss))`` over the transformer stack, plain vs remat policies.

Each configuration runs in a fresh subprocess whose glibc returns freed memory
(``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_``, see
/work/shared/research/measuring-memory.md), so RSS follows live tensor bytes.
The child builds the model, runs one warm-up step, resets the peak RSS
(``/proc/self/clear_refs``), runs ``vmap(grad(loss), in_dims=(None, 0))`` once
and reports, above the RSS before the step: the RSS at the end of the forward
pass (read by the loss function itself, which vmap runs once, after its last
op: what is retained for the backward pass, per-example input wrappers
included) and the peak RSS of the whole step (``VmHWM``, which the per-example
weight gradients, batch x parameters, dominate). Nothing is read from remat's
own bookkeeping.

Usage::

    python benchmarks/transforms_memory.py               # transformer "medium" (the issue's workload)
    python benchmarks/transforms_memory.py --size small  # quicker
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

CONFIGS = {
    "plain": None,
    "save-nothing": "nothing_saveable",
    "save-matmuls": "dots_saveable",
    "dots-no-batch": "dots_with_no_batch_dims_saveable",
    "save-everything": "everything_saveable",
}

_CHILD = r"""
import gc, json, sys, time
import torch
from torch.func import grad, vmap
from remat import remat, policies
from remat.bench.models import make_model

size, pol_name = sys.argv[1], sys.argv[2]
torch.set_num_threads(int(sys.argv[3]))
params, x, block, _ = make_model("transformer", size)
policy = None if pol_name == "None" else getattr(policies, pol_name)
blk = block if policy is None else remat(block, policy=policy)

marks = []

def loss(params, x):  # one example: x is [1, seq, d]
    h = x
    for p in params:
        h = blk(p, h)
    out = (h * h).mean()
    gc.collect()
    marks.append(status("VmRSS:"))  # vmap runs this once: the forward pass is over, the backward not begun
    return out

per_example = vmap(grad(loss), in_dims=(None, 0))
xs = x.unsqueeze(1)  # [batch, 1, seq, d]: one example per vmap slot

def status(key):  # noqa: E306
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)

g = per_example(params, xs)  # warm-up
del g
gc.collect()
base = status("VmRSS:")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
t0 = time.perf_counter()
g = per_example(params, xs)
dt = time.perf_counter() - t0
peak = status("VmHWM:")
checksum = float(sum(v.double().sum() for p in g for v in p.values()))
print(json.dumps({"retained": marks[-1] - base, "peak_over_base": peak - base, "seconds": dt,
                  "checksum": checksum}))
"""


def run_config(size: str, policy: str | None, threads: int) -> dict[str, float]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072",
               OMP_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-c", _CHILD, size, str(policy), str(threads)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="medium", choices=["small", "medium", "large"])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import torch

    print(f"vmap(grad) per-example gradients, transformer {args.size}, float32, CPU, "
          f"torch {torch.__version__}, {datetime.date.today().isoformat()}")
    rows = {name: run_config(args.size, pol, args.threads) for name, pol in CONFIGS.items()}
    plain = rows["plain"]
    print("| config | retained fwd->bwd (MiB) | vs plain | peak over base (MiB) | vs plain | time (s) "
          "| grad checksum |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['retained'] / 2**20:.1f} | {r['retained'] / plain['retained']:.2f} "
              f"| {r['peak_over_base'] / 2**20:.1f} | {r['peak_over_base'] / plain['peak_over_base']:.2f} "
              f"| {r['seconds']:.2f} | {r['checksum']:.6g} |")


if __name__ == "__main__":
    main()
