"""What a full-engine call's pack hook hands autograd for each saved tensor (``Frame.pack`` in ``_engine/full.py``).

A :class:`Packed` names the call, what became of the tensor (``KEEP``: held by reference, ``OFFLOAD``: copied to
host memory, ``DROP``: recomputed, ``INPUT``: an argument, ``ROUTED``: saved through the enclosing call), and
where it sits. A routed call (NOTE [nested remat] in ``_engine/full.py``) also leaves a :class:`Nested` for its
parent's recompute, and hands its stash to the parent as :class:`ParentHandle` records. Both the forward pass
(``_engine/full.py``) and the recompute (``_engine/recompute.py``) read these records; what a recompute made is a :class:`Made`.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _torch_internals as ti
from .._errors import RematError, internal_error, kept_written_after_save, saved_written_after_save

__all__ = ["KEEP", "OFFLOAD", "DROP", "INPUT", "ROUTED", "Packed", "Nested", "ParentHandle", "made_anew",
           "Made", "saved_written", "kept_written"]

KEEP, OFFLOAD, DROP, INPUT = "kept", "offloaded", "recomputed", "input"
ROUTED = "routed"  # a routed frame's kept tensor, saved through the parent frame (NOTE [nested remat])

class Packed:
    """What autograd holds for one saved tensor of a remat call."""

    __slots__ = ("frame", "kind", "height", "pos", "payload", "version", "meta", "record", "level")

    def __init__(self, frame: Any, kind: str, height: int, pos: int, payload: Any, version: int,
                 meta: tuple[Any, ...], record: Any) -> None:
        self.frame = frame
        self.kind = kind
        self.height = height
        self.pos = pos
        self.payload = payload
        self.version = version
        self.meta = meta
        self.record = record  # the OpRecord that produced it (None: an input), for inspection
        self.level: Any = None  # a kept wrapper's grad level (functorch.Level), whose history the held alias lacks


class Nested:
    """What the parent's recompute must know to re-run one routed call (NOTE [nested remat]).

    ``routed``: the call's save positions handed to the parent (its kept tensors);
    ``stash``: the outputs of its replay stash handed to the parent when its forward pass ended,
    as (op index, output position); ``children``: the same for the routed calls made inside it, in call order.
    """

    __slots__ = ("routed", "stash", "children")

    def __init__(self) -> None:
        self.routed: set[int] = set()
        self.stash: list[tuple[int, int]] = []
        self.children: list[Nested] = []


class ParentHandle:
    """A stashed output of a routed call, saved through its parent (NOTE [nested remat])."""

    __slots__ = ("parent", "packed", "value")
    routed = True

    def __init__(self, parent: Any, packed: Packed) -> None:
        self.parent = parent
        self.packed = packed
        self.value: torch.Tensor | None = None  # fetched for the duration of this call's recompute

    def fetch(self) -> torch.Tensor:
        return self.parent.unpack(self.packed)


def made_anew(handle: Any) -> bool:
    """Whether a parent hands this saved tensor back as a new tensor (fetched from host memory, recomputed), whose
    version counter is not the forward's input's (NOTE [nested remat])."""
    while isinstance(handle, Packed) and handle.kind == ROUTED:
        handle = handle.payload
    return isinstance(handle, Packed) and handle.kind in (OFFLOAD, DROP)


class Made(dict):  # type: ignore[type-arg]
    """What a recompute made for the backward pass: save position -> tensor, and each tensor's version when it was
    made, checked when the backward pass reads it (NOTE [written after saved]).

    NOTE [written after saved]
        Autograd refuses to hand a node a saved tensor that was written in place after the node saved it (its
        version moved). A dropped tensor was not held, so that check cannot run on it; but every recompute
        replays the forward pass's ops up to the last tensor it must make, writes included: a write after an op
        saved the tensor shows there as a version that moved since the recompute made it, and the value it
        would hand the backward pass is the written one, a wrong gradient without an error. So the version is
        noted when the tensor is made and compared when the backward pass reads it, which is when autograd
        compares (a tensor saved for a node the backward pass never runs may be written freely, as in plain
        autograd).
    """

    __slots__ = ("versions",)

    def __init__(self, captured: dict[int, torch.Tensor], versions: dict[int, int]) -> None:
        super().__init__(captured)
        self.versions = versions

    def take(self, fn_name: str, pos: int) -> torch.Tensor:
        """Hand saved tensor ``pos`` to the backward pass, once, checked unwritten since it was made."""
        t = self.take_if_made(fn_name, pos)
        if t is None:
            raise internal_error(f"the recompute of {fn_name} did not make saved tensor #{pos}")
        return t

    def take_if_made(self, fn_name: str, pos: int) -> torch.Tensor | None:
        """:meth:`take`, or None where tensor ``pos`` was not made (or was taken already)."""
        t: torch.Tensor | None = self.pop(pos, None)
        if t is None:
            return None
        v0 = self.versions.get(pos)
        if v0 is not None:
            now = ti.unwrap_all(t)._version
            if now != v0:
                raise saved_written(fn_name, pos, t, v0, now)
        return t


def saved_written(fn_name: str, pos: int, t: Any, v0: int, v1: int) -> RematError:
    """``saved_written_after_save``, naming ``allow_mutation_on_saved_tensors()`` where it is on."""
    return saved_written_after_save(fn_name, pos, t, v0, v1, ti.mutation_on_saved_allowed())


def kept_written(fn_name: str, t: Any, v0: int) -> RematError:
    """``kept_written_after_save``, the same."""
    return kept_written_after_save(fn_name, t, v0, ti.mutation_on_saved_allowed())
