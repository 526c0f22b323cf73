"""The core benchmark: retained activation memory and step time of a transformer stack on the CPU.

Workload: 4 pre-LN transformer blocks (batch 8, seq 256, d_model 512, 8 heads,
MLP 2048, explicit attention, float32), each block wrapped; the model is
``make_model("transformer", "medium")`` from ``remat/bench/models.py``.

* Retained memory: for each configuration a fresh Python process (environment
  ``MALLOC_MMAP_THRESHOLD_=131072 MALLOC_TRIM_THRESHOLD_=131072``, so that glibc
  returns freed tensors and RSS follows live tensor bytes) runs one warm-up step,
  then reads its RSS before and after a forward pass: the difference is what the
  forward pass leaves alive for the backward pass. The in-process live-storage
  census of ``remat.bench.measure`` is shown next to it as a second, independent
  figure.
* Time: forward + backward, all configurations interleaved in one process
  (every configuration once per round), median of the rounds, and the median of
  the per-round ratios to plain autograd (``remat.bench.measure.measure``).

Usage::

    python benchmarks/transformer_cpu.py [--threads 2] [--rounds 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

import torch

from remat.bench.configs import make_wrap
from remat.bench.measure import Config, MiB, measure, ratio
from remat.bench.models import SIZES, make_model

CONFIGS = ["no-remat", "save-nothing", "save-matmuls", "offload-to-cpu", "torch-checkpoint", "torch-sac-matmuls"]
SAME_POLICY_IN_TORCH = {"save-nothing": "torch-checkpoint", "save-matmuls": "torch-sac-matmuls"}
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def _model():
    params, x, _, apply = make_model("transformer", "medium")
    for blk in params:
        for t in blk.values():
            t.requires_grad_(True)
    return params, x, apply


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(key: str, threads: int) -> None:
    """In a fresh process: RSS retained by one forward pass of configuration ``key``."""
    torch.set_num_threads(threads)
    params, x, apply = _model()
    wrap = make_wrap(key, "transformer")
    wrt = [t for blk in params for t in blk.values()]
    torch.autograd.grad(apply(params, x, wrap), wrt)  # warm-up: thread pools, caches, first-touch pages
    gc.collect()
    before = _rss()
    loss = apply(params, x, wrap)
    gc.collect()
    after = _rss()
    torch.autograd.grad(loss, wrt)  # the step must still work
    print(json.dumps({"key": key, "retained_bytes": after - before}))


def rss_retained(key: str, threads: int) -> int:
    env = dict(os.environ, **MALLOC_ENV)
    p = subprocess.run([sys.executable, __file__, "--child", key, "--threads", str(threads)], env=env,
                       capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"measuring {key} failed:\n{p.stderr}")
    return int(json.loads(p.stdout.strip().splitlines()[-1])["retained_bytes"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds (default 7)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.threads)
        return 0
    torch.set_num_threads(a.threads)

    def say(msg: str) -> None:
        print(f"transformer_cpu: {msg}", file=sys.stderr, flush=True)

    rss = {}
    for k in CONFIGS:
        say(f"retained memory of {k} (fresh process)")
        rss[k] = rss_retained(k, a.threads)
    params, x, apply = _model()
    configs = [Config(k, lambda p, i, w=make_wrap(k, "transformer"): apply(p, i, w)) for k in CONFIGS]
    t0 = time.perf_counter()
    rows = measure(configs, [params, x], steps=a.rounds, warmup=1, progress=say)
    say(f"timing done in {time.perf_counter() - t0:.0f} s")
    by = {r.label: r for r in rows}

    head = ["configuration", "retained MiB (RSS)", "retained MiB (census)", "ms/step", "vs no-remat (wall)",
            "vs no-remat (CPU)", "vs torch, same policy (wall)", "vs torch, same policy (CPU)", "recomputed GFLOP"]
    body = []
    base = by["no-remat"]
    for r in rows:
        same = by.get(SAME_POLICY_IN_TORCH.get(r.label, ""))
        body.append([r.label, f"{rss[r.label] / MiB:.0f}", f"{r.retained_bytes / MiB:.0f}", f"{r.time_s * 1e3:.0f}",
                     f"{ratio(r, base):.3f}x", f"{ratio(r, base, cpu=True):.3f}x",
                     f"{ratio(r, same):.3f}x" if same else "-", f"{ratio(r, same, cpu=True):.3f}x" if same else "-",
                     f"{r.recomputed_flops / 1e9:.2f}"])
    widths = [max(len(c) for c in col) for col in zip(head, *body, strict=True)]
    cfg = SIZES["medium"]["transformer"]
    print(f"transformer stack {cfg}, float32, CPU, {a.threads} threads, median of {a.rounds} rounds, "
          f"torch {torch.__version__}")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for b in body:
        print("| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                for i, (c, w) in enumerate(zip(b, widths, strict=True))) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": cfg, "threads": a.threads, "rounds": a.rounds, "torch": torch.__version__,
                       "rss_retained_bytes": rss, "rows": [r.to_dict() for r in rows]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
