"""Where a tensor's bytes lie in its storage, in bytes: its geometry, the span it reads, whether two share a byte.

The offload engine copies storages, not tensors: a small slice gets a copy of
the bytes it spans (:func:`_span`; NOTE [one copy per storage] in
``copies.py``), and a read checks its bytes against those a reader of the same
storage wrote, byte by byte (:func:`_geometry`, :func:`_overlap`; NOTE [reads
of one device copy] in ``copies.py``).
"""

from __future__ import annotations

import torch

from .._context import internal

__all__ = ["_Geometry", "_geometry", "_overlap", "_span"]

# A tensor's bytes in its storage: (first byte, shape, strides in bytes, element size)
_Geometry = tuple[int, tuple[int, ...], tuple[int, ...], int]


def _geometry(t: torch.Tensor, base: int = 0) -> _Geometry:
    """``t``'s :data:`_Geometry`, its bytes counted from byte ``base`` of its storage."""
    es = t.element_size()
    return int(t.storage_offset()) * es - base, tuple(t.shape), tuple(int(st) * es for st in t.stride()), es


def _overlap(g: _Geometry, h: _Geometry, max_addresses: int = 1 << 24) -> bool:
    """Whether two tensors' bytes (:data:`_Geometry`, in one storage) have one in common, exactly, by their
    elements' addresses (``unsafe_split``'s column blocks interleave without sharing one). Asked only where one of
    them was written, so its cost matters little; past ``max_addresses`` bytes each: True (an error rather than a
    guess)."""

    def extent(x: _Geometry) -> tuple[int, int, int]:
        lo = hi = x[0]
        n = 1
        for size, st in zip(x[1], x[2]):
            n *= size
            if st >= 0:
                hi += (size - 1) * st
            else:
                lo += (size - 1) * st
        return lo, hi + x[3], n * x[3]

    (a, b, n), (lo, hi, m) = extent(g), extent(h)
    if n == 0 or m == 0 or a >= hi or lo >= b:
        return False
    if n > max_addresses or m > max_addresses:
        return True

    def addresses(x: _Geometry) -> torch.Tensor:
        addr = torch.full((), x[0], dtype=torch.int64)
        for size, st in zip(x[1], x[2]):
            addr = addr.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * st
        return (addr.reshape(-1, 1) + torch.arange(x[3], dtype=torch.int64)).reshape(-1)

    with internal():  # (remat's modes let its ops through)
        return bool(torch.isin(addresses(h), addresses(g)).any())


def _span(t: torch.Tensor, es: int, offset: int) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` of its storage that a strided tensor that is not contiguous reads (lo a multiple of
    its element size), given what the caller has asked of it already: ``t.element_size()``, ``t.storage_offset()``
    (a contiguous one's are ``offset * es`` on, ``t.nbytes`` of them: :meth:`OffloadEngine._offload`)."""
    if t.numel() == 0:
        return 0, 0
    lo = offset
    hi = lo + 1
    for size, stride in zip(t.shape, t.stride()):
        if stride >= 0:
            hi += (size - 1) * stride
        else:
            lo += (size - 1) * stride
    return int(lo) * es, int(hi) * es
