"""``policies.memory_budget`` against the best fixed policy and ``torch.compile``'s ``activation_memory_budget``.

For each budget fraction ``f`` and each model it measures, in one process, the activation bytes kept
between the forward and the backward pass (a live-storage census outside remat for eager code; torch's
autograd graph for compiled code, ``remat.bench.measure.saved_bytes``) and the GFLOPs the backward pass
recomputes (torch's FLOP formulas, counted at dispatch on the backward pass, minus what the same model's
backward pass costs without recompute):

* ``memory_budget(f)``, one remat over the whole model (the budget is a fraction of all it would keep);
* ``memory_budget(f)`` on each block (a fraction of what each block keeps; the block inputs come on top);
* the best fixed JAX-style policy on each block that keeps at most ``f`` of the whole model's bytes
  (the least recompute among nothing, dots, dots without batch dims, names, everything);
* the model under ``torch.compile`` with ``activation_memory_budget = f`` (its knapsack over recomputable
  nodes; backend ``aot_eager``, whose partitioner is inductor's, so that the recompute can be counted);
* ``memory_budget(bytes)`` over the whole model with the bytes torch's compiled model kept: the
  recompute of both at equal memory.

Models: the reference transformer stack (4 blocks, batch 8, seq 256, d 512) and a chain of 24 small
blocks (batch 2, seq 64, d 128, as ``benchmarks/chain_budget.py``). The table is in docs/budgets.md.

    python benchmarks/memory_budget.py                         # both models, budgets 5%, 10%, 25%, 50%
    python benchmarks/memory_budget.py --model chain --budgets 0.1,0.5
    python benchmarks/memory_budget.py --offload               # keep/recompute against keep/offload/recompute

``--offload`` compares, per budget, ``memory_budget(f)`` with ``memory_budget(f, offload=model)`` under a stated
device model (default ``DeviceModel.h200()``: 989 TFLOP/s, PCIe Gen5 x16 at 64 GB/s each way; ``--flops``,
``--d2h``, ``--h2d`` change it): the retained MiB on the device (the census outside remat; what is offloaded runs
through the offload engine, host to host on this CPU), the host MiB and the modelled step time of each plan
(NOTE [three-way budget] in ``remat/_budgets/budget_offload.py``) against no remat.
"""

from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Callable

import torch

import remat
from remat import DeviceModel, policies
from remat import _torch_internals as ti
from remat.bench.measure import FlopCount, live_bytes_after, saved_bytes
from remat.bench.models import make_transformer

MODELS = {
    "stack": {"blocks": 4, "batch": 8, "seq": 256, "d": 512, "heads": 8, "ff": 2048},
    "chain": {"blocks": 24, "batch": 2, "seq": 64, "d": 128, "heads": 4, "ff": 512},
}
TINY = {"blocks": 2, "batch": 2, "seq": 16, "d": 32, "heads": 2, "ff": 64}  # --tiny: the test's smoke run
FIXED = {
    "nothing_saveable": policies.nothing_saveable,
    "dots_with_no_batch_dims_saveable": policies.dots_with_no_batch_dims_saveable,
    "dots_saveable": policies.dots_saveable,
    "save_only_these_names('attn')": policies.save_only_these_names("attn"),
    "save_only_these_names('ff')": policies.save_only_these_names("ff"),
    "save_only_these_names('attn', 'ff')": policies.save_only_these_names("attn", "ff"),
    "everything_saveable": policies.everything_saveable,
}


def run_model(name: str, cfg: dict[str, int], budgets: list[float],
              backend: str) -> list[tuple[str, str, float, float, str]]:
    params, x, _, apply = make_transformer(**cfg)
    for blk in params:
        for t in blk.values():
            t.requires_grad_(True)
    wrt = [t for blk in params for t in blk.values()]

    def backward_flops(loss: torch.Tensor) -> int:
        with FlopCount() as fc:
            torch.autograd.grad(loss, wrt)
        return fc.total

    def eager(fn: Callable[..., torch.Tensor]) -> tuple[int, int]:
        _, held = live_bytes_after(lambda: fn(params, x))
        return held, backward_flops(fn(params, x))

    def compiled(f: float) -> tuple[int, int]:
        torch._dynamo.reset()  # noqa: SLF001 (a benchmark: each budget compiles afresh)
        with ti.activation_memory_budget(f):
            fn = torch.compile(lambda p, x: apply(p, x), backend=backend)
            loss = fn(params, x)
        return saved_bytes(loss, inputs=(params, x)), backward_flops(loss)

    full, base = eager(apply)
    _, cbase = compiled(1.0)
    fixed = {k: eager(functools.partial(apply, wrap=functools.partial(remat.remat, policy=p)))
             for k, p in FIXED.items()}
    rows = [(f"{name}", "no remat", full, 0.0, "")]
    for f in budgets:
        pct = f"{f:.0%}"
        whole = policies.memory_budget(f)
        fn = remat.remat(apply, policy=whole)
        fn(params, x).backward()  # solves
        plan = next(iter(whole.plans.values()))
        held, fl = eager(fn)
        rows.append((pct, "memory_budget, whole model", held, fl - base,
                     f"solved in {plan.solve_seconds:.2f} s" if plan else ""))
        per = policies.memory_budget(f)
        wrap = functools.partial(remat.remat, policy=per)
        apply(params, x, wrap).backward()
        held, fl = eager(functools.partial(apply, wrap=wrap))
        rows.append((pct, "memory_budget, each block", held, fl - base, ""))
        fits = [(fl, k, held) for k, (held, fl) in fixed.items() if held <= f * full]
        if fits:
            fl, k, held = min(fits)
            rows.append((pct, f"best fixed policy: {k}", held, fl - base, ""))
        else:
            rows.append((pct, "best fixed policy: none fits", math.nan, math.nan, ""))
        held_c, fl_c = compiled(f)
        rows.append((pct, "torch.compile activation_memory_budget", held_c, fl_c - cbase, ""))
        same = policies.memory_budget(int(held_c))
        fn = remat.remat(apply, policy=same)
        fn(params, x).backward()
        held, fl = eager(fn)
        rows.append((pct, "memory_budget at torch's bytes, whole model", held, fl - base, ""))
    return rows


def run_offload(name: str, cfg: dict[str, int], budgets: list[float],
                model: DeviceModel) -> list[tuple[str, str, float, float, float, float]]:
    """Rows (budget, plan, retained MiB, host MiB, modelled ms, recomputed GFLOP) for both kinds of plan."""
    from remat.offload import OffloadEngine, use_engine

    params, x, block, apply = make_transformer(**cfg)
    for blk in params:
        for t in blk.values():
            t.requires_grad_(True)
    wrt = [t for blk in params for t in blk.values()]
    blocks = [functools.partial(block, p) for p in params]

    def measured(fn: Callable[..., torch.Tensor]) -> tuple[int, int]:
        loss, held = live_bytes_after(lambda: fn(params, x))
        with FlopCount() as fc:
            torch.autograd.grad(loss, wrt)
        return held, fc.total

    with use_engine(OffloadEngine(pin_memory=False)):
        full, base = measured(apply)
        rows = []
        for f in [1.0, *budgets]:
            for kind, pol in (("keep/recompute", policies.memory_budget(f, offload=model)),
                              ("keep/offload/recompute", policies.memory_budget(f, offload=model))):
                fn = remat.remat(apply, policy=pol)
                fn(params, x).backward()  # solves
                plan = next(iter(pol.plans.values()))
                assert plan is not None
                if kind == "keep/recompute":  # the same model, priced without offloading: a budget's two-way plan
                    pol = policies.memory_budget(f)
                    fn = remat.remat(apply, policy=pol)
                    fn(params, x).backward()
                    secs, host = plan.two_way_seconds, 0
                else:
                    secs, host = plan.seconds, plan.offloaded_bytes
                held, fl = measured(fn)
                label = "no remat" if f == 1.0 else f"{f:.0%}"
                if f == 1.0 and kind == "keep/recompute":
                    rows.append((label, "no remat (measured)", full, 0.0, secs * 1e3, 0.0))
                    continue
                if f == 1.0:
                    continue
                rows.append((label, kind, held, host, secs * 1e3, (fl - base) / 1e9))
            if f == 1.0:
                continue
            for kind, off in (("sequential, keep/recompute", None), ("sequential, keep/offload/recompute", model)):
                try:
                    seq = remat.sequential(blocks, budget=f, offload=model)
                    (seq(x) ** 2).mean().backward()  # solves
                except ValueError:  # no schedule fits
                    rows.append((f"{f:.0%}", f"{kind}: none fits", math.nan, math.nan, math.nan, math.nan))
                    continue
                plan = next(iter(seq.plans.values()))
                if off is None:
                    try:
                        seq = remat.sequential(blocks, budget=f)
                        (seq(x) ** 2).mean().backward()
                    except ValueError:
                        rows.append((f"{f:.0%}", f"{kind}: none fits", math.nan, math.nan, math.nan, math.nan))
                        continue
                secs = plan.seconds if off is not None else plan.two_way_seconds
                host = plan.host_bytes if off is not None else 0
                held, fl = measured(lambda p, x: (seq(x) ** 2).mean())  # noqa: B023
                rows.append((f"{f:.0%}", f"{kind} ({seq.schedule(x)})", held, host, secs * 1e3, (fl - base) / 1e9))
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["stack", "chain", "both"], default="both")
    p.add_argument("--budgets", default="0.05,0.1,0.25,0.5", help="comma-separated fractions")
    p.add_argument("--backend", default="aot_eager", help="torch.compile backend for torch's budget")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--tiny", action="store_true", help="tiny models (a smoke test)")
    p.add_argument("--plot", default=None, metavar="PNG", help="retained MiB against recomputed GFLOP, per model")
    p.add_argument("--offload", action="store_true", help="keep/recompute against keep/offload/recompute")
    p.add_argument("--flops", type=float, default=None, help="--offload: the device's FLOP/s (default H200's)")
    p.add_argument("--d2h", type=float, default=None, help="--offload: device-to-host bytes/s (default 64e9)")
    p.add_argument("--h2d", type=float, default=None, help="--offload: host-to-device bytes/s (default 64e9)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    budgets = [float(s) for s in a.budgets.split(",")]
    models = {k: TINY for k in MODELS} if a.tiny else MODELS
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, compiled with backend {a.backend}")
    names = ["stack", "chain"] if a.model == "both" else [a.model]
    if a.offload:
        h = DeviceModel.h200()
        model = DeviceModel(flops=a.flops or h.flops, d2h=a.d2h or h.d2h, h2d=a.h2d or h.h2d)
        print(f"device model: {model.flops / 1e12:g} TFLOP/s, {model.d2h / 1e9:g} GB/s to the host, "
              f"{model.h2d / 1e9:g} GB/s back, {model.max_inflight_bytes >> 20} MiB in flight")
        for name in names:
            cfg = models[name]
            print(f"\n{name}: {cfg}")
            print("| budget | plan | retained MiB | host MiB | modelled step µs | vs no remat | recomputed GFLOP |\n"
                  "|---|---|--:|--:|--:|--:|--:|")
            rows = run_offload(name, cfg, budgets, model)
            plain = rows[0][4]
            for budget, what, held, host, ms, gf in rows:
                if math.isnan(held):
                    print(f"| {budget} | {what} | - | - | - | - | - |", flush=True)
                    continue
                print(f"| {budget} | {what} | {held / 2**20:.2f} | {host / 2**20:.2f} | {ms * 1e3:.1f} | "
                      f"{ms / plain:.3f}x | {gf:.3f} |", flush=True)
        return
    results = {}
    for name in names:
        cfg = models[name]
        print(f"\n{name}: {cfg}")
        print("| budget | configuration | retained MiB | recomputed GFLOP | |\n|---|---|--:|--:|---|")
        results[name] = rows = run_model(name, cfg, budgets, a.backend)
        for budget, what, held, flops, note in rows:
            mib = "-" if math.isnan(held) else f"{held / 2**20:.2f}"
            gf = "-" if math.isnan(flops) else f"{flops / 1e9:.3f}"
            print(f"| {budget} | {what} | {mib} | {gf} | {note} |", flush=True)
    if a.plot:
        plot(results, models, a.plot)
        print(f"wrote {a.plot}")


def plot(results: dict[str, list[tuple[str, str, float, float, str]]], models: dict[str, dict[str, int]],
         path: str) -> None:
    """One panel per model: retained MiB (x) against recomputed GFLOP (y), a line per configuration family."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.5 * len(results), 4.8), squeeze=False)
    styles = {"memory_budget, whole model": ("o-", "memory_budget (whole model)"),
              "torch.compile activation_memory_budget": ("s--", "torch.compile activation_memory_budget"),
              "best fixed policy": ("^:", "best fixed policy within the budget")}
    for ax, (name, rows) in zip(axes[0], results.items()):
        for key, (style, label) in styles.items():
            pts = sorted((held / 2**20, flops / 1e9) for _, what, held, flops, _ in rows
                         if what.startswith(key) and not math.isnan(held))
            if pts:
                ax.plot(*zip(*pts), style, label=label, alpha=0.8)
        ax.set_title(f"{name}: {models[name]}", fontsize=8)
        ax.set_xlabel("retained MiB (activations between forward and backward)")
        ax.set_ylabel("recomputed GFLOP in the backward pass")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
