"""Instructions per op of remat's forward pass against torch's checkpointing, counted by callgrind, not timed.

``overhead.py``'s wall-clock ratios move with the machine: on one 2-core machine
remat's ``dots_saveable`` cost 0.42-0.46 of torch's selective checkpointing per op,
on a faster one 0.50-0.54. An instruction count does not depend on the machine's
load or clock, so it tells a change in remat's own work from the machine's noise,
and a ratio that holds on every machine from one that holds on the one it ran on.

Each configuration of ``overhead.py`` (the ``block`` workload) runs in four
processes under ``valgrind --tool=callgrind``: 1 and ``--long`` blocks, each with
``--warm`` forward and backward steps, then ``--warm`` or ``--warm + --calls``
forward calls with the garbage collector off (each output let go at once). The
per-op count is ``((I[long, more] - I[long, fewer]) - (I[1, more] - I[1, fewer]))``
over ``--calls`` and the ops between the two lengths: imports, warm-up and the
per-call cost cancel. Plain autograd's count is subtracted from every row.

    python benchmarks/instructions.py                  # needs valgrind; ~30 min on 2 cores
    python benchmarks/instructions.py --configs "plain,remat dots_saveable" --jobs 2
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
           "remat dots_saveable", "remat offload (min_bytes=0)"]


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """``overhead.py``'s inputs at its default width."""
    torch.manual_seed(0)
    return torch.randn(16, 16, requires_grad=True), torch.randn(4, 16)


def child(config: str, blocks: int, warm: int, calls: int) -> torch.Tensor | None:
    """The process callgrind counts: warm up, then ``calls`` forward calls (the last one's output returned)."""
    torch.set_num_threads(1)
    f = overhead.configs()[config](overhead.block(blocks))
    W, x = inputs()
    for _ in range(warm):
        torch.autograd.grad(f(W, x).sum(), (W,))
    gc.collect()
    gc.disable()
    out = None
    for _ in range(calls):
        out = f(W, x)
    return out


def count(config: str, blocks: int, warm: int, calls: int) -> int:
    """Instructions of one child process, from callgrind's totals."""
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "cg.out")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
                        os.path.abspath(__file__), "--child", config, str(blocks), str(warm), str(calls)],
                       check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with open(out) as fh:
            for line in fh:
                if line.startswith(("totals:", "summary:")):
                    return int(line.split()[1])
    raise RuntimeError(f"no totals in callgrind's output for {config!r}")


def per_op(got: dict[tuple[str, int, int], int], configs: list[str], long: int, warm: int, calls: int,
           d_ops: int) -> dict[str, float]:
    """Instructions per op above plain autograd's, per configuration, from the counts ``got[config, blocks, calls
    made]`` of the four processes each (``d_ops``: the ops between 1 and ``long`` blocks)."""
    def of(c: str) -> float:
        more = (got[c, long, warm + calls] - got[c, long, warm]) - (got[c, 1, warm + calls] - got[c, 1, warm])
        return more / calls / d_ops

    plain = of("plain")
    return {c: of(c) - plain for c in configs}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=",".join(DEFAULT), help="comma-separated names from overhead.py")
    ap.add_argument("--long", type=int, default=4, help="blocks in the long call (the short one has 1)")
    ap.add_argument("--warm", type=int, default=10)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--jobs", type=int, default=2, help="processes under valgrind at once")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        c, b, w, n = args.child
        child(c, int(b), int(w), int(n))
        return
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if "plain" not in configs:
        configs.insert(0, "plain")
    unknown = set(configs) - set(overhead.configs())
    if unknown:
        sys.exit(f"unknown configuration(s) {sorted(unknown)}; known: {sorted(overhead.configs())}")
    if shutil.which("valgrind") is None:
        sys.exit("instructions.py needs valgrind (apt install valgrind)")
    n_ops = {b: overhead.count_ops(overhead.block(b), *inputs()) for b in (1, args.long)}
    runs = [(c, b, n) for c in configs for b in (1, args.long) for n in (args.warm, args.warm + args.calls)]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        got = dict(zip(runs, pool.map(lambda r: count(r[0], r[1], args.warm, r[2]), runs)))

    rows = per_op(got, configs, args.long, args.warm, args.calls, n_ops[args.long] - n_ops[1])
    print(f"block: {n_ops[1]} and {n_ops[args.long]} ATen ops per call, forward only, {args.calls} calls after "
          f"{args.warm} steps, gc off; callgrind instructions; torch {torch.__version__}, Python "
          f"{sys.version.split()[0]}")
    print("instructions per op above plain autograd; vs torch: over the peer's (save-nothing: torch checkpoint; "
          "every other policy: torch SAC)")
    print(f"{'configuration':<28} {'instr/op':>9}  {'vs torch':>8}")
    print(f"{'-' * 28} {'-' * 9}  {'-' * 8}")
    for c, v in rows.items():
        peer = "torch checkpoint" if c == "remat save-nothing" else "torch SAC (matmuls)"
        ratio = f"{v / rows[peer]:.2f}" if c.startswith("remat ") and rows.get(peer, 0) > 0 else ""
        print(f"{c:<28} {v:>9.0f}  {ratio:>8}")


if __name__ == "__main__":
    main()
