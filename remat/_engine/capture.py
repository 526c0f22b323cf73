"""The re-run recompute's saved-tensor hooks: take what the forward pass dropped, at the positions it dropped them,
check each (``check_saved``), hold nothing else longer than needed, and stop once everything is made."""

from __future__ import annotations

from typing import Any

import torch

from .. import _torch_internals as ti
from .._context import internal
from .._errors import saved_shape_differs
from .ops import DeadRead, is_tainted
from .packed import Nested

__all__ = ["Capture", "StopRecompute", "check_saved", "holdable", "identity", "NOT_HELD", "PassThrough"]

# NOTE [one set of checks]
#     A re-run recompute takes what the forward pass dropped through one rule, ``check_saved``: the tensor is not a
#     placeholder of a skipped op (else ``DeadRead``: the recompute runs again without skipping any op, NOTE [dead
#     ops]) and it has the shape and dtype the forward pass saved there. The recompute also checks every op it runs
#     against the op the forward pass recorded (``Replayer``), comparing what each op read (NOTE [same reads] in
#     ``_engine/wiring.py``).


def check_saved(fn_name: str, t: torch.Tensor, meta: tuple[Any, ...], pos: int, dead: bool) -> None:
    """The checks every recompute applies to a tensor it takes at save position ``pos`` (NOTE [one set of checks]).

    ``meta``: what the forward pass saved there, ``(shape, dtype)``;
    ``dead``: the tensor is, or shares the storage of, a placeholder the recompute made for a skipped op."""
    if dead:
        raise DeadRead  # NOTE [dead ops]: the backward pass would read a placeholder
    if t.shape != meta[0] or t.dtype != meta[1]:
        raise saved_shape_differs(fn_name, t, meta, pos)


class StopRecompute(Exception):
    """Raised by a partial recompute's pack hook once it has made every tensor it was asked for."""


class Capture:
    """Saved-tensor hooks of a recompute: keep what the saving level saves, in order."""

    def __init__(self, frame: Any, s: int, detach: bool) -> None:
        self.frame: Any = frame
        self.s = s
        self.target: int | None = None
        self.detach = detach
        # NOTE [what a recompute holds]: nothing will differentiate the recompute's graph (unless the function
        # runs a backward pass of its own inside, which reads it)
        self.drop_unused = detach and not frame.inner_backward and not frame.forwarding
        self.n = 0
        self.fn_name = frame.fn_name
        self.wanted = frame.drops.get(s, {})
        self.captured: dict[int, torch.Tensor] = {}
        self.versions: dict[int, int] = {}  # position -> version when made (NOTE [written after saved])
        self._children = iter(frame.nested.children)
        self.stop_after: int | None = None  # a partial recompute: stop after this many saves
        self.tainted: dict[int, Any] = {}  # the storages of the replayer's placeholders (NOTE [dead ops]): none saved

    def next_nested(self) -> Nested | None:
        """The routing of the next routed call this recompute re-runs (in forward order)."""
        return next(self._children, None)

    def pack(self, t: torch.Tensor) -> Any:
        top = ti.peek_interpreter()
        level = None if top is None else int(top.level())
        if level == self.target:
            pos = self.n
            self.n += 1
            meta = self.wanted.get(pos)
            if meta is not None:
                check_saved(self.fn_name, t, meta, pos, bool(self.tainted) and is_tainted(self.tainted, ti.unwrap_all(t)))
                held = holdable(t)
                self.versions[pos] = ti.unwrap_all(t)._version
                if self.detach and not ti.is_wrapped(t):
                    self.captured[pos] = held  # (one detach serves both)
                else:
                    with internal():
                        self.captured[pos] = t.detach() if self.detach else t
                if self.stop_after is not None and self.n >= self.stop_after:
                    raise StopRecompute
                return held
            if self.stop_after is not None and self.n >= self.stop_after:
                raise StopRecompute
            if self.drop_unused:
                return NOT_HELD  # NOTE [what a recompute holds]
        return holdable(t)

    def unpack(self, t: Any) -> Any:
        return t


class _NotHeld:
    """What a recompute's own graph holds for a tensor nobody will read (NOTE [what a recompute holds]).

    Autograd hands it to ``unpack``, which returns it, only if that graph is differentiated, which never happens;
    a node given it would fail loudly ("expected a Tensor"), never compute with a wrong value."""

    __slots__ = ()


NOT_HELD = _NotHeld()


def holdable(t: torch.Tensor, mode: bool = True) -> torch.Tensor:
    """What to hold for a saved tensor (in a pack hook) without a reference cycle, on either engine.

    A saved output's grad_fn is the node that saves it: holding the tensor itself
    would make a cycle through the C++ graph that Python's gc cannot see, and the
    graph with its activations would leak on every step. Autograd restores the
    graph metadata on unpack, so a plain tensor is detached. A functorch wrapper
    must keep its lower-level history (detach would strip every level), so its
    inner value is re-wrapped in a dead wrapper, which functorch treats as
    transparent, exactly like a saved wrapper of an exited level. ``mode``: one of
    remat's dispatch modes is on the stack (without one, a plain detach).
    """
    if ti.is_wrapped(t):
        top = ti.peek_interpreter()
        if top is not None and ti.maybe_level(t) == int(top.level()) and t.grad_fn is not None:
            return ti.dead_grad_wrapper(ti.unwrap_one(t))
        return t
    if not t.requires_grad or t.is_leaf:
        return t  # (a leaf, such as a parameter: no node of its own; is_leaf asks without making the node's Python
        # object, which t.grad_fn does: ~0.4 us a kept tensor)
    if not mode:
        return t.detach()  # (save-nothing's forward pass: no mode of remat's is on the stack)
    if type(t) is torch.Tensor:
        return ti.detach_below_modes(t)  # (no mode sees it: no need to mark it remat's own)
    with internal():
        return t.detach()


class PassThrough:
    """An inner remat call re-run by an outer recompute: its saves are the outer graph's own.

    The positions the call's forward pass routed to the parent (``nested.routed``) are
    saved through ``ctx`` again, so the outer recompute sees them at the same positions.
    """

    def __init__(self, ctx: Any, nested: Nested | None) -> None:
        self.ctx = ctx
        self.routed = set() if nested is None else nested.routed
        self._children = iter(() if nested is None else nested.children)
        self.n = 0
        self.drop_unused = getattr(ctx, "drop_unused", False)  # the outer recompute's graph is never differentiated

    def next_nested(self) -> Nested | None:
        return next(self._children, None)

    def pack(self, t: torch.Tensor) -> Any:
        pos = self.n
        self.n += 1
        if pos in self.routed:
            return self.ctx.pack(t)
        if self.drop_unused:
            # the inner call's own activations: its own frame recomputes them when the backward pass reaches it;
            # holding them here would keep every inner activation until the outer recompute ends
            # (NOTE [what a recompute holds])
            return NOT_HELD
        return holdable(t)

    def unpack(self, t: Any) -> Any:
        return t


def identity(x: Any) -> Any:
    return x
