"""Per-op cost of this checkout's remat against another commit's, both imported in one process and interleaved.

``overhead.py`` compares remat with torch in one process; a change to remat itself
is compared across two processes, whose run-to-run spread on a shared machine
(0.5-1 us an op) hides the gains a hot-path change makes. This script exports the
package of ``--base`` (a commit, default ``HEAD``) into a temporary folder under the
name ``remat_base`` (remat's modules import each other relatively, so the copy is
a package of its own), imports it next to the working tree's ``remat``, and times
the ``block`` workload of ``overhead.py`` (1 and ``--long`` tiny transformer blocks,
one thread) under each, plain autograd in the same rounds, every configuration once
per round in a shuffled order; the table shows the fastest round's slope over plain
autograd, us per op, forward / backward, and the difference.

    python benchmarks/ab.py                                  # the working tree against HEAD
    python benchmarks/ab.py --base 18a38e4 --policy dots_saveable --rounds 41
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import overhead  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def export_base(rev: str, into: str) -> None:
    """Write ``rev``'s ``remat/`` package to ``into/remat_base``."""
    archive = os.path.join(into, "base.tar")
    subprocess.run(["git", "-C", ROOT, "archive", "--format=tar", "-o", archive, rev, "remat"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    os.rename(os.path.join(into, "remat"), os.path.join(into, "remat_base"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="the commit to compare with (default HEAD)")
    ap.add_argument("--policy", default="nothing_saveable", help="a name in remat.policies (default nothing_saveable)")
    ap.add_argument("--long", type=int, default=8, help="blocks in the long call (the short one has 1)")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--reps", type=int, default=10, help="calls per configuration per round")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        export_base(args.base, tmp)
        sys.path.insert(0, tmp)
        import remat_base  # type: ignore[import-not-found]

        import remat

        W = torch.randn(16, 16, requires_grad=True)
        x = torch.randn(4, 16)
        fns = {"short": overhead.block(1), "long": overhead.block(args.long)}
        wraps: dict[str, Callable[[Any], Any]] = {
            "plain": lambda f: f,
            "this tree": lambda f: remat.remat(f, policy=getattr(remat.policies, args.policy)),
            f"base {args.base}": lambda f: remat_base.remat(f, policy=getattr(remat_base.policies, args.policy)),
        }
        runs = {(name, k): w(f) for name, w in wraps.items() for k, f in fns.items()}
        for fn in runs.values():
            overhead._time(fn, W, x, 2)
        samples: dict[tuple[str, str], list[tuple[float, float]]] = {key: [] for key in runs}
        order, rng = list(runs), random.Random(0)
        for _ in range(args.rounds):
            rng.shuffle(order)
            for key in order:
                samples[key].append(overhead._time(runs[key], W, x, args.reps))
        d_ops = overhead.count_ops(fns["long"], W, x) - overhead.count_ops(fns["short"], W, x)

        def slope(name: str, i: int) -> float:
            return (min(s[i] for s in samples[(name, "long")]) - min(s[i] for s in samples[(name, "short")])) / d_ops

        per_op = {name: [(slope(name, i) - slope("plain", i)) * 1e6 for i in (0, 1)] for name in wraps if name != "plain"}
    print(f"block workload, 1 and {args.long} blocks, policy {args.policy}, 1 thread, min of {args.rounds} shuffled "
          f"interleaved rounds x {args.reps} calls; torch {torch.__version__}")
    print("us per op above plain autograd, forward / backward")
    for name, (f, b) in per_op.items():
        print(f"  {name:24s} {f:6.2f} / {b:6.2f}")
    (f1, b1), (f0, b0) = per_op.values()
    print(f"  {'this tree - base':24s} {f1 - f0:+6.2f} / {b1 - b0:+6.2f}")


if __name__ == "__main__":
    main()
