"""The offload engine's pinned-memory pool: page-locked host buffers that copies to the host run into, reused.

A buffer goes back to :class:`_PinnedPool` when the last copy that reads it is
done (marked with that copy's event) and is handed out again only once the event
has completed; once warm, a step that offloads the shapes of the step before
allocates no pinned memory. The engine's copy streams and events are in
``streams.py``; this module knows nothing of them but an event's ``query`` and
``synchronize``.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from .._errors import RematError

__all__ = ["_PinnedPool", "_default_pinned_cap"]


def _default_pinned_cap() -> int | None:
    """Half the host's physical memory: page-locked memory the OS cannot swap, so a leak (a graph kept
    alive step after step) must end in a clear error, not a frozen machine. None where unknown."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // 2
    except (ValueError, OSError, AttributeError):
        return None


def _alloc_pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class _PinnedPool:
    """Page-locked host buffers, reused by size class once the last copy using them is done.

    Sizes are rounded up to a power of two (at least 4 KiB), as PyTorch's own
    pinned-memory allocator does underneath, so a step that offloads the same
    shapes as the step before reuses every buffer.
    """

    # a size class not asked for in this many acquisitions gives its free buffers back (shapes that vary
    # from step to step would otherwise leave a buffer behind in every class they ever used)
    IDLE_ACQUIRES = 1024

    def __init__(self, max_bytes: int | None = None, alloc: Callable[[int], torch.Tensor] | None = None) -> None:
        self.max_bytes = max_bytes
        self.alloc = alloc or _alloc_pinned
        self._tick = 0
        self._last_use: dict[int, int] = {}  # size class -> tick of its last acquisition
        self.trimmed = 0  # free buffers given back because their size class went unused
        self.free: dict[int, list[tuple[torch.Tensor, Any]]] = collections.defaultdict(list)
        self.allocated_bytes = 0
        self.allocations = 0  # buffers allocated (stays flat once warm)
        self.reuses = 0
        self.evictions = 0  # free buffers dropped at the cap to make room for another size
        # buffers come back from whichever thread drops the last reference (the autograd engine runs
        # one thread per device), and from __del__ whenever the garbage collector runs, possibly on a
        # thread inside acquire: release only appends to a deque (atomic, takes no lock) and acquire
        # drains it under the lock. A lock taken in release could deadlock there.
        self._lock = threading.Lock()
        self._returned: collections.deque[tuple[torch.Tensor, Any]] = collections.deque()

    @staticmethod
    def size_class(nbytes: int) -> int:
        return max(4096, 1 << max(nbytes - 1, 0).bit_length())

    def acquire(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            return self._acquire(nbytes)

    def _drain(self) -> None:
        while self._returned:
            buf, ready = self._returned.popleft()
            self.free[buf.numel()].append((buf, ready))

    def _evict(self, need: int) -> None:
        """At the cap: drop free buffers of other sizes whose copies are done, until ``need`` more bytes fit."""
        for cls in sorted(self.free, reverse=True):
            bucket = self.free[cls]
            for entry in list(bucket):
                if self.max_bytes is None or self.allocated_bytes + need <= self.max_bytes:
                    return
                if entry[1] is None or entry[1].query():
                    bucket.remove(entry)
                    self.allocated_bytes -= cls
                    self.evictions += 1

    def _trim(self) -> None:
        for cls, last in list(self._last_use.items()):
            if self._tick - last > self.IDLE_ACQUIRES and self.free.get(cls):
                keep = [(b, ev) for b, ev in self.free[cls] if ev is not None and not ev.query()]
                n = len(self.free[cls]) - len(keep)
                self.free[cls] = keep
                self.allocated_bytes -= n * cls
                self.trimmed += n

    def _acquire(self, nbytes: int) -> torch.Tensor:
        self._drain()
        cls = self.size_class(nbytes)
        self._tick += 1
        self._last_use[cls] = self._tick
        if self._tick % 64 == 0:
            self._trim()
        bucket = self.free[cls]
        for i, (buf, ev) in enumerate(bucket):
            if ev is None or ev.query():
                del bucket[i]
                self.reuses += 1
                return buf
        if self.max_bytes is not None and self.allocated_bytes + cls > self.max_bytes:
            self._evict(cls)
        if self.max_bytes is not None and self.allocated_bytes + cls > self.max_bytes:
            if bucket:  # at the cap: wait for a buffer of this size whose copy is still running
                buf, ev = bucket.pop(0)
                ev.synchronize()
                self.reuses += 1
                return buf
            raise RematError(
                f"remat: offloading a {nbytes / 2**20:.1f} MiB tensor needs {cls / 2**20:.1f} MiB more pinned "
                f"host memory, past the engine's max_pinned_bytes={self.max_bytes} "
                f"({self.allocated_bytes / 2**30:.2f} GiB pinned already). Raise max_pinned_bytes, offload "
                "fewer tensors (a larger min_bytes, a names policy), or save/recompute some instead."
            )
        try:
            buf = self.alloc(cls)
        except RuntimeError as e:
            raise RematError(
                f"remat: could not allocate {cls / 2**20:.1f} MiB of pinned host memory for offloading "
                f"({self.allocated_bytes / 2**30:.2f} GiB pinned so far): {e}. Offload fewer tensors "
                "(a larger min_bytes, a names policy), free host memory, or use "
                "OffloadEngine(pin_memory=False) (synchronous copies into pageable memory)."
            ) from e
        self.allocated_bytes += cls
        self.allocations += 1
        return buf

    def release(self, buf: torch.Tensor, ready: Any) -> None:
        self._returned.append((buf, ready))

    def empty(self) -> int:
        """Drop every free buffer; returns the bytes dropped."""
        with self._lock:
            self._drain()
            n = sum(b.numel() for bucket in self.free.values() for b, _ in bucket)
            self.free.clear()
            self.allocated_bytes -= n
            return n

