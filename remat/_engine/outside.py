"""Op arguments as NOTE [outside tensors] in ``_engine/outside_writes.py`` needs them: which an op writes, which are
Python numbers, how to swap tensors in. Pure functions over ATen ops and their arguments."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
from typing import Any

import torch

__all__ = ["HIDDEN_WRITES", "SMALL", "mutates", "written_positions", "replace_tensors", "nbytes",
           "geometry", "fingerprint", "overlap", "StorageSnapshot"]

# Ops that write their running-statistics arguments (3 and 4) in training mode (argument 5)
# although their schemas do not say so.
HIDDEN_WRITES = frozenset({torch.ops.aten.native_batch_norm.default, torch.ops.aten.cudnn_batch_norm.default,
                           torch.ops.aten.miopen_batch_norm.default})


def mutates(func: Any, args: tuple[Any, ...], schema_mutable: bool) -> bool:
    return schema_mutable or (func in HIDDEN_WRITES and len(args) > 5 and bool(args[5]))


@functools.cache
def written_args(func: Any) -> frozenset[int]:
    """Indices of the schema arguments an op writes."""
    if func in HIDDEN_WRITES:
        return frozenset({3, 4})
    return frozenset(i for i, a in enumerate(func._schema.arguments)
                     if a.alias_info is not None and a.alias_info.is_write)


def written_positions(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int]:
    """Positions, in ``_dispatch.arg_tensors`` order, of the tensors an op writes."""
    written = written_args(func)
    names = [a.name for a in func._schema.arguments]
    out: list[int] = []
    pos = 0
    items = [(i, a) for i, a in enumerate(args)]
    items += [(names.index(k) if k in names else -1, a) for k, a in kwargs.items()]
    for i, a in items:
        if isinstance(a, torch.Tensor):
            if i in written:
                out.append(pos)
            pos += 1
        elif isinstance(a, (list, tuple)):
            for x in a:
                if isinstance(x, torch.Tensor):
                    if i in written:
                        out.append(pos)
                    pos += 1
    return out


def replace_tensors(args: tuple[Any, ...], kwargs: dict[str, Any],
                     new: dict[int, torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args``/``kwargs`` with the tensors at positions ``new`` (``_dispatch.arg_tensors`` order) replaced."""
    pos = 0

    def one(a: Any) -> Any:
        nonlocal pos
        if isinstance(a, torch.Tensor):
            pos += 1
            return new.get(pos - 1, a)
        if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
            return type(a)(one(x) for x in a)
        return a

    args2 = tuple(one(a) for a in args)
    kwargs2 = {k: one(a) for k, a in kwargs.items()}
    return args2, kwargs2


SMALL = 64 * 1024  # bytes: outside tensors up to this size that need no gradient are copied, not checked
LIFTED_COPIED = 16 << 20  # bytes: Python data lifted inside a call up to this size is copied; above, hashed


def nbytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return 0


def geometry(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)


def view_geometry(t: torch.Tensor) -> tuple[Any, ...]:
    return tuple(t.shape), t.stride(), t.storage_offset()


def at_geometry(t: torch.Tensor, g: tuple[Any, ...]) -> torch.Tensor:
    """An alias of ``t`` at geometry ``g`` (``geometry``'s) on its storage: a value an in-place view op reshaped
    since (``t.t_()``) as its op made it."""
    return t.as_strided(g[0], g[1], g[2])


def fingerprint(t: torch.Tensor) -> tuple[Any, ...]:
    """A cryptographic hash of a tensor's value (shape, dtype and every byte), holding nothing.

    A tensor built from Python data inside the call (``torch.tensor(...)``, ``torch.from_numpy``) is made
    afresh by the recompute; remat keeps only this, not the tensor, to check the recompute built the same.
    """
    if t.is_meta:
        return (tuple(t.shape), t.dtype, "meta")  # (no values: its shape and dtype are all there is)
    b = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().contiguous()
    data = ctypes.string_at(b.data_ptr(), b.numel()) if b.numel() else b""  # (numpy is not a dependency)
    return (tuple(t.shape), t.dtype, hashlib.blake2b(data, digest_size=32).hexdigest())


_OVERLAP_EXACT = 1 << 22  # elements: above, two tensors whose spans overlap count as overlapping


Layout = tuple[tuple[int, ...], tuple[int, ...], int, int]  # shape, strides, storage offset, bytes per element


def _offsets(t: Layout, lo: int, unit: int) -> torch.Tensor:
    """The offsets, in ``unit`` bytes from byte ``lo`` of its storage, of every ``unit`` of a layout's bytes."""
    shape, stride, offset, itemsize = t
    offs = torch.zeros((), dtype=torch.long)
    for n, st in zip(shape, stride):
        offs = offs.unsqueeze(-1) + torch.arange(n) * st
    per = itemsize // unit
    return (offs.reshape(-1, 1) * per + (offset * itemsize - lo) // unit + torch.arange(per)).reshape(-1)


def _layout(t: torch.Tensor) -> Layout:
    return (tuple(int(n) for n in t.shape), tuple(int(s) for s in t.stride()), int(t.storage_offset()), t.itemsize)


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors on one storage share a byte (NOTE [quiet writes] in ``trace.py``; run it in ``internal()``
    under a recording mode)."""
    try:
        return _overlap(_layout(a), _layout(b))
    except (RuntimeError, NotImplementedError):  # (a tensor without strides: counted as overlapping)
        return True


@functools.lru_cache(maxsize=1024)
def _overlap(a: Layout, b: Layout) -> bool:
    # (by layout alone, cached: a loop writes pieces of the same layouts on every step, a GRU cell's gates)
    if 0 in a[0] or 0 in b[0]:
        return False
    spans: list[tuple[int, int]] = []
    for shape, stride, offset, itemsize in (a, b):
        first = offset * itemsize
        spans.append((first, first + (sum((n - 1) * st for n, st in zip(shape, stride)) + 1) * itemsize))
    (alo, ahi), (blo, bhi) = spans
    if ahi <= blo or bhi <= alo:
        return False
    if a == b or max(math.prod(a[0]), math.prod(b[0])) > _OVERLAP_EXACT:
        return True
    lo = min(alo, blo)
    unit = min(a[3], b[3])  # (bytes of the smaller element: one mask entry each)
    mask = torch.zeros(-(-(max(ahi, bhi) - lo) // unit), dtype=torch.bool)
    mask[_offsets(a, lo, unit)] = True
    return bool(mask[_offsets(b, lo, unit)].any())


WHOLE = 1 << 20  # bytes: a storage up to this size is copied whole
ABSOLUTE = frozenset({"as_strided", "as_strided_", "as_strided_scatter"})  # ops whose offsets count from byte 0


class StorageSnapshot:
    """The bytes of one outside storage before the call first wrote it, as far as the call's tensors on it reach.

    NOTE [outside writes] in ``trace.py``, NOTE [written outside storages] in ``outside_writes.py``: each recompute
    reads and writes views of its own copy (``copy``, ``view``), so two tensors on the storage see each other's
    writes. Copied are the bytes the tensors ``cover`` reaches (a cache slot of a large arena, not the arena), the
    whole storage when it is small; a tensor met later extends the span with the bytes it reaches, which no write of
    the call has touched yet (every write goes through a tensor covered first).
    """

    __slots__ = ("storage", "lo", "data")
    # (views replay with the offsets they had; ``as_strided``'s count from the storage's first byte, and it may reach
    # any byte: a storage it views is copied whole, ``cover(t, whole=True)``)

    def __init__(self, t: torch.Tensor, whole: bool = False) -> None:
        self.storage: Any = t.untyped_storage()  # (the real one, while the forward pass runs: ``done``)
        self.lo = 0
        self.data: Any = None  # uint8, the bytes [lo, lo + len)
        self.cover(t, whole)

    def cover(self, t: torch.Tensor, whole: bool = False) -> None:
        """Extend the span to every byte of ``t`` (with the storage's current values there); ``whole``: to the
        whole storage (an ``as_strided`` view of it, whose offset counts from the storage's first byte)."""
        n = self.storage.nbytes()
        if n <= WHOLE or whole:
            lo, hi = 0, n
        else:
            first = int(t.storage_offset()) * t.itemsize
            extent = sum((int(d) - 1) * int(st) for d, st in zip(t.shape, t.stride())) + 1 if t.numel() else 0
            lo, hi = first // 16 * 16, min(n, -(-(first + extent * t.itemsize) // 16) * 16)
        if self.data is not None:
            old_lo, old_hi = self.lo, self.lo + self.data.numel()
            if old_lo <= lo and hi <= old_hi:
                return
            lo, hi = min(lo, old_lo), max(hi, old_hi)
        raw = torch.empty(0, dtype=torch.uint8, device=self.storage.device).set_(self.storage, lo, (hi - lo,), (1,))
        raw = raw.clone()
        if self.data is not None:
            raw[old_lo - lo:old_hi - lo] = self.data  # (the values before the call's writes)
        self.lo, self.data = lo, raw

    def done(self) -> None:
        self.storage = None

    def copy(self) -> torch.Tensor:
        return self.data.clone()  # type: ignore[no-any-return]

    def view(self, copy: torch.Tensor, geometry: tuple[Any, ...]) -> torch.Tensor:
        """A tensor of ``geometry`` (``geometry(t)`` of a tensor on the storage) on a ``copy`` of the snapshot."""
        shape, stride, offset, dtype = geometry
        at = (int(offset) * dtype.itemsize - self.lo) // dtype.itemsize
        return torch.empty(0, dtype=dtype, device=copy.device).set_(copy.untyped_storage(), at, shape, stride)
