"""Measuring what a configuration costs, from outside the library: memory, time, recomputed FLOPs.

A configuration is a loss function ``loss_fn(*args) -> scalar``; a step is its
forward pass and ``torch.autograd.grad`` of the loss with respect to the
arguments that require grad. For each configuration :func:`measure` reports:

* retained bytes: memory allocated by the forward pass and still alive when it
  ends (what is held for the backward pass, plus the loss). On CUDA from the
  caching allocator (``torch.cuda.memory_allocated``); elsewhere from
  :class:`LiveCensus`, which counts the storages that ops allocate and watches
  them die. Neither reads remat's bookkeeping.
* peak bytes: the most memory allocated at once during the step, above what was
  allocated before it (``torch.cuda.max_memory_allocated``, or the census).
* compiled configurations (``Config.compiled``) on a CPU: Dynamo runs compiled code
  eagerly while a dispatch mode such as the census is active, so their retained
  bytes are weighed from the autograd graph instead (:func:`saved_bytes`: what the
  compiled forward saved for its backward graph, inputs excepted); the two measures
  agree on eager autograd (``tests/test_compile.py``). Their peak is not measured
  (``-1``, shown as ``-``).
* time per step: median over interleaved rounds (every configuration once per
  round, so drift of a shared machine hits them alike), and the median of the
  per-round ratios to the first configuration (the baseline).
* recomputed FLOPs: FLOPs of the backward pass (``FlopCounterMode``: matmuls,
  convolutions, attention) minus the baseline's. Replayed (saved) outputs are
  not run again and so not counted.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import random
import statistics
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch.utils.flop_counter import flop_registry

from .._torch_internals import TorchDispatchMode, inner_tensors, storage_of

__all__ = ["FlopCount", "Config", "Result", "LiveCensus", "live_bytes_after", "saved_bytes", "measure", "ratio", "format_table", "pareto_front", "ties", "time_better", "plot", "MiB"]

MiB = float(1 << 20)
Progress = Callable[[str], None]


@dataclasses.dataclass
class Config:
    """One thing to measure: a label and a loss function of the shared arguments."""

    label: str
    loss_fn: Callable[..., torch.Tensor]
    # torch.compile'd: no dispatch mode may watch it (Dynamo would run it eagerly), so on a CPU the retained
    # bytes are read from the autograd graph (saved_bytes) and the peak is not measured
    compiled: bool = False


@dataclasses.dataclass
class Result:
    """What one configuration cost (bytes, seconds, FLOPs)."""

    label: str
    retained_bytes: int
    peak_bytes: int
    time_s: float
    time_ratio: float
    backward_flops: int
    recomputed_flops: int
    times_s: list[float]
    cpu_times_s: list[float] = dataclasses.field(default_factory=list)  # process CPU time per step
    # half the interquartile range of the per-round ratios to the baseline: the noise of time_ratio
    ratio_spread: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class LiveCensus(TorchDispatchMode):
    """Counts the bytes of storages allocated by ops while it is active that are still alive.

    Every op output whose storage is new is weighed (``untyped_storage().nbytes()``)
    and watched with a finalizer; ``live`` is the sum of those alive, ``peak`` its
    maximum. Storages allocated before, or outside any op, are not counted.

    Example:
        >>> import torch
        >>> from remat.bench.measure import LiveCensus
        >>> with LiveCensus() as c:
        ...     a = torch.ones(1024)
        ...     b = a * 2
        ...     del a
        >>> c.live, c.peak
        (4096, 8192)
    """

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: dict[int, object] = {}  # data_ptr -> token of the storage allocated there
        self._finalizers: list[weakref.finalize] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        outs = [t for t in optree.tree_leaves(out, none_is_leaf=True) if isinstance(t, torch.Tensor)]
        if outs:
            # an output sharing an input's storage (a view, an in-place op) allocated nothing
            tree: Any = (args, kwargs)
            ins = {_ptr(t) for t in optree.tree_leaves(tree, none_is_leaf=True) if isinstance(t, torch.Tensor)}
            for t in outs:
                self._watch(t, ins)
        return out

    def _watch(self, t: torch.Tensor, ins: set[int]) -> None:
        try:
            s = t.untyped_storage()
            ptr = s.data_ptr()
        except (RuntimeError, NotImplementedError):
            # a wrapper subclass (a DTensor): its inner tensors hold the bytes, allocated below every mode
            for inner in inner_tensors(t):
                self._watch(inner, ins)
            return
        if not ptr or ptr in self._tracked or ptr in ins:
            return
        n = int(s.nbytes())
        token = object()
        self._tracked[ptr] = token
        self.live += n
        self.peak = max(self.peak, self.live)
        fin = weakref.finalize(s, self._freed, ptr, token, n)
        fin.atexit = False
        self._finalizers.append(fin)

    def _freed(self, ptr: int, token: object, n: int) -> None:
        if self._tracked.get(ptr) is token:
            del self._tracked[ptr]
            self.live -= n

    def close(self) -> None:
        """Stop watching (the counts stay as they are)."""
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()
        self._tracked.clear()


def live_bytes_after(forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Run ``forward()``; return its loss and the bytes of the storages its ops allocated that are still alive.

    The loss's own storage is not counted. The census is a :class:`LiveCensus`, a
    ``TorchDispatchMode`` outside remat: it weighs each storage an op allocates and
    watches it die; it never asks remat what it holds.

    Example:
        >>> import torch
        >>> from remat.bench.measure import live_bytes_after
        >>> x = torch.ones(256, requires_grad=True)
        >>> loss, held = live_bytes_after(lambda: x.exp().sum())
        >>> held  # exp saved its 1 KiB output for the backward pass
        1024
    """
    census = LiveCensus()
    try:
        with census:
            loss = forward()
        gc.collect()
        return loss, census.live - loss.untyped_storage().nbytes()
    finally:
        census.close()


def saved_bytes(loss: torch.Tensor, inputs: Any = ()) -> int:
    """Bytes of the storages that ``loss``'s autograd graph holds for the backward pass, ``inputs``' excepted.

    Walks the graph from ``loss.grad_fn`` and weighs, once per storage, every tensor a
    node saved (``_saved_*`` of torch's nodes, ``saved_tensors`` of autograd Functions,
    which is where a ``torch.compile``'d forward keeps what its backward graph needs).
    Storages of ``inputs`` (a pytree: arguments, parameters) are not counted, as
    :class:`LiveCensus` does not count what existed before the forward pass. For
    compiled code, where no dispatch mode can watch (Dynamo does not run compiled code
    under one). Reading a saved tensor runs its unpack hook: use it only on graphs
    without saved-tensor hooks (no eager remat, no ``save_on_cpu``).

    Example:
        >>> import torch
        >>> from remat.bench.measure import saved_bytes
        >>> x = torch.ones(256, requires_grad=True)
        >>> saved_bytes(x.exp().sum(), inputs=[x])  # exp saved its 1 KiB output
        1024
    """
    skip = {_ptr(t) for t in optree.tree_leaves(inputs, none_is_leaf=True) if isinstance(t, torch.Tensor)}
    sizes: dict[int, int] = {}
    todo, seen = [loss.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for attr in dir(node):
            if not (attr.startswith("_saved_") or attr == "saved_tensors"):
                continue
            try:
                val = getattr(node, attr)
            except RuntimeError:  # freed, or not a tensor
                continue
            for t in val if isinstance(val, (tuple, list)) else (val,):
                if isinstance(t, torch.Tensor) and (p := _ptr(t)) and p not in skip:
                    sizes[p] = int(t.untyped_storage().nbytes())
        todo.extend(fn for fn, _ in node.next_functions)
    return sum(sizes.values())


def _ptr(t: torch.Tensor) -> int:
    s = storage_of(t)  # (a DTensor's: its local shard's)
    return int(s.data_ptr()) if s is not None else 0


def _grad_leaves(args: Sequence[Any]) -> list[torch.Tensor]:
    tree: Any = list(args)
    return [a for a in optree.tree_leaves(tree, none_is_leaf=True)
            if isinstance(a, torch.Tensor) and a.requires_grad]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(cfg: Config, args: Sequence[Any], wrt: list[torch.Tensor]) -> None:
    loss = cfg.loss_fn(*args)
    torch.autograd.grad(loss, wrt)


def _memory(cfg: Config, args: Sequence[Any], wrt: list[torch.Tensor], device: torch.device) -> tuple[int, int]:
    gc.collect()
    if cfg.compiled and device.type != "cuda":
        loss = cfg.loss_fn(*args)
        return saved_bytes(loss, inputs=list(args)), -1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        loss = cfg.loss_fn(*args)
        torch.cuda.synchronize(device)
        gc.collect()
        retained = torch.cuda.memory_allocated(device) - base
        grads = torch.autograd.grad(loss, wrt)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del loss, grads
        return retained, peak
    census = LiveCensus()
    try:
        with census:
            loss = cfg.loss_fn(*args)
        gc.collect()
        retained = census.live
        with census:
            grads = torch.autograd.grad(loss, wrt)
        del loss, grads
        return retained, census.peak
    finally:
        census.close()


class FlopCount(TorchDispatchMode):
    """FLOPs of the ops torch has formulas for (matrix products, convolutions, attention), counted at dispatch.

    torch's ``FlopCounterMode`` with the same formulas, without its module tracker: the
    tracker's module hooks run ops of their own (``view_as`` of each parameter) when a
    recompute calls the modules again, which a recompute must not see.
    """

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))
        return out


def _backward_flops(cfg: Config, args: Sequence[Any], wrt: list[torch.Tensor]) -> int:
    loss = cfg.loss_fn(*args)
    with FlopCount() as fc:
        torch.autograd.grad(loss, wrt)
    return fc.total


def _max_steps(steps: int, min_time: float, max_steps: int | None) -> int:
    """The most rounds :func:`measure` times (default: the larger of ``steps`` and 100), checked."""
    if max_steps is None:
        max_steps = max(steps, 100)
    if not min_time >= 0 or max_steps < steps:  # (not >=: NaN too)
        raise ValueError(f"measure: min_time must be >= 0 and max_steps >= steps, got {min_time}, {max_steps}")
    return max_steps


def measure(configs: Sequence[Config], args: Sequence[Any], *, steps: int = 5, warmup: int = 1,
            progress: Progress | None = None, min_time: float = 0.0, max_steps: int | None = None) -> list[Result]:
    """Measure each configuration on the same arguments; the first one is the baseline for ratios.

    Timing runs ``steps`` rounds (every configuration once per round, interleaved), then more rounds while the
    timed steps took less than ``min_time`` seconds in all, up to ``max_steps`` rounds (default: the larger of
    ``steps`` and 100): a small model's steps are short, and its medians need more of them to be stable on a
    busy machine. Each round runs the configurations in an order of its own (shuffled, from a fixed seed): in
    one fixed order, the first ran every round just after the round's full garbage collection had run through
    every object of the process, with cold caches, and each ran after the same neighbour (2026-12-02, the small
    transformer: a step just after the full collection took 10-20 % longer, no-remat's 12.1 against 10.2 ms,
    and no-remat ran there every round: each ratio to it read about 16 % low).

    Example:
        >>> import torch
        >>> from remat import remat
        >>> from remat.bench.measure import Config, measure
        >>> f = lambda w, x: torch.tanh(torch.tanh(x @ w) @ w).pow(2).sum()
        >>> w, x = torch.randn(64, 64, requires_grad=True), torch.randn(32, 64)
        >>> rows = measure([Config("plain", f), Config("remat", remat(f))], [w, x], steps=2)
        >>> rows[0].retained_bytes > rows[1].retained_bytes, rows[1].recomputed_flops > 0
        (True, True)
    """
    if not configs:
        raise ValueError("measure: no configurations to measure")
    max_steps = _max_steps(steps, min_time, max_steps)
    if steps < 1 or warmup < 0:
        raise ValueError(f"measure: steps must be >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    wrt = _grad_leaves(args)
    if not wrt:
        raise ValueError(
            "measure: no argument requires grad, so there is no backward pass to measure; "
            "call .requires_grad_() on the parameters (or inputs) to differentiate."
        )
    device = wrt[0].device
    say = progress or (lambda s: None)
    mem: dict[str, tuple[int, int]] = {}
    flops: dict[str, int] = {}
    for i, c in enumerate(configs):
        say(f"[{i + 1}/{len(configs)}] {c.label}: warm-up, memory, FLOPs")
        for _ in range(max(warmup, 1 if c.compiled else 0)):  # the first call of a compiled one compiles
            _step(c, args, wrt)
        mem[c.label] = _memory(c, args, wrt, device)
        flops[c.label] = _backward_flops(c, args, wrt)
    times: dict[str, list[float]] = {c.label: [] for c in configs}
    cpu: dict[str, list[float]] = {c.label: [] for c in configs}
    r, spent = 0, 0.0
    order, rng = list(configs), random.Random(0)
    while r < steps or (spent < min_time and r < max_steps):
        r += 1
        say(f"timing round {r}/{steps}" if r <= steps else f"timing round {r} (until {min_time:g} s in all)")
        gc.collect()  # (a full collection costs ~0.1 s with torch loaded: once a round, the young ones per step)
        rng.shuffle(order)
        for c in order:
            gc.collect(1)
            _sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            _step(c, args, wrt)
            _sync(device)
            times[c.label].append(time.perf_counter() - t0)
            cpu[c.label].append(time.process_time() - c0)
            spent += times[c.label][-1]
    base = configs[0].label
    out = []
    for c in configs:
        ratios = [t / b for t, b in zip(times[c.label], times[base], strict=True)]
        q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
        out.append(Result(
            label=c.label, retained_bytes=mem[c.label][0], peak_bytes=mem[c.label][1],
            time_s=statistics.median(times[c.label]), time_ratio=statistics.median(ratios),
            backward_flops=flops[c.label], recomputed_flops=flops[c.label] - flops[base], times_s=times[c.label],
            cpu_times_s=cpu[c.label], ratio_spread=(q[2] - q[0]) / 2,
        ))
    return out


def format_table(rows: Sequence[Result], baseline: str | None = None) -> str:
    """An aligned text table of results."""
    base = baseline or (rows[0].label if rows else "")
    head = ["configuration", "retained MiB", "peak MiB", "ms/step", f"time vs {base}", "recomputed GFLOP"]
    body = [[r.label, f"{r.retained_bytes / MiB:.1f}", f"{r.peak_bytes / MiB:.1f}" if r.peak_bytes >= 0 else "-",
             f"{r.time_s * 1e3:.1f}",
             f"{r.time_ratio:.2f}x" + (f" ±{r.ratio_spread:.2f}" if r.ratio_spread else ""),
             f"{r.recomputed_flops / 1e9:.3f}"] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def ratio(a: Result, b: Result, cpu: bool = False) -> float:
    """Median over the rounds of ``a``'s step time over ``b``'s in the same round (wall or process CPU time)."""
    ta, tb = (a.cpu_times_s, b.cpu_times_s) if cpu else (a.times_s, b.times_s)
    return statistics.median(x / y for x, y in zip(ta, tb, strict=True))


def pareto_front(rows: Sequence[Result]) -> list[Result]:
    """The results no other result beats on both retained memory and time (sorted by memory).

    Time is what the table's "time vs" column shows (``time_ratio``: per round, the step time over the
    baseline's in the same round; the median over the rounds), so that the front and the table agree: a slow
    stretch of the machine slows every configuration of its rounds alike, where medians taken apart can order two
    close configurations either way. So ``rows`` must come from one :func:`measure` call (one baseline).

    A result beats another only by more than the noise: memory by more than 2% (or 64 KiB), time by more than the
    uncertainty of the median of their per-round ratio and by more than 3% (:func:`time_better`); two results within those
    of each other are *tied* (:func:`ties`), and neither beats the other. So the front does not change with the noise
    of a run."""
    front = [r for r in rows if not any(_beats(o, r) for o in rows if o is not r)]
    return sorted(front, key=lambda r: r.retained_bytes)


def _mem_better(a: Result, b: Result) -> bool:
    return b.retained_bytes - a.retained_bytes > max(0.02 * b.retained_bytes, 64 * 1024)


def time_better(a: Result, b: Result) -> bool:
    """``a``'s step is shorter than ``b``'s beyond the noise: paired by round (the same round's two steps, so that a
    slow stretch of the machine cancels out), the median of ``a``'s over ``b``'s is below 1 by more than its
    uncertainty (the 95% interval of a median: 1.57 interquartile ranges over the square root of the rounds) and by
    more than 3%. (Without paired rounds: the medians' ratios, by both spreads.)"""
    n = len(a.times_s)
    if n >= 3 and n == len(b.times_s):
        r = [x / y for x, y in zip(a.times_s, b.times_s, strict=True)]
        q = statistics.quantiles(r, n=4)
        # (the median's uncertainty: about 1.57 IQR / sqrt(n) for a 95% interval, McGill et al.'s notches)
        return statistics.median(r) < 1 - max(1.57 * (q[2] - q[0]) / math.sqrt(n), TIE)
    return b.time_ratio - a.time_ratio > max(a.ratio_spread + b.ratio_spread, 0.02)


TIE = 0.03  # steps closer than 3% are tied whatever the noise (a difference a user would not act on)


def _beats(a: Result, b: Result) -> bool:
    """``a`` is no worse than ``b`` on memory and time (within the noise) and better on one, beyond it."""
    mem_ok = not _mem_better(b, a)
    time_ok = not time_better(b, a)
    return mem_ok and time_ok and (_mem_better(a, b) or time_better(a, b))


def ties(rows: Sequence[Result]) -> list[tuple[Result, Result]]:
    """Pairs of results within the noise of each other on both memory and time (see :func:`pareto_front`)."""
    return [(a, b) for i, a in enumerate(rows) for b in rows[i + 1:]
            if not (_mem_better(a, b) or _mem_better(b, a) or time_better(a, b) or time_better(b, a))]


def plot(rows: Sequence[Result], path: str, title: str = "") -> None:
    """Save a PNG of retained memory against time (the table's "time vs" column: per-round ratios to the first
    row, their median, the measure :func:`pareto_front` ranks by), with the Pareto front marked (needs
    matplotlib)."""
    try:
        import matplotlib  # type: ignore[import-not-found]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found]
    except ImportError as e:
        raise ImportError("plotting needs matplotlib: pip install matplotlib (or pip install 'remat[plot]')") from e
    fig, ax = plt.subplots(figsize=(7, 4.5))
    front = pareto_front(rows)
    ax.scatter([r.retained_bytes / MiB for r in rows], [r.time_ratio for r in rows], color="tab:blue")
    for r in rows:
        ax.annotate(r.label, (r.retained_bytes / MiB, r.time_ratio), textcoords="offset points", xytext=(5, 4),
                    fontsize=8)
    ax.plot([r.retained_bytes / MiB for r in front], [r.time_ratio for r in front], color="tab:red",
            marker="o", fillstyle="none", markersize=11, label="Pareto front")
    ax.set_xlabel("retained activations (MiB)")
    ax.set_ylabel(f"forward + backward step, time vs {rows[0].label} (x)" if rows else "time vs baseline (x)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
