"""The planned recompute's dispatch modes: a planned call's recompute runs its function again under one of them,
which hands back what the plan holds, skips what it may, and checks every op it runs against what the forward
pass read (NOTE [same reads] in ``_wiring.py``; NOTE [value recompute] in ``planned.py``).

NOTE [random ops]
    The recorder notes, before each random op of the forward pass, its generator and that generator's state; the
    recompute sets that state before running the op, so it draws the numbers the forward pass drew even where the
    function sets the state itself (``torch.manual_seed(self.seed); self.seed += 1``, a Megatron-style tracker's
    fork, a user's generator re-seeded): restoring the state once at the start of the recompute would replay the
    function's own seeding with the values it has now. The generators it set are put back when it ends.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import optree
import torch

from .. import _outside as ox
from .. import _torch_internals as ti
from .._context import INTERNAL, internal
from .._dispatch import Recorder
from .._errors import RematError
from .._ops import (
    DETACH,
    RANGE_OPS,
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
    op_meta,
    profiler_op,
    storage_key,
    tensor_leaves,
    traits,
)
from .._outside_writes import outside_args
from .._torch_internals import TorchDispatchMode
from .._wiring import Wiring, autocast_cast, cast_source, describe_difference, same_key, values_key
from .capture import PlannedCapture, StopRecompute
from .plans import (
    ALIASING,
    RUN,
    TO_COPY,
    NeedsGraph,
    Values,
    cast_agrees,
    is_placeholder,
    off_the_plan,
    past_aliases,
    reads_placeholder,
    skip_tag,
    version_of,
    written_after_saved,
)

__all__ = ["Replayer", "Replay", "ValueReplay", "replayed"]

class Replay(TorchDispatchMode):
    """A planned call's recompute: the planned ops' held outputs handed back, dead ops skipped, every other op run.

    A dead op hands back NaN placeholders, as on the full engine (NOTE [dead ops]). The plan's liveness comes
    from the recorded call, so it is checked: what an op computes from a placeholder is one too (a view that
    always runs), and a placeholder captured as a saved tensor, written or drawn on, or read as a number
    (``.item()``) stops the recompute (``DeadRead``), which runs again without skipping anything.
    """

    def __init__(self, frame: Any, skip_dead: bool) -> None:
        super().__init__()
        self.frame = frame
        self.ops: tuple[Any, ...] = frame.plan.ops or ()
        self.calls = frame.plan.calls
        self.held = frame.held
        self.dead = frame.plan.dead if skip_dead else {}
        self.placeholders = frame.placeholders
        self.skip_names = frame.plan.skip_names
        self.thread = threading.get_ident()
        self.limit = frame.limit
        self.i = 0
        self.keys = frame.keys
        self.wiring = Wiring(frame.known)  # NOTE [same reads]
        self.casts = frame.plan.casts
        self.aliases = frame.plan.aliases
        self.identity = frame.plan.identity  # NOTE [hooks' aliases]: matched only as such, either way
        self.run_to = -1  # NOTE [written after dropped]: the last op to run, if the capture does not stop it
        self.capture: PlannedCapture | None = None

    skip_name = skip_tag  # (the recompute lets the forward pass's tags go: each saved nothing)
    no_grad = False  # (the recompute that builds the graph)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        i = self.i
        if (i < self.limit and self.ops[i] is func and not INTERNAL.get()
                and (func is not TO_COPY or cast_agrees(self.casts, self.wiring, i, args, kwargs))
                and (func not in ALIASING or (i in self.identity) is identity_alias(func, args, kwargs))):
            if i > self.run_to >= 0 and self.capture is not None and self.capture.n >= self.capture.stop_after:
                raise StopRecompute  # NOTE [written after dropped]: every dropped tensor made, the last write run
            self.i = i + 1
            out = self._planned(i, func, args, kwargs)
            self._note(i, out, args)
            return out
        if func in RANGE_OPS:
            return profiler_op(func, args, kwargs or {})  # NOTE [FSDP's hooks] in _dispatch.py
        if not INTERNAL.get():
            out = off_the_plan(self, i, func, types, args, kwargs, self.frame.cached_casts)
            if out is not RUN:
                return out
        if not (INTERNAL.get() or ignored(func)):
            self.i = i + 1
            if i < self.limit:
                raise RematError(
                    f"remat: the recompute of {self.frame.fn_name} diverged from its forward pass: op #{i} was "
                    f"{self.ops[i]} in the forward pass but {func} now; the function must do the same work every "
                    "time it is called (no data-dependent branches or changing global state)."
                )
            if self.run_to >= 0 and self.capture is not None and self.capture.n >= self.capture.stop_after:
                # NOTE [written after dropped]: past the plan a call followed (it left it), with every dropped
                # tensor made and the plan's last write run: no op past the plan runs unchecked in the recompute
                raise StopRecompute
        if self.placeholders and reads_placeholder(self.placeholders, args, kwargs):
            return self._run_tainted(func, args, kwargs)
        return func(*args, **kwargs) if kwargs else func(*args)

    def _planned(self, i: int, func: Any, args: Any, kwargs: Any) -> Any:
        """The plan's op ``i``, checked to read what it read in the forward pass (NOTE [same reads]; no key: a tag the
        forward pass let go, NOTE [skipped tags], an alias, the same value either way), then its held outputs handed
        back, a dead op's placeholders, or run."""
        then = self.keys[i]
        if then is not None and i not in self.identity:  # (an identity alias: its output takes its argument's token)
            now = self.wiring.key(args, kwargs)
            if now != then and not same_key(now, then):
                if self.no_grad:
                    # (under no_grad: a value may depend on grad mode, torch.is_grad_enabled(); the recompute that
                    # builds the graph, under grad mode as the forward pass ran, checks again and raises if it still
                    # differs: NOTE [value recompute])
                    raise NeedsGraph
                raise self.frame.read_other(i, func, now, then)
        out: Any = RUN
        if i in self.held:
            out = replayed(self.frame, i)
        if out is RUN:
            d = self.dead.get(i)
            if d is not None:
                out = self._taint(d.placeholders())
            elif self.placeholders and reads_placeholder(self.placeholders, args, kwargs):
                out = self._run_tainted(func, args, kwargs)
            else:
                call = self.calls[i]
                out = call(*args, **kwargs) if kwargs else call(*args)
        return out

    def _note(self, i: int, out: Any, args: Any) -> None:
        """NOTE [same reads]: op ``i``'s outputs are its own in this pass (autocast's cast of a leaf: the leaf's)."""
        if i in self.casts:
            self.wiring.note_cast(out, args[0])  # NOTE [autocast's cache]
        elif i in self.aliases:
            self.wiring.note_alias(out, args[0])  # NOTE [hooks' aliases]
        else:
            self.wiring.note(i, out)

    def _run_tainted(self, func: Any, args: Any, kwargs: Any) -> Any:
        """An op that must run reads a placeholder (a view of a dead op's output, say): its outputs are placeholders
        too; a write or a random draw on one is not followed, the recompute runs again."""
        if any(traits(func)):
            raise DeadRead
        out = func(*args, **kwargs) if kwargs else func(*args)
        if not isinstance(out, torch.Tensor) and any(
                x is not None and not isinstance(x, torch.Tensor) for x in optree.tree_leaves(out, none_is_leaf=True)):
            raise DeadRead  # a number read from a placeholder (.item()): Python code may branch on it
        return self._taint(out)

    def _taint(self, out: Any) -> Any:
        for t in optree.tree_leaves(out, none_is_leaf=True):
            if isinstance(t, torch.Tensor):
                self.placeholders[id(t)] = weakref.ref(t)
        return out


class ValueReplay(Replay):
    """NOTE [value recompute]: :class:`Replay` under no_grad, taking each dropped tensor as its op returns it, and
    stopping before the op after the one that saved the last of them."""

    no_grad = True

    def __init__(self, frame: Any, skip_dead: bool, values: Values, stop: int) -> None:
        super().__init__(frame, skip_dead)
        self.at_op = values.at_op  # op index -> (which of its tensors, dropped position)
        self.one = values.one  # op index -> the dropped position its only tensor is, where it returns one
        self.saved_at = values.saved_at  # ops run -> the dropped positions saved then
        self.stop = stop
        self.made: dict[int, torch.Tensor] = {}
        self.versions: dict[int, int] = {}  # position -> version when saved (NOTE [written after saved])
        self.pending: list[tuple[int, weakref.ref[torch.Tensor]]] = []
        self.drops = frame.drops
        # the plan's ops that this call followed, then one that is no op: the handler's index never passes the limit
        # (it stops there), so comparing with the padded entry stands for the bounds check
        self.ops = (*self.ops[:self.limit], None)

    def settle(self, n: int) -> None:
        """``n`` ops have run, and returned through autograd's layers too (an in-place op's version moves above
        this mode, after the op): hold what they made, and note the versions of the tensors saved at this point
        in the forward pass. Held weakly until now: torch's binding detaches a factory's output (``rand_like``)
        that Python holds when it returns, and the function would get another tensor than the one taken (an
        extra ``detach``, taken for the function's own if one comes next)."""
        made = self.made
        pending = self.pending
        if pending:
            for pos, ref in pending:
                t = ref()
                if t is None:
                    raise NeedsGraph  # died before its save (a tensor only an autograd.Function's ctx held)
                made[pos] = t
            pending.clear()
        saved = self.saved_at.get(n)
        if saved is not None:
            versions = self.versions
            for pos in saved:
                t = made.get(pos)
                if t is not None:
                    versions[pos] = t._version

    def skip_name(self) -> bool:
        i = self.i  # (as in Tap.skip_name)
        if i in self.aliases and i < self.limit:
            i = past_aliases(self.aliases, self.limit, i)
        if not (i < self.limit and i in self.skip_names and threading.get_ident() == self.thread
                and ti.no_levels_open()):
            return False
        for k in range(self.i, i):  # (the plan's aliases this pass skips, as in __torch_dispatch__)
            if k in self.at_op:
                raise NeedsGraph
            if self.pending or k in self.saved_at:
                self.settle(k)
            if k >= self.stop:
                raise StopRecompute
        if self.pending or i in self.saved_at:  # (as for an op, below)
            self.settle(i)
        if i >= self.stop:
            raise StopRecompute
        self.i = i + 1
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        i = self.i
        if self.ops[i] is func and not INTERNAL.get() and (
                func is not TO_COPY or cast_agrees(self.casts, self.wiring, i, args, kwargs)) and (
                func not in ALIASING or (i in self.identity) is identity_alias(func, args, kwargs)):  # (padded)
            if self.pending or i in self.saved_at:  # (most ops neither return nor follow a save)
                self.settle(i)
            if i >= self.stop:
                raise StopRecompute  # the op that saved the last dropped tensor has run: stop before the next one
            self.i = i + 1
            out = self._planned(i, func, args, kwargs)
            pos = self.one.get(i)
            if pos is not None and type(out) is torch.Tensor:
                # (the common case, _take_one inlined: the op returned one tensor, dropped at ``pos``)
                meta = self.drops.get(pos)
                if meta is not None:
                    ph = self.placeholders
                    if ph and id(out) in ph and is_placeholder(ph, out):
                        raise DeadRead
                    if out.shape != meta[0] or out.dtype != meta[1]:
                        raise NeedsGraph
                    self.pending.append((pos, weakref.ref(out)))
            else:
                want = self.at_op.get(i)
                if want is not None:
                    self._take(out, want)
            self._note(i, out, args)
            return out
        if INTERNAL.get() or ignored(func):
            if func in RANGE_OPS:
                return profiler_op(func, args, kwargs or {})  # NOTE [FSDP's hooks] in _dispatch.py
            if self.placeholders and reads_placeholder(self.placeholders, args, kwargs):
                # (an op not of the call, a hook's alias of a placeholder, say: a placeholder too, as in Replay)
                return self._run_tainted(func, args, kwargs)
            return func(*args, **kwargs) if kwargs else func(*args)
        leaf = autocast_cast(func, args, kwargs)
        if leaf is not None:  # NOTE [autocast's cache]: a cast the forward pass read from autocast's cache
            out = self.frame.cached_casts.get((id(leaf), kwargs["dtype"]))
            if out is None:
                out = func(*args, **kwargs)
            self.wiring.note_cast(out, leaf)
            return out
        if identity_alias(func, args, kwargs):  # NOTE [hooks' aliases] in _dispatch.py: not the plan's: not counted
            out = func(*args, **kwargs)
            self.wiring.note_alias(out, args[0])
            return out
        j = i
        while j < self.limit and j in self.aliases:
            j += 1  # (the forward pass's identity aliases this pass does not make: a hook's, under grad mode only)
        if j > i and self.ops[j] is func:
            if any(k in self.at_op for k in range(i, j)):
                raise NeedsGraph  # (one the dropped tensors are taken from: the recompute that saves finds them)
            for k in range(i, j):
                if self.pending or k in self.saved_at:
                    self.settle(k)
                if k >= self.stop:
                    raise StopRecompute
            self.i = j
            return self.__torch_dispatch__(func, types, args, kwargs)
        if i >= self.stop:
            self.settle(i)
            raise StopRecompute  # (stop <= limit: the ops past the plan come after the last save)
        raise NeedsGraph  # not the forward pass's op without a graph: maybe with one (a fused path taken)

    def _dropped(self, t: torch.Tensor, pos: int) -> bool:
        """Whether ``t`` is the tensor this call dropped at save position ``pos`` (False: held as an input of the
        call), checked as the recompute that saves checks it."""
        meta = self.drops.get(pos)
        if meta is None:
            return False
        ph = self.placeholders
        if ph and id(t) in ph and is_placeholder(ph, t):
            raise DeadRead
        if t.shape != meta[0] or t.dtype != meta[1]:
            raise NeedsGraph
        return True

    def _take_one(self, t: torch.Tensor, pos: int) -> None:
        """An op returned one tensor, dropped at ``pos``: held weakly until the op has returned (``settle``)."""
        if self._dropped(t, pos):
            self.pending.append((pos, weakref.ref(t)))

    def _take(self, out: Any, want: list[tuple[int, int]]) -> None:
        """The dropped tensors op ``i`` returned. One tensor is held weakly until the op has returned (``settle``);
        several, strongly now: the op's caller may keep only some (``layer_norm`` drops the mean and rstd its node
        saved), and no factory returns several."""
        if isinstance(out, torch.Tensor):
            for _, pos in want:
                self._take_one(out, pos)
            return
        outs = tensor_leaves(out)
        for k, pos in want:
            if self._dropped(outs[k], pos):
                self.made[pos] = outs[k]


def replayed(self: Any, i: int) -> Any:
    """Op ``i``'s held outputs, for the recompute (NOTE [planned calls])."""
    h = self.plan.hold.get(i)
    if h is None:  # a dead op's kept output (_hand_back)
        kept = self.held[i][0]()
        if kept is None:
            return RUN  # its node was freed: a placeholder
        if kept.t._version != kept.version:
            raise written_after_saved(self.fn_name, kept.t, kept.version)
        return ti.detach_below_modes(kept.t)
    origins = self.origins.get(i) or self.held[i]
    v0s = self.held_versions.get(i, ())
    if self.forwarding and i not in self.held_versions:
        # a backward pass inside the forward pass, before its end has checked what it holds: an output written
        # in place since the op returned it is not the op's value any more (plain autograd allows the write
        # where no node saved the output): the op runs again, as the end of the forward pass would decide
        held_at = self.versions_at_hold.get(i, ())
        if any(v is not None and v != v0 for v, v0 in zip((version_of(o) for o in origins), held_at)):
            return RUN
    if h.single and h.offload is None:  # (one tensor held, the common case: on the hot path)
        v, orig, v0 = self.held[i][0], origins[0], v0s[0] if v0s else None
        if type(v) is torch.Tensor and type(orig) is torch.Tensor:  # (held strongly: _held_value inline)
            if v0 is not None and orig._version != v0:
                raise self._written(i, v0, orig._version)
            val = ti.detach_below_modes(v)
        else:
            val = _held_value(self, i, v, v0, orig)
        if i in self.copied:
            del self.held[i]  # a copy the recompute writes: handed over once, a later recompute runs the op
        return val
    vals = []
    with internal():
        for v, v0, orig in zip(self.held[i], v0s, origins):
            val = _held_value(self, i, v, v0, orig)
            if val is RUN:
                return RUN
            vals.append(val)
    return vals[0] if h.single else h.rebuild(vals)

def _held_value(self: Any, i: int, v: Any, v0: int | None, orig: Any) -> Any:
    """One held output of op ``i`` for the recompute: checked unwritten since the forward pass; ``RUN`` if
    it was held weakly and died; fetched if offloaded."""
    if isinstance(v, weakref.ref):
        v = v()
        if v is None:
            return RUN  # died since the forward pass: run the op again
    now = version_of(orig)
    if v0 is not None and now is not None and now != v0:
        raise self._written(i, v0, now)
    # (no mode sees remat's own detach)
    return ti.detach_below_modes(v) if isinstance(v, torch.Tensor) else self.engine.fetch(v)


class Replayer(TorchDispatchMode):
    """Recompute: the same ops in the same order; stashed outputs handed back, not recomputed."""

    def __init__(self, recorder: Recorder, unused: set[int] = frozenset(),  # type: ignore[assignment]
                 skip_dead: bool = True) -> None:
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
        # NOTE [autocast's cache] in _wiring.py: id -> (leaf, weakref) of the casts the recompute ran past the ops
        self.casts: dict[int, tuple[torch.Tensor, weakref.ref[torch.Tensor]]] = {}
        self.wiring = None if recorder.wiring is None else Wiring(recorder.wiring.known, loose=True)
        self.generators: dict[int, tuple[torch.Generator, torch.Tensor]] = {}  # set by the recompute: their states

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
        # NOTE [autocast's cache] in _wiring.py: a cast of a leaf matches the forward pass's cast of that leaf only
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
            out = func(*args, **kwargs)
            if wiring is not None:
                wiring.note_alias(out, args[0])
            if self.tainted and is_tainted(self.tainted, args[0]):
                self._taint([out])
            return out
        if wiring is None or rec.wkey is None:
            return self._run(i, rec, func, args, kwargs)
        now = wiring.key(args, kwargs)  # NOTE [same reads] in _wiring.py: the values and which tensor each is
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
        return out

    def _run(self, i: int, rec: OpRecord, func: Any, args: Any, kwargs: Any) -> Any:
        """The recorded op ``i`` in the recompute: a placeholder, its stashed outputs, or run (checked)."""
        if rec.skippable and i in self.unused:
            with internal():  # NOTE [unused outputs]
                dead = [dead_value(m) for m in rec.out_meta]
                self.unused_keys.update(storage_key(t) for t in dead)
                return rec.rebuild(dead)
        if rec.stash is not None and not rec.random and (self.skip_dead or all(
                x is not None for x in rec.stash)):
            return self._replay(rec, func, args, kwargs)
        if not rec.live and rec.skippable and self.skip_dead:
            with internal():  # dead: nothing needed reads it (NOTE [dead ops])
                return rec.rebuild(self._taint([dead_value(m) for m in rec.out_meta]))
        tainted = bool(self.tainted) and any(is_tainted(self.tainted, t) for t in arg_tensors(args, kwargs))
        if tainted and rec.live:
            raise DeadRead
        if rec.scalars and rec.wkey is None:  # NOTE [same reads] in _wiring.py: the values, where no key was noted
            values = values_key(args, kwargs)
            if values != rec.scalars and not same_key(values, rec.scalars):
                raise self.diverged(
                    f"op #{i} {func} read other values than in the forward pass: "
                    f"{describe_difference(values, list(rec.scalars), lambda j: None)} (a Python value computed from state "
                    "that changed, such as a step counter, a module's attribute or a global)"
                )
        if rec.outside is not None or rec.subst is not None:
            args, kwargs = outside_args(self, i, rec, args, kwargs)
        if rec.random and self.unused_keys:
            args, kwargs = self._no_placeholders(args, kwargs)
        if rec.rng is not None:
            # NOTE [random ops]: the state the forward pass drew from, whatever the function set since (a seed
            # set inside it, a tracker's fork); every generator is put back when the recompute ends
            gen, state = rec.rng
            with internal():
                if id(gen) not in self.generators:
                    self.generators[id(gen)] = (gen, gen.get_state())
                gen.set_state(state)
        if rec.lifted is not None:
            with internal():
                now = ox.fingerprint(arg_tensors(args, kwargs)[0])
            if now != rec.lifted:
                raise self.diverged(
                    f"op #{i} {func} lifted a tensor built from Python data (torch.tensor, torch.from_numpy) "
                    f"of shape {list(now[0])} whose value differs from the forward pass's (data read from "
                    "state that changed in between)"
                )
        out = func(*args, **kwargs)
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
        (a NaN probability is an error): zeros of the same shape stand in; its outputs are placeholders too."""
        with internal():
            ins = arg_tensors(args, kwargs)
            new = {j: torch.zeros_like(t) for j, t in enumerate(ins) if storage_key(t) in self.unused_keys}
            if not new:
                return args, kwargs
            self.unused_keys.update(storage_key(t) for t in new.values())
            return ox.replace_tensors(args, kwargs, new)

    def _replay(self, rec: OpRecord, func: Any, args: Any, kwargs: Any) -> Any:
        assert rec.stash is not None
        vals: list[Any] = []
        versions = rec.versions or [None] * len(rec.stash)
        with internal():
            for ref, meta, v0 in zip(rec.stash, rec.out_meta, versions):
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
                    orig = rec.refs[len(vals)]() if v0 is not None else None
                    if orig is not None and orig._version != v0:
                        raise RematError(
                            f"remat: the output of {rec.describe()} that {self.rec.fn_name} kept for its "
                            f"recompute was modified in place after the forward pass (version {v0} -> "
                            f"{orig._version}), e.g. a result of the function changed before the backward pass. "
                            "Clone a result before modifying it, or run the backward pass first."
                        )
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
