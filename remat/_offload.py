"""The offload engine: saved activations to host memory in the forward pass, back in the backward pass.

On CUDA a device-to-host copy runs on a dedicated stream, ordered after the
kernel that produced the tensor by an event, into a page-locked (pinned) host
buffer drawn from a reusable pool; ``record_stream`` keeps the caching allocator
from handing the device memory out again before the copy has finished, and the
forward pass never waits on the host. In the backward pass host-to-device copies
run on a second stream: the first time the backward pass reads an offloaded
tensor of a remat call, all of that call's tensors are fetched, and so are the
tensors of the call the backward pass will reach next (the call that ran just
before it in the forward pass), so the copies overlap the compute.

On the CPU (``src`` and ``dst`` both ``"cpu"``) the same paths run
synchronously: the saved tensor is copied into a fresh host buffer and the
original is released, which is what the tests check on machines without a GPU.

NOTE [default engine]
    One engine serves every remat call of a thread (so prefetching can look from
    one call to the next, and the pinned pool is reused across steps). It lives
    in a context variable, created on first use; ``OffloadEngine`` can also be
    built and installed explicitly with :func:`use_engine`.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from ._errors import RematError

__all__ = ["OffloadEngine", "Offloaded", "default_engine", "use_engine"]

_ENGINE: contextvars.ContextVar[OffloadEngine | None] = contextvars.ContextVar("remat_engine", default=None)


def default_engine() -> OffloadEngine:
    eng = _ENGINE.get()
    if eng is None:
        eng = OffloadEngine()
        _ENGINE.set(eng)
    return eng


@contextlib.contextmanager
def use_engine(engine: OffloadEngine) -> Iterator[OffloadEngine]:
    """Make ``engine`` serve the remat calls inside the ``with`` block."""
    tok = _ENGINE.set(engine)
    try:
        yield engine
    finally:
        _ENGINE.reset(tok)


class _PinnedPool:
    """Page-locked host buffers, reused by size class once their last copy is done."""

    def __init__(self) -> None:
        self.free: dict[int, list[tuple[torch.Tensor, Any]]] = collections.defaultdict(list)
        self.allocated_bytes = 0
        self.allocations = 0  # number of cudaHostAlloc calls (stays flat once warm)

    @staticmethod
    def size_class(nbytes: int) -> int:
        return 1 << max(nbytes - 1, 0).bit_length()

    def acquire(self, nbytes: int) -> torch.Tensor:
        cls = self.size_class(nbytes)
        bucket = self.free[cls]
        for i, (buf, ev) in enumerate(bucket):
            if ev is None or ev.query():
                del bucket[i]
                return buf
        try:
            buf = torch.empty(cls, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as e:
            raise RematError(
                f"remat: could not allocate {cls / 2**20:.1f} MiB of pinned host memory for offloading "
                f"({self.allocated_bytes / 2**30:.2f} GiB pinned so far): {e}. Lower the offload "
                "engine's max_inflight_bytes, offload fewer tensors (min_bytes, a names policy), or "
                "use OffloadEngine(pin_memory=False)."
            ) from e
        self.allocated_bytes += cls
        self.allocations += 1
        return buf

    def release(self, buf: torch.Tensor, ev: Any) -> None:
        self.free[buf.numel()].append((buf, ev))


class Offloaded:
    """A saved tensor living on another device until the backward pass needs it."""

    __slots__ = ("engine", "host", "src", "shape", "dtype", "stride", "offset", "d2h_done",
                 "device_copy", "h2d_done", "group", "buf", "__weakref__")

    def __init__(self) -> None:
        self.device_copy: torch.Tensor | None = None
        self.h2d_done: Any = None
        self.buf: torch.Tensor | None = None

    def __del__(self) -> None:
        eng, buf = getattr(self, "engine", None), getattr(self, "buf", None)
        if eng is not None and buf is not None:
            eng._pool.release(buf, self.h2d_done or self.d2h_done)


class OffloadEngine:
    """Moves saved tensors to host memory and back; one serves all remat calls of a thread.

    Args:
        pin_memory: use page-locked host buffers for CUDA tensors (needed for
            asynchronous copies).
        max_inflight_bytes: bound on bytes of device-to-host copies that may be
            in flight at once; past it the forward pass waits for the oldest copy.
        prefetch: in the backward pass, also start fetching the tensors of the
            call the backward pass will reach next.

    Example:
        >>> import torch
        >>> from remat import remat, policies
        >>> from remat.offload import OffloadEngine, use_engine
        >>> eng = OffloadEngine()
        >>> f = remat(lambda x: x.sin().exp().sum(), policy=policies.offload_to_cpu(min_bytes=0))
        >>> x = torch.randn(1000, requires_grad=True)
        >>> with use_engine(eng):
        ...     f(x).backward()
        >>> eng.stats["offloaded"] > 0
        True
    """

    def __init__(self, pin_memory: bool = True, max_inflight_bytes: int = 8 << 30, prefetch: bool = True) -> None:
        self.pin_memory = pin_memory
        self.max_inflight_bytes = max_inflight_bytes
        self.prefetch = prefetch
        self._pool = _PinnedPool()
        self._d2h: dict[torch.device, Any] = {}
        self._h2d: dict[torch.device, Any] = {}
        self._inflight: collections.deque[tuple[Any, int]] = collections.deque()
        self._inflight_bytes = 0
        # groups (remat calls) in forward order, weakly: group -> list of Offloaded
        self._groups: weakref.WeakKeyDictionary[Any, list[weakref.ref[Offloaded]]] = weakref.WeakKeyDictionary()
        self._order: list[weakref.ref[Any]] = []
        self.stats = collections.Counter()  # offloaded, offloaded_bytes, fetched, prefetched

    # ---- forward ---------------------------------------------------------------
    def offload(self, t: torch.Tensor, dst: str, group: Any = None) -> Offloaded:
        """Start copying ``t`` to device ``dst``; the caller then drops ``t``."""
        o = Offloaded()
        o.engine, o.src, o.group = self, t.device, group
        o.shape, o.dtype, o.stride, o.offset = t.shape, t.dtype, t.stride(), 0
        dst_dev = torch.device(dst)
        nbytes = t.numel() * t.element_size()
        src = t if t.is_contiguous() else t.contiguous()
        o.stride = src.stride()
        if t.device.type == "cuda" and dst_dev.type == "cpu":
            o.host, o.d2h_done = self._d2h_copy(src, nbytes)
        else:
            o.host, o.d2h_done = src.to(dst_dev, copy=True), None
        self.stats["offloaded"] += 1
        self.stats["offloaded_bytes"] += nbytes
        if group is not None:
            if group not in self._groups:
                self._groups[group] = []
                self._order.append(weakref.ref(group))
            self._groups[group].append(weakref.ref(o))
        return o

    def _stream(self, table: dict[torch.device, Any], dev: torch.device) -> Any:
        s = table.get(dev)
        if s is None:
            s = table[dev] = torch.cuda.Stream(device=dev)
        return s

    def _d2h_copy(self, t: torch.Tensor, nbytes: int) -> tuple[torch.Tensor, Any]:
        self._bound_inflight(nbytes)
        side = self._stream(self._d2h, t.device)
        if self.pin_memory:
            buf = self._pool.acquire(nbytes)
            host = buf[:nbytes].view(t.dtype).view(t.shape)
        else:
            buf, host = None, torch.empty(t.shape, dtype=t.dtype)
        side.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(side):
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        t.record_stream(side)  # the allocator must not reuse t's memory before the copy ends
        self._inflight.append((done, nbytes))
        self._inflight_bytes += nbytes
        host._remat_buf = buf  # type: ignore[attr-defined]
        return host, done

    def _bound_inflight(self, nbytes: int) -> None:
        while self._inflight and (self._inflight_bytes + nbytes > self.max_inflight_bytes or self._inflight[0][0].query()):
            ev, n = self._inflight.popleft()
            ev.synchronize()
            self._inflight_bytes -= n

    # ---- backward --------------------------------------------------------------
    def fetch(self, o: Offloaded) -> torch.Tensor:
        """The tensor back on its source device (waits for its copy if needed)."""
        if o.device_copy is None:
            if o.group is not None and self.prefetch:
                self._prefetch_group(o.group, also_next=True)
            if o.device_copy is None:
                self._start_h2d(o)
        t = o.device_copy
        assert t is not None
        if o.h2d_done is not None:
            cur = torch.cuda.current_stream(o.src)
            cur.wait_event(o.h2d_done)
            t.record_stream(cur)
        self.stats["fetched"] += 1
        return t

    def _start_h2d(self, o: Offloaded) -> None:
        if o.src.type == "cuda":
            side = self._stream(self._h2d, o.src)
            with torch.cuda.stream(side):
                if o.d2h_done is not None:
                    side.wait_event(o.d2h_done)
                dev = torch.empty_strided(o.shape, o.stride, dtype=o.dtype, device=o.src)
                dev.copy_(o.host, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(side)
            o.device_copy, o.h2d_done = dev, ev
        else:
            o.device_copy = o.host if o.host.device == o.src else o.host.to(o.src)

    def _prefetch_group(self, group: Any, also_next: bool) -> None:
        for ref in self._groups.get(group, ()):
            o = ref()
            if o is not None and o.device_copy is None:
                self._start_h2d(o)
                self.stats["prefetched"] += 1
        if not also_next:
            return
        # the call the backward pass reaches next is the live group offloaded just before this one
        self._order = [r for r in self._order if r() is not None]
        groups = [r() for r in self._order]
        if group in groups:
            i = groups.index(group)
            if i > 0:
                self._prefetch_group(groups[i - 1], also_next=False)

    def applies(self, t: torch.Tensor, decision: Any) -> bool:
        """Whether ``decision`` (an Offloadable) moves ``t``: right source device, large enough."""
        if decision.src is not None and torch.device(decision.src).type != t.device.type:
            return False
        return t.numel() * t.element_size() >= decision.min_bytes

    def pinned_bytes(self) -> int:
        return self._pool.allocated_bytes

    def pinned_allocations(self) -> int:
        return self._pool.allocations
