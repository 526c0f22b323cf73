"""Op arguments as NOTE [outside tensors] in ``_engine/outside_writes.py`` needs them: which an op writes, which are
Python numbers, how to swap tensors in. Pure functions over ATen ops and their arguments."""

from __future__ import annotations

import ctypes
import functools
import hashlib
from typing import Any

import torch

__all__ = ["HIDDEN_WRITES", "SMALL", "mutates", "written_positions", "replace_tensors", "nbytes",
           "geometry", "fingerprint", "overlap"]

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


def nbytes(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return 0


def geometry(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)


def fingerprint(t: torch.Tensor) -> tuple[Any, ...]:
    """A cryptographic hash of a tensor's value (shape, dtype and every byte), holding nothing.

    A tensor built from Python data inside the call (``torch.tensor(...)``, ``torch.from_numpy``) is made
    afresh by the recompute; remat keeps only this, not the tensor, to check the recompute built the same.
    """
    b = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().contiguous()
    data = ctypes.string_at(b.data_ptr(), b.numel()) if b.numel() else b""  # (numpy is not a dependency)
    return (tuple(t.shape), t.dtype, hashlib.blake2b(data, digest_size=32).hexdigest())


_OVERLAP_EXACT = 1 << 22  # elements: above, two tensors whose spans overlap count as overlapping


def _byte_offsets(t: torch.Tensor, lo: int) -> torch.Tensor:
    """The offsets, from byte ``lo`` of its storage, of every byte of ``t``."""
    offs = torch.zeros((), dtype=torch.long)
    for n, st in zip(t.shape, t.stride()):
        offs = offs.unsqueeze(-1) + torch.arange(int(n)) * int(st)
    start = int(t.storage_offset()) * t.itemsize - lo
    return (offs.reshape(-1, 1) * t.itemsize + start + torch.arange(t.itemsize)).reshape(-1)


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors on one storage share a byte (NOTE [quiet writes] in ``trace.py``; run it in ``internal()``
    under a recording mode)."""
    try:
        if a.numel() == 0 or b.numel() == 0:
            return False
        spans: list[tuple[int, int]] = []
        for t in (a, b):
            first = int(t.storage_offset()) * t.itemsize
            spans.append((first, first + (sum((int(n) - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.itemsize))
        (alo, ahi), (blo, bhi) = spans
        if ahi <= blo or bhi <= alo:
            return False
        if alo == blo and a.shape == b.shape and a.stride() == b.stride() or max(a.numel(), b.numel()) > _OVERLAP_EXACT:
            return True
        lo = min(alo, blo)
        mask = torch.zeros(max(ahi, bhi) - lo, dtype=torch.bool)
        mask[_byte_offsets(a, lo)] = True
        return bool(mask[_byte_offsets(b, lo)].any())
    except (RuntimeError, NotImplementedError):
        return True
