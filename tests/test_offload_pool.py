"""The pinned host memory pool: buffers reused from step to step, sizes no longer used given back, a
default cap, failures reported with what to do, no deadlock when a buffer comes back during an acquire, no buffer
lost when starting a copy fails.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from remat import RematError
from remat._offload import _PinnedPool
from remat.offload import OffloadEngine

pytestmark = pytest.mark.usefixtures("one_thread")


def test_pinned_pool_reuses_buffers_and_reports_failures() -> None:
    made: list[int] = []

    def alloc(n: int) -> torch.Tensor:
        made.append(n)
        return torch.empty(n, dtype=torch.uint8)

    pool = _PinnedPool(max_bytes=3 * 8192, alloc=alloc)
    for _ in range(3):  # three "steps" of the same sizes: allocated once
        bufs = [pool.acquire(5000), pool.acquire(8192), pool.acquire(100)]
        for b in bufs:
            pool.release(b, None)
    assert made == [8192, 8192, 4096] and pool.allocations == 3 and pool.reuses == 6
    pool.acquire(5000), pool.acquire(5000)
    pool.acquire(5000)  # at the cap: the free 4 KiB buffer is evicted to make room (issue 13, item 7)
    assert pool.evictions == 1 and pool.allocated_bytes == 3 * 8192
    with pytest.raises(RematError, match="past the engine's max_pinned_bytes"):
        pool.acquire(5000)  # nothing left to evict

    def broken(n: int) -> torch.Tensor:
        raise RuntimeError("cudaErrorMemoryAllocation")

    with pytest.raises(RematError, match="could not allocate .* pinned host memory.*pin_memory=False"):
        _PinnedPool(alloc=broken).acquire(10)


def test_pinned_pool_release_while_acquiring_does_not_deadlock() -> None:
    """A _HostCopy's __del__ returns its buffer whenever the garbage collector runs, possibly on a thread
    inside acquire (holding the pool's lock): release must not take that lock (issue 13, item 7)."""
    import threading

    pool: _PinnedPool

    def alloc(n: int) -> torch.Tensor:
        pool.release(torch.empty(4096, dtype=torch.uint8), None)  # as if the GC ran a __del__ right here
        return torch.empty(n, dtype=torch.uint8)

    pool = _PinnedPool(alloc=alloc)
    worker = threading.Thread(target=lambda: pool.acquire(100), daemon=True)
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive(), "deadlock: release waited for the lock acquire holds"
    pool.acquire(100)  # the returned buffer is reused
    assert pool.reuses == 1


def test_pinned_pool_gives_back_sizes_no_longer_used_and_has_a_default_cap() -> None:
    """Shapes that vary from step to step must not leave a pinned buffer in every size class they used (item 7)."""
    pool = _PinnedPool(alloc=lambda n: torch.empty(n, dtype=torch.uint8))
    pool.release(pool.acquire(100_000), None)  # a 128 KiB class, used once
    assert pool.allocated_bytes == 131072
    for _ in range(_PinnedPool.IDLE_ACQUIRES + 128):
        pool.release(pool.acquire(100), None)  # later steps use another size only
    assert pool.trimmed == 1 and pool.allocated_bytes == 4096
    assert OffloadEngine()._pool.max_bytes is not None  # half the host's memory unless told otherwise


def test_pinned_buffer_returns_to_the_pool_when_starting_its_copy_fails() -> None:
    """Item 9: a buffer acquired before an exception is not lost."""
    class Failing(OffloadEngine):
        def _d2h_start(self, c: Any, raw: torch.Tensor, buf: torch.Tensor) -> None:
            raise RuntimeError("CUDA error: launch failure")

    eng = Failing()
    eng._pool = _PinnedPool(alloc=lambda n: torch.empty(n, dtype=torch.uint8))
    from remat._offload import _HostCopy

    c = _HostCopy(eng, 0, None, torch.device("cpu"), 1000)
    with pytest.raises(RuntimeError, match="launch failure"):
        eng._d2h_async(c, torch.empty(1000, dtype=torch.uint8))
    eng._pool.acquire(1000)
    assert eng._pool.allocations == 1 and eng._pool.reuses == 1
