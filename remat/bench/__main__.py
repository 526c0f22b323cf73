"""``python -m remat.bench``: compare remat policies with torch's checkpointing on a reference model.

For each configuration (see ``remat/bench/configs.py``) it runs forward and
backward steps of the model and prints, per configuration: activation memory
retained between the forward and the backward pass, peak memory of the step,
time per step and its ratio to plain autograd, and the GFLOPs recomputed in the
backward pass (see ``remat/bench/measure.py`` for how each is measured).

Example::

    python -m remat.bench                                   # the demo transformer, CPU, under a minute
    python -m remat.bench --model mlp --size medium --steps 10 --json out.json --plot out.png
    python -m remat.bench --device cuda --dtype bfloat16 --size large
    python -m remat.bench --compile                         # adds the same model under torch.compile
    python -m remat.bench --budgets 0.35,0.5                # adds remat.sequential over the blocks and
                                                            # policies.memory_budget per block at these budgets
    python -m remat.bench --budgets 0.25 --compile          # and torch.compile's activation_memory_budget
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from .. import _torch_internals as ti
from .. import policies
from .._api.transform import remat
from .._budgets.sequential import sequential
from .._errors import RematError
from .configs import COMPILED, CONFIGS, NAMES, applies, default_configs, label, make_wrap
from .measure import Config, MiB, format_table, measure, pareto_front, plot, ties, time_better
from .models import SIZES, make_model

MIN_TIME = 12.0  # seconds of timed steps the default run measures at least: enough rounds for a stable ranking
MAX_STEPS = 60

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _positive(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _fractions(s: str) -> list[float]:
    try:
        out = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected fractions such as 0.25,0.5, got {s!r}") from None
    if not out or not all(0.0 < f <= 1.0 for f in out):
        raise argparse.ArgumentTypeError(f"expected fractions in (0, 1], got {s!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m remat.bench",
        description="Compare remat policies with torch.utils.checkpoint on a reference model: retained and "
        "peak memory, time per forward+backward step, recomputed FLOPs.",
        epilog="configurations: " + "; ".join(f"{k}: {v}" for k, v in CONFIGS.items()),
    )
    p.add_argument("--model", choices=sorted(SIZES["demo"]), default="transformer", help="reference model")
    p.add_argument("--size", choices=list(SIZES), default="demo",
                   help="model size (default: demo, tens of MiB of activations, under a minute on 2 CPU cores)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--steps", type=_positive, default=None,
                   help="timed rounds, every configuration once per round (default: at least 7, and more until "
                   f"the timed steps took {MIN_TIME:g} s in all, at most {MAX_STEPS} rounds)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per configuration first (default 1)")
    p.add_argument("--policies", default=None,
                   help="comma-separated configurations to run (default: all that apply to the device); "
                   "no-remat always runs first as the baseline")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="also run the model under torch.compile (backend inductor, or the one named: aot_eager, "
                   f"...) with no remat and with {', '.join(COMPILED[1:])}; labels start with 'compiled'")
    p.add_argument("--budgets", default=None, metavar="F[,F...]", type=_fractions,
                   help="also run, for each F: remat.sequential over the model's blocks with budget=F (a fraction of "
                   "what the blocks keep without remat; label 'budget F%%'), each block remat'd with "
                   "policies.memory_budget(F) ('memory_budget F%%') and, with --compile, the model compiled with "
                   "torch's activation_memory_budget=F ('compiled budget F%%')")
    p.add_argument("--threads", type=_positive, default=None, help="torch.set_num_threads on CPU")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")
    p.add_argument("--plot", metavar="PATH", default=None,
                   help="also write a PNG of memory against time with the Pareto front (needs matplotlib)")
    return p


def _device(p: argparse.ArgumentParser, spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(spec)
    except RuntimeError:
        p.error(f"--device: unknown device {spec!r}; use cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {spec}: CUDA is not available here (torch {torch.__version__}, "
                f"CUDA build: {torch.version.cuda or 'no'}); use --device cpu")
    if dev.type not in ("cpu", "cuda"):
        p.error(f"--device: {spec!r} is not supported; use cpu, cuda or cuda:N")
    return dev


def _configs(p: argparse.ArgumentParser, spec: str | None, model: str, device: torch.device) -> list[str]:
    if spec is None:
        return default_configs(model, device)
    keys = [k.strip() for k in spec.split(",") if k.strip()]
    bad = [k for k in keys if k not in CONFIGS]
    if bad or not keys:
        p.error(f"--policies: unknown configuration(s) {', '.join(bad) or '(none given)'}; "
                f"choose from {', '.join(CONFIGS)}")
    if "names" in keys and model not in NAMES:
        p.error(f"--policies: names: {applies('names', model, device)}; "
                f"use it with --model {' or '.join(sorted(NAMES))}")
    return ["no-remat"] + [k for k in dict.fromkeys(keys) if k != "no-remat"]


LEGEND = """Columns: retained MiB = bytes the forward pass allocated that are still alive when it ends (what is held for
  the backward pass; counted from outside remat); peak MiB = the most of those bytes alive at once in the step;
  ms/step = the median forward + backward step; time vs no-remat = per round, the step over no-remat's step in the
  same round, the median over the rounds, +- half their interquartile range (the run's noise); recomputed GFLOP =
  backward-pass FLOPs above no-remat's. Two configurations closer than the noise on both counts are tied."""

_CODE = {"save-nothing": 'policy="save-nothing"', "save-matmuls": 'policy="save-matmuls"',
         "offload-to-cpu": 'policy="offload-to-cpu"'}


def _code(label: str) -> str:
    if label in _CODE:
        return _CODE[label]
    if label.startswith("names("):
        names = ", ".join(f'"{n}"' for n in label[6:-1].split(","))
        return f"policy=policies.save_only_these_names({names})"
    if label.startswith("memory_budget "):
        return f"policy=policies.memory_budget({float(label.split()[1].rstrip('%')) / 100:g})"
    if label.startswith("budget "):
        return f"remat.sequential(blocks, budget={float(label.split()[1].rstrip('%')) / 100:g})"
    return label


def recommend(rows: Sequence[Any], front: set[str], inapplicable: Sequence[str] = ()) -> str:
    """What to use, from the Pareto front: the remat configuration on it that costs least time (among those tied
    on time, the one that keeps least), and the one that keeps least memory; never a winner the noise cannot tell,
    nor one that does not apply here (``inapplicable``: offloading on a machine where the copy frees nothing)."""
    base = rows[0]
    ours = [r for r in rows if r.label in front and r is not base and not r.label.startswith(("torch", "compiled"))
            and r.label not in inapplicable]
    if not ours:
        return ("Recommendation: no remat configuration is on the front here (this model keeps little between the "
                "passes, or torch's peer is as good within the noise); see docs/policies.md for a larger model.")
    # (the remat configurations no other one is faster than beyond the noise; the one of them that keeps least)
    cheap = min((r for r in ours if not any(time_better(o, r) for o in ours if o is not r)),
                key=lambda r: (r.retained_bytes, r.time_ratio))
    least = min(ours, key=lambda r: (r.retained_bytes, r.time_ratio))
    full = base.retained_bytes or 1

    def said(r: Any) -> str:
        return (f"{r.label} keeps {r.retained_bytes / MiB:.1f} MiB ({r.retained_bytes / full:.0%} of "
                f"{base.label}'s {base.retained_bytes / MiB:.1f}) at {r.time_ratio:.2f}x the step: {_code(r.label)}")

    out = f"Recommendation: {said(cheap)}."
    if least is not cheap:
        out += f" Least memory: {said(least)}."
    return out + (" To fit a memory limit in between, policy=policies.memory_budget(fraction) keeps at most that "
                  "fraction of what autograd would and recomputes the rest at the least cost. See docs/policies.md.")


def _with_budget(fn: Any, fraction: float, *args: Any) -> Any:
    with ti.activation_memory_budget(fraction):  # read when the first call compiles
        return fn(*args)


def _square_mean(h: torch.Tensor) -> torch.Tensor:
    return (h * h).mean()  # the reference models' loss (remat/bench/models.py)


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    device = _device(p, a.device)
    keys = _configs(p, a.policies, a.model, device)
    if a.compile is not None and a.compile not in torch.compiler.list_backends(exclude_tags=()):
        p.error(f"--compile: unknown backend {a.compile!r}; choose from "
                f"{', '.join(torch.compiler.list_backends(exclude_tags=()))}")
    if a.warmup < 0:
        p.error("--warmup must be >= 0")
    if a.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib, which is not installed: pip install matplotlib (or 'remat[plot]')")
    for flag, path in (("--json", a.json), ("--plot", a.plot)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder is not None and not os.path.isdir(folder):
            p.error(f"{flag}: the folder {folder} does not exist; create it first, or give another path")
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = DTYPES[a.dtype]

    def say(msg: str) -> None:
        print(f"remat.bench: {msg}", file=sys.stderr, flush=True)

    say(f"{a.model} {a.size}, {device}, {a.dtype}, configurations: {', '.join(keys)}"
        + (f"; compiled ({a.compile}): {', '.join(COMPILED)}" if a.compile else ""))
    for k in keys:
        why = applies(k, a.model, device)
        if why:
            say(f"note: {k}: {why}; measured anyway, as asked")
    params, x, block, apply = make_model(a.model, a.size, dtype=dtype, device=device)
    for leaf in [t for blk in params for t in blk.values()]:
        leaf.requires_grad_(True)
    configs = []
    for k in keys:
        wrap = make_wrap(k, a.model)
        configs.append(Config(label(k, a.model), lambda prm, inp, wrap=wrap: apply(prm, inp, wrap)))
    for f in a.budgets or ():
        chain = sequential([functools.partial(block, blk) for blk in params], budget=f)
        try:
            chain(x)  # the first call measures the blocks and solves the schedule
        except RematError as e:
            say(f"note: budget {f:.0%} left out: {e}")
        else:
            say(f"budget {f:.0%}: {chain.schedule(x)}")
            configs.append(Config(f"budget {f:.0%}", lambda prm, inp, chain=chain: _square_mean(chain(inp))))
        # policies.memory_budget: one policy (one plan) for every block, solved on a first call here
        pol = policies.memory_budget(f)
        wrap = functools.partial(remat, policy=pol)
        apply(params, x, wrap).backward()
        plan = next(iter(pol.plans.values()))
        if plan is not None:
            say(f"memory_budget {f:.0%}: each block keeps {plan.kept_bytes / 2**20:.2f} of "
                f"{plan.full_bytes / 2**20:.2f} MiB, recomputes {plan.recompute_flops / 1e9:.3f} GFLOP")
        configs.append(Config(f"memory_budget {f:.0%}", lambda prm, inp, wrap=wrap: apply(prm, inp, wrap)))
    if a.compile:
        for k in COMPILED:
            wrap = make_wrap(k, a.model)
            fn = torch.compile(lambda prm, inp, wrap=wrap: apply(prm, inp, wrap), backend=a.compile)
            configs.append(Config(f"compiled {label(k, a.model)}", fn, compiled=True))
        for f in a.budgets or ():
            # torch's own budget; the string default makes Dynamo compile this function once per budget
            budgeted = torch.compile(lambda prm, inp, tag=f"{f}": apply(prm, inp) if tag else None, backend=a.compile)
            configs.append(Config(f"compiled budget {f:.0%}", functools.partial(_with_budget, budgeted, f),
                                  compiled=True))
    t0 = time.perf_counter()
    auto = a.steps is None
    rows = measure(configs, [params, x], steps=7 if auto else a.steps, warmup=a.warmup, progress=say,
                   min_time=MIN_TIME if auto else 0.0, max_steps=MAX_STEPS if auto else a.steps)
    steps = len(rows[0].times_s)
    say(f"done in {time.perf_counter() - t0:.1f} s")
    title = f"{a.model} ({a.size}), {device}, {a.dtype}, median of {steps} step(s), torch {torch.__version__}"
    print(title)
    print(format_table(rows, baseline="no-remat"))
    print(LEGEND)
    front = {r.label for r in pareto_front(rows)}
    tied = [(a.label, b.label) for a, b in ties(rows) if a.label in front and b.label in front]
    print(f"Pareto front (retained memory vs time): {', '.join(r.label for r in rows if r.label in front)}"
          + (f"; tied within the noise: {', '.join(f'{a} and {b}' for a, b in tied)}" if tied else ""))
    print(recommend(rows, front, [label(k, a.model) for k in keys if applies(k, a.model, device)]))
    if a.json:
        doc: dict[str, Any] = {
            "model": a.model, "size": a.size, "config": SIZES[a.size][a.model], "device": str(device),
            "dtype": a.dtype, "steps": steps, "torch": torch.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "compile": a.compile,
            "rows": [r.to_dict() | {"pareto": r.label in front} for r in rows],
        }
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=2)
        say(f"wrote {a.json}")
    if a.plot:
        plot(rows, a.plot, title=title)
        say(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
