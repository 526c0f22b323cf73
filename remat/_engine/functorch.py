"""The functorch glue: record the interpreter stack of a forward pass, rebuild it for the recompute.

NOTE [per-level replay]
    Under ``torch.func`` every transform is a level on an interpreter stack. When
    autograd saves a tensor inside a remat'd call, the pack hook runs once per
    level that records a node, with every interpreter above that level popped, so
    the top of the stack names the *saving level*. The recompute for a saving
    level ``s`` must produce the very tensors that level saved, as seen by that
    level. So it rebuilds the stack that was live in the forward pass:

    * levels below ``s`` are still alive (they are the bottom of the stack during
      the backward pass) and are reused;
    * level ``s`` is reused if it is still alive (``grad``: the backward pass runs
      inside the level); if it is dead (``vjp``/``jacrev``: the backward pass runs
      after the level exited) a fresh grad level stands in for it;
    * whatever the current stack has above that (``jacrev``'s vmap over the basis)
      is popped for the duration;
    * the levels that were above ``s`` in the forward pass are dead by now and are
      replayed on fresh interpreters: vmap with the recorded batch size,
      randomness and batch dims, grad with requires_grad, jvp with tangents
      rebuilt the same way.

    The inputs of the call are re-wrapped level by level from their recorded
    decomposition (the value seen at each stack height). Level numbers are reused
    by torch (a vmap level can take the number of an exited vjp level), so each
    grad/jvp level keeps a liveness sentinel (a 0-element wrapper) instead of
    comparing numbers. What the recompute captures at the level standing in for
    ``s`` is returned as-is: ``SavedVariable::unpack`` makes a shallow detached
    copy of what the unpack hook returns, which would strip jvp tangents and
    lower-level history from an unwrapped inner value.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .. import _torch_internals as ti
from .._errors import RematError, internal_error

__all__ = ["Level", "record_stack", "saving_height", "Decomposed", "decompose", "replay", "below_all_levels"]

_SENTINEL_BASE = torch.empty(0)


@dataclasses.dataclass
class Level:
    """One functorch interpreter as it was during the forward pass."""

    kind: str  # "vmap" | "grad" | "jvp"
    level: int
    batch_size: int = 0
    randomness: str = "error"
    prev_mode: bool = True
    sentinel: torch.Tensor | None = None

    def alive(self) -> bool:
        return self.sentinel is None or not ti.is_dead_wrapper(self.sentinel)


def record_stack(fn_name: str) -> list[Level]:
    """The current interpreter stack as Level records; raise for unsupported transforms."""
    levels = []
    for interp in ti.interpreter_stack():
        key, lvl = interp.key(), int(interp.level())
        if key == ti.TransformType.Vmap:
            bs, rnd = ti.vmap_info(interp)
            levels.append(Level("vmap", lvl, batch_size=bs, randomness=rnd))
        elif key == ti.TransformType.Grad:
            sent = ti.wrap_for_grad(_SENTINEL_BASE, lvl)
            levels.append(Level("grad", lvl, prev_mode=ti.grad_prev_mode(interp), sentinel=sent))
        elif key == ti.TransformType.Jvp:
            sent = ti.wrap_for_grad(_SENTINEL_BASE, lvl)
            levels.append(Level("jvp", lvl, prev_mode=ti.jvp_prev_mode(interp), sentinel=sent))
        else:
            raise RematError(
                f"remat: {fn_name} was called under torch.func.{str(key).split('.')[-1].lower()}, "
                "which remat does not support: functionalize rewrites mutations into copies, so "
                "the recompute could not replay them. Call remat outside functionalize, or use "
                "torch.func.functionalize on the function inside remat."
            )
    return levels


def saving_height(levels: Sequence[Level]) -> int:
    """Index in ``levels`` of the level now saving a tensor (-1: no functorch level)."""
    top = ti.peek_interpreter()
    if top is None:
        return -1
    s = ti.stack_depth() - 1
    if s >= len(levels) or levels[s].level != int(top.level()):
        raise internal_error(
            f"a tensor was saved at functorch level {int(top.level())} (height {s}) that the "
            f"forward pass did not record ({[(lv.kind, lv.level) for lv in levels]})"
        )
    return s


@dataclasses.dataclass
class Decomposed:
    """A value of the call as seen at each stack height, and how each level wraps it."""

    values: list[Any]  # values[j]: the value at height j (j levels active)
    infos: list[Any]  # infos[j]: how level j wraps values[j] into values[j + 1]


@contextlib.contextmanager
def _height(h: int) -> Iterator[None]:
    """Temporarily pop the interpreters above height ``h``."""
    popped = []
    try:
        while ti.stack_depth() > h:
            popped.append(ti.pop_layer())
        yield
    finally:
        while popped:
            ti.push_layer(popped.pop())


def below_all_levels() -> contextlib.AbstractContextManager[None]:
    """Run ops on plain tensors with no functorch level active (a pack hook runs with the
    saving level still on the stack, where even an op on a plain tensor returns a wrapper)."""
    return _height(0)


def decompose(value: Any, levels: Sequence[Level], height: int) -> Decomposed:
    """Unwrap ``value`` (living at ``height``) level by level down to height 0."""
    import torch.autograd.forward_ad as fwAD

    vals: list[Any] = [None] * (height + 1)
    infos: list[Any] = [None] * height
    vals[height] = value
    v = value
    for j in range(height - 1, -1, -1):
        lv = levels[j]
        info: Any = None
        if isinstance(v, torch.Tensor) and ti.maybe_level(v) == lv.level:
            if lv.kind == "vmap" and ti.is_batched(v):
                info = ("vmap", ti.bdim(v))
                v = ti.unwrap_one(v)
            elif lv.kind in ("grad", "jvp") and ti.is_grad_wrapper(v):
                tangent = None
                if lv.kind == "jvp":
                    with _height(j + 1):
                        _, t = fwAD.unpack_dual(v)
                    if t is not None:
                        tangent = decompose(ti.unwrap_for_grad(t, lv.level), levels, j)
                info = (lv.kind, v.requires_grad, tangent)
                v = ti.unwrap_one(v)
        infos[j] = info
        vals[j] = v
    return Decomposed(vals, infos)


def _wrap(info: Any, v: Any, level: int, start: int, fresh: dict[int, int]) -> Any:
    """Re-apply one recorded level of wrapping to ``v`` at (fresh) level ``level``."""
    import torch.autograd.forward_ad as fwAD

    if info is None or not isinstance(v, torch.Tensor):
        return v
    if info[0] == "vmap":
        return ti.add_batch_dim(v, info[1], level)
    if info[0] == "jvp" and info[2] is not None:
        v = fwAD.make_dual(v, _rebuild(info[2], start, fresh))
    else:
        v = ti.wrap_for_grad(v, level)
    if info[1]:
        with ti.inplace_requires_grad_allowed():
            v.requires_grad_()
    return v


def _rebuild(dec: Decomposed, start: int, fresh: dict[int, int]) -> Any:
    v = dec.values[start]
    for j in range(start, len(dec.infos)):
        v = _wrap(dec.infos[j], v, fresh[j], start, fresh)
    return v


def _push(lv: Level, es: contextlib.ExitStack) -> int:
    if lv.kind == "vmap":
        return es.enter_context(ti.vmap_level(lv.batch_size, lv.randomness))
    if lv.kind == "grad":
        return es.enter_context(ti.grad_level(lv.prev_mode))
    return es.enter_context(ti.jvp_level(lv.prev_mode))


def check_lower_levels(levels: Sequence[Level], s: int, fn_name: str) -> None:
    """Levels below the saving level must still be the bottom of the stack."""
    cur = ti.interpreter_stack()
    for j in range(max(s, 0)):
        if j >= len(cur) or int(cur[j].level()) != levels[j].level:
            raise RematError(
                f"remat: the backward pass of {fn_name} runs under a different torch.func "
                f"stack than its forward pass did (level {levels[j].kind}:{levels[j].level} "
                "is gone). Run the backward pass inside the same transforms as the forward pass."
            )


@contextlib.contextmanager
def replay(
    levels: Sequence[Level], decs: Sequence[Decomposed | None], flat: Sequence[Any], s: int
) -> Iterator[tuple[list[Any], int | None]]:
    """Rebuild the forward's stack for a recompute of saving level ``s``.

    Yields the call's flat inputs re-wrapped for the rebuilt stack and the level
    number whose saves must be captured (None: no functorch level).
    """
    h = len(levels)
    cur = ti.interpreter_stack()
    alive = s < 0 or (
        levels[s].alive() and len(cur) > s and int(cur[s].level()) == levels[s].level
    )
    fresh = {j: lv.level for j, lv in enumerate(levels)}
    with contextlib.ExitStack() as es:
        es.enter_context(_height(s + 1 if alive else max(s, 0)))
        es.enter_context(torch.enable_grad())
        start = s + 1 if alive else s
        start = max(start, 0)
        vals = [d.values[start] if d is not None else a for d, a in zip(decs, flat)]
        for j in range(start, h):
            fresh[j] = _push(levels[j], es)
            vals = [
                _wrap(d.infos[j], v, fresh[j], start, fresh) if d is not None else v
                for d, v in zip(decs, vals)
            ]
        target = None if s < 0 else (levels[s].level if alive else fresh[s])
        yield vals, target
