"""Three-way budgets and offload under torch.compile, measured on a GPU (a stage of benchmarks/gpu_check.sh).

On CUDA it measures the device once (``DeviceModel.probe``: a bfloat16 matrix product and pinned copies each
way), then runs the reference transformer stack (4 blocks, batch 8, seq 256, d 512, float32), one remat over the
whole model, in one process, interleaved, for each budget (default 10% and 25%):

* no remat; ``memory_budget(f)`` (keep/recompute); ``memory_budget(f, offload=<the probed model>)``
  (keep/offload/recompute);
* and once: ``torch.compile`` of the stack with each block under ``offload_to_cpu()``, compiled inside
  ``remat.offload.compiled_offloading()`` (the compiled offload row: torch's compile-time activation offloading,
  driven by the policy, moves the values to host memory; on a torch without it remat warns and recomputes them).

For each row: **held** MiB (``torch.cuda.memory_allocated`` at the end of the forward pass, less the
parameters and input), **peak** MiB (``max_memory_allocated`` over the step), the median step time in ms
(forward and backward, synchronised), the ratio to no remat and to the keep/recompute plan at the same budget,
the bytes the offload engine copied to the host, and the plan's modelled time.

    python benchmarks/budget_gpu.py                      # CUDA
    python benchmarks/budget_gpu.py --tiny               # the CPU, a tiny stack, DeviceModel.h200() (tests)
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import remat
from remat import DeviceModel, policies
from remat.bench.models import make_transformer
from remat.offload import OffloadEngine, compiled_offloading, use_engine

STACK = {"blocks": 4, "batch": 8, "seq": 256, "d": 512, "heads": 8, "ff": 2048}
TINY = {"blocks": 2, "batch": 2, "seq": 16, "d": 32, "heads": 2, "ff": 64}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the CPU, a tiny stack, a given device model")
    ap.add_argument("--budgets", default="0.1,0.25", help="comma-separated fractions")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per row (median)")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled offload row")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not a.tiny
    dev = torch.device("cuda" if cuda else "cpu")
    cfg = TINY if a.tiny else STACK
    model = DeviceModel.probe(dev) if cuda else DeviceModel.h200()
    print(f"budget_gpu: {dev}, torch {torch.__version__}; device model {'probed' if cuda else 'given'}: "
          f"{model.flops / 1e12:.1f} TFLOP/s, {model.d2h / 1e9:.1f} GB/s to the host, {model.h2d / 1e9:.1f} back")
    params, x, _, apply = make_transformer(**cfg, device=dev)
    for blk in params:
        for t in blk.values():
            t.requires_grad_(True)
    wrt = [t for blk in params for t in blk.values()]
    base = torch.cuda.memory_allocated() if cuda else 0
    engine = OffloadEngine(pin_memory=cuda)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    ref: list[torch.Tensor] = []

    def run(fn: Callable[..., torch.Tensor]) -> tuple[float, float, float, str]:
        """(held MiB after the forward pass, peak MiB, median step ms, gradients against no remat's)."""
        times, held, peak, grads = [], 0.0, 0.0, ()
        for i in range(a.steps + 1):
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            loss = fn(params, x)
            sync()
            if cuda:
                held = (torch.cuda.memory_allocated() - base) / 2**20
            grads = torch.autograd.grad(loss, wrt)
            sync()
            if i:  # the first step measures and solves
                times.append(time.perf_counter() - t0)
            if cuda:
                peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            del loss
        if not ref:
            ref.extend(grads)
        same = "bitwise" if all(torch.equal(a, b) for a, b in zip(grads, ref)) else (
            "close" if all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(grads, ref)) else "WRONG")
        return held, peak, statistics.median(times) * 1e3, same

    rows: list[tuple[str, str, float, float, float, str, Any, str]] = []
    with use_engine(engine):
        plain = run(apply)
        rows.append(("-", "no remat", *plain, 0, ""))
        for f in [float(s) for s in a.budgets.split(",")]:
            two = policies.memory_budget(f)
            three = policies.memory_budget(f, offload=model)
            got = {}
            for kind, pol in (("keep/recompute", two), ("keep/offload/recompute", three)):
                moved0 = _moved(engine)
                got[kind] = run(remat.remat(apply, policy=pol))
                plan = next(iter(pol.plans.values()))
                note = "" if plan is None else (
                    f"modelled {plan.seconds * 1e6:.1f} µs vs {plan.two_way_seconds * 1e6:.1f} µs keep/recompute; "
                    f"offloads {len(plan.offloaded)} ops, {plan.offloaded_bytes / 2**20:.1f} MiB"
                    if pol is three else f"keeps {plan.kept_bytes / 2**20:.1f} MiB")
                rows.append((f"{f:.0%}", kind, *got[kind], (_moved(engine) - moved0) // (a.steps + 1), note))
        if not a.no_compile:
            rows.append(("-", *_compiled_row(apply, run)))
    print("\n| budget | configuration | held MiB | peak MiB | step ms | vs no remat | gradients | copied MiB/step | |")
    print("|---|---|--:|--:|--:|--:|---|--:|---|")
    for budget, what, held, peak, ms, same, copied, note in rows:
        print(f"| {budget} | {what} | {held:.2f} | {peak:.2f} | {ms:.2f} | {ms / plain[2]:.2f}x | {same} | "
              f"{copied / 2**20:.1f} | {note} |")
    return 1 if any(r[5] in ("WRONG", "FAILED") for r in rows) else 0


def _moved(engine: OffloadEngine) -> int:
    """Bytes the engine copied to the host so far (its own count: the census of device memory is the check)."""
    return int(engine.stats["offloaded_bytes"])


def _compiled_row(apply: Callable[..., torch.Tensor],
                  run: Callable[[Callable[..., torch.Tensor]], tuple[float, float, float, str]]) -> tuple[Any, ...]:
    wrap = remat.remat  # each block under offload_to_cpu, compiled as a whole
    fn = torch.compile(lambda p, x: apply(p, x, wrap=lambda blk: wrap(blk, policy=policies.offload_to_cpu(min_bytes=0))))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with compiled_offloading():  # (the first step compiles: torch's offloading pass, driven by the policy)
                held, peak, ms, same = run(fn)
        except Exception as e:  # noqa: BLE001 (a benchmark row: report, do not stop the check)
            return ("torch.compile, offload_to_cpu per block", 0.0, 0.0, float("nan"), "FAILED", 0,
                    f"{type(e).__name__}: {str(e)[:120]}")
    fell_back = any("offload" in str(w.message) for w in caught)
    return ("torch.compile, offload_to_cpu per block", held, peak, ms, same, 0,
            "fell back to recompute (warned)" if fell_back else "torch's activation offloading")


if __name__ == "__main__":
    raise SystemExit(main())
