"""The re-run recompute's dispatch mode: where the recompute runs the function's Python again (the routes of
docs/how-it-works.md "Where neither replay serves"), or replays its program (NOTE [program replay] in
``program.py``), the :class:`Replayer` checks every op against the forward pass's record (NOTE [same reads] in
``_engine/wiring.py``) and hands back what the policy kept.

NOTE [random ops]
    The recorder notes, before each random op of the forward pass, its generator and that generator's state; the
    recompute sets that state before running the op, so it draws the numbers the forward pass drew even where the
    function sets the state itself (``torch.manual_seed(self.seed); self.seed += 1``, a Megatron-style tracker's
    fork, a user's generator re-seeded): restoring the state once at the start of the recompute would replay the
    function's own seeding with the values it has now. The generators it set are put back when it ends.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .. import _torch_internals as ti
from .._context import INTERNAL, internal
from .._errors import RematError
from .._torch_internals import TorchDispatchMode
from . import outside as ox
from .ambient import draw_as_recorded
from .dispatch import Recorder
from .ops import (
    DETACH,
    RANGE_OPS,
    TO_COPY,
    VIEW,
    DeadRead,
    OpRecord,
    arg_tensors,
    cast_of,
    dead_value,
    fmt_meta,
    identity_alias,
    ignored,
    is_tainted,
    op_info,
    op_meta,
    profiler_op,
    storage_freed,
    storage_key,
    tensor_leaves,
)
from .outside_writes import outside_args, placeholders, with_copies
from .wiring import Wiring, autocast_cast, cast_source, describe_difference, same_key, values_key

__all__ = ["Replayer"]

def _write_on_placeholders(func: Any, args: Any, kwargs: Any, unused_keys: set[int]) -> Any:
    """NOTE [unused outputs] in _engine/full.py: a write that reads a placeholder must not run on it (its values are
    uninitialised: ``index_put_``'s indices, ``embedding_renorm_``'s). Into tensors that are placeholders too, it is
    skipped: its outputs, the arguments it returns, are returned (placeholders still); into a real tensor, DeadRead
    (the recompute runs in full). Else None: run it."""
    info = op_info(func)
    if not info.written and not info.written_kw:
        return None
    with internal():
        ws = [args[k] for k in info.written if k < len(args)] + [kwargs.get(k) for k in info.written_kw]
        wkeys = {storage_key(t) for t in ws if isinstance(t, torch.Tensor)}
        if not any(storage_key(t) in unused_keys for t in arg_tensors(args, kwargs) if storage_key(t) not in wkeys):
            return None
    if not all(k in unused_keys for k in wkeys) or None in info.alias_of:
        raise DeadRead
    outs = [args[a] if type(a) is int else kwargs[a] for a in info.alias_of]  # type: ignore[index]
    return outs[0] if len(outs) == 1 else tuple(outs)


def _written_to_a_copy(rec: OpRecord, func: Any, args: Any, kwargs: Any, out: Any) -> Any:
    """NOTE [written outside storages]: the tensor an op wrote whose write went to a copy, when the op returned the
    copy: it is read on (``A.add_(1); A.as_strided(...)``, ``torch.div(a, b, out=A); A @ B``: an ``out=`` op hands
    its argument back above the modes; ``torch.max(x, 1, out=(v, i))``: its outputs, in order) as the forward's op
    returned it, as that op's output. So too a dead in-place op the recompute skipped (its placeholder returned,
    ``dropout``'s ``bernoulli_``): its argument is read on as its output."""
    if args and out is not args[0] and isinstance(args[0], torch.Tensor) and 0 in op_info(func).written:
        return args[0]  # type: ignore[no-any-return]
    if rec.subst is None:
        return None
    info = op_info(func)
    ws = tuple(kwargs.get(k) for k in info.written_kw)
    if not ws or not all(isinstance(w, torch.Tensor) for w in ws):
        return None
    if len(ws) == 1:
        return ws[0] if ws[0] is not out else None
    return ws if type(out) is not tuple or any(w is not o for w, o in zip(ws, out)) else None


class Replayer(TorchDispatchMode):
    """Recompute: the same ops in the same order; stashed outputs handed back, not recomputed."""

    def __init__(self, recorder: Recorder, unused: set[int] = frozenset(), skip_dead: bool = True) -> None:  # type: ignore[assignment]
        super().__init__()
        self.rec = recorder
        self.skip_dead = skip_dead
        # NOTE [dead ops]: the storages of the placeholders handed back for dead ops, and of what ops computed from
        # them: an op the recompute needs reading one, or one saved for the backward pass, is DeadRead (by storage:
        # an alias of one made where no mode sees is one too)
        self.tainted: dict[int, Any] = {}
        self.pos = 0
        self.unused = unused  # ops feeding only outputs this backward pass does not differentiate
        self.unused_keys: set[int] = set()  # storages of the placeholders handed back for them
        # NOTE [autocast's cache] in _engine/wiring.py: id -> (leaf, weakref) of the casts the recompute ran past the ops
        self.casts: dict[int, tuple[torch.Tensor, weakref.ref[torch.Tensor]]] = {}
        self.wiring = None if recorder.wiring is None else Wiring(recorder.wiring.known, loose=True)
        self.generators: dict[int, tuple[torch.Generator, torch.Tensor]] = {}  # set by the recompute: their states
        self.shadows: dict[int, Any] = {}  # NOTE [written outside storages]: id -> (Shadow, this recompute's copy)

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        with internal():
            for gen, state in self.generators.values():
                gen.set_state(state)
        self.generators.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if INTERNAL.get() or ignored(func):
            return profiler_op(func, args, kwargs) if func in RANGE_OPS else func(*args, **kwargs)
        if func is DETACH and self.rec.region:
            return func(*args, **kwargs)
        ops = self.rec.ops
        i = self.pos
        rec = ops[i] if i < len(ops) else None
        # NOTE [autocast's cache] in _engine/wiring.py: a cast of a leaf matches the forward pass's cast of that leaf only
        leaf = autocast_cast(func, args, kwargs) if func is TO_COPY else None
        alias = (func is VIEW or func is DETACH) and identity_alias(func, args, kwargs)
        if alias and (rec is None or not rec.alias or func is not rec.func):
            # NOTE [hooks' aliases]: the forward pass's next alias of this op, past its aliases of others; or one the
            # forward pass did not make here: run, not counted
            j = i
            while j < len(ops) and ops[j].alias and ops[j].func is not func:
                j += 1
            if j < len(ops) and ops[j].alias and ops[j].func is func:
                i, rec = j, ops[j]
            else:
                out = func(*args, **kwargs)
                if self.wiring is not None:
                    self.wiring.note_alias(out, args[0])
                return out
        if rec is None or func is not rec.func or (func is TO_COPY and cast_of(rec) is not leaf):
            if leaf is not None:  # a cast the forward pass read from autocast's cache: run, not counted
                out = func(*args, **kwargs)
                self.casts[id(out)] = (leaf, weakref.ref(out))
                if self.wiring is not None:
                    self.wiring.note_cast(out, leaf)
                return out
            j = i
            while j < len(ops) and (ops[j].alias or ops[j].cast_leaf is not None and (
                    ops[j].func is not func or func is TO_COPY)):
                # (casts of the forward pass's this recompute read from autocast's cache; identity aliases it lacks)
                j += 1
            if j > i and j < len(ops) and ops[j].func is func:
                i, rec = j, ops[j]
        elif rec.alias and not alias:
            # NOTE [hooks' aliases]: the forward pass's identity aliases this recompute does not make
            j = i
            while j < len(ops) and ops[j].alias:
                j += 1
            if j < len(ops) and ops[j].func is func:
                i, rec = j, ops[j]
        self.pos = i + 1
        if rec is None:
            raise self.diverged(f"it ran {func} after the {len(ops)} ops of the forward pass", cache_hint=True)
        if func is not rec.func:
            raise self.diverged(f"op #{i} was {rec.describe()} in the forward pass but {func} now", cache_hint=True)
        wiring = self.wiring
        if rec.alias and alias:
            # NOTE [hooks' aliases]: the same value under another name, whichever tensor a hook's alias of the forward
            # pass at this position read: its output takes its argument's token, which the ops after it are checked by
            if rec.subst is not None:  # (an alias of an outside tensor the call writes: of the recompute's copy)
                args, kwargs = with_copies(self, rec, args, kwargs)
            out = func(*args, **kwargs)
            if wiring is not None:
                wiring.note_alias(out, args[0])
            if self.tainted and is_tainted(self.tainted, args[0]):
                self._taint([out])
            return out
        if wiring is None or rec.wkey is None:
            return self._run(i, rec, func, args, kwargs)
        now = wiring.key(args, kwargs)  # NOTE [same reads] in _engine/wiring.py: the values and which tensor each is
        if now != rec.wkey and not same_key(now, rec.wkey, loose=True):
            raise self.diverged(
                f"op #{i} {func} read other values than in the forward pass: "
                f"{describe_difference(now, rec.wkey, lambda j: None)} (a Python value computed from state that "
                "changed, such as a step counter, a module's attribute or a global, or another tensor picked by it)"
            )
        out = self._run(i, rec, func, args, kwargs)
        leaf = cast_of(rec)
        if leaf is not None:
            wiring.note_cast(out, leaf)
        elif rec.alias:
            wiring.note_alias(out, args[0])
        else:
            wiring.note(i, out)
            w = _written_to_a_copy(rec, func, args, kwargs, out)
            if w is not None:
                wiring.note(i, w)
        return out

    def _run(self, i: int, rec: OpRecord, func: Any, args: Any, kwargs: Any) -> Any:
        """The recorded op ``i`` in the recompute: a placeholder, its stashed outputs, or run (checked)."""
        if rec.skippable and i in self.unused:
            with internal():  # NOTE [unused outputs]
                dead = [dead_value(m) for m in rec.out_meta]
                self.unused_keys.update(storage_key(t) for t in dead)
                return rec.rebuild(dead)
        if rec.stash is not None and (not rec.random or rec.held) and (self.skip_dead or all(
                x is not None and not (isinstance(x, weakref.ref) and x() is None) for x in rec.stash)) \
                and not _stale(rec, self.rec.fn_name):
            return self._replay(rec, func, args, kwargs)
        if not rec.live and rec.skippable and self.skip_dead:
            with internal():  # dead: nothing needed reads it (NOTE [dead ops])
                return rec.rebuild(self._taint([dead_value(m) for m in rec.out_meta]))
        tainted = bool(self.tainted) and any(is_tainted(self.tainted, t) for t in arg_tensors(args, kwargs))
        if tainted and rec.live:
            raise DeadRead
        if rec.scalars and rec.wkey is None:  # NOTE [same reads] in _engine/wiring.py: the values, where no key was noted
            values = values_key(args, kwargs)
            if values != rec.scalars and not same_key(values, rec.scalars):
                raise self.diverged(
                    f"op #{i} {func} read other values than in the forward pass: "
                    f"{describe_difference(values, list(rec.scalars), lambda j: None)} (a Python value computed from state "
                    "that changed, such as a step counter, a module's attribute or a global)"
                )
        if rec.outside is not None or rec.subst is not None:
            args, kwargs = outside_args(self, i, rec, args, kwargs)
        if self.unused_keys and (skip := _write_on_placeholders(func, args, kwargs, self.unused_keys)) is not None:
            return skip
        stand_in = rec.random and bool(self.unused_keys or tainted)
        if stand_in:
            args, kwargs = self._no_placeholders(args, kwargs)
        if rec.rng is not None and id(rec.rng[0]) not in self.generators:
            # NOTE [random ops]: the state the forward pass drew from, whatever the function set since (a seed set
            # inside it, a tracker's fork: ``draw_as_recorded`` below); each generator put back when the recompute ends
            with internal():
                self.generators[id(rec.rng[0])] = (rec.rng[0], rec.rng[0].get_state())
        if rec.lifted is not None:
            with internal():
                now = ox.fingerprint(arg_tensors(args, kwargs)[0])
            if now != rec.lifted:
                placeholders(self)  # (the data came from a placeholder: NOTE [dead ops])
                raise self.diverged(
                    f"op #{i} {func} lifted a tensor built from Python data (torch.tensor, torch.from_numpy) "
                    f"of shape {list(now[0])} whose value differs from the forward pass's (data read from "
                    "state that changed in between)"
                )
        out = func(*args, **kwargs) if rec.rng is None else draw_as_recorded(  # (on stand-in values, a poisson draws
            *rec.rng, None if stand_in else rec.drew, func, func, args, kwargs, self.rec.fn_name)  # as many as it will)
        outs = tensor_leaves(out)
        if self.unused_keys:
            # an op that ran on a placeholder (a random op, a write) made a placeholder too (NOTE [unused outputs])
            with internal():
                if any(storage_key(t) in self.unused_keys for t in arg_tensors(args, kwargs)):
                    self.unused_keys.update(storage_key(t) for t in outs)
        if tainted:
            self._taint(outs)  # (a view of a placeholder, run as views always are: a placeholder too)
        got = [op_meta(t)[:2] for t in outs]
        want = [m[:2] if m is not None else None for m in rec.out_meta]
        if got != want:
            raise self.diverged(
                f"op #{i} {func} produced {', '.join(fmt_meta(m) for m in got)} in the recompute but "
                f"{', '.join(fmt_meta(m) for m in want)} in the forward pass", cache_hint=True
            )
        return out

    def _taint(self, ts: list[Any]) -> list[Any]:
        with internal():
            for t in ts:
                if isinstance(t, torch.Tensor):
                    s = ti.storage_of(t)
                    if s is not None:
                        self.tainted[s.data_ptr()] = weakref.ref(s)
        return ts

    def _no_placeholders(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """A random op reading a placeholder (NOTE [unused outputs]) must still draw its numbers, on valid values
        (a NaN probability is an error): ones of the same shape stand in (valid where zeros are not: ``multinomial``'s
        weights, ``_standard_gamma``'s concentration); its outputs are placeholders too."""
        with internal():
            ins = arg_tensors(args, kwargs)
            new = {j: torch.ones_like(t) for j, t in enumerate(ins) if storage_key(t) in self.unused_keys
                   or (self.tainted and is_tainted(self.tainted, t))}  # (a dead op's placeholder: NOTE [dead ops])
            if not new:
                return args, kwargs
            self.unused_keys.update(storage_key(t) for t in new.values())
            return ox.replace_tensors(args, kwargs, new)

    def _replay(self, rec: OpRecord, func: Any, args: Any, kwargs: Any) -> Any:
        assert rec.stash is not None
        vals: list[Any] = []
        with internal():
            for ref, meta in zip(rec.stash, rec.out_meta):
                t = ref() if isinstance(ref, weakref.ref) else ref
                if t is None:
                    t = self._taint([dead_value(meta)])[0]
                elif getattr(t, "routed", False):
                    # held by the enclosing call (NOTE [nested remat] in _engine/full.py), fetched before this recompute
                    # began (fetching may run the enclosing call's recompute, which cannot run inside a mode)
                    t = t.value.detach()
                elif not isinstance(t, torch.Tensor):
                    t = t.engine.fetch(t)  # offloaded: bring it back
                else:
                    t = t.clone() if rec.cow else t.detach()
                vals.append(t)
        return rec.rebuild(vals)

    def same_cast(self, cur: torch.Tensor, t0: torch.Tensor) -> bool:
        """NOTE [autocast's cache]: ``t0`` (read in the forward pass) is autocast's cast of a leaf, and ``cur``
        (read now) the cast of the same leaf to the same dtype, made by this recompute or cached."""
        leaf = cast_source(t0)
        if leaf is None or cur.dtype != t0.dtype or cur.shape != t0.shape:
            return False
        made = self.casts.get(id(cur))
        if made is not None and made[1]() is cur:
            return made[0] is leaf
        return cast_source(cur) is leaf

    def finish(self) -> None:
        while self.pos < len(self.rec.ops) and self.rec.ops[self.pos].alias:
            self.pos += 1  # NOTE [hooks' aliases]
        if self.pos != len(self.rec.ops):
            nxt = self.rec.ops[self.pos]
            raise self.diverged(
                f"it stopped after {self.pos} ops; the forward pass went on with {nxt.describe()}"
            )

    def diverged(self, what: str, cache_hint: bool = False) -> RematError:
        """``cache_hint``: the difference is one of ops or shapes, which a key/value cache makes (a message about a
        value or a tensor of the same shape suggests none: issue 38, a hint at a cache the caller had turned off was
        wrong advice)."""
        return RematError(
            f"remat: the recompute of {self.rec.fn_name} diverged from its forward pass: {what}. "
            "The wrapped function must run the same ops on the same shapes every time it is "
            "called with the same inputs: avoid data-dependent Python branches on values that "
            "change between forward and backward, global state that changes (counters, caches, "
            "a module switched between train() and eval()), and in-place mutation of inputs."
            + (" A key/value cache that grows on every call changes the shapes: for a Hugging Face model pass "
               "use_cache=False (model.config.use_cache = False)." if cache_hint else "")
        )


def _stale(rec: OpRecord, fn_name: str) -> bool:
    """Whether a kept output of ``rec`` was written in place after the forward pass (through its own tensor, or a
    tensor of the call on its storage: ``Recorder.watch_results`` watches both), or its storage freed: then the op
    runs again, from its arguments, as a dropped one does (its value in the forward pass is what the backward pass
    needs). A random op drawn from a generator another thread shared (NOTE [draws in threads]) cannot be drawn
    again: a ``RematError``."""
    moved = None
    for a, v0 in rec.watch or ():
        if a._version != v0:
            moved = f"version {v0} -> {a._version}"
    if any(type(h) is torch.Tensor and storage_freed(h) for h in rec.stash or ()):
        moved = "its storage freed"  # (by the caller: no version moves)
    if moved is not None and rec.random:
        raise RematError(
            f"remat: the output of {rec.describe()} that {fn_name} kept for its recompute was modified "
            f"in place after the forward pass ({moved}), e.g. a result of the function "
            "changed before the backward pass. Clone a result before modifying it, or run the backward pass first."
        )
    return moved is not None
