"""Per-op and per-call overhead of remat's policies against torch's checkpointing, on ops with negligible kernels.

Each configuration wraps one chain of tiny ops (``--width`` wide, so kernels cost
next to nothing and what is left is Python and dispatch). Two chain lengths are
timed (``--short`` and ``--long`` ops); the slope between them is the cost per op,
the intercept the cost per call, each with plain autograd's subtracted. Forward and
backward (for a remat'd function: its recompute) are timed apart. Every
configuration runs once per round (interleaved, in a shuffled order); the table shows the fastest round
(``--stat median`` for medians).

    python benchmarks/overhead.py                # about a minute on 2 cores
    python benchmarks/overhead.py --rounds 41 --workload block

Workloads: ``chain`` (sin, matmul, scale, tanh, repeated), ``block`` (a tiny
pre-LN transformer block: layer norm, linear, softmax attention, gelu; what the
bench models run, at width 16) and ``mlp`` (matmul, in-place ReLU, tanh: a
configuration that raises, as torch's selective checkpointing does there, shows
"raises"). Ops are counted by a dispatch mode on the plain function. Three floors: an empty
dispatch mode as torch runs one (its handler wrapped in ``torch._disable_dynamo``), the
same unwrapped, as remat's own modes run (the floor of remat's recording), and the floor of
any engine that records under such a mode and replays from Python (``replay_floor``: the
unwrapped mode noting each op, hooks that do nothing, every op called again in the backward
pass). The garbage collector stays on (as in training), and the table says so.
"""

from __future__ import annotations

import argparse
import functools
import gc
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import create_selective_checkpoint_contexts

import remat
from remat import checkpoint_name, policies
from remat._torch_internals import TorchDispatchMode as RematMode  # (the floor of remat's own modes)

MATMULS = [torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.baddbmm.default]


class _NoOp(TorchDispatchMode):
    """The floor of any Python dispatch mode: call the op and return."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class _NoOpUnwrapped(RematMode):
    """The same, without the ``torch._disable_dynamo`` wrapper torch puts around a mode's handler (remat's modes
    opt out of it: ``remat._torch_internals.TorchDispatchMode``): the floor remat's own modes start from."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class _Recorder(RematMode):
    """The floor of a recording: each op noted with its arguments, nothing else."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, Any, Any]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.ops.append((func, args, kwargs))
        return func(*args, **kwargs)


def replay_floor(f: Callable[..., Any]) -> Callable[..., Any]:
    """What no engine that records the ATen ops under a Python mode and replays them from Python can go under: the
    unwrapped mode noting each op, saved-tensor hooks that do nothing, and in the backward pass every op called
    once more from Python (below autograd, its result thrown away). Not a remat (it holds what plain autograd
    holds): a floor."""

    def run(*a: Any) -> Any:
        rec, replayed = _Recorder(), []

        def unpack(t: torch.Tensor) -> torch.Tensor:
            if not replayed:
                replayed.append(True)
                with torch.no_grad():
                    for op, args, kwargs in rec.ops:
                        op(*args, **kwargs)
            return t

        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack), rec:
            return f(*a)

    return run


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.n += 1
        return func(*args, **(kwargs or {}))


def _tagger(tag: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    return (lambda t: checkpoint_name(t, "mm")) if tag else (lambda t: t)


def chain(n: int, tag: bool = False) -> Callable[..., torch.Tensor]:
    """sin, matmul, scale, tanh, repeated: ``n`` groups of 4 ops (with ``tag``, the matmul named "mm")."""
    name = _tagger(tag)

    def f(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = x
        for _ in range(n):
            h = name(torch.sin(h) @ W)
            h = torch.tanh(h * 0.5)
        return h

    return f


def block(n: int, tag: bool = False) -> Callable[..., torch.Tensor]:
    """``n`` tiny pre-LN transformer blocks (one remat call over all of them)."""
    name = _tagger(tag)

    def f(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        h = x
        for _ in range(n):
            a = F.layer_norm(h, (d,))
            q = name(a @ W)
            att = torch.softmax(q @ a.transpose(-1, -2) / d**0.5, dim=-1)
            h = h + att @ a
            h = h + F.gelu(name(F.layer_norm(h, (d,)) @ W))
        return h

    return f


def mlp(n: int, tag: bool = False) -> Callable[..., torch.Tensor]:
    """``n`` layers of ``tanh(relu_(h @ W))``: the ReLU writes the matmul's output in place, as
    ``nn.ReLU(inplace=True)`` does (torch's selective checkpointing refuses to save such an output)."""
    name = _tagger(tag)

    def f(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = x
        for _ in range(n):
            h = torch.tanh(torch.relu_(name(h @ W)))
        return h

    return f


WORKLOADS = {"chain": chain, "block": block, "mlp": mlp}


def count_ops(f: Callable[..., torch.Tensor], W: torch.Tensor, x: torch.Tensor) -> int:
    """ATen ops one call of plain ``f`` dispatches."""
    with _Count() as c:
        f(W, x)
    return c.n


def _is_mm(op: Any, *args: Any, **kwargs: Any) -> bool:
    return op in MATMULS


def configs() -> dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]]:
    sac = functools.partial(create_selective_checkpoint_contexts, MATMULS)

    def torch_ckpt(f: Callable[..., Any], **kw: Any) -> Callable[..., Any]:
        return lambda *a: torch_checkpoint(f, *a, use_reentrant=False, **kw)

    def noop_mode(f: Callable[..., Any], mode: type = _NoOp) -> Callable[..., Any]:
        def run(*a: Any) -> Any:
            with mode():
                return f(*a)
        return run

    return {
        "plain": lambda f: f,
        "empty dispatch mode": noop_mode,
        "empty mode, unwrapped": lambda f: noop_mode(f, _NoOpUnwrapped),
        "floor: record + replay": replay_floor,
        "torch checkpoint": torch_ckpt,
        "torch SAC (matmuls)": lambda f: torch_ckpt(f, context_fn=sac),
        "remat save-nothing": lambda f: remat.remat(f, policy=policies.nothing_saveable),
        "remat dots_saveable": lambda f: remat.remat(f, policy=policies.dots_saveable),
        "remat names('mm')": lambda f: remat.remat(f, policy=policies.save_only_these_names("mm")),
        "remat custom callable": lambda f: remat.remat(f, policy=_is_mm),
        "remat offload (min_bytes=0)": lambda f: remat.remat(f, policy=policies.offload_to_cpu(min_bytes=0)),
    }


def _vs_peer(row: tuple[Any, ...], by_name: dict[str, tuple[Any, ...]]) -> str:
    """``row``'s per-op cost over its torch peer's, forward / backward ("" for torch's own rows, or a peer that did
    not run or raised; "-" for a side where the peer's cost per op came out at or below zero)."""
    if not row[0].startswith("remat ") or row[1] is None:
        return ""
    peer = by_name.get("torch checkpoint" if row[0] == "remat save-nothing" else "torch SAC (matmuls)")
    if peer is None or peer[1] is None:
        return ""

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}" if b > 0 else "-"  # (a peer's slope at or below zero, in a short noisy run: no ratio)

    return f"{ratio(row[1], peer[1])}/{ratio(row[2], peer[2])}"


def _time(fn: Callable[..., torch.Tensor], W: torch.Tensor, x: torch.Tensor, reps: int) -> tuple[float, float]:
    """Seconds per call of the forward and of the backward, over ``reps`` calls."""
    fwd = bwd = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn(W, x)
        t1 = time.perf_counter()
        (gW,) = torch.autograd.grad(out.sum(), (W,))
        t2 = time.perf_counter()
        fwd += t1 - t0
        bwd += t2 - t1
    return fwd / reps, bwd / reps


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="chain")
    ap.add_argument("--short", type=int, default=2, help="groups in the short chain")
    ap.add_argument("--long", type=int, default=16, help="groups in the long chain")
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--reps", type=int, default=10, help="calls per configuration per round")
    ap.add_argument("--only", default="", help="comma-separated substrings of the configurations to run")
    ap.add_argument("--stat", choices=["min", "median"], default="min",
                    help="per configuration, the fastest round (default: what the code costs, least disturbed by "
                         "other work on the machine) or the median round")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    W = torch.randn(args.width, args.width, requires_grad=True)
    x = torch.randn(4, args.width)
    make = WORKLOADS[args.workload]
    fns = {"short": make(args.short), "long": make(args.long)}
    n_ops = {k: count_ops(f, W, x) for k, f in fns.items()}
    wraps = configs()
    if args.only:
        keep = [s.strip() for s in args.only.split(",")]
        wraps = {k: v for k, v in wraps.items() if k == "plain" or any(s in k for s in keep)}
    # only the names configuration tags the matmuls: a tag is an op of its own under remat (an alias)
    tagged = {"short": make(args.short, True), "long": make(args.long, True)}
    runs = {(name, k): w(tagged[k] if "names" in name else f) for name, w in wraps.items() for k, f in fns.items()}
    raises: dict[str, str] = {}
    for key, fn in runs.items():  # warm up (and fill any per-function cache)
        try:
            _time(fn, W, x, 2)
        except RuntimeError as e:
            raises[key[0]] = str(e).split("\n")[0]
    runs = {key: fn for key, fn in runs.items() if key[0] not in raises}
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {key: [] for key in runs}
    # each round in an order of its own (seeded): in one fixed order each configuration runs after the same
    # neighbour every round, and what that one leaves (garbage, a cold cache) lands on it alone
    order, rng = list(runs), random.Random(0)
    for _ in range(args.rounds):
        rng.shuffle(order)
        for key in order:
            samples[key].append(_time(runs[key], W, x, args.reps))
    d_ops = n_ops["long"] - n_ops["short"]

    stat = min if args.stat == "min" else statistics.median

    def med(name: str, k: str, i: int) -> float:
        return stat(s[i] for s in samples[(name, k)])

    rows: list[tuple[Any, ...]] = []
    for name in wraps:
        if name in raises:
            rows.append((name, None, None, None, None))
            continue
        per_op, per_call = [], []
        for i in (0, 1):
            slope = (med(name, "long", i) - med(name, "short", i)) / d_ops
            base = (med("plain", "long", i) - med("plain", "short", i)) / d_ops
            per_op.append((slope - base) * 1e6)
            at_zero = med(name, "short", i) - slope * n_ops["short"]
            base0 = med("plain", "short", i) - base * n_ops["short"]
            per_call.append((at_zero - base0) * 1e6)
        rows.append((name, *per_op, *per_call))
    print(f"{args.workload}: {n_ops['short']} and {n_ops['long']} ATen ops per call, width {args.width}, "
          f"1 thread, {args.stat} of {args.rounds} shuffled interleaved rounds x {args.reps} calls, gc "
          f"{'on' if gc.isenabled() else 'off'}; torch {torch.__version__}, Python {sys.version.split()[0]}")
    print("overhead above plain autograd (us); backward = the recompute and the hooks; the names row runs the "
          "chain with its matmuls tagged (checkpoint_name: one more op each)")
    print("vs torch: a remat row's cost per op over its peer's (save-nothing: torch checkpoint; every other "
          "policy: torch SAC), forward / backward; the goal (issue 10) is <= 1 for save-nothing, <= 0.5 for the rest")
    by_name = {r[0]: r for r in rows}
    hdr = ("configuration", "fwd/op", "bwd/op", "fwd/call", "bwd/call", "vs torch")
    widths = [max(len(hdr[0]), *(len(r[0]) for r in rows)), 7, 7, 8, 8, 11]
    print("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(hdr, widths))))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [("raises" if v is None else f"{v:.1f}").rjust(w)
                                           for v, w in zip(r[1:], widths[1:])]
        cells.append(_vs_peer(r, by_name).rjust(widths[-1]))
        print("  ".join(cells))
    for name, msg in raises.items():
        print(f"{name}: {msg}")


if __name__ == "__main__":
    main()
