"""How an offloaded storage's bytes move: copy streams, events, the bound on copies in flight, the pinned pool.

:class:`_Transfers` is the offload engine's lowest layer (``schedule.py`` and
``engine.py`` build on it): it works out a copy's route (``routes.py``), starts
a copy to the host (on CUDA asynchronously, on a stream of its own, after an
event recorded where the tensor was made, into a buffer of the pinned pool,
``pool.py``) and a copy back to the device, holds a running copy's device bytes
until the copy is known to have read them, and lets go of a device copy once
its handles have read it. Which bytes to copy, and when, is the layers above's.

NOTE [stream-ordered reuse]
    ``record_stream`` lets the caching allocator's reserved memory grow far above
    what is allocated while the host runs ahead, and adds hidden synchronizations.
    Instead, as torchtune and FSDP2 do: a device-to-host copy's source bytes are
    held by the engine until its event is seen complete (polled at the next
    offload and in the backward pass), or until the compute stream has been made
    to wait for it (``wait_event``: no host wait); then dropped, so their reuse is
    ordered after the copy. A host-to-device copy writes into bytes allocated for
    the compute stream, after an event recorded there, and the compute stream
    waits for the copy before reading them or letting them go.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Any

import torch

from .copies import _NOTHING_GIVEN, _Copy, _note_written, _settle
from .pool import _default_pinned_cap, _PinnedPool
from .routes import _CPU, _Route, _Routes

__all__ = ["_STAT_KEYS", "_Transfers"]

# the engine's counters, every layer's (OffloadEngine's docstring says what each counts)
_STAT_KEYS = ("offloaded", "copies", "offloaded_bytes", "shared", "kept_on_device", "fetched", "h2d", "h2d_bytes",
              "prefetched", "prefetch_oom", "stream_waits")


class _Transfers:
    """The copies themselves, to the host and back: routes, streams, events, the bound on copies in flight, the
    pinned pool; and the engine's lock, counters and trace, which every layer shares.

    A base class of the engine, not an object it holds: its steps (:meth:`_asynchronous`, :meth:`_copy_raw`,
    :meth:`_d2h_start`, :meth:`_stream`, :meth:`_stream_wait`, :meth:`_start_h2d`) are the seams a subclass of the
    engine overrides (the tests make copies finish when they say, fail, or run out of memory, and record the stream
    waits; ``benchmarks/gpu_check.py`` delays the copy streams). Each step calls the next through ``self``, so an
    override holds wherever the step is called from, with no call more per copy.
    """

    def __init__(self, pin_memory: bool, max_inflight_bytes: int, max_pinned_bytes: int | None, trace: bool) -> None:
        self._pin_memory = pin_memory
        self._routes = routes = _Routes()
        # (the forward pass's hot paths' own names for three of the routes' tables: an attribute less per saved tensor)
        self._route_table, self._kinds, self._from_cpu = routes.table, routes.kinds, routes.from_cpu
        self.max_inflight_bytes = max_inflight_bytes
        self.trace: list[tuple[str, int, int]] | None = [] if trace else None
        self._pool = _PinnedPool(_default_pinned_cap() if max_pinned_bytes is None else max_pinned_bytes)
        self._d2h: dict[torch.device, Any] = {}
        self._h2d: dict[torch.device, Any] = {}
        # per source device: copies to the host still running (event, bytes), and their bytes; one device's
        # copies do not hold back another's forward pass
        self._inflight: dict[torch.device, collections.deque[tuple[Any, int, Any, Any]]] = collections.defaultdict(
            collections.deque)
        self._inflight_bytes: collections.Counter[torch.device] = collections.Counter()
        # the autograd engine runs one thread per device: offload, fetch and the bookkeeping of reads
        # (also from a handle's __del__, whenever the garbage collector runs) take this lock
        self._lock = threading.RLock()
        # (a plain dict, every key present: a Counter's += costs ~0.25 us against a dict's ~0.07, several per saved
        # tensor on the forward pass's hot path)
        self._stats: dict[str, int] = dict.fromkeys(_STAT_KEYS, 0)

    @property
    def pin_memory(self) -> bool:
        return self._pin_memory

    @pin_memory.setter
    def pin_memory(self, value: bool) -> None:
        self._pin_memory = value
        self._routes.clear()  # (each copy's route is looked up: _route)

    # ---- routes ----------------------------------------------------------------
    def _route(self, device: torch.device, dst: str) -> _Route:
        """Whether a copy from ``device`` to the device named ``dst`` keeps (NOTE [keep last]) and runs asynchronously
        (:meth:`_asynchronous`), and the device ``dst`` names: worked out once per pair (three lookups and two calls
        cost ~1 us, per copy)."""
        to = self._routes.device(dst)
        return self._routes.add(device, dst, self._asynchronous(device, to), to)

    def _plain_from_cpu(self, dst: str) -> torch.device | None:
        """The device ``dst`` names if a copy from the CPU there is synchronous and kept nowhere (:meth:`_route`),
        else None: ``offload_saved``'s common case looks it up once per saved tensor (a route's lookup and two of its
        fields cost ~0.15 us more)."""
        keep, asynchronous, to = self._route_table.get((_CPU, dst)) or self._route(_CPU, dst)
        plain = None if keep or asynchronous else to
        self._from_cpu[dst] = plain
        return plain

    def _asynchronous(self, src: torch.device, dst: torch.device) -> bool:
        """Whether a copy from ``src`` to ``dst`` runs asynchronously, into a pinned buffer (else: synchronously,
        done when :meth:`_copy_raw` returns)."""
        return self.pin_memory and self._routes.type(src) == "cuda" and self._routes.type(dst) == "cpu"

    # ---- to the host -----------------------------------------------------------
    def _copy_raw(self, c: _Copy, raw: torch.Tensor, dst: torch.device, asynchronous: bool) -> None:
        """Start the copy of ``raw`` (uint8 bytes; on the synchronous path also a tensor that is exactly its
        storage) to ``dst`` (``asynchronous``: what :meth:`_asynchronous` says of the pair); ``_settle`` it once it
        has read the bytes."""
        if asynchronous:
            self._d2h_async(c, raw)  # settled when its event is seen complete, or the compute stream waits on it
        else:  # synchronous (CPU, pageable memory, other device pairs); clone: fewer arguments to parse
            c.host = raw.clone() if c.src == dst else raw.to(dst, copy=True)
            if c.vsrc is not None:
                _settle(c)
        stats = self._stats
        stats["copies"] += 1
        stats["offloaded_bytes"] += c.nbytes
        if self.trace is not None:
            self._log("d2h", c)

    def _stream(self, table: dict[torch.device, Any], dev: torch.device) -> Any:
        s = table.get(dev)
        if s is None:
            s = table[dev] = torch.cuda.Stream(device=dev)
        return s

    def _d2h_async(self, c: _Copy, raw: torch.Tensor) -> None:
        self._bound_inflight(c.nbytes, raw.device)
        buf = self._pool.acquire(c.nbytes)
        try:
            self._d2h_start(c, raw, buf)
        except BaseException:
            self._pool.release(buf, None)  # nothing was queued into it: back to the pool
            raise

    def _d2h_start(self, c: _Copy, raw: torch.Tensor, buf: torch.Tensor) -> None:
        cur = torch.cuda.current_stream(raw.device)
        side = self._stream(self._d2h, raw.device)
        produced = torch.cuda.Event()
        produced.record(cur)
        side.wait_event(produced)  # after the kernel that wrote the tensor; the host does not wait
        with torch.cuda.stream(side):
            c.host = buf[: c.nbytes]
            c.host.copy_(raw, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        # NOTE [stream-ordered reuse]: the device bytes are held (not record_stream'ed) until the copy is
        # known done, or until the compute stream has been made to wait for it; only then dropped
        c.buf = buf
        self._running(c, raw, done)

    def _running(self, c: _Copy, raw: torch.Tensor, done: Any) -> None:
        """``c``'s copy from ``raw`` was queued; ``done`` completes when it has read the bytes."""
        c.d2h_done = done
        self._inflight[raw.device].append((done, c.nbytes, raw, weakref.ref(c)))
        self._inflight_bytes[raw.device] += c.nbytes

    def _bound_inflight(self, nbytes: int, device: torch.device) -> None:
        """Drop the finished copies' device bytes; past ``max_inflight_bytes`` of running ones, make the
        compute stream (not the host) wait for the oldest, then drop its bytes (NOTE [stream-ordered reuse])."""
        queue = self._inflight[device]
        while queue:
            ev, n, _, cref = queue[0]
            if not ev.query():
                if self._inflight_bytes[device] + nbytes <= self.max_inflight_bytes:
                    return
                self._stream_wait(device, ev)
                self._stats["stream_waits"] += 1
            queue.popleft()
            self._inflight_bytes[device] -= n
            _settle(cref())

    def end_of_call(self) -> None:
        """A remat call's forward pass ended: let go of the device bytes of its finished copies now,
        rather than at the next offload or read (they would be held through the rest of the forward)."""
        with self._lock:
            for device in list(self._inflight):
                self._poll(device)

    def _poll(self, device: torch.device) -> None:
        """Drop the device bytes of the copies to the host that have finished."""
        queue = self._inflight.get(device)
        while queue and queue[0][0].query():
            _, n, _, cref = queue.popleft()
            self._inflight_bytes[device] -= n
            _settle(cref())

    @staticmethod
    def _stream_wait(device: torch.device, ev: Any) -> None:
        """Work queued next on ``device``'s current stream runs after ``ev`` (the host does not wait)."""
        torch.cuda.current_stream(device).wait_event(ev)

    # ---- back to the device ----------------------------------------------------
    def _start_h2d(self, c: _Copy, ahead: bool = False) -> None:
        """Start the copy of ``c``'s host bytes back to its device, a new round of reads (``ahead``: before a read
        needs it, NOTE [prefetch])."""
        assert c.host is not None
        if c.d2h_done is not None and self._routes.type(c.src) == "cuda" \
                and self._routes.type(c.host.device) == "cpu":
            # NOTE [stream-ordered reuse]: the device bytes belong to the compute stream (which reads them,
            # and frees them in its own order); the copy stream writes them after that stream's earlier work
            cur = torch.cuda.current_stream(c.src)
            dev = torch.empty(c.nbytes, dtype=torch.uint8, device=c.src)
            allocated = torch.cuda.Event()
            allocated.record(cur)
            side = self._stream(self._h2d, c.src)
            with torch.cuda.stream(side):
                side.wait_event(c.d2h_done)
                side.wait_event(allocated)
                dev.copy_(c.host, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(side)
            c.dev, c.h2d_done = dev, ev
        else:  # synchronous; a fresh copy even on the CPU, so the CPU runs the same life cycle as CUDA
            c.dev = c.host.to(c.src, copy=True)
        _note_written(c)  # (what the last round's reads wrote stays known; the new round's read other bytes)
        c.given = _NOTHING_GIVEN
        c.round += 1
        c.pending = c.live
        self._stats["h2d"] += 1
        self._stats["h2d_bytes"] += c.nbytes
        if ahead:
            self._stats["prefetched"] += 1
        self._log("h2d", c)

    def _read(self, c: _Copy) -> None:
        """One more handle of ``c`` has been read (or died unread): past the last, hold the device copy weakly."""
        with self._lock:
            self._read_locked(c)

    def _read_locked(self, c: _Copy) -> None:
        if c.deferred is not None:
            return  # never copied: the device bytes are all there is, held until the handles die
        c.pending -= 1
        if c.pending <= 0 and c.dev is not None:
            if c.h2d_done is not None:  # dropped maybe unread: its reuse must come after the copy into it
                self._stream_wait(c.src, c.h2d_done)
            c.dev_weak = weakref.ref(c.dev.untyped_storage())
            c.dev = None
            _note_written(c, weakly=True)

    # ---- inspection ------------------------------------------------------------
    def _log(self, what: str, c: _Copy) -> None:
        if self.trace is not None:
            self.trace.append((what, -1 if c.group is None else c.group.gid, c.cid))

    def pinned_bytes(self) -> int:
        """Bytes of pinned host memory the pool holds (in use or free)."""
        return self._pool.allocated_bytes

    def pinned_allocations(self) -> int:
        """Pinned buffers allocated so far; flat from step to step once the pool is warm."""
        return self._pool.allocations

    def empty_cache(self) -> int:
        """Hand the pool's free pinned buffers back to PyTorch; returns the bytes released."""
        return self._pool.empty()
