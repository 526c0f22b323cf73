"""Saved-tensor hooks and the recompute: what one call of a remat'd function keeps, and how it gets the rest back.

A :class:`Frame` is one call. During its forward pass it installs
``saved_tensors_hooks``: every tensor autograd saves is *kept* (an input or
parameter held by reference, or the output of an op the policy saves),
*offloaded* (copied to host memory by the offload engine) or *dropped*. The
first time the backward pass unpacks a dropped tensor of a given functorch
level, the frame recomputes: it rebuilds the forward's transform stack
(NOTE [per-level replay] in ``_functorch.py``), restores the random-number and
autocast state, re-runs the function under capture hooks and the
:class:`~remat._dispatch.Replayer`, and keeps what that level saved until the
backward pass has read it all (or the backward pass ends).

NOTE [nested remat]
    A remat call inside another remat call's forward pass gets a frame of its own
    with its own policy. Without functorch levels (a *routed* frame) the outer
    policy governs what survives the forward pass and the inner policy what is kept
    during the outer recompute, as in JAX: the inner call's inputs and the tensors
    its own policy keeps are not held by the inner frame but saved through the
    outer frame (``parent.pack``), which drops them if the outer policy recomputes
    the op that made them (they come back through the outer recompute) or keeps
    them. So an outer save-nothing holds only its inputs between forward and
    backward, whatever the inner policy (two-level checkpointing). For the
    positions to line up, each routed frame records (``_Nested``) which of its
    save positions went to the parent, and the routed calls made inside it; the
    outer recompute re-runs each inner call (``call_nested_replay``) under a
    ``_PassThrough`` that saves exactly those positions through the recompute's
    capture again, in forward order (recursively for deeper nesting). Not routed:
    the inner's stash of outputs to replay (``dots_saveable``'s matmul outputs,
    NOTE [stash liveness]) and offloaded tensors, which the inner frame still
    holds itself; a checkpoint_name that drops a value after it was routed leaves
    it to the parent's decision. Under torch.func levels the inner frame holds its own saved
    tensors (its levels differ from the outer's and its recompute rebuilds them).

NOTE [offload under torch.func]
    An offloaded tensor comes back as a plain tensor, but under torch.func the
    backward pass needs it wrapped for the level that saved it, which may be
    dead by then. So under transforms an offloaded output is stashed (offloaded)
    at the dispatch level, the saved wrapper is dropped, and the recompute rebuilds
    the wrapper by replaying the function with the offloaded outputs copied back
    instead of computed: no FLOPs of offloaded ops are recomputed. When an outer recompute re-runs an inner call, the inner call only
    re-saves its inputs through the recompute's capture hooks (so positions line
    up with the forward pass) and runs under pass-through hooks: its own saved
    tensors come from its own frame, recomputed when the backward pass reaches it.

NOTE [kept under higher-order grad]
    Under ``grad(grad(f))`` (or ``jacrev(jacrev)``) the tensors a level saves carry
    the history of the grad levels below it, which the outer backward pass walks.
    A kept op output carries the forward's history, a recomputed one the
    recompute's: mixing both at one level makes the outer backward pass walk the
    shared part of the graph twice (``dots_saveable`` ran extra matmuls) and
    recompute the lower level too. So at a level that recomputes anyway and has a
    grad level below it, kept op outputs are replayed from the stash instead (no
    FLOPs, same bytes held): the whole level's saves then come from the recompute.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from . import _torch_internals as ti
from ._ambient import AmbientState
from ._dispatch import Recorder, Replayer, internal, storage_key
from ._errors import RematError
from ._functorch import (
    Decomposed,
    Level,
    below_all_levels,
    check_lower_levels,
    decompose,
    record_stack,
    replay,
    saving_height,
)
from ._inspect import INSPECTOR
from ._policies import Offloadable, Recompute
from ._state import Snapshot

__all__ = ["Frame", "active_context", "call_nested_replay", "holdable"]

_KEEP, _OFFLOAD, _DROP, _INPUT = "kept", "offloaded", "recomputed", "input"
_ROUTED = "routed"  # a routed frame's kept tensor, saved through the parent frame (NOTE [nested remat])

# The innermost remat context of this thread: a Frame in its forward pass, or a
# recompute (_Capture / _PassThrough). Nested calls and checkpoint_name look here.
_ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("remat_active", default=None)


def active_context() -> Any:
    return _ACTIVE.get()


@contextlib.contextmanager
def _activate(ctx: Any) -> Iterator[None]:
    tok = _ACTIVE.set(ctx)
    try:
        yield
    finally:
        _ACTIVE.reset(tok)


class Packed:
    """What autograd holds for one saved tensor of a remat call."""

    __slots__ = ("frame", "kind", "height", "pos", "payload", "version", "meta", "record")

    def __init__(self, frame: Frame, kind: str, height: int, pos: int, payload: Any, version: int,
                 meta: tuple[Any, ...], record: Any) -> None:
        self.frame = frame
        self.kind = kind
        self.height = height
        self.pos = pos
        self.payload = payload
        self.version = version
        self.meta = meta
        self.record = record  # the OpRecord that produced it (None: an input), for inspection


class _Nested:
    """What the parent's recompute must know to re-run one routed call (NOTE [nested remat]).

    ``routed``: the call's save positions handed to the parent (its kept tensors);
    ``children``: the same for the routed calls made inside it, in call order.
    """

    __slots__ = ("routed", "children")

    def __init__(self) -> None:
        self.routed: set[int] = set()
        self.children: list[_Nested] = []


class Frame:
    """One call of a remat'd function."""

    def __init__(self, run: Callable[[list[Any]], Any], flat: list[Any], fn_name: str,
                 policy: Callable[..., Any], preserve_rng: bool, engine: Any, state: Snapshot) -> None:
        self.run = run
        self.state = state  # NOTE [state is an input]
        self.fn_name = fn_name
        self.levels: list[Level] = record_stack(fn_name)
        h = len(self.levels)
        parent = _ACTIVE.get()
        # Two-level checkpointing (NOTE [nested remat]): inputs saved through the parent.
        self.parent: Frame | None = parent if parent is not None and h == 0 else None
        self.routed = self.parent is not None
        self.nested = _Nested()  # the routed calls made in this forward pass, and this call's own routing
        if self.parent is not None:
            self.parent.nested.children.append(self.nested)
        self.engine = engine
        # a weak reference: a bound method would make frame -> recorder -> frame a cycle that
        # holds the stashed activations until the garbage collector runs
        wself = weakref.ref(self)
        self.recorder = Recorder(policy, fn_name, lambda t, d: wself()._offload(t, d))  # type: ignore[union-attr]
        self.recorder.on_demote = lambda key: wself()._demote(key)  # type: ignore[union-attr]
        self.recorder.describe_tensor = state.label_of
        self._kept: dict[int, list[tuple[Packed, int]]] = {}  # storage key -> kept packs made here, vid
        with internal():
            tensors = [a for a in flat if isinstance(a, torch.Tensor)]
            self.ambient = AmbientState.capture(tensors, preserve_rng)
            self.decs: list[Decomposed | None] = [
                decompose(a, self.levels, h) if isinstance(a, torch.Tensor) and not self.routed else None
                for a in flat
            ]
            self.versions = [ti.unwrap_all(a)._version if isinstance(a, torch.Tensor) else None for a in flat]
            # the state's tensors are re-wrapped for the recompute's levels like the inputs
            self.state_decs: list[Decomposed | None] = [
                decompose(t, self.levels, h) if h and ti.is_wrapped(t) else None for t in state.tensors
            ]
        self.flat: list[Any] = list(flat)  # for a routed frame: parent handles after forward()
        self.input_ids: dict[int, int] = {}  # id of an input tensor -> its slot, while routed forward runs
        self.counts: dict[int, int] = {}  # saving height -> number of tensors saved there
        self.drops: dict[int, dict[int, tuple[Any, ...]]] = {}  # height -> dropped position -> (shape, dtype)
        self.cache: dict[int, dict[int, torch.Tensor]] = {}
        self._lock = threading.RLock()  # re-entrant: a recompute may unpack the parent, or itself
        self.used: dict[int, set[int]] = {}
        self.recomputes = 0
        self.needed_vids: set[int] = set()
        self._in_cache: list[Any] | None = None  # routed frame: inputs fetched from the parent, this backward
        self._served = 0  # routed frame: unpacks served in this backward
        self._mixed: list[tuple[Packed, int]] = []  # NOTE [kept under higher-order grad]: (packed, vid)
        self._tangents_todo: list[tuple[torch.Tensor, int]] = []  # dropped under a jvp level (_promote_tangents)
        self._offloaded = False  # this call handed a tensor to the offload engine

    # ---- forward -------------------------------------------------------------
    def forward(self) -> Any:
        flat = self.flat
        if self.routed:
            assert self.parent is not None
            with internal():
                self.flat = [self.parent.pack(a) if isinstance(a, torch.Tensor) else a for a in flat]
            self.input_ids = {id(a): i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)}
            # every tensor slot (a tensor passed twice has one id but two slots), and whether the
            # forward's input required grad: the parent hands inputs back detached
            self._routed_slots = {i: a.requires_grad for i, a in enumerate(flat) if isinstance(a, torch.Tensor)}
        self._forward_inputs = flat
        with internal():
            self.recorder.input_keys = {storage_key(ti.unwrap_all(a)) for a in flat if isinstance(a, torch.Tensor)}
        try:
            with contextlib.ExitStack() as es:
                es.enter_context(ti.saved_tensors_hooks_enabled())
                es.enter_context(saved_tensors_hooks(self.pack, self.unpack))
                es.enter_context(self.recorder)
                es.enter_context(_activate(self))
                out = self.run(flat)
            if self.levels and self.recorder.offloaded_written:
                raise RematError(
                    f"remat: {self.fn_name} writes in place into a tensor that its offload policy "
                    "offloads, under torch.func; remat does not support that yet (its replay could "
                    "give wrong gradients). Make the write out of place (h = h * 2 instead of "
                    "h.mul_(2)), or use a save or recompute policy under torch.func."
                )
            with internal():
                self._check_forward_mutation(flat)
                self._replay_kept_above_grad()
                self._promote_tangents()
                with below_all_levels():  # promoting detaches (and may offload) plain tensors
                    if any(lv.kind == "jvp" for lv in self.levels) or (self.levels and self.recorder.mutated_inplace):
                        # under jvp the recompute must also produce tangents, which the saved
                        # primals do not name; under torch.func, writes through the batching rules'
                        # views are not all seen as values: no liveness analysis (NOTE [stash liveness])
                        pass
                    else:
                        self.recorder.prune(self.needed_vids)
                    self.recorder.seal()  # its copies must be plain tensors
                if self._offloaded:
                    self.engine.end_of_call()  # NOTE [stream-ordered reuse] in _offload.py
        finally:
            self.needed_vids = set()
            self._kept = {}
            self._mixed = []
            self._tangents_todo = []
            self.input_ids = {}
            del self._forward_inputs
        return out

    def _check_forward_mutation(self, flat: list[Any]) -> None:
        now = [ti.unwrap_all(a)._version if isinstance(a, torch.Tensor) else None for a in flat]
        if self.drops:
            for i, (a, v0, v1) in enumerate(zip(flat, self.versions, now)):
                if v0 != v1:
                    raise RematError(
                        f"remat: {self.fn_name} modified its input #{i} ({_shape(a)}) in place during "
                        "its forward pass; the recompute would read the modified value and give wrong "
                        "gradients. Clone the input inside the function before modifying it "
                        "(x = x.clone()), or do the in-place update outside the remat'd function."
                    )
        self.versions = now

    # ---- hooks ---------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Packed:
        with internal():
            s = saving_height(self.levels)
            pos = self.counts.get(s, 0)
            self.counts[s] = pos + 1
            phys = ti.unwrap_all(t)
            meta = (tuple(t.shape), t.dtype)
            rec = self.recorder.producer(phys)
            decision = None if rec is None else rec.decision
            slot = self.input_ids.get(id(t))
            if slot is not None and self._forward_inputs[slot] is t:
                p = Packed(self, _INPUT, s, pos, slot, phys._version, meta, None)
            elif decision is None and self.routed and self.recorder.made_here_decision(phys) in (None, Recompute):
                # a view of an input, or a tensor of the enclosing call: recompute, do not pin it
                # (a view the policy saves is kept below: it pins what the policy asked for)
                p = self._drop(s, pos, phys, meta, rec)
            elif decision is Recompute:
                p = self._drop(s, pos, phys, meta, rec)
            elif isinstance(decision, Offloadable) and self.engine.applies(phys, decision):
                if ti.is_wrapped(t):
                    # under torch.func the recompute replays the offloaded output (NOTE [offload under torch.func])
                    # promote's detach and copy must make plain tensors: in a pack hook the saving
                    # level is still active and would wrap them (the replay would then wrap twice)
                    assert rec is not None  # an Offloadable decision comes from a recorded op
                    with below_all_levels(), ti.plain_ops_in_pack_hook():
                        self.recorder.promote(rec)
                        # the saved tensor may be a view made by a later op (transpose, reshape) whose
                        # output is stashed weakly and dies with the wrapper: promote that op too, or
                        # the replay finds it dead (NaN). Both copies share one host copy (_offload.py).
                        self.recorder._promote(self.recorder.vid(phys))
                    p = self._drop(s, pos, phys, meta, rec)
                else:
                    # t itself (the engine detaches): the engine keeps a weakref to catch in-place writes
                    p = Packed(self, _OFFLOAD, s, pos, self._offload(t, decision), phys._version, meta, rec)
            elif self.routed:
                # kept by this call's policy: the parent's policy decides whether it survives the
                # forward pass (NOTE [nested remat]); the parent's recompute re-saves this position
                assert self.parent is not None
                self.nested.routed.add(pos)
                tok = INSPECTOR.set(None)  # listed below, in this call's scope, with the parent's decision
                try:
                    handle = self.parent.pack(t)
                finally:
                    INSPECTOR.reset(tok)
                p = Packed(self, _ROUTED, s, pos, handle, phys._version, meta, rec)
            else:  # an input or parameter held by reference, or a saved op output
                p = Packed(self, _KEEP, s, pos, holdable(t), phys._version, meta, rec)
                if rec is not None:
                    self._kept.setdefault(storage_key(phys), []).append((p, self.recorder.vid(phys)))
                if rec is not None and rec.stash is not None and any(lv.kind == "grad" for lv in self.levels[:s]):
                    self._mixed.append((p, self.recorder.vid(phys)))  # NOTE [kept under higher-order grad]
            if p.kind == _DROP and any(lv.kind == "jvp" for lv in self.levels[: max(s, 0)]):
                # its tangents are read after the forward pass (no op may run inside a pack hook)
                self._tangents_todo.append((t, s))
            insp = INSPECTOR.get()
            if insp is not None:  # remat.saved_residuals is listing what is saved (_inspect.py)
                final = p
                while final.kind == _ROUTED:  # what the enclosing calls decided for it
                    final = final.payload
                insp.on_save(t, final.kind, self)
            return p

    def _promote_tangents(self) -> None:
        """Under jvp levels below the saving level the recompute must also produce the dropped tensors'
        tangents (the outer jvp reads them): if the ops that made them are replayed, hold their outputs,
        or the replay finds them dead (NaN). Tangents of tangents too (nested jvp). Runs at the end of
        the forward pass (unpack_dual inside a pack hook trips a functorch assert), so until then the
        dropped tensors of such a call stay alive."""
        todo = [decompose(t, self.levels, s + 1) for t, s in self._tangents_todo]  # t lives at height s + 1
        self._tangents_todo = []
        while todo:
            dec = todo.pop()
            for info in dec.infos:
                if info is not None and info[0] == "jvp" and info[2] is not None:
                    tangent = info[2]
                    if isinstance(tangent.values[0], torch.Tensor):
                        with below_all_levels():  # detach must give a plain tensor (see pack)
                            self.recorder.promote_value(tangent.values[0])
                    todo.append(tangent)

    def _replay_kept_above_grad(self) -> None:
        """Kept op outputs of a recomputing level above a grad level: replay them (NOTE [kept under higher-order grad])."""
        for p, vid in self._mixed:
            rec = p.record
            if p.height not in self.drops:
                continue  # this level recomputes nothing: keep everything, as plain autograd would
            with below_all_levels():  # detach must give a plain tensor, not a wrapper of a live level
                self.recorder.promote(rec)
            if any(isinstance(r, weakref.ref) for r in rec.stash):
                continue  # an output of the op is gone, it could not be replayed: keep this one
            self.drops[p.height][p.pos] = p.meta
            self.needed_vids.add(vid)
            p.kind, p.payload = _DROP, None

    def _offload(self, t: torch.Tensor, decision: Offloadable) -> Any:
        """What the recorder stashes for an output to offload (``t``: the op's own output)."""
        if not self.engine.applies(t, decision):
            return t.detach()  # kept; detached, or it would hold its own graph (see holdable)
        self._offloaded = True
        with ti.no_dispatch_modes():  # remat's copy, not an op of the user's modes or of a tracer
            return self.engine.offload(t, decision.dst, group=self)

    def _demote(self, key: int) -> None:
        """A checkpoint_name the policy drops names a value already saved as kept: drop it now."""
        for p, vid in self._kept.pop(key, ()):
            p.kind, p.payload = _DROP, None
            self.drops.setdefault(p.height, {})[p.pos] = p.meta
            self.needed_vids.add(vid)

    def _drop(self, s: int, pos: int, phys: torch.Tensor, meta: tuple[Any, ...], rec: Any) -> Packed:
        self.drops.setdefault(s, {})[pos] = meta
        self.needed_vids.add(self.recorder.vid(phys))
        self.recorder.drop_value(phys)  # the recompute must make it again
        return Packed(self, _DROP, s, pos, None, 0, meta, rec)

    def unpack(self, p: Packed) -> torch.Tensor:
        # The autograd engine runs a graph spanning devices on one thread per device: two of them
        # may reach this call at once. One recompute per level, and consistent bookkeeping.
        with self._lock:
            return self._unpack_counted(p)

    def _unpack_counted(self, p: Packed) -> torch.Tensor:
        out = self._unpack(p)
        if self.routed:
            self._served += 1
            if self._served >= sum(self.counts.values()):
                # this call's backward has read everything: let go of the inputs fetched from the parent
                self._in_cache = None
                self._served = 0
        return out

    def _unpack(self, p: Packed) -> torch.Tensor:
        if p.kind == _KEEP:
            self._check_version(p, ti.unwrap_all(p.payload)._version)
            return p.payload  # type: ignore[no-any-return]
        if p.kind == _OFFLOAD:
            return self.engine.fetch(p.payload)  # type: ignore[no-any-return]
        if p.kind == _INPUT:
            return self._inputs()[p.payload]  # type: ignore[no-any-return]
        if p.kind == _ROUTED:
            assert self.parent is not None
            return self.parent.unpack(p.payload)
        s = p.height
        if s not in self.cache:
            self.cache[s] = self._recompute(s)
            self.used[s] = set()
            # free at the end of this backward pass even if it does not read everything
            ti.queue_backward_callback(self._release_later())
        out = self.cache[s][p.pos]
        used = self.used[s]
        used.add(p.pos)
        if len(used) == len(self.drops[s]):
            # clear, not just forget: the recompute graph these tensors hold must not outlive them
            self.cache.pop(s).clear()
            del self.used[s]
        return out

    def _release_later(self) -> Callable[[], None]:
        """A callback for the end of the backward pass that holds this frame weakly: a bound method
        would keep the frame, and its stash of saved outputs, alive until the whole backward pass
        ends instead of until the backward pass leaves this call (the peak then held every call's
        stash at once)."""
        wself = weakref.ref(self)

        def release() -> None:
            frame = wself()
            if frame is not None:
                frame._release_all()

        return release

    def _release_all(self) -> None:
        for captured in self.cache.values():
            captured.clear()
        self.cache.clear()
        self.used.clear()
        self._in_cache = None
        self._served = 0

    def _check_version(self, p: Packed, now: int) -> None:
        if now != p.version:
            raise RematError(
                f"remat: a tensor of shape {list(p.meta[0])} that {self.fn_name} saved for the backward "
                f"pass was modified in place after it was saved (version {p.version} -> {now}). "
                "Do not modify inputs or results of a remat'd function in place before the backward "
                "pass; clone them first."
            )

    # ---- recompute -------------------------------------------------------------
    def _inputs(self) -> list[Any]:
        if not self.routed:
            return self.flat
        assert self.parent is not None
        if self._in_cache is not None:
            return self._in_cache
        # Fetch the inputs from the parent once per backward pass: each parent position is then
        # read once, as the parent's freeing of its recomputed tensors assumes.
        ti.queue_backward_callback(self._release_later())
        out = []
        for i, a in enumerate(self.flat):
            if i in self._routed_slots:
                a = self.parent.unpack(a)
                if self._routed_slots[i] and not a.requires_grad:
                    # a detached value from the parent: without this the recompute builds no graph
                    # and saves nothing (NOTE [nested remat])
                    with internal():
                        a = a.detach().requires_grad_()
            out.append(a)
        self._in_cache = out
        return out

    def _recompute(self, s: int) -> dict[int, torch.Tensor]:
        self.recomputes += 1
        check_lower_levels(self.levels, s, self.fn_name)
        flat = self._inputs()
        for i, (a, v0) in enumerate(zip(flat, self.versions)):
            if isinstance(a, torch.Tensor) and v0 is not None and ti.unwrap_all(a)._version != v0:
                raise RematError(
                    f"remat: input #{i} ({_shape(a)}) of {self.fn_name} was modified in place after its "
                    "forward pass and before its backward pass; the recompute would read the new "
                    "value. Clone it before modifying it, or run the backward pass first."
                )
        detach = s < 0 and not torch.is_grad_enabled()
        capture = _Capture(self, s, detach)
        replayer = Replayer(self.recorder)
        with contextlib.ExitStack() as es:
            es.enter_context(ti.saved_tensors_hooks_enabled())
            n = len(flat)
            vals, target = es.enter_context(
                replay(self.levels, self.decs + self.state_decs, flat + self.state.tensors, s))
            vals, state_vals = vals[:n], vals[n:]
            written = self.recorder.written_outside
            if written:
                # state the forward pass wrote (a BatchNorm's statistics): the recompute's writes go to a
                # copy at the dispatch level (NOTE [outside tensors]), but autograd would still bump the real
                # buffer's version and give it the recompute's history: let the recompute write a stand-in
                with internal():
                    state_vals = [v.detach().clone() if storage_key(ti.unwrap_all(t)) in written else v
                                  for t, v in zip(self.state.tensors, state_vals)]
            es.enter_context(self.state.restored(state_vals))
            capture.target = target
            es.enter_context(self.ambient.restored())
            es.enter_context(saved_tensors_hooks(capture.pack, capture.unpack))
            es.enter_context(replayer)
            es.enter_context(_activate(capture))
            self.run(vals)
            replayer.finish()
        captured, capture.captured, capture.frame = capture.captured, {}, None  # no cycle via the hooks
        if capture.n != self.counts.get(s, 0):
            raise RematError(
                f"remat: the recompute of {self.fn_name} saved {capture.n} tensors for the backward pass "
                f"where its forward pass saved {self.counts.get(s, 0)}; the function must do the same "
                "work every time it is called (no data-dependent branches or changing global state). If it "
                "reads tensors that are not its arguments from somewhere remat does not look (a dict or a "
                "global, under torch.func), pass them as arguments."
            )
        return captured


class _Capture:
    """Saved-tensor hooks of a recompute: keep what the saving level saves, in order."""

    def __init__(self, frame: Frame, s: int, detach: bool) -> None:
        self.frame: Frame | None = frame
        self.s = s
        self.target: int | None = None
        self.detach = detach
        self.n = 0
        self.fn_name = frame.fn_name
        self.wanted = frame.drops.get(s, {})
        self.captured: dict[int, torch.Tensor] = {}
        self._children = iter(frame.nested.children)

    def next_nested(self) -> _Nested | None:
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
                if (tuple(t.shape), t.dtype) != meta:
                    raise RematError(
                        f"remat: the recompute of {self.fn_name} saved a tensor of shape "
                        f"{list(t.shape)} {t.dtype} where its forward pass saved {list(meta[0])} "
                        f"{meta[1]} (saved tensor #{pos}); the function must compute the same "
                        "shapes every time it is called (a key/value cache that grows on every call changes "
                        "them: for a Hugging Face model pass use_cache=False (model.config.use_cache = False))."
                    )
                with internal():
                    self.captured[pos] = t.detach() if self.detach else t
        return holdable(t)

    def unpack(self, t: Any) -> Any:
        return t


def holdable(t: torch.Tensor) -> torch.Tensor:
    """What to hold for a saved tensor (in a pack hook) without a reference cycle.

    A saved output's grad_fn is the node that saves it: holding the tensor itself
    would make a cycle through the C++ graph that Python's gc cannot see, and the
    graph with its activations would leak on every step. Autograd restores the
    graph metadata on unpack, so a plain tensor is detached. A functorch wrapper
    must keep its lower-level history (detach would strip every level), so its
    inner value is re-wrapped in a dead wrapper, which functorch treats as
    transparent, exactly like a saved wrapper of an exited level.
    """
    if not ti.is_wrapped(t):
        if not t.requires_grad:
            return t
        with internal():
            return t.detach()
    top = ti.peek_interpreter()
    if top is not None and ti.maybe_level(t) == int(top.level()) and t.grad_fn is not None:
        return ti.dead_grad_wrapper(ti.unwrap_one(t))
    return t


class _PassThrough:
    """An inner remat call re-run by an outer recompute: its saves are the outer graph's own.

    The positions the call's forward pass routed to the parent (``nested.routed``) are
    saved through ``ctx`` again, so the outer recompute sees them at the same positions.
    """

    def __init__(self, ctx: Any, nested: _Nested | None) -> None:
        self.ctx = ctx
        self.routed = set() if nested is None else nested.routed
        self._children = iter(() if nested is None else nested.children)
        self.n = 0

    def next_nested(self) -> _Nested | None:
        return next(self._children, None)

    def pack(self, t: torch.Tensor) -> Any:
        pos = self.n
        self.n += 1
        if pos in self.routed:
            return self.ctx.pack(t)
        return holdable(t)

    def unpack(self, t: Any) -> Any:
        return t


def call_nested_replay(ctx: Any, run: Callable[[list[Any]], Any], flat: list[Any]) -> Any:
    """Run an inner remat call inside an outer recompute (NOTE [nested remat])."""
    nested = None
    if not ti.interpreter_stack():  # the forward made a routed frame for this call
        nested = ctx.next_nested()
        for a in flat:
            if isinstance(a, torch.Tensor):
                ctx.pack(a)
    pt = _PassThrough(ctx, nested)
    with saved_tensors_hooks(pt.pack, pt.unpack), _activate(pt):
        return run(flat)


def _shape(t: torch.Tensor) -> str:
    return f"shape {list(t.shape)}, {str(t.dtype).replace('torch.', '')}"
