"""Instructions per op and per call of remat's forward and backward passes against torch's checkpointing (callgrind).

``overhead.py``'s wall-clock ratios move with the machine: on one 2-core machine
remat's ``dots_saveable`` cost 0.42-0.46 of torch's selective checkpointing per op,
on a faster one 0.50-0.54. An instruction count does not depend on the machine's
load or clock, so it tells a change in remat's own work from the machine's noise,
and a ratio that holds on every machine from one that holds on the one it ran on.

Each configuration of ``overhead.py`` (the ``block`` workload; the names row with
its matmuls tagged, as there) runs in six processes under
``valgrind --tool=callgrind``: 1 and ``--long`` blocks, each with ``--warm`` forward
and backward steps, then, with the garbage collector off:

- ``--warm`` forward calls (each output let go at once);
- ``--warm + --calls`` forward calls;
- ``--warm + --calls`` forward calls, the last ``--calls`` of them each followed by
  its backward pass (``torch.autograd.grad`` of the output's sum).

The forward count per op is ``((I[long, more] - I[long, fewer]) - (I[1, more] -
I[1, fewer]))`` over ``--calls`` and the ops between the two lengths; the backward's
is the same difference between the third and second processes (the recompute, the
hooks and the backward's own kernels, less what letting a graph go unread costs:
the forward's count has that). Imports, warm-up and the per-call cost cancel, and
plain autograd's count is subtracted from every row.

The cost per call is counted on its own: the same three processes run a call of
``sin(sin(W))`` (two ops; the inner one's output is saved by the outer and dropped by
every remat policy and by torch's checkpointing, so the backward pass recomputes
one op), and the count per call is the difference over ``--calls``. It is not the
intercept of the per-op line, as ``overhead.py`` reports it: torch's checkpointing
costs more per op on the 4-block call than on the 1-block one (its per-op slope
from 1 to 4 blocks puts its per-call intercept at ~31 k instructions forward and
below zero backward), so an intercept tells little of what a call costs.

    python benchmarks/instructions.py                  # needs valgrind; ~1.5 h on 2 cores
    python benchmarks/instructions.py --configs "plain,remat dots_saveable" --jobs 2
    python benchmarks/instructions.py --passes backward --configs "plain,torch SAC (matmuls),remat names('mm')"
    python benchmarks/instructions.py --per call        # the cost per call only; ~20 min
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import os
import shutil
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead  # noqa: E402

DEFAULT = ["plain", "empty dispatch mode", "torch checkpoint", "torch SAC (matmuls)", "remat save-nothing",
           "remat dots_saveable", "remat names('mm')", "remat custom callable", "remat offload (min_bytes=0)"]
PASSES = ("forward", "backward")
PER = ("op", "call")


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """``overhead.py``'s inputs at its default width."""
    torch.manual_seed(0)
    return torch.randn(16, 16, requires_grad=True), torch.randn(4, 16)


def two_ops(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The call counted for the cost per call: the outer ``sin`` saves the inner one's output, which every remat
    policy and torch's checkpointing drop (``x`` unused)."""
    return torch.sin(torch.sin(W))


def child(config: str, blocks: int, warm: int, calls: int,
          grads: int = 0) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The process callgrind counts: warm up, then ``calls`` forward calls of ``blocks`` blocks (0: :func:`two_ops`),
    the last ``grads`` of them each followed by its backward pass (the last call's output and the last backward
    pass's gradient returned)."""
    torch.set_num_threads(1)
    f = overhead.configs()[config](overhead.block(blocks, "names" in config) if blocks else two_ops)
    W, x = inputs()
    for _ in range(warm):
        torch.autograd.grad(f(W, x).sum(), (W,))
    gc.collect()
    gc.disable()
    out = grad = None
    for i in range(calls):
        out = f(W, x)
        if i >= calls - grads:
            (grad,) = torch.autograd.grad(out.sum(), (W,))
    return out, grad


def count(config: str, blocks: int, warm: int, calls: int, grads: int) -> int:
    """Instructions of one child process, from callgrind's totals."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "cg.out")
        # (a fixed hash seed: with a random one, the same process's count moves by a few per cent from run to run)
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
                        os.path.abspath(__file__), "--child", config, str(blocks), str(warm), str(calls), str(grads)],
                       check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(out) as fh:
            for line in fh:
                if line.startswith(("totals:", "summary:")):
                    return int(line.split()[1])
    raise RuntimeError(f"no totals in callgrind's output for {config!r}")


def runs(configs: list[str], long: int, warm: int, calls: int, passes: list[str],
         per: tuple[str, ...] = PER) -> list[tuple[str, int, int, int]]:
    """The processes to count: ``(config, blocks, forward calls, backward passes)``; 0 blocks: :func:`two_ops`."""
    made = [(warm, 0), (warm + calls, 0)] if "forward" in passes else [(warm + calls, 0)]
    if "backward" in passes:
        made.append((warm + calls, calls))
    blocks = ((1, long) if "op" in per else ()) + ((0,) if "call" in per else ())
    return [(c, b, n, g) for c in configs for b in blocks for n, g in made]


def costs(got: dict[tuple[str, int, int, int], int], configs: list[str], long: int, warm: int, calls: int,
          n_ops: dict[int, int], pass_: str = "forward") -> dict[str, tuple[float | None, float | None]]:
    """Instructions per op and per call of one pass above plain autograd's, per configuration, from the counts
    ``got[config, blocks, forward calls, backward passes]`` (``n_ops``: the ops a call of 1 and ``long`` blocks
    dispatches). Per op: the slope between the two lengths; per call: a call of :func:`two_ops`. None: not
    counted."""
    fewer, more = ((warm, 0), (warm + calls, 0)) if pass_ == "forward" else ((warm + calls, 0), (warm + calls, calls))

    def extra(c: str, b: int) -> float | None:
        if (c, b, *more) not in got:
            return None
        return (got[(c, b, *more)] - got[(c, b, *fewer)]) / calls

    def of(c: str) -> tuple[float | None, float | None]:
        short, big = extra(c, 1), extra(c, long)
        op = None if short is None or big is None else (big - short) / (n_ops[long] - n_ops[1])
        return op, extra(c, 0)

    plain = of("plain")
    return {c: tuple(None if v is None or p is None else v - p  # type: ignore[misc]
                     for v, p in zip(of(c), plain)) for c in configs}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(DEFAULT), help="comma-separated names from overhead.py")
    ap.add_argument("--long", type=int, default=4, help="blocks in the long call (the short one has 1)")
    ap.add_argument("--warm", type=int, default=10)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--jobs", type=int, default=2, help="processes under valgrind at once")
    ap.add_argument("--passes", default=",".join(PASSES), help="forward, backward or both (comma-separated)")
    ap.add_argument("--per", default=",".join(PER), help="op, call or both (comma-separated): the costs to count")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        c, b, w, n, g = args.child
        child(c, int(b), int(w), int(n), int(g))
        return
    passes = [p.strip() for p in args.passes.split(",") if p.strip()]
    if not passes or set(passes) - set(PASSES):
        sys.exit(f"--passes takes forward, backward or both, comma-separated; got {args.passes!r}")
    per = tuple(p.strip() for p in args.per.split(",") if p.strip())
    if not per or set(per) - set(PER):
        sys.exit(f"--per takes op, call or both, comma-separated; got {args.per!r}")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if "plain" not in configs:
        configs.insert(0, "plain")
    unknown = set(configs) - set(overhead.configs())
    if unknown:
        sys.exit(f"unknown configuration(s) {sorted(unknown)}; known: {sorted(overhead.configs())}")
    if shutil.which("valgrind") is None:
        sys.exit("instructions.py needs valgrind (apt install valgrind)")
    n_ops = {b: overhead.count_ops(overhead.block(b), *inputs()) for b in (1, args.long)}
    todo = runs(configs, args.long, args.warm, args.calls, passes, per)
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        got = dict(zip(todo, pool.map(lambda r: count(r[0], r[1], args.warm, r[2], r[3]), todo)))

    table = {p: costs(got, configs, args.long, args.warm, args.calls, n_ops, p) for p in passes}
    print(f"block: {n_ops[1]} and {n_ops[args.long]} ATen ops per call (the plain blocks' forward); a call: "
          f"sin(sin(W)), two ops; {args.calls} calls after {args.warm} steps, gc off; callgrind instructions; torch "
          f"{torch.__version__}, Python {sys.version.split()[0]}")
    print("instructions above plain autograd, per op of the blocks and per call of sin(sin(W)) (backward: the "
          "recompute, the hooks and the backward's kernels); vs torch: over the peer's (save-nothing: torch "
          "checkpoint; every other policy: torch SAC), " + " / ".join(passes))
    short = {"forward": "fwd", "backward": "bwd"}
    ks = [k for k, name in enumerate(PER) if name in per]
    cols = [f"{short[p]}/{PER[k]}" for k in ks for p in passes] + [f"vs torch/{PER[k]}" for k in ks]
    print(f"{'configuration':<28} " + "  ".join(f"{h:>13}" for h in cols))
    print(f"{'-' * 28} " + "  ".join("-" * 13 for _ in cols))
    for c in configs:
        peer = "torch checkpoint" if c == "remat save-nothing" else "torch SAC (matmuls)"
        cells = [f"{table[p][c][k]:.0f}" for k in ks for p in passes]
        for k in ks:
            if not c.startswith("remat ") or peer not in table[passes[0]]:
                cells.append("")  # (a remat row whose peer was not asked for: its counts only)
                continue
            ratios = [f"{table[p][c][k] / table[p][peer][k]:.2f}" if table[p][peer][k] > 0 else "-"  # type: ignore
                      for p in passes]
            cells.append("/".join(ratios))
        print(f"{c:<28} " + "  ".join(f"{v:>13}" for v in cells))


if __name__ == "__main__":
    main()
