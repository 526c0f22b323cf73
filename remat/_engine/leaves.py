"""The leaves of a call's arguments and results: dataclass instances among optree's leaves taken apart into their
fields' leaves, and put back (the arguments: ``select.py``; a region's result: ``region.py``)."""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import optree
import torch

__all__ = ["dataclass_fields"]


def _is_dataclass(a: Any) -> bool:
    # (a ModelOutput is a dataclass and a mapping whose items mirror its fields: a leaf, as optree has it)
    return dataclasses.is_dataclass(a) and not isinstance(a, (type, torch.Tensor, collections.abc.Mapping))


def dataclass_fields(leaves: list[Any], depth: int = 0,
                      seen: frozenset[int] = frozenset()) -> tuple[list[Any], Callable[[list[Any]], list[Any]] | None]:
    """Dataclass instances among optree's leaves (one registered with torch's pytree for ``torch.func``, or none) give
    their fields' leaves, so that their tensors are the call's inputs as a dict's are (under ``torch.func``, the
    recompute's tensors at the rebuilt levels); and the function that puts the instances back: the instance itself
    while its fields hold the leaves given, else a copy holding them (the frame holds that function until the
    backward pass: it holds the instance weakly where it can, and a copy of it without its fields). One that cannot
    be taken apart and put back (a cycle, a field not set, one that cannot be copied, an iterator among its fields,
    no tensor in it, more than 4096 leaves, deeper than 32) stays a leaf, as optree has it."""
    if depth > 32 or not any(_is_dataclass(a) for a in leaves):
        return leaves, None
    out: list[Any] = []
    parts: list[Any] = []
    for a in leaves:
        part = _expand(a, depth, seen) if _is_dataclass(a) else None
        parts.append(None if part is None else part[1])
        out.extend([a] if part is None else part[0])
    if all(p is None for p in parts):
        return leaves, None

    def collapse(flat: list[Any]) -> list[Any]:
        res: list[Any] = []
        i = 0
        for p in parts:
            if p is None:
                res.append(flat[i])
                i += 1
                continue
            ref, empty, names, spec, n, inner = p
            sub = flat[i:i + n]
            i += n
            top = sub if inner is None else inner(sub)
            a = ref()
            if a is not None:
                now: list[Any]
                try:
                    now = optree.tree_leaves(tuple(getattr(a, k) for k in names), none_is_leaf=True)  # type: ignore[arg-type]
                except AttributeError:
                    now = []
                if len(now) == len(top) and all(x is y for x, y in zip(now, top)):
                    res.append(a)  # (the caller's own: what the function sets on it is the caller's)
                    continue
            a = copy.copy(empty)
            for k, v in zip(names, optree.tree_unflatten(spec, top)):
                object.__setattr__(a, k, v)
            res.append(a)
        return res

    return out, collapse


def _expand(a: Any, depth: int, seen: frozenset[int]) -> tuple[list[Any], tuple[Any, ...]] | None:
    """A dataclass instance's fields' leaves and what puts it back (``dataclass_fields``), or None: a leaf."""
    if id(a) in seen:
        return None
    try:
        names = tuple(f.name for f in dataclasses.fields(a))
        top: list[Any]
        top, spec = optree.tree_flatten(tuple(getattr(a, k) for k in names), none_is_leaf=True)  # type: ignore[arg-type]
        sub, inner = dataclass_fields(top, depth + 1, seen | {id(a)})
        if len(sub) > 4096 or not any(isinstance(x, torch.Tensor) for x in sub) or any(
                isinstance(x, collections.abc.Iterator) and not isinstance(x, torch.Tensor) for x in sub):
            return None
        empty = copy.copy(a)
        for k in names:
            object.__setattr__(empty, k, None)
    except Exception:  # noqa: BLE001 (a field not set, a copy that raises: a leaf, as before)
        return None
    try:
        ref: Any = weakref.ref(a)
    except TypeError:  # (``slots=True``: held, as a leaf is)
        ref = lambda a=a: a  # noqa: E731
    return sub, (ref, empty, names, spec, len(sub), inner)
