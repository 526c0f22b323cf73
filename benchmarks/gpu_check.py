"""The offload engine's GPU checks: exact under delayed copies, waits under the cap, pinned pool, prefetch, in-place writes.

Run by ``benchmarks/gpu_check.sh`` (which also runs the CUDA tests and
``benchmarks/offload_gpu.py``); output in markdown, one ``- **PASS**`` /
``- **FAIL**`` / ``- SKIP`` line per check, a summary at the end, exit status 1 if
a check failed. ``--tiny`` runs the same code on the CPU with the small
transformer in seconds (``tests/test_gpu_check.py`` runs it): what needs CUDA
(delays on the copy streams, the in-flight cap, the pinned pool, sync counting)
is skipped and says so.

Checks (CUDA: the transformer stack at size ``medium``, float32, ``offload-to-cpu``):

* **delayed copies**: an :class:`OffloadEngine` subclass enqueues
  ``torch.cuda._sleep`` on its copy stream before every copy, in both directions
  (torch itself is not patched); three steps back to back without synchronising;
  each step's gradients must be ``torch.equal`` to plain autograd's, and under the cap
  nothing waits for a copy (``stats["stream_waits"] == 0``; the host never waits: NOTE
  [stream-ordered reuse] in ``remat/_offload/streams.py``);
* the in-flight cap: the same with ``max_inflight_bytes`` small: the engine must bound the
  bytes in flight (``stream_waits``: the compute stream waits for the oldest copy),
  gradients still exact;
* **pinned pool**: ``pinned_allocations()`` flat over 5 back-to-back steps once warm;
* **prefetch**: the backward pass with and without ``prefetch``, copies back started
  ahead of need (from the engine's trace) and backward time;
* **in-place write**: ``a = x.exp(); a.mul_(2)`` under plain autograd with delayed copies
  (and under ``torch.func.grad``): a ``RematError``, plain's error, or the gradient of the
  same program without the write; never another gradient.

Usage::

    python benchmarks/gpu_check.py          # CUDA machine; falls back to --tiny without CUDA
    python benchmarks/gpu_check.py --tiny   # anywhere, seconds
"""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import offload_gpu  # noqa: E402

from remat import RematError, policies, remat  # noqa: E402
from remat.bench.models import make_model  # noqa: E402
from remat.offload import OffloadEngine, use_engine  # noqa: E402

MiB = float(1 << 20)


class DelayedCopies(OffloadEngine):
    """An engine whose copies start late: ``cycles`` GPU clock cycles of ``torch.cuda._sleep`` are enqueued on
    the copy stream each time the engine takes it for a copy (device to host and host to device).

    Test hook: it overrides the engine's private ``_stream`` (the one place the engine takes a copy
    stream); torch is not patched. ``delayed`` counts the sleeps per stream: two streams must show up.
    """

    def __init__(self, cycles: int, **kwargs: Any) -> None:
        if not callable(getattr(OffloadEngine, "_stream", None)):
            raise RuntimeError("OffloadEngine has no _stream(table, device) method: the delay hook needs updating")
        super().__init__(**kwargs)
        self.cycles = cycles
        self.delayed: collections.Counter[int] = collections.Counter()

    def _stream(self, table: Any, dev: torch.device) -> Any:
        s = super()._stream(table, dev)
        if self.cycles:
            with torch.cuda.stream(s):
                torch.cuda._sleep(self.cycles)
            self.delayed[id(s)] += 1  # the engine keeps one stream per direction and device
        return s


def environment(tiny: bool) -> None:
    """The environment table: printed first, before anything touches the device."""
    print("## Environment\n\n| item | value |\n|---|---|")
    rows = [("python", platform.python_version()), ("torch", torch.__version__),
            ("torch CUDA", str(torch.version.cuda))]
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        rows.append(("device", f"{props.name}, sm {props.major}.{props.minor}, "
                               f"{props.total_memory / 2**30:.1f} GiB, {torch.cuda.device_count()} visible"))
    else:
        rows.append(("device", "no CUDA device"))
    try:
        rows.append(("optree", importlib.metadata.version("optree")))
    except importlib.metadata.PackageNotFoundError:
        import optree  # noqa: F401  # on the path without package metadata: still importable

        rows.append(("optree", "importable (no package metadata)"))
    import remat as remat_pkg

    rows.append(("remat", f"imported from {os.path.dirname(os.path.realpath(remat_pkg.__file__ or '?'))}"))
    try:
        with open("/proc/meminfo") as fh:
            total = next(line.split()[1] for line in fh if line.startswith("MemTotal"))
        rows.append(("host memory", f"{int(total) / 2**20:.1f} GiB (MemTotal)"))
    except (OSError, StopIteration):
        pass
    rows.append(("mode", "--tiny: CPU, transformer small float32" if tiny else "CUDA, transformer medium float32"))
    for k, v in rows:
        print(f"| {k} | {v} |")
    print("\n## Checks\n", flush=True)


class Checks:
    """Runs the checks, prints one markdown line each, keeps the tally."""

    def __init__(self, tiny: bool) -> None:
        self.tiny = tiny
        self.cuda = not tiny
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.tally: collections.Counter[str] = collections.Counter()
        self.lines: list[str] = []
        dtype = torch.float32
        self.params, self.x, _, self.apply = make_model("transformer", "small" if tiny else "medium", dtype,
                                                        self.device)
        for blk in self.params:
            for p in blk.values():
                p.requires_grad_(True)
        self.flat = [p for blk in self.params for p in blk.values()]
        self.policy = policies.offload_to_cpu(min_bytes=0 if tiny else 1 << 20)
        self.cpms = self._cycles_per_ms() if self.cuda else 0.0

    # ---- output ---------------------------------------------------------------------------------
    def result(self, status: str, name: str, detail: str) -> None:
        self.tally[status] += 1
        mark = {"PASS": "**PASS**", "FAIL": "**FAIL**", "SKIP": "SKIP"}[status]
        line = f"- {mark} {name}: {detail}"
        self.lines.append(line)
        print(line, flush=True)

    def skip_cuda(self, name: str, what: str) -> None:
        self.result("SKIP", name, f"needs CUDA ({what}); --tiny runs on the CPU")

    def run(self, name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as e:  # one broken check must not hide the others
            traceback.print_exc()
            self.result("FAIL", name, f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")

    # ---- helpers --------------------------------------------------------------------------------
    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    @staticmethod
    def _cycles_per_ms() -> float:
        torch.cuda._sleep(1000)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        torch.cuda._sleep(20_000_000)
        e1.record()
        e1.synchronize()
        return 20_000_000 / max(e0.elapsed_time(e1), 1e-3)

    def cycles(self, ms: float) -> int:
        return int(ms * self.cpms)

    def step(self, wrap: Callable[[Any], Any] | None) -> list[torch.Tensor]:
        """One forward and backward pass, no synchronisation; the gradients (cloned, stream-ordered)."""
        for p in self.flat:
            p.grad = None
        loss = self.apply(self.params, self.x, wrap or (lambda f: f))
        loss.backward()
        return [p.grad.clone() for p in self.flat]  # type: ignore[union-attr]

    def remat_wrap(self) -> Callable[[Any], Any]:
        return lambda f: remat(f, policy=self.policy)

    # ---- the checks -----------------------------------------------------------------------------
    def delayed_exactness(self) -> None:
        name = "delayed copies, exact gradients"
        ref = self.step(None)
        ref2 = self.step(None)
        self.sync()
        plain_repro = all(torch.equal(a, b) for a, b in zip(ref, ref2, strict=True))
        if self.cuda:
            eng: OffloadEngine = DelayedCopies(self.cycles(2.0))
        else:
            eng = OffloadEngine()
        syncs = 0
        with use_engine(eng), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if self.cuda:
                self.sync()
                torch.cuda.set_sync_debug_mode("warn")
            try:
                grads = [self.step(self.remat_wrap()) for _ in range(3)]  # back to back, no synchronize
            finally:
                if self.cuda:
                    torch.cuda.set_sync_debug_mode("default")
            syncs = sum("synchroniz" in str(w.message) for w in caught)
        self.sync()
        equal = [all(torch.equal(a, b) for a, b in zip(g, ref, strict=True)) for g in grads]
        diff = max(float((a - b).abs().max()) for g in grads for a, b in zip(g, ref, strict=True))
        st = eng.stats
        copies = st["copies"] + st["h2d"]
        if self.cuda:
            assert isinstance(eng, DelayedCopies)
            streams, sleeps = len(eng.delayed), sum(eng.delayed.values())
            delays = f"{eng.cycles} cycles (~2 ms) slept {sleeps} times for {copies} copies, on {streams} copy streams"
        else:
            streams, sleeps, delays = 2, copies, "no delays (CPU copies are synchronous)"
        detail = (f"3 steps back to back, {delays}: gradients torch.equal to plain autograd's: {equal} "
                  f"(max abs diff {diff:.3g}; plain reproducible: {plain_repro}); "
                  f"{st['copies']} copies out, {st['h2d']} back; host syncs flagged by sync debug mode: "
                  f"{syncs if self.cuda else 'n/a'}")
        if not plain_repro and not all(equal):
            self.result("FAIL", name, detail + " (plain autograd is not reproducible here: inconclusive)")
        elif streams != 2 or sleeps < copies:
            self.result("FAIL", name, detail + " (not every copy was delayed, in both directions)")
        else:
            self.result("PASS" if all(equal) else "FAIL", name, detail)
        # waits for a copy in the forward pass: none while the bytes in flight stay under the cap (the engine has
        # the compute stream wait past it, never the host)
        inflight = st["offloaded_bytes"] // 3
        wname = "no waits for a copy under the cap"
        wdetail = (f"stats['stream_waits'] = {st['stream_waits']} over 3 steps, "
                   f"{inflight / MiB:.1f} MiB offloaded per step, "
                   f"cap max_inflight_bytes = {eng.max_inflight_bytes / MiB:.0f} MiB")
        self.result("PASS" if st["stream_waits"] == 0 else "FAIL", wname, wdetail)

    def inflight_cap(self) -> None:
        name = "in-flight cap enforced"
        if not self.cuda:
            self.skip_cuda(name, "asynchronous copies")
            return
        cap = 8 << 20
        eng = DelayedCopies(self.cycles(2.0), max_inflight_bytes=cap)
        with use_engine(eng):
            ref = self.step(None)
            g = self.step(self.remat_wrap())
        self.sync()
        st = eng.stats
        exact = all(torch.equal(a, b) for a, b in zip(g, ref, strict=True))
        ok = st["stream_waits"] > 0 and exact
        self.result("PASS" if ok else "FAIL", name,
                    f"max_inflight_bytes = {cap / MiB:.0f} MiB with delayed copies: {st['stream_waits']} "
                    f"compute-stream waits (expected > 0), gradients exact: {exact}")

    def pinned_flat(self) -> None:
        name = "pinned allocations flat over 5 back-to-back steps"
        if not self.cuda:
            self.skip_cuda(name, "the pinned pool serves CUDA tensors only")
            return
        for delay_ms in (0.0, 2.0):
            eng = DelayedCopies(self.cycles(delay_ms)) if delay_ms else OffloadEngine()
            with use_engine(eng):
                self.step(self.remat_wrap())
                self.sync()
                warm = eng.pinned_allocations()
                counts = []
                for _ in range(5):
                    self.step(self.remat_wrap())
                    counts.append(eng.pinned_allocations())
            self.sync()
            detail = f"after warmup {warm}, after each step {counts}; pool {eng.pinned_bytes() / MiB:.1f} MiB"
            if delay_ms:  # informative: a buffer whose copy has not finished cannot be reused yet
                self.lines.append(f"  - with copies delayed ~{delay_ms:g} ms: {detail}")
                print(self.lines[-1], flush=True)
            else:
                self.result("PASS" if counts == [warm] * 5 else "FAIL", name, detail)

    def prefetch(self) -> None:
        name = "backward with and without prefetch"
        ref = self.step(None)
        out = {}
        for pf in (True, False):
            eng = OffloadEngine(prefetch=pf, trace=True)
            times = []
            with use_engine(eng):
                for i in range(4):
                    for p in self.flat:
                        p.grad = None
                    assert eng.trace is not None
                    eng.trace.clear()
                    loss = self.apply(self.params, self.x, self.remat_wrap())
                    self.sync()
                    t0 = time.perf_counter()
                    loss.backward()
                    self.sync()
                    if i:
                        times.append(time.perf_counter() - t0)
                    ahead = offload_gpu.ahead_of_need(eng.trace)
            exact = all(torch.equal(p.grad, r) for p, r in zip(self.flat, ref, strict=True))  # type: ignore[arg-type]
            out[pf] = (statistics.median(times), ahead, exact, eng.stats["prefetched"] // 4)
        (t1, (a1, n1), e1, s1), (t0, (a0, n0), e0, _) = out[True], out[False]
        ok = a1 > 0 and a0 == 0 and e1 and e0
        self.result("PASS" if ok else "FAIL", name,
                    f"prefetch=True: backward {t1 * 1e3:.1f} ms, {a1} of {n1} copies back started ahead of need "
                    f"(trace; engine stats['prefetched'] {s1} per step), gradients exact {e1}; prefetch=False: "
                    f"backward {t0 * 1e3:.1f} ms, {a0} of {n0} ahead, gradients exact {e0}")
        if s1 != a1:
            line = (f"  - engine accounting: stats['prefetched'] = {s1} per step but only {a1} copies back started "
                    "before the fetch that needed them (the copy started for the tensor being read counts too)")
            self.lines.append(line)
            print(line, flush=True)

    def in_place(self) -> None:
        name = "in-place write after offload (a = x.exp(); a.mul_(2))"

        def f(x: torch.Tensor) -> torch.Tensor:
            a = x.exp()
            a.mul_(2)
            return a.sin().sum()

        def g(x: torch.Tensor) -> torch.Tensor:  # the same arithmetic without the write
            a = x.exp() * 2
            return a.sin().sum()

        n = (16 << 20) if self.cuda else 4096  # 64 MiB: the copy takes long enough for a write to race it
        x = torch.randn(n, device=self.device).requires_grad_()
        (want,) = torch.autograd.grad(g(x), x)
        try:
            torch.autograd.grad(f(x), x)
            plain = "a gradient"
        except RuntimeError as e:
            plain = "RuntimeError" if "inplace operation" in str(e) else f"RuntimeError ({e})"
        pol = policies.offload_to_cpu(min_bytes=0)

        def outcome(run: Callable[[], torch.Tensor]) -> tuple[bool, str]:
            try:
                got = run()
                self.sync()
            except RematError as e:
                return True, f"RematError ({str(e)[:80]}...)"
            except RuntimeError as e:
                if "inplace operation" in str(e):
                    return True, "plain's RuntimeError (modified by an inplace operation)"
                return False, f"unexpected RuntimeError: {str(e)[:120]}"
            if torch.equal(got, want):
                return True, "the gradient of the program without the write (torch.equal)"
            return False, f"a WRONG gradient (max abs diff {float((got - want).abs().max()):.3g})"

        delay = self.cycles(20.0) if self.cuda else 0
        eng = DelayedCopies(delay) if self.cuda else OffloadEngine()
        with use_engine(eng):
            ok1, what1 = outcome(lambda: torch.autograd.grad(remat(f, policy=pol)(x), x)[0])
            ok2, what2 = outcome(lambda: torch.func.grad(remat(f, policy=pol))(x.detach()))
        delays = f"copies delayed ~20 ms ({delay} cycles)" if self.cuda else "CPU, no delays"
        self.result("PASS" if ok1 and ok2 else "FAIL", name,
                    f"{delays}; plain autograd gives {plain}; remat under plain autograd gives {what1}; "
                    f"under torch.func.grad gives {what2}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the CPU, the small transformer, seconds (tests run this)")
    args = ap.parse_args(argv)
    tiny = args.tiny or not torch.cuda.is_available()
    print("# remat GPU check" + (" (--tiny: CPU)" if tiny else "") + "\n")
    if tiny and not args.tiny:
        print("no CUDA device: running --tiny\n")
    if tiny:
        torch.set_num_threads(1)
    t0 = time.perf_counter()
    environment(tiny)
    c = Checks(tiny)
    c.run("delayed copies, exact gradients", c.delayed_exactness)
    c.run("in-flight cap enforced", c.inflight_cap)
    c.run("pinned allocations flat over 5 back-to-back steps", c.pinned_flat)
    c.run("backward with and without prefetch", c.prefetch)
    c.run("in-place write after offload", c.in_place)
    t = c.tally
    print(f"\ngpu_check: {t['PASS']} passed, {t['FAIL']} failed, {t['SKIP']} skipped "
          f"in {time.perf_counter() - t0:.1f} s")
    return 1 if t["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
