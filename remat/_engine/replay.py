"""The planned recompute's dispatch modes: a planned call's recompute runs its function again under one of them,
which hands back what the plan holds, skips what it may, and checks every op it runs against what the forward
pass read (NOTE [same reads] in ``_wiring.py``; NOTE [value recompute] in ``planned.py``)."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import optree
import torch

from .. import _torch_internals as ti
from .._context import INTERNAL, internal, naming
from .._dispatch import (
    RANGE_OPS,
    DeadRead,
    identity_alias,
    ignored,
    profiler_op,
    tensor_leaves,
    traits,
)
from .._errors import RematError
from .._packed import Made
from .._torch_internals import TorchDispatchMode, saved_tensors_hooks
from .._wiring import Wiring, autocast_cast, same_key
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
from .recompute import PlannedCapture, StopRecompute, identity

__all__ = ["Replay", "ValueReplay", "planned_recompute", "replayed"]

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


def planned_recompute(self: Any) -> Made:
    """A planned call's recompute (``FastFrame._recompute``): the dropped tensors, made again by following the plan
    (NOTE [planned calls]), or by value (NOTE [value recompute]); the checks are the full engine's (NOTE [one set
    of checks] in ``recompute.py``)."""
    self.recomputes += 1
    if self.wrote_dropped:
        raise RematError(
            f"remat: {self.fn_name} wrote in place into a tensor it had saved for the backward pass, through an "
            "alias with a version counter of its own (.data, or detach()), after an op its signature's first "
            "call did not run (a data-dependent branch): the recompute, which follows that call, cannot replay "
            "the write. The signature runs on the full engine from the next call on (it replays every op); "
            "or write into a clone (NOTE [written after dropped] in planned.py)."
        )
    # (a backward pass inside the forward pass: an input written so far would be written again by the
    # recompute, into the caller's tensor, and read written: the end of the forward pass's error, raised first)
    self._check_versions(after_forward=self.forwarding)
    # (no accumulation check, as the full engine's: an inner backward pass is ops the forward pass did not run,
    # which the replay refuses: NOTE [same reads])
    try:
        return _run_recompute(self, skip_dead=bool(self.plan.dead))
    except DeadRead:
        self.refuse()  # the recorded call's liveness does not hold for this one
        return _run_recompute(self, skip_dead=False)

def _run_recompute(self: Any, skip_dead: bool) -> Made:
    values = self.plan.values
    if (values is not None and not torch.is_grad_enabled() and not self.forwarding and not self.diverged
            and self.values_ok and self.drops.keys() <= values.stop.keys()):
        try:
            return _value_recompute(self, values, skip_dead)
        except NeedsGraph:
            self.plan.values = None  # (the signature's later calls recompute as below from the start)
    self.placeholders = {}
    # (stops once the last dropped tensor is saved again; inside the forward pass that is before where the
    # forward pass has got, and before any op past the plan, whose random draws the call kept no state for)
    capture = PlannedCapture(self.drops, self.last_drop + 1, self.fn_name,
                       detach=not torch.is_grad_enabled(), placeholders=self.placeholders,
                       mode=self.plan.ops is not None)
    run_to = _last_write(self)  # NOTE [written after dropped]: the replay stops after it, not the capture
    capture.hold_stop = run_to >= 0
    with ti.saved_tensors_hooks_enabled(), torch.enable_grad(), self.state.restored(self.state.tensors), \
            self.ambient.restored(), saved_tensors_hooks(capture.pack, identity):
        try:
            if self.plan.ops is None:
                self.run(self.flat)
            else:
                replay = Replay(self, skip_dead)
                replay.run_to, replay.capture = run_to, capture
                with naming(replay), replay:
                    self.run(self.flat)
        except StopRecompute:
            pass
    self.placeholders = {}
    if capture.n < capture.stop_after:
        raise RematError(
            f"remat: the recompute of {self.fn_name} saved {capture.n} tensors for the backward pass where "
            f"its forward pass saved {capture.stop_after} or more; the function must do the same work every "
            "time it is called (no data-dependent branches or changing global state)."
        )
    return capture.finish()

def _last_write(self: Any) -> int:
    """NOTE [written after dropped]: the index of the last op of the plan this call followed that writes in
    place (-1: none), which the recompute runs; inside the forward pass, none: it stops where the forward pass
    has got (an op it has not run has no key to check)."""
    if self.forwarding or not self.plan.writes:
        return -1
    return max((i for i in self.plan.writes if i < self.limit), default=-1)

def _value_recompute(self: Any, values: Values, skip_dead: bool) -> Made:
    """NOTE [value recompute]: the recompute under ``torch.no_grad()``, the dropped tensors taken as the ops
    return them. It stops once the op that saved the last of them has run."""
    self.placeholders = {}
    # (NOTE [written after dropped]: through the plan's last write, which may write a dropped tensor's storage)
    mode = ValueReplay(self, skip_dead, values, max(values.stop[self.last_drop], _last_write(self) + 1))
    try:
        with torch.no_grad(), self.state.restored(self.state.tensors), self.ambient.restored(), naming(mode), mode:
            out = None
            try:
                out = self.run(self.flat)
            except StopRecompute:
                pass
            mode.settle(mode.i)  # (the function returned after the op that saved the last: out holds it)
            del out
    except (NeedsGraph, DeadRead, RematError):
        raise
    except Exception as e:
        # what the function does only with grad mode on (h.register_hook, retain_grad on an intermediate):
        # the recompute that builds the graph runs it, and raises if the error is the function's own
        raise NeedsGraph from e
    finally:
        self.placeholders = {}
    made = mode.made
    if mode.i < mode.stop or len(made) != len(self.drops) or len(mode.versions) != len(made):
        raise NeedsGraph  # ran out of ops first, or a tensor died before its save: the recompute that saves
    return Made(made, mode.versions, plain=True)

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
