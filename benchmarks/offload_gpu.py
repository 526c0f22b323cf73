"""Activation offloading on one GPU: peak memory and step time of remat's offload policy against the alternatives.

Workload: the reference transformer stack at size "large" (8 pre-LN blocks, batch 8,
seq 2048, d_model 2048, 16 heads, MLP 8192, explicit attention, bfloat16), each
block one remat call; plain autograd saves about 20-30 GiB of activations for it.
Configurations, interleaved round by round after a warmup step each, medians of
``--rounds`` rounds:

* no remat; remat ``save-nothing``; remat ``save-matmuls``;
* remat ``offload-to-cpu`` (pinned pool, side streams, prefetch: ``remat.offload``);
* ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around the forward pass;
* torchtune-style offloading written here in a few lines with ``saved_tensors_hooks``:
  every saved activation of at least 1 MiB (parameters stay) copied into pinned
  memory on a side stream, copied back on demand when the backward pass reads it.

For each: peak ``torch.cuda.max_memory_allocated`` over a step, memory held
between forward and backward, median step time and its ratio to no remat, and
whether the gradients equal those of no remat bit for bit (offloading changes no
arithmetic, so they should). Runs in well under 5 minutes on one H200.

``--tiny`` runs the same code on the CPU with the small transformer in seconds (the
test suite runs it): no streams, no pinned memory, every tensor offloaded.

Usage::

    python benchmarks/offload_gpu.py            # on a CUDA machine
    python benchmarks/offload_gpu.py --tiny     # anywhere
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from remat import policies, remat  # noqa: E402
from remat.bench.models import make_model  # noqa: E402
from remat.offload import OffloadEngine, use_engine  # noqa: E402

MIN_BYTES = 1 << 20


@contextlib.contextmanager
def torchtune_style(device: torch.device, min_bytes: int) -> Iterator[None]:
    """All saved activations to pinned host memory on a side stream, back on demand (torchtune's recipe)."""
    on_cuda = device.type == "cuda"
    side = torch.cuda.Stream(device) if on_cuda else None

    def pack(t: torch.Tensor) -> Any:
        if t.numel() * t.element_size() < min_bytes or (t.is_leaf and t.requires_grad):  # parameters stay
            return t
        if side is None:
            return (t.to("cpu", copy=True), t.device, None)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        t.record_stream(side)
        return (host, t.device, done)

    def unpack(p: Any) -> torch.Tensor:
        if isinstance(p, torch.Tensor):
            return p
        host, dev, done = p
        if done is None:
            return host.to(dev, copy=True)  # type: ignore[no-any-return]
        torch.cuda.current_stream(dev).wait_event(done)
        return host.to(dev, non_blocking=True)  # type: ignore[no-any-return]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def saved_bytes(apply: Callable[..., Any], params: Any, x: torch.Tensor) -> int:
    """Bytes of distinct storages plain autograd saves for the backward pass (parameters excluded)."""
    seen: dict[int, int] = {}
    param_ptrs = {p.untyped_storage().data_ptr() for blk in params for p in blk.values()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in param_ptrs:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = apply(params, x)
    del loss
    return sum(seen.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="small model on the CPU, seconds (tests run this)")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5, tiny 2)")
    args = ap.parse_args()
    tiny = args.tiny or not torch.cuda.is_available()
    if not args.tiny and tiny:
        print("no CUDA device: running --tiny")
    rounds = args.rounds or (2 if tiny else 5)
    if tiny:
        torch.set_num_threads(1)
        device, size, dtype, min_bytes = torch.device("cpu"), "small", torch.float32, 0
    else:
        device, size, dtype, min_bytes = torch.device("cuda"), "large", torch.bfloat16, MIN_BYTES
    params, x, _, apply = make_model("transformer", size, dtype, device)
    for blk in params:
        for p in blk.values():
            p.requires_grad_(True)
    engine = OffloadEngine()
    offload = policies.offload_to_cpu(min_bytes=min_bytes)
    nullctx: Callable[[], Any] = contextlib.nullcontext
    configs: dict[str, tuple[Callable[[Any], Any], Callable[[], Any]]] = {
        "no remat": (lambda f: f, nullctx),
        "save-nothing": (lambda f: remat(f, policy="save-nothing"), nullctx),
        "save-matmuls": (lambda f: remat(f, policy="save-matmuls"), nullctx),
        "offload-to-cpu": (lambda f: remat(f, policy=offload), lambda: use_engine(engine)),
        "save_on_cpu(pin_memory=True)": (lambda f: f, lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)),
        "torchtune-style offload": (lambda f: f, lambda: torchtune_style(device, min_bytes)),
    }
    flat = [p for blk in params for p in blk.values()]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step(name: str) -> tuple[float, int, int]:
        wrap, ctx = configs[name]
        for p in flat:
            p.grad = None
        sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        t0 = time.perf_counter()
        with ctx():
            loss = apply(params, x, wrap)
            sync()
            held = (torch.cuda.memory_allocated() - before) if device.type == "cuda" else 0
            loss.backward()
        sync()
        dt = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
        return dt, peak, held

    act = saved_bytes(apply, params, x)
    print(f"transformer {size}, {str(dtype).replace('torch.', '')}, {device.type}: plain autograd saves "
          f"{act / 2**30:.2f} GiB ({act / 2**20:.1f} MiB) of activations; {rounds} rounds, medians")
    ref: list[torch.Tensor] = []
    equal: dict[str, tuple[bool, float]] = {}
    for name in configs:  # warmup, and the gradient check against no remat
        step(name)
        grads = [p.grad.detach().clone() for p in flat]  # type: ignore[union-attr]
        if not ref:
            ref = grads
        diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(grads, ref, strict=True))
        equal[name] = (all(torch.equal(a, b) for a, b in zip(grads, ref, strict=True)), diff)
        del grads
    warm_pinned = engine.pinned_allocations()
    times: dict[str, list[float]] = {n: [] for n in configs}
    peaks: dict[str, int] = {}
    helds: dict[str, int] = {}
    for r in range(rounds):
        order = list(configs) if r % 2 == 0 else list(reversed(configs))  # interleaved, alternating order
        for name in order:
            dt, peak, held = step(name)
            times[name].append(dt)
            peaks[name] = max(peaks.get(name, 0), peak)
            helds[name] = max(helds.get(name, 0), held)
    base = statistics.median(times["no remat"])
    print(f"| {'configuration':<30} | peak GiB | held GiB | step ms | vs no remat | gradients")
    print(f"|{'-' * 32}|----------|----------|---------|-------------|----------")
    for name in configs:
        med = statistics.median(times[name])
        eq, diff = equal[name]
        print(f"| {name:<30} | {peaks[name] / 2**30:8.2f} | {helds[name] / 2**30:8.2f} | {med * 1e3:7.1f} | "
              f"{med / base:10.2f}x | grads equal: {eq} (max |diff| {diff:.3g})")
    st = engine.stats
    print(f"offload engine: {st['offloaded_bytes'] / 2**30 / (rounds + 1):.2f} GiB copied per step, "
          f"{st['shared']} saved tensors shared a copy, {st['prefetched']} of {st['h2d']} copies back prefetched, "
          f"{st['waits']} forward waits; pinned pool {engine.pinned_bytes() / 2**30:.2f} GiB, "
          f"allocations after warmup {warm_pinned}, after all rounds {engine.pinned_allocations()}")


if __name__ == "__main__":
    main()
