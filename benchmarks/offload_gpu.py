"""Activation offloading on one GPU: memory, bytes moved and step time of remat's offload policy and the others.

Workload: the reference transformer stack (``--size large``, the default: 8 pre-LN
blocks, batch 8, seq 2048, d_model 2048, 16 heads, MLP 8192, explicit attention,
bfloat16), each block one remat call; plain autograd saves about 17 GiB of
activations for it. Configurations, each a warmup step, then a memory step, then
``--rounds`` timed rounds interleaved (the order alternating), medians:

* no remat; remat ``save-nothing``; remat ``save-matmuls``;
* remat ``offload-to-cpu`` (pinned pool, side streams, prefetch: ``remat.offload``),
  and the same with ``OffloadEngine(prefetch=False)``;
* ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around the forward pass
  (it copies every saved tensor, parameters included, on the compute stream);
* torchtune-style offload: the algorithm of torchtune's ``OffloadActivations``
  (``use_streams=True``), re-implemented here with ``saved_tensors_hooks`` (see
  :class:`TorchtuneStyle`): references kept until the copy is done, stream waits
  instead of ``record_stream``, tensors still on the device reused in the backward.

Columns: **peak alloc** / **peak reserved** (``max_memory_allocated`` /
``max_memory_reserved`` of the memory step, read after ``empty_cache()`` and
``reset_peak_memory_stats()``), **held** (allocated at the end of the forward pass,
copies finished, minus before it), **retries** / **syncs** (``num_alloc_retries`` /
``num_sync_all_streams`` of ``torch.cuda.memory_stats()`` during the memory step),
**D2H** / **H2D** (bytes moved per step: the engine's stats for remat rows, the
hooks' own counts for the others), forward / backward / step ms (medians;
forward and backward split by CUDA events on the compute stream, no
synchronisation between them), **copy exposed** (extra step time over no remat
divided by the time the bytes moved take at the measured pinned copy bandwidth: 0
means the copies are hidden, 1 that they are not overlapped at all), and whether
the gradients equal those of no remat bit for bit (offloading changes no
arithmetic, so they should). After the table: the bandwidth, per engine how many
copies back started ahead of need (counted from the engine's trace) and the
pinned pool's allocations, and the leak check of :func:`saved_bytes`.

``--tiny`` runs the same code on the CPU with the small transformer in seconds (the
test suite runs it): no streams, no pinned memory, every tensor offloaded, memory
columns n/a.

Usage::

    python benchmarks/offload_gpu.py                  # CUDA machine; falls back to --tiny without CUDA
    python benchmarks/offload_gpu.py --rounds 3       # fewer timed rounds
    python benchmarks/offload_gpu.py --size medium    # a smaller stack (seconds)
    python benchmarks/offload_gpu.py --tiny           # anywhere
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import os
import statistics
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from remat import policies, remat  # noqa: E402
from remat.bench.models import make_model  # noqa: E402
from remat.offload import OffloadEngine, use_engine  # noqa: E402

MIN_BYTES = 1 << 20
GiB, MiB = float(1 << 30), float(1 << 20)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---- the other offloaders, with the bytes they move counted ------------------------------------------


class SaveOnCpuCounted(torch.autograd.graph.saved_tensors_hooks):
    """``torch.autograd.graph.save_on_cpu(pin_memory=True)``, unchanged, with the bytes it moves counted."""

    def __init__(self, counts: dict[str, int]) -> None:
        inner = torch.autograd.graph.save_on_cpu(pin_memory=True)

        def pack(t: torch.Tensor) -> Any:
            counts["d2h"] += nbytes(t)  # save_on_cpu copies every saved tensor, parameters included
            return inner.pack_hook(t)

        def unpack(p: Any) -> torch.Tensor:
            counts["h2d"] += nbytes(p[1])
            return inner.unpack_hook(p)  # type: ignore[no-any-return]

        super().__init__(pack, unpack)


class TorchtuneStyle(torch.autograd.graph.saved_tensors_hooks):
    """The algorithm of torchtune's ``OffloadActivations(use_streams=True)``, written from its description.

    Forward: every saved tensor of at least ``min_bytes`` that is not a leaf (parameters and
    inputs stay, as in remat) is copied on a side stream into pinned memory (torch's caching host
    allocator); the device tensor is *kept* (a reference in a forward stash) until
    ``max_fwd_stash`` later tensors have been offloaded, then the compute stream waits on the
    copy's event and the reference is dropped: no ``record_stream``, no host wait.

    Backward: a tensor still in the forward stash (the last ones of the forward pass) is used as
    it is, nothing copied. Any other is copied back on the side stream when autograd unpacks it (on
    demand: no prefetch), and the compute stream waits for the side stream. Its device copy is held
    until the autograd node that read it has run; when the backward moves on to the next node, the
    side stream waits on an event recorded after that node and the reference is dropped
    (``record_stream`` only when the node's output aliases it). At the end of the backward pass
    the remaining references are released the same way.

    On the CPU (``--tiny``) the same bookkeeping runs with synchronous copies and no streams.
    """

    def __init__(self, device: torch.device, min_bytes: int, max_fwd_stash: int = 5) -> None:
        self.device, self.min_bytes, self.max_fwd_stash = device, min_bytes, max_fwd_stash
        self.cuda = device.type == "cuda"
        self.s1 = torch.cuda.Stream(device) if self.cuda else None  # the copy stream
        self.tracker: dict[int, tuple[torch.Tensor, bool]] = {}  # id -> (tensor kept, or host copy; offloaded?)
        self.fwd_stash: dict[int, tuple[torch.Tensor, Any]] = {}  # id -> (device tensor, its copy's event)
        self.bwd_stash: dict[int, torch.Tensor] = {}  # id -> device copy, until the node reading it has run
        self.bwd_events: dict[int, Any] = {}
        self.next_id = 0
        self.in_backward = False
        self.node: Any = None
        self.counts = {"d2h": 0, "h2d": 0, "reused": 0}
        super().__init__(self.pack, self.unpack)

    def _s0(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def pack(self, t: torch.Tensor) -> int:
        if self.in_backward:  # a new forward pass
            self.in_backward = False
        tid = self.next_id
        self.next_id += 1
        if nbytes(t) < self.min_bytes or t.is_leaf:
            self.tracker[tid] = (t.detach(), False)
            return tid
        for old in [k for k in self.fwd_stash if k <= tid - self.max_fwd_stash]:
            _, ev = self.fwd_stash.pop(old)  # copied long enough ago: free it in stream order
            if ev is not None:
                self._s0().wait_event(ev)
        if self.s1 is not None:
            self.s1.wait_stream(self._s0())
            with torch.cuda.stream(self.s1):
                host = torch.empty_like(t, device="cpu", pin_memory=True)
                host.copy_(t, non_blocking=True)
                ev = self.s1.record_event()
        else:
            host, ev = t.detach().to("cpu", copy=True), None
        self.fwd_stash[tid] = (t.detach(), ev)
        self.tracker[tid] = (host, True)
        self.counts["d2h"] += nbytes(t)
        return tid

    def unpack(self, tid: int) -> torch.Tensor:
        if not self.in_backward:
            self.in_backward = True
            engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
            engine.queue_callback(self._end_of_backward)  # released at the end of the backward pass
        val, offloaded = self.tracker.pop(tid)
        if not offloaded:
            return val
        # which autograd node is reading: its tensors are released once the backward moves past it
        # (torch._C._current_autograd_node: torchtune's own means; no public API names the running node)
        node = torch._C._current_autograd_node()
        prev: list[int] = []
        if node is not self.node:
            self.node = node
            prev = list(self.bwd_stash)
        fetched = tid not in self.fwd_stash
        if not fetched:
            dev = self.fwd_stash[tid][0]  # still on the device: no copy back
            self.counts["reused"] += 1
        elif self.s1 is not None:
            with torch.cuda.stream(self.s1):
                dev = val.to(self.device, non_blocking=True)
            self._s0().wait_stream(self.s1)
            self.bwd_stash[tid] = dev
            self.counts["h2d"] += nbytes(val)
        else:
            dev = val.to(self.device, copy=True)
            self.bwd_stash[tid] = dev
            self.counts["h2d"] += nbytes(val)
        if node is not None:
            node.register_hook(functools.partial(self._after_node, tid, fetched, prev))
        else:
            self._after_node(tid, fetched, prev, (), ())
        return dev

    def _after_node(self, tid: int, fetched: bool, prev: list[int], grad_inputs: Any, grad_outputs: Any) -> None:
        if fetched and tid in self.bwd_stash:
            dev = self.bwd_stash[tid]
            ptr = dev.untyped_storage().data_ptr()
            if any(isinstance(g, torch.Tensor) and g.untyped_storage().data_ptr() == ptr for g in grad_inputs):
                if self.cuda:  # the node's output is a view of it: it lives on, release by record_stream
                    dev.record_stream(self._s0())
                del self.bwd_stash[tid]
            elif self.cuda:
                self.bwd_events[tid] = self._s0().record_event()
        for k in list(self.fwd_stash):  # the backward pass has begun: the forward stash goes
            _, ev = self.fwd_stash.pop(k)
            if ev is not None:
                self._s0().wait_event(ev)
        for k in prev:  # the previous node's copies: the copy stream waits until that node ran, then drop
            ev = self.bwd_events.pop(k, None)
            if ev is not None and self.s1 is not None:
                self.s1.wait_event(ev)
            self.bwd_stash.pop(k, None)

    def _end_of_backward(self) -> None:
        for k in list(self.bwd_stash):
            ev = self.bwd_events.pop(k, None)
            if self.s1 is not None:
                if ev is not None:
                    self.s1.wait_event(ev)
                else:
                    self.bwd_stash[k].record_stream(self._s0())
            del self.bwd_stash[k]
        for k in list(self.fwd_stash):
            _, ev = self.fwd_stash.pop(k)
            if ev is not None:
                self._s0().wait_event(ev)
        self.node = None


# ---- measurements shared with gpu_check.py --------------------------------------------------------------


def saved_bytes(apply: Callable[..., Any], params: Any, x: torch.Tensor,
                probe: list[weakref.ref[Any]] | None = None) -> int:
    """Bytes of distinct storages plain autograd saves for the backward pass (parameters excluded).

    The pack hook returns ``t.detach()``: returning ``t`` itself would make the saved output hold
    its own ``grad_fn`` (a cycle through C++ that the garbage collector cannot see), and the whole
    graph would stay alive. The detached aliases keep each storage alive until the loss is
    dropped, so two saved storages never share a data pointer. ``probe`` collects weak
    references to the saved storages (the leak check: all dead when this returns).
    """
    seen: dict[int, int] = {}
    param_ptrs = {p.untyped_storage().data_ptr() for blk in params for p in blk.values()}
    x_ptr = x.untyped_storage().data_ptr()  # the input: counted, but alive after the call

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in param_ptrs:
            seen[s.data_ptr()] = s.nbytes()
            if probe is not None and s.data_ptr() != x_ptr:
                probe.append(weakref.ref(s))
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = apply(params, x)
    del loss
    return sum(seen.values())


def ahead_of_need(trace: list[tuple[str, int, int]]) -> tuple[int, int]:
    """(copies back started before they were needed, all copies back), from an ``OffloadEngine(trace=True)`` trace.

    Each ``fetch`` ends with one ``("use", group, copy)`` entry, and the copies it starts are logged
    before it: a copy back was started ahead of need when the fetch that started it was reading
    another copy.
    """
    ahead = total = 0
    for i, (what, _, cid) in enumerate(trace):
        if what != "h2d":
            continue
        total += 1
        nxt = next((c for w, _, c in trace[i + 1:] if w == "use"), None)
        ahead += nxt != cid
    return ahead, total


def copy_bandwidth(device: torch.device, nbytes_: int = 1 << 30, repeats: int = 3) -> tuple[float, float]:
    """(host to device, device to host) bytes per second of a plain copy, best of ``repeats``.

    CUDA: a pinned host buffer and a non-blocking copy timed with events. CPU: a host memcpy.
    """
    if device.type != "cuda":
        a, b = torch.empty(nbytes_, dtype=torch.uint8), torch.empty(nbytes_, dtype=torch.uint8)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            b.copy_(a)
            best = min(best, time.perf_counter() - t0)
        return nbytes_ / best, nbytes_ / best
    host = torch.empty(nbytes_, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes_, dtype=torch.uint8, device=device)
    out = []
    for dst, src in ((dev, host), (host, dev)):
        best = float("inf")
        for _ in range(repeats):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            dst.copy_(src, non_blocking=True)
            e1.record()
            e1.synchronize()
            best = min(best, e0.elapsed_time(e1) / 1e3)
        out.append(nbytes_ / best)
    del host, dev
    return out[0], out[1]


# ---- the benchmark ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Config:
    """One row: how a block is wrapped, the context around the step, and the bytes it has moved so far."""

    name: str
    wrap: Callable[[Any], Any]
    ctx: Callable[[], Any]
    moved: Callable[[], tuple[int, int]] = lambda: (0, 0)  # cumulative (device to host, host to device) bytes
    engine: OffloadEngine | None = None
    counts: dict[str, int] | None = None


def engine_moved(engine: OffloadEngine) -> Callable[[], tuple[int, int]]:
    def moved() -> tuple[int, int]:
        st = engine.stats
        return st["offloaded_bytes"], st["h2d_bytes"]

    return moved


@dataclasses.dataclass
class Row:
    fwd: list[float] = dataclasses.field(default_factory=list)
    bwd: list[float] = dataclasses.field(default_factory=list)
    step: list[float] = dataclasses.field(default_factory=list)
    mem: dict[str, float] = dataclasses.field(default_factory=dict)
    moved: tuple[int, int] = (0, 0)
    stats: dict[str, int] = dataclasses.field(default_factory=dict)
    ahead: tuple[int, int] = (0, 0)
    equal: bool = True
    diff: float = 0.0
    warm_pinned: int = 0


def fmt(v: float | None, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def settled_allocated(device: torch.device) -> int:
    """``torch.cuda.memory_allocated()`` once the device is idle and the allocator has processed the events of
    blocks freed while a side stream still used them (``record_stream``): it does so on its next allocation."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.empty(1, device=device)
    return torch.cuda.memory_allocated(device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="small model on the CPU, seconds (tests run this)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5, tiny 2)")
    ap.add_argument("--size", default="large", choices=["small", "medium", "large"], help="model size on CUDA")
    args = ap.parse_args(argv)
    tiny = args.tiny or not torch.cuda.is_available()
    if not args.tiny and tiny:
        print("no CUDA device: running --tiny")
    rounds = args.rounds or (2 if tiny else 5)
    if tiny:
        torch.set_num_threads(1)
        device, size, dtype, min_bytes = torch.device("cpu"), "small", torch.float32, 0
    else:
        device, size, dtype, min_bytes = torch.device("cuda"), args.size, torch.bfloat16, MIN_BYTES
    cuda = device.type == "cuda"
    unit, uname = (MiB, "MiB") if tiny else (GiB, "GiB")
    params, x, _, apply = make_model("transformer", size, dtype, device)
    for blk in params:
        for p in blk.values():
            p.requires_grad_(True)
    flat = [p for blk in params for p in blk.values()]

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    # the leak check: saved_bytes() must leave nothing behind (its pack hook once returned t: the whole
    # plain graph stayed alive on the device). Measured on a second call: the first one allocates the
    # cuBLAS workspaces, which stay.
    saved_bytes(apply, params, x)
    alloc0 = settled_allocated(device)
    probe: list[weakref.ref[Any]] = []
    act = saved_bytes(apply, params, x, probe)
    alloc1 = settled_allocated(device)
    alive = sum(r() is not None for r in probe)
    leak_ok = alive == 0 and alloc1 == alloc0
    print(f"transformer {size}, {str(dtype).replace('torch.', '')}, {device.type}: plain autograd saves "
          f"{act / GiB:.2f} GiB ({act / MiB:.1f} MiB) of activations; {rounds} rounds, medians")
    print(f"leak check: {'PASS' if leak_ok else 'FAIL'}: saved_bytes() left {alive} of {len(probe)} saved storages "
          f"alive; memory allocated {alloc0 / MiB:.1f} MiB before, {alloc1 / MiB:.1f} MiB after")

    bw_h2d, bw_d2h = copy_bandwidth(device, (1 << 30) if cuda else (16 << 20))
    engine = OffloadEngine(trace=True)
    engine_np = OffloadEngine(prefetch=False, trace=True)
    offload = policies.offload_to_cpu(min_bytes=min_bytes)
    soc_counts = {"d2h": 0, "h2d": 0}
    tt = TorchtuneStyle(device, min_bytes)
    nullctx: Callable[[], Any] = contextlib.nullcontext
    configs = [
        Config("no remat", lambda f: f, nullctx),
        Config("save-nothing", lambda f: remat(f, policy="save-nothing"), nullctx),
        Config("save-matmuls", lambda f: remat(f, policy="save-matmuls"), nullctx),
        Config("offload-to-cpu", lambda f: remat(f, policy=offload), lambda: use_engine(engine),
               engine_moved(engine), engine),
        Config("offload-to-cpu, prefetch=False", lambda f: remat(f, policy=offload), lambda: use_engine(engine_np),
               engine_moved(engine_np), engine_np),
        Config("save_on_cpu(pin_memory=True)", lambda f: f, lambda: SaveOnCpuCounted(soc_counts),
               lambda: (soc_counts["d2h"], soc_counts["h2d"]), counts=soc_counts),
        Config("torchtune-style offload", lambda f: f, lambda: tt,
               lambda: (tt.counts["d2h"], tt.counts["h2d"]), counts=tt.counts),
    ]
    rows = {c.name: Row() for c in configs}

    def step(cfg: Config, row: Row, memory: bool) -> None:
        for p in flat:
            p.grad = None
        sync()
        stats0: dict[str, Any] = {}
        if memory:
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                stats0 = torch.cuda.memory_stats()
            if cfg.engine is not None:
                assert cfg.engine.trace is not None
                cfg.engine.trace.clear()
        moved0, est0 = cfg.moved(), dict(cfg.engine.stats) if cfg.engine is not None else {}
        before = settled_allocated(device)
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if cuda else []
        t0 = time.perf_counter()
        if evs:
            evs[0].record()
        with cfg.ctx():
            loss = apply(params, x, cfg.wrap)
            t1 = time.perf_counter()
            if memory:  # the copies of the forward pass finished: what the device still holds
                row.mem["held"] = settled_allocated(device) - before
            if evs:
                evs[1].record()
            loss.backward()
            if evs:
                evs[2].record()
        del loss
        sync()
        t2 = time.perf_counter()
        if memory:
            if cuda:
                st = torch.cuda.memory_stats()
                row.mem["peak"] = torch.cuda.max_memory_allocated()
                row.mem["reserved"] = torch.cuda.max_memory_reserved()
                for k in ("num_alloc_retries", "num_sync_all_streams"):
                    row.mem[k] = st.get(k, 0) - stats0.get(k, 0)
            m1 = cfg.moved()
            row.moved = (m1[0] - moved0[0], m1[1] - moved0[1])
            if cfg.engine is not None:
                row.stats = {k: v - est0.get(k, 0) for k, v in cfg.engine.stats.items()}
                assert cfg.engine.trace is not None
                row.ahead = ahead_of_need(cfg.engine.trace)
        else:
            if evs:
                row.fwd.append(evs[0].elapsed_time(evs[1]) / 1e3)
                row.bwd.append(evs[1].elapsed_time(evs[2]) / 1e3)
            else:
                row.fwd.append(t1 - t0)
                row.bwd.append(t2 - t1)
            row.step.append(t2 - t0)

    ref: list[torch.Tensor] = []
    for cfg in configs:  # warmup (the pools fill), the gradient check against no remat, the memory step
        log(f"warmup and memory step: {cfg.name}")
        row = rows[cfg.name]
        step(cfg, row, memory=False)
        row.fwd, row.bwd, row.step = [], [], []  # the warmup is not timed
        grads = [p.grad.detach().clone() for p in flat]  # type: ignore[union-attr]
        if not ref:
            ref = grads
        row.diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(grads, ref, strict=True))
        row.equal = all(torch.equal(a, b) for a, b in zip(grads, ref, strict=True))
        del grads
        if cfg.engine is not None:
            row.warm_pinned = cfg.engine.pinned_allocations()
        step(cfg, row, memory=True)
    for r in range(rounds):
        log(f"timed round {r + 1} of {rounds}")
        for cfg in configs if r % 2 == 0 else configs[::-1]:  # interleaved, alternating order
            step(cfg, rows[cfg.name], memory=False)
            if cfg.engine is not None:
                assert cfg.engine.trace is not None
                cfg.engine.trace.clear()

    base = statistics.median(rows["no remat"].step)
    na = "n/a"
    print(f"\n| configuration | peak alloc {uname} | peak reserved {uname} | held {uname} | retries | syncs "
          f"| D2H {uname} | H2D {uname} | fwd ms | bwd ms | step ms | vs no remat | copy exposed | grads equal |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for cfg in configs:
        row = rows[cfg.name]
        med = statistics.median(row.step)
        d2h, h2d = row.moved
        copy_s = d2h / bw_d2h + h2d / bw_h2d
        exposed = f"{(med - base) / copy_s:.2f}" if copy_s > 0 else "–"
        mem = [fmt(row.mem[k] / unit) if cuda else na for k in ("peak", "reserved", "held")]
        cnt = [str(int(row.mem[k])) if cuda else na for k in ("num_alloc_retries", "num_sync_all_streams")]
        eq = "True" if row.equal else f"False (max abs diff {row.diff:.3g})"
        print(f"| {cfg.name} | {' | '.join(mem)} | {' | '.join(cnt)} | {d2h / unit:.2f} | {h2d / unit:.2f} "
              f"| {statistics.median(row.fwd) * 1e3:.1f} | {statistics.median(row.bwd) * 1e3:.1f} | {med * 1e3:.1f} "
              f"| {med / base:.2f}x | {exposed} | {eq} |")
    what = "pinned, non-blocking, CUDA events" if cuda else "host memcpy"
    print(f"\ncopy bandwidth ({what}, best of 3): host to device {bw_h2d / 1e9:.1f} GB/s, "
          f"device to host {bw_d2h / 1e9:.1f} GB/s; copy exposed = (step - no remat step) / "
          "(D2H / bandwidth + H2D / bandwidth)")
    for cfg in configs:
        row = rows[cfg.name]
        if cfg.engine is not None:
            st, eng = row.stats, cfg.engine
            ahead, total = row.ahead
            note = "" if st.get("prefetched", 0) == ahead else (
                f" (engine stats['prefetched'] says {st.get('prefetched', 0)}: it also counts the copy started for "
                "the tensor being read)")
            h2d_note = "" if st.get("h2d", 0) == st.get("copies", 0) else " (H2D bytes estimated: h2d != copies)"
            kept = f", {st['kept_on_device']} kept on the device" if st.get("kept_on_device") else ""
            pool = (f"pinned pool {eng.pinned_bytes() / unit:.2f} {uname}, allocations after warmup "
                    f"{row.warm_pinned}, after all rounds {eng.pinned_allocations()}")
            print(f"{cfg.name}: per step {st.get('copies', 0)} copies out ({st.get('shared', 0)} saved tensors "
                  f"shared one{kept}), {st.get('h2d', 0)} copies back{h2d_note}, {ahead} of {total} started ahead "
                  f"of need (trace){note}; compute-stream waits for a copy (the host never waits) "
                  f"{st.get('stream_waits', 0)}; {pool}")
    print(f"torchtune-style offload: per step {rows['torchtune-style offload'].moved[0] / unit:.2f} {uname} out, "
          f"{rows['torchtune-style offload'].moved[1] / unit:.2f} {uname} back; "
          f"{tt.counts['reused']} tensors reused from the device in all steps (forward stash)")
    return 0 if leak_ok and all(r.equal for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
