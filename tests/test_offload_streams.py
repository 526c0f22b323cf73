"""Copies in flight: copies back prefetched one call ahead of the backward pass (or started when read,
or when prefetching runs out of memory), the in-flight budget per device, copies to the host that read their bytes
late (NOTE [written while copied]), one engine serving two threads, and a user's dispatch mode that sees the
function's ops and not the engine's copies.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch

from remat import RematError, policies, remat
from remat.bench.models import make_model
from remat.offload import OffloadEngine, use_engine

from .helpers import LateCopies, OpLog, assert_tree_close, leaves, requires_grad_tree

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- copies back: prefetched ahead of the backward pass, or started when read --------------------------------------


def test_retain_graph_second_backward_copies_again() -> None:
    params, x, _, apply = make_model("mlp", "small", torch.float32, "cpu")
    params = requires_grad_tree(params)
    eng = OffloadEngine()
    with use_engine(eng):
        loss = apply(params, x, lambda f: remat(f, policy=policies.offload_to_cpu(min_bytes=0)))
        g1 = torch.autograd.grad(loss, leaves(params), retain_graph=True)
        h2d = eng.stats["h2d"]
        g2 = torch.autograd.grad(loss, leaves(params))
    ref = torch.autograd.grad(apply(params, x), leaves(params))
    assert_tree_close(g1, ref)
    assert_tree_close(g2, ref)
    assert eng.stats["h2d"] == 2 * h2d  # the device copies were let go after the first backward pass


def _trace_run(prefetch: bool) -> list[tuple[str, int, int]]:
    params, x, _, apply = make_model("mlp", "small", torch.float32, "cpu")  # 4 layers: 4 remat calls
    params = requires_grad_tree(params)
    eng = OffloadEngine(prefetch=prefetch, trace=True)
    with use_engine(eng):
        apply(params, x, lambda f: remat(f, policy=policies.offload_to_cpu(min_bytes=0))).backward()
    assert eng.trace is not None
    return eng.trace


def test_prefetch_starts_the_next_call_before_the_backward_reaches_it() -> None:
    trace = _trace_run(prefetch=True)
    groups = sorted({g for _, g, _ in trace})
    assert len(groups) == 4
    d2h = [g for e, g, _ in trace if e == "d2h"]
    assert d2h == sorted(d2h)  # offloaded in forward order
    first_use = {g: min(i for i, (e, gg, _) in enumerate(trace) if e == "use" and gg == g) for g in groups}
    h2d = {g: [i for i, (e, gg, _) in enumerate(trace) if e == "h2d" and gg == g] for g in groups}
    copies = {g: {c for e, gg, c in trace if e == "d2h" and gg == g} for g in groups}
    last = groups[-1]
    assert first_use[last] == min(first_use.values())  # the backward pass starts at the last call
    for g in groups:
        assert {trace[i][2] for i in h2d[g]} == copies[g]  # every copy of g fetched, once
        assert max(h2d[g]) < first_use[g]  # all started before g's first read
        if g != last:  # ...and already when the backward pass reached the call after it
            assert max(h2d[g]) < first_use[g + 1] < first_use[g]
            assert min(h2d[g]) > first_use.get(g + 2, -1)  # not earlier than one call ahead


def test_without_prefetch_each_copy_starts_when_read() -> None:
    trace = _trace_run(prefetch=False)
    for i, (e, g, c) in enumerate(trace):
        if e == "h2d":
            assert trace[i + 1] == ("use", g, c)


def test_prefetch_copies_a_call_last_saved_first() -> None:
    """The backward pass reads a call's tensors in reverse: its copies back start in reverse (item 3)."""
    f = remat(lambda x: x.sin().sin().sin().sin().sum(), policy=policies.offload_to_cpu(min_bytes=0))
    eng = OffloadEngine(trace=True)
    x = torch.randn(64, requires_grad=True)
    with use_engine(eng):
        loss = f(x)
        d2h = [cid for what, _, cid in eng.trace if what == "d2h"]
        loss.backward()
    h2d = [cid for what, _, cid in eng.trace if what == "h2d"]
    assert len(d2h) >= 3 and h2d == d2h[::-1]


def test_prefetched_counts_only_copies_started_before_they_were_needed() -> None:
    """The copy being read when the backward reaches a call is not "ahead of need"; bytes back are counted."""
    f = remat(lambda x: x.sin().sin().sin().sin().sum(), policy=policies.offload_to_cpu(min_bytes=0))
    eng = OffloadEngine(trace=True)
    x = torch.randn(64, requires_grad=True)
    with use_engine(eng):
        f(x).backward()
    h2d = [cid for what, _, cid in eng.trace if what == "h2d"]
    first_use = next(cid for what, _, cid in eng.trace if what == "use")
    assert eng.stats["h2d"] == len(h2d) == 3 and eng.stats["prefetched"] == 2  # all but the one read first
    assert first_use in h2d and eng.stats["h2d_bytes"] == eng.stats["offloaded_bytes"]


def test_out_of_memory_while_prefetching_falls_back_to_fetching_when_read() -> None:
    class Tight(OffloadEngine):
        def _start_h2d(self, c: Any, ahead: bool = False) -> None:
            if ahead:
                raise torch.OutOfMemoryError("no room to copy ahead")
            super()._start_h2d(c, ahead)

    f = remat(lambda x: x.sin().sin().sin().sum(), policy=policies.offload_to_cpu(min_bytes=0))
    x = torch.randn(64, dtype=torch.float64, requires_grad=True)
    eng = Tight()
    with use_engine(eng):
        f(x).backward()
    y = x.detach().clone().requires_grad_()
    y.sin().sin().sin().sum().backward()
    assert torch.equal(x.grad, y.grad)  # type: ignore[arg-type]
    assert eng.stats["prefetch_oom"] >= 1 and eng.stats["h2d"] >= 2 and eng.stats["prefetched"] == 0


# ---- copies out: the in-flight budget, a tensor written while its copy runs ----------------------------------------


class _FakeEvent:
    """A copy's completion event, on a fake clock: done once ``clock[0] >= at``. The host never waits on it."""

    def __init__(self, clock: list[int], at: int) -> None:
        self.clock, self.at = clock, at

    def query(self) -> bool:
        return self.clock[0] >= self.at

    def synchronize(self) -> None:
        raise AssertionError("the forward pass must not wait for the host (NOTE [stream-ordered reuse])")


def test_inflight_budget_is_per_device_and_waits_on_the_stream_not_the_host() -> None:
    """Items 4 and 8: copies still running from one device do not hold back another device; past
    max_inflight_bytes a device's compute stream (not the host) waits for its oldest copy, whose device
    bytes are then let go; finished copies are let go without waiting."""
    clock = [0]
    waited: list[tuple[torch.device, Any]] = []

    class Engine(OffloadEngine):
        @staticmethod
        def _stream_wait(device: torch.device, ev: Any) -> None:
            waited.append((device, ev))

    eng = Engine(max_inflight_bytes=100)
    a, b = torch.device("cuda", 0), torch.device("cuda", 1)  # keys only: nothing runs on a device
    held = [torch.empty(50, dtype=torch.uint8) for _ in range(2)]
    refs = [weakref.ref(h) for h in held]
    for at, raw in zip((1, 2), held):
        eng._inflight[a].append((_FakeEvent(clock, at), 50, raw, lambda: None))
        eng._inflight_bytes[a] += 50
    del held, raw
    assert all(r() is not None for r in refs)  # the engine holds the bytes of running copies
    eng._bound_inflight(60, b)  # device b has nothing running: no wait
    assert waited == [] and eng.stats["stream_waits"] == 0
    eng._bound_inflight(40, a)  # 100 running on a + 40 > 100: the stream waits for the oldest only
    assert [d for d, _ in waited] == [a] and eng._inflight_bytes[a] == 50
    assert refs[0]() is None and refs[1]() is not None  # the oldest's bytes let go, ordered after its copy
    clock[0] = 5
    eng._poll(a)  # finished: let go without any wait
    assert len(waited) == 1 and eng._inflight_bytes[a] == 0 and refs[1]() is None


@pytest.mark.parametrize("when", ["while-copied", "after-copied", "never"])
def test_a_tensor_written_while_its_copy_runs_raises_even_once_dropped(when: str) -> None:
    """NOTE [written while copied] in _offload/copies.py: a saved output written in place after the call, then dropped.
    Plain autograd raises. On CUDA the copy to the host may read the bytes after the write: remat returned the
    gradient of the written values, wrong and without an error, before the engine kept an alias while the copy
    runs. Written once the copy has read them, the host copy is what was saved: exact (the tensor is gone)."""
    x = torch.randn(64, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    want = torch.autograd.grad((x.exp() * 3).sum(), x)[0]
    eng = LateCopies()
    with use_engine(eng):
        y = remat(lambda v: v.exp(), policy=policies.offload_to_cpu(min_bytes=0))(x)
        assert eng.stats["copies"] == 1 and len(eng.running) == 1
        z = y * 3  # (a product with a number saves nothing: only remat holds y)
        if when == "after-copied":
            eng.finish()
            eng.end_of_call()  # the engine sees the copy done (it polls at each call's end and each offload)
        if when != "never":
            with torch.no_grad():
                y.mul_(0)
        del y
        eng.finish()
        if when == "while-copied":
            with pytest.raises(RematError, match="modified in place after it was saved"):
                torch.autograd.grad(z.sum(), x)
        else:
            assert torch.equal(torch.autograd.grad(z.sum(), x)[0], want)


# ---- one engine on two threads; a user's dispatch mode sees no copy ------------------------------------------------


def test_one_engine_serves_backward_passes_on_two_threads() -> None:
    """The autograd engine runs a thread per device: fetches and reads from two threads share one engine."""
    import threading

    eng = OffloadEngine()
    pol = policies.offload_to_cpu(min_bytes=0)
    results: dict[int, Any] = {}

    def work(i: int) -> None:
        with use_engine(eng):
            x = torch.randn(256, dtype=torch.float64, generator=torch.Generator().manual_seed(i), requires_grad=True)
            for _ in range(20):
                x.grad = None
                remat(lambda v: v.sin().exp().cos().sum(), policy=pol)(x).backward()
            y = x.detach().clone().requires_grad_()
            y.sin().exp().cos().sum().backward()
            results[i] = torch.equal(x.grad, y.grad)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {0: True, 1: True}


@pytest.mark.parametrize("engine", ["default", "copies-late"])
def test_a_users_dispatch_mode_sees_the_functions_ops_not_the_offload_copies(engine: str) -> None:
    """The engine pops the user's modes only when one is pushed (no_dispatch_modes): with one, remat's copies stay
    below it, on the fast path's calls and on the first, recorded one, synchronous or not."""
    def f(v: torch.Tensor) -> torch.Tensor:
        return (v.sin() @ v.t()).exp().sum()

    g = remat(f, policy=policies.offload_to_cpu(min_bytes=0))
    x = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)
    (want,) = torch.autograd.grad(f(x), x)
    eng = OffloadEngine() if engine == "default" else LateCopies()
    for _ in range(3):  # the recorded call, then planned ones
        with use_engine(eng), OpLog() as mode:
            out = g(x)
        if isinstance(eng, LateCopies):
            eng.finish()
        (got,) = torch.autograd.grad(out, x)
        assert torch.equal(got, want)
        ops = [op for op in mode.ops if op is not torch.ops.aten.detach.default]
        assert ops == [torch.ops.aten.sin.default, torch.ops.aten.t.default, torch.ops.aten.mm.default,
                       torch.ops.aten.exp.default, torch.ops.aten.sum.default], ops
    assert eng.stats["copies"] >= 3 * 2, eng.stats  # sin's and exp's outputs, each call
