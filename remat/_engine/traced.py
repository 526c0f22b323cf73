"""The replay engine's call: record the forward pass (``trace.py``), replay what the backward pass needs
(``replaying.py``). No line of the user's Python runs twice.

A :class:`TraceFrame` is one call. Its forward pass runs the function once under autograd's saved-tensor hooks
and the :class:`~remat._engine.trace.Tracer`. Per saved tensor its pack hook keeps it (an input, an outside
tensor, the output of a step the policy keeps), hands it to the offload engine, or drops it, noting its slot.
The first unpack of a dropped tensor replays the steps that make every dropped tensor of the call (NOTE
[replay]); each is let go as soon as the backward pass has read it (NOTE [free as used] in ``full.py``), and
whatever is left when the backward pass ends.

NOTE [nested replay]
    A remat call inside another one's forward pass is a frame of its own, with its own policy, whose parent is
    the enclosing frame. What the inner call would hold between the passes (its inputs, the outside tensors the
    parent made, what its policy keeps, the values its replay reads) is packed through the parent instead
    (``ROUTED``), so the parent's policy decides whether it survives the forward pass, as in JAX: an outer
    save-nothing over inner blocks holds only the outer inputs. The parent's trace saw the inner call's steps
    too, so it can replay what it dropped; the inner call's replay fetches what it needs from the parent, which
    replays in turn. Two-level checkpointing, with no Python run twice at any level.

NOTE [unused outputs in a replay]
    When the backward pass differentiates only some outputs of a call (``a, b = f(x, y)``, then
    ``a.sum().backward()``), the replay makes only the dropped tensors the used outputs were computed from, as
    JAX's dead-code elimination does (``test_remat_eqn_dce``). An output is unused when the engine will not run
    its node (``_torch_internals.will_engine_execute``, asked as ``register_multi_grad_hook`` asks; a prehook notes
    the nodes it ran already, which it no longer reports). A dropped tensor skipped and read after all (a double
    backward reaches the forward's nodes through the first backward's graph) makes the replay run again in full.

NOTE [dropped packs]
    A dropped tensor's pack is the tuple ``(slot, version when saved, the slot's weak reference)``: no object of its
    own per saved tensor (its allocation, its release and the garbage collector's share cost ~1 us an op of the
    forward pass on tiny blocks). What a ``_Pack`` would note later lives on the frame: the weak references to the
    tensor's views and base (``alias_refs``, by slot, when the forward pass ends) and, on the trace, the saves a
    write in the forward pass made stale (``Trace.moved``, by slot and version, which is exact: every save of that
    slot at that version saw the value the write changed).

NOTE [data replaced]
    ``t.data = y`` gives ``t`` another storage without an op any mode sees and without moving its version. Plain
    autograd's saves of ``t`` as an op's input hold ``t`` itself and read ``y``'s values, saved before or after; its
    save as its own op's output holds an alias of the old storage and reads the old values. The pack hook compares
    a dropped or offloaded tensor's storage with the one its op made, and the forward pass's end does for every
    dropped tensor still alive. A save made after the data moved (an input's, necessarily) is kept: exact. The
    slot's earlier saves may be either kind, which the pack hook cannot tell apart (autograd packs an op's inputs
    before the op reaches any mode, so the trace's last step is the same for both), so their unpack raises
    ``RematError``. Not seen: a tensor whose data was replaced, that no op saved afterwards and that died before
    the forward pass ended (its earlier saves replay the old values), as under ``torch.utils.checkpoint``.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import optree
import torch

from .. import _errors as errors
from .. import _torch_internals as ti
from .._context import activated, active_context, internal
from .._errors import RematError, input_written_before_backward
from .._policies.core import Offloadable, Recompute
from .._torch_internals import saved_tensors_hooks
from . import outside as ox
from .capture import holdable
from .ops import Half, storage_freed
from .packed import DROP, INPUT, KEEP, OFFLOAD, ROUTED, kept_written, saved_written
from .region import NeedsRegion, forward_pass
from .replaying import adopt, ancestors, check_lifted, copy_outside, plan, run, watches
from .trace import Trace, Tracer

__all__ = ["TraceFrame"]

Tensor = torch.Tensor
_grad_enabled = torch.is_grad_enabled
_FOR_REPLAY = ("for a nested call's replay",)  # (_Pack.meta of a kept value routed from a nested call)


class _Pack:
    """What autograd holds for one saved tensor of a traced call that is kept, offloaded, routed through the parent,
    or an input. A dropped tensor's pack, the common case, is a tuple instead (NOTE [dropped packs])."""

    __slots__ = ("frame", "kind", "slot", "payload", "version", "ref", "aliases", "meta", "__weakref__")

    def __init__(self, frame: Any, kind: str, slot: int, payload: Any, version: int, ref: Any = None) -> None:
        self.frame = frame
        self.kind = kind
        self.slot = slot
        self.payload = payload
        self.version = version
        self.ref = ref  # a dropped or offloaded tensor, weakly: written in place since it was saved, it raises
        self.aliases: Any = ()  # weak references to the dropped tensor's views and base
        # (shape, dtype) of the tensor when a write moved its version (``Trace.settle``), for the message once it is gone
        self.meta: Any = None


class _Ran:
    """A prehook on an output's node noting that the backward pass ran it (NOTE [unused outputs in a replay]); it holds the
    frame weakly (the node would hold the frame: a cycle through the graph)."""

    __slots__ = ("frame", "ran", "__weakref__")

    def __init__(self, frame: Any) -> None:
        self.frame = weakref.ref(frame)
        self.ran = False

    def __call__(self, grad_outputs: Any) -> None:
        self.ran = True


class _Serving(Half):
    """The unpack hook of a traced call (``TraceFrame.unpack``): hand back what was kept, fetch what was offloaded,
    replay once what was dropped (NOTE [replay]) and let go of it as it is read; a half of ``TraceFrame``."""

    def unpack(self, p: Any) -> Tensor:
        """A dropped tensor's pack (the tuple of NOTE [dropped packs]): replay, once, what the backward pass reads
        (NOTE [replay]) and hand it back; any other pack: ``_unpack_pack``."""
        if type(p) is not tuple:
            return self._unpack_pack(p)
        s, version, ref = p
        with self._lock:
            if self.replaced and s in self.replaced:
                raise errors.data_replaced(self.fn_name, self.replaced[s])
            graph = _grad_enabled()
            if ref is not None:
                t = ref()
                aliases = self.alias_refs.get(s, ()) if self.alias_refs else ()
                moved = self.trace.moved.get((s, version)) if self.trace.moved else None
                if aliases or moved is not None or (t is not None and t._version != version):
                    self._check_written(s, version, ref, aliases, moved, DROP)  # (NOTE [dropped packs])
            entry = self.caches.get(graph)
            if entry is None or s not in entry[0]:
                entry = self.caches[graph] = self._replay(graph, full=s in self.skipped)
                if s not in entry[0]:
                    # NOTE [unused outputs in a replay]: one the analysis skipped is read after all: everything, now
                    entry = self.caches[graph] = self._replay(graph, full=True)
                if not ti.queue_backward_callback(self._release_later()):
                    # read outside a backward pass (``grad_fn._saved_self``): nothing ends it, so nothing is kept
                    self.caches.pop(graph, None)
                    return entry[0][s]
            made, left, versions = entry
            t = made[s]
            r = self.view_roots.get(s) if self.view_roots else None
            if t._version != versions[s] or (r is not None and r in self.made_roots
                                             and self.made_roots[r]._version != versions[r]):
                # a backward node wrote it (or the value it is a view of: the replay's views share no version
                # counter) in place and another reads it now: plain autograd refuses this too
                raise saved_written(self.fn_name, s, t, versions[s], t._version)
            n = left[s] - 1
            if n > 0:
                left[s] = n
                return t
            del made[s]
            del left[s]
            if r is not None and not any(left.get(v) for v, rr in self.view_roots.items() if rr == r):
                self.made_roots.pop(r, None)
            return t

    def _unpack_pack(self, p: _Pack) -> Tensor:
        with self._lock:
            kind = p.kind
            if kind == DROP:  # (a kept value a name dropped since: ``_demote``)
                self._check_written(p.slot, p.version, p.ref, p.aliases, p.meta, p.kind)
                return self.unpack((p.slot, p.version, None))
            if kind == KEEP or kind == INPUT:
                t = p.payload
                if t._version != p.version or (p.meta is _FOR_REPLAY and storage_freed(t)):
                    # (a nested call's value written or freed: made again, unless this call wrote its storage)
                    if p.meta is _FOR_REPLAY and not _grad_enabled() and \
                            self.trace.key_of.get(p.slot) not in self.trace.written_keys:
                        return self._make_again(p.slot)
                    raise kept_written(self.fn_name, t, p.version)
                return t  # type: ignore[no-any-return]
            if kind == OFFLOAD:
                if self.replaced and p.slot in self.replaced:
                    raise errors.data_replaced(self.fn_name, self.replaced[p.slot])
                t = self.engine.fetch(p.payload)  # (which raises if the tensor it copied was written since)
                self._check_written(p.slot, p.version, p.ref, p.aliases, p.meta, p.kind)  # (or one of its aliases)
                if self.trace.outside_keys:
                    self._check_outside_storage(p.slot)
                return t  # type: ignore[no-any-return]
            if kind == ROUTED:
                assert self.parent is not None
                return self.parent.unpack(p.payload)
            raise AssertionError(kind)

    def _check_written(self, slot: int, version: int, ref: Any, aliases: Any, meta: Any, kind: str) -> None:
        """Raise if the saved tensor (or one of its ``aliases``) was written in place since it was saved at
        ``version``; ``meta``: its (shape, dtype, version) after a write in the forward pass made it stale already."""
        if ref is None:
            return
        t = ref()
        moved = meta is not None or (t is not None and t._version != version)
        if t is None:  # (its views and base share its version counter: the first alive tells; n checked n each before)
            for r in aliases:
                a = r()
                if a is not None:
                    if a._version != version:
                        moved, t = True, a
                    break
        if not moved:
            return
        shape, dtype, now = (t.shape, t.dtype, t._version) if t is not None else meta
        if kind == OFFLOAD:
            raise errors.offloaded_written_after_save(self.fn_name, shape)
        # written in place since it was saved (in the forward pass: NOTE [outside writes] in trace.py)
        shown = t if t is not None else torch.empty(shape, dtype=dtype)
        raise saved_written(self.fn_name, slot, shown, version, now)

    def _make_again(self, s: int) -> Tensor:
        """NOTE [kept values written after the call] for a nested call's value this call keeps for it: its step
        replayed from what is available (not itself), below autograd (a graph-building backward refuses it)."""
        steps, frees = plan(self.trace, {s}, self._available(False) - {s}, frozenset())
        return run(self.trace, steps, frees, {s}, self._source(False), False)[s]  # type: ignore[no-any-return]

    def _replay(self, graph: bool, full: bool = False) -> tuple[dict[int, Tensor], dict[int, int], dict[int, int]]:
        self.recomputes += 1
        trace = self.trace
        wanted = set(self.counts)
        self.skipped = set()
        if self._outs and not graph and not self.forwarding and not full:
            used = set()
            for ref, s, version, ran in self._outs:
                t, hook = ref(), ran()
                if t is None or hook is None or hook.ran or t._version != version or t.grad_fn is None \
                        or ti.will_engine_execute(t.grad_fn):
                    used.add(s)
            if len(used) < len(self._outs):
                anc = ancestors(trace, used)
                self.skipped = {s for s in wanted if s not in anc}
                wanted -= self.skipped
        steps, frees = plan(trace, wanted, self._available(graph), self._stale_copies(wanted, graph))
        if graph:
            for step in steps:
                if step.nograd_outs is not None and any((t := r()) is not None and t.grad_fn is not None
                                                        for r in step.nograd_outs):
                    raise RematError(
                        f"remat: a backward pass that builds a graph (create_graph=True, a double backward) "
                        f"reads a tensor {self.fn_name} dropped that a custom autograd.Function made "
                        f"({step.op} ran inside its forward); remat's replay cannot rebuild that Function's "
                        "graph. Save the Function's outputs (a policy that keeps them, e.g. "
                        "policies.everything_saveable), or run the double backward without remat."
                    )
        made = run(trace, steps, frees, wanted, self._source(graph), graph)
        versions = {s: t._version for s, t in made.items()}
        # the dropped values that dropped views were made from: held until the views are read (a view holds their
        # storage anyway), so that a write into one before a view is read is seen (the replay's views share no
        # version counter with their base)
        self.made_roots = {r: made[r] for r in self.view_roots.values() if r in made}
        return made, dict(self.counts), versions

    def _stale_copies(self, wanted: set[int], graph: bool) -> frozenset[int]:
        """Wanted slots whose offloaded copy for the replay's reads predates a write into their storage (a name
        dropped the value since: ``h = x @ W; h[:, :2].mul_(3)``): made again, the write with them."""
        if graph or not self.replay_offloaded or not self.trace.written_keys:
            return frozenset()
        key_of, written = self.trace.key_of, self.trace.written_keys
        return frozenset(s for s in wanted if s in self.replay_offloaded and key_of.get(s) in written)

    def _available(self, graph: bool) -> set[int]:
        """The slots a replay reads rather than makes."""
        trace = self.trace
        avail = set(trace.outside)  # (with the parent's values routed through it: NOTE [nested replay])
        if graph:  # (a kept value routed through the parent, as one kept here, is a copy without history: made again)
            return avail
        written = getattr(getattr(self.parent, "trace", None), "written_keys", ())  # (the enclosing call wrote)
        avail.update(s for s in self.routed if s not in trace.producer or trace.key_of.get(s) not in written)
        rw = self.replay_watch  # NOTE [kept values written after the call] in replaying.py
        avail.update(s for s in self.replay_offloaded if all(a._version == v for a, v in rw.get(s, ())))
        versions, kw = trace.stash_versions, self.kept_watch
        for s, v in trace.stash.items():  # (its storage freed by the caller, no version moved: made again)
            if type(v) is not weakref.ref and v._version == versions.get(s) and (
                    s not in kw or all(a._version == v0 for a, v0 in kw[s])) and not storage_freed(v):
                avail.add(s)
        # (a copy the offload engine took for the replay holds the value before any later write; one taken for a
        # save, the value then, which a write through .data since would make stale)
        written = trace.written_keys
        for s, ref in self.offloaded.items():
            if trace.key_of.get(s) not in written and ref() is not None:
                avail.add(s)
        return avail

    def _source(self, graph: bool) -> Callable[[int], Tensor]:
        trace = self.trace
        copies: dict[int, Any] = {}  # storage key -> this replay's copy of a storage the call wrote

        def source(s: int) -> Tensor:
            shadow = trace.shadowed.get(s) if trace.shadowed else None
            if shadow is not None:  # NOTE [outside writes] (the parent's value too was written since: not routed)
                key, geometry = shadow
                snap = trace.shadows[key]
                c = copies.get(key)
                if c is None:
                    c = copies[key] = snap.copy()
                return snap.view(c, geometry)  # type: ignore[no-any-return]
            h = self.routed.get(s)
            if h is not None:
                assert self.parent is not None
                v = trace.made(s, self.parent.unpack(h))
                # (the parent's kept tensor itself, which a replayed step may write: a copy, as a kept value's below)
                return v.clone() if trace.key_of.get(s) in trace.written_keys else v  # type: ignore[no-any-return]
            e = trace.outside.get(s)
            if e is not None:
                snap = trace.snapshots.get(s)
                if snap is not None:
                    return snap.clone()
                t, v0 = e
                if t is None:
                    raise RuntimeError(f"remat: internal error: outside slot {s} of {self.fn_name} was let go")
                if t._version != v0:
                    self._refuse_outside_written(s, t, v0)
                if trace.lifted and trace.lifted.get(s) is not None:
                    check_lifted(trace, s, t)
                g = trace.geometry0.get(s) if trace.geometry0 else None
                if g is not None:  # (an in-place view op of the call reshaped it since: as the steps read it)
                    with internal():
                        return ox.at_geometry(t, g)
                return t
            if not graph:
                v = trace.stash.get(s)
                if v is not None and type(v) is not weakref.ref:
                    # (a replayed step may write it: a copy, so that the next replay reads what was kept)
                    return v.clone() if trace.key_of.get(s) in trace.written_keys else v  # type: ignore[no-any-return]
                o = self.replay_offloaded.get(s)
                check = o is None  # (a copy taken for the replay holds the value it reads, written since or not)
                if check:
                    ref = self.offloaded.get(s)
                    p = ref() if ref is not None else None
                    o = p.payload if p is not None else None
                if o is not None:
                    v = self.engine.fetch(o, check)
                    # (a replayed step may write it: a copy of its own, not the engine's device copy)
                    return v.clone() if trace.key_of.get(s) in trace.written_keys else v  # type: ignore[no-any-return]
            raise RuntimeError(f"remat: internal error: the replay of {self.fn_name} has no value for slot {s}")

        return source

    def _refuse_outside_written(self, s: int, t: Tensor, v0: int) -> None:
        """Outside slot ``s``, ``t``, was written in place since the forward pass read it at version ``v0``."""
        i = self.trace.inputs.get(s)
        if i is not None:
            raise input_written_before_backward(self.fn_name, i, t)
        raise errors.outside_written_before_backward(self.fn_name, self.describe(t), t, v0)

    def _check_outside_storage(self, s: int) -> None:
        """Slot ``s`` (offloaded) lives on an outside tensor's storage (``unbind``'s or ``unsafe_chunk``'s pieces
        of an input): raise if that tensor was written since the forward pass read it, as a replay reading it would
        (the engine's copy holds the values before the write; plain autograd reads the new ones, or refuses)."""
        trace = self.trace
        for o in trace.outside_keys.get(trace.key_of.get(s, 0), ()):
            if o in trace.shadowed or o in trace.snapshots:
                continue  # (written by the call itself: NOTE [outside writes])
            t, v0 = trace.outside[o]
            if t is not None and t._version != v0:
                self._refuse_outside_written(o, t, v0)

    def _release_later(self) -> Callable[[], None]:
        wself = weakref.ref(self)

        def release() -> None:
            frame = wself()
            if frame is not None:
                frame.caches.clear()
                frame.made_roots = {}

        return release


class _Saving(Half):
    """The pack hook of a traced call (``TraceFrame.pack``): per saved tensor, keep it, offload it or drop it, as
    the policy decided for the op that made its storage; and what the tracer reports (a name that drops a kept
    value, a write into an offloaded storage, an outside tensor the parent made); a half of ``TraceFrame``."""

    _group: Any  # (set by TraceFrame.__init__, as every attribute this half reads)

    def pack(self, t: Tensor) -> Any:
        trace = self.trace
        if self.measure is not None:  # (a memory budget's measuring call: what autograd saved, after which step)
            self.measure.note(t, trace.steps[-1] if trace.steps else None)
        e = trace._slot_of.get(id(t))
        if e is None or e[0]() is not t:
            return self._keep(t, -1, INPUT)
        s = e[1]
        step = trace.producer.get(s)
        if step is None:
            return self._keep(t, s, INPUT)  # (an outside tensor)
        # a view is decided for by the op that made its storage (keeping a view keeps that storage)
        r = trace.root.get(s, s)
        replayable = step.replayable
        if r != s:
            step = trace.producer.get(r)
            if step is None:
                return self._keep(t, s, INPUT)  # (a view of an input or a parameter: nothing of the call's)
            replayable = replayable and step.replayable
        decision = step.decision
        if decision is Recompute and replayable:
            k = trace.key_of.get(s)
            if k is not None:
                try:  # (Trace.data_replaced, inline: -0.3 us an op, measured with benchmarks/ab.py)
                    if (t.data_ptr() - t.storage_offset() * t.itemsize or -id(t)) != k and trace.data_replaced(s, t):
                        return self._data_replaced(t, s)  # NOTE [data replaced]
                except (RuntimeError, NotImplementedError):
                    pass
            counts = self.counts
            counts[s] = counts.get(s, 0) + 1
            # a view shares its base's version counter: watched through the base, which may outlive it (a write into
            # the base after the view is gone still moves the counter plain autograd checks); an offloaded one too
            ref = trace.refs.get(r, e[0]) if r != s and t._base is not None else e[0]
            d = (s, t._version, ref)  # (NOTE [dropped packs])
            trace.drops.append(d)  # (indexed by storage at the call's first write in place: Trace.after_write)
            return d
        if isinstance(decision, Offloadable) and replayable:  # (offload_saved asks whether it moves t)
            if trace.data_replaced(s, t):
                return self._data_replaced(t, s)  # NOTE [data replaced]
            if self._group is None:
                self._group = self.engine.group(self)  # (looked up once a call: the engine's common case)
            with internal():
                o = self.engine.offload_saved(t, decision, group=self._group, own_modes=self.depth)
            if o is not None:
                self._offloaded_any = True
                ref = trace.refs.get(r, e[0]) if r != s and t._base is not None else e[0]  # (as a dropped one's)
                p = _Pack(self, OFFLOAD, s, o, t._version, ref)
                trace.drops.append(p)  # (NOTE [written after saved] in _engine/packed.py: watched with its aliases)
                # weakly: once autograd let go of the save, the engine may free its copy (NOTE [keep last])
                self.offloaded[s] = weakref.ref(p)
                return p
        p = self._keep(t, s, KEEP)
        if p.kind == KEEP:
            self.kept.setdefault(r, []).append(p)
        return p

    def _data_replaced(self, t: Tensor, s: int) -> _Pack:
        """NOTE [data replaced]: ``t``'s data is not what its op made: kept for this save; the slot's earlier ones
        raise at their unpack."""
        self.replaced[s] = list(t.shape)
        return self._keep(t, s, KEEP)

    def _keep(self, t: Tensor, s: int, kind: str) -> _Pack:
        if self.parent is not None:
            return _Pack(self, ROUTED, s, self.parent.pack(t), t._version)
        return _Pack(self, kind, s, holdable(t), t._version)

    def _demote(self, s: int) -> None:
        """A ``checkpoint_name`` the policy drops names a value saved as kept already (or a view of it): drop it."""
        trace = self.trace
        for p in self.kept.pop(s, ()):
            if p.kind == KEEP:
                held, for_replay = p.payload, p.meta is _FOR_REPLAY  # (a detached alias: it shares t's version counter)
                # written since it was saved: stale already (as Trace.settle notes); a nested call's: made again
                moved = held._version != p.version and not for_replay
                p.meta = (held.shape, held.dtype, held._version) if moved else None
                # watched as a dropped tensor is from now on (a write before the backward pass raises at the unpack,
                # as plain autograd's check of the saved tensor would): its slot's weak reference, and among the
                # call's drops (a write in the forward pass moving it, its views and base when the forward pass ends)
                p.kind, p.payload, p.ref = DROP, None, None if for_replay else trace.refs.get(p.slot)
                if not for_replay:  # (a nested call's value is no autograd save: not refused when written)
                    trace.drops.append(p)
                self.counts[p.slot] = self.counts.get(p.slot, 0) + 1

    def _offload_written_quietly(self, p: _Pack) -> None:
        """An offloaded save was written in the forward pass where no version counter shows (through ``t.data``):
        plain autograd reads the written values, the engine's copy holds the ones before; replayed instead (the
        replay runs the write again), as a dropped save is."""
        if p.kind != OFFLOAD:
            return
        p.kind, p.payload = DROP, None
        self.offloaded.pop(p.slot, None)
        self.replay_offloaded.pop(p.slot, None)  # (a copy taken before the write: the replay makes it and writes it)
        self.counts[p.slot] = self.counts.get(p.slot, 0) + 1

    def _storage_written(self, key: int) -> None:
        if not self._offloaded_any:
            return
        keys = {key}
        self.engine.storage_written(self, keys)  # NOTE [one copy per storage] in _offload/copies.py
        # a copy not taken yet (the engine keeps the newest call on the device: NOTE [keep last]) is taken before
        # the write, which on CUDA waits for a copy still running
        handles = [*self.replay_offloaded.values(), *(p.payload for r in self.offloaded.values() if (p := r()))]
        for o in handles:
            if self.engine.shares_storage(o, keys):
                self.engine.before_write(o)

    def _offload_for_replay(self, s: int, t: Tensor, decision: Offloadable) -> bool:
        """An output the policy offloads that a replayed step reads: copied to host memory now, not held here."""
        if not self.engine.applies(t, decision):
            return False
        with internal():
            o = self.engine.offload_saved(t, decision, group=self)
        if o is None:
            return False
        self._offloaded_any = True
        self.replay_offloaded[s] = o
        return True

    def _route_outside(self, s: int, t: Tensor) -> None:
        """NOTE [nested replay]: an outside tensor of this call that the parent made (an input, a closure over one of
        its values): saved through the parent, not held here."""
        parent = self.parent
        assert parent is not None
        if parent.trace.slot_of(t) is None:
            return
        # (one that every enclosing call read from outside too, a parameter or a global, this call holds as they do,
        # or copies when the forward pass ends if it is small and needs no gradient: NOTE [outside tensors])
        p: TraceFrame | None = parent
        while p is not None:
            ps = p.trace.slot_of(t)
            if ps is not None and ps not in p.trace.outside:
                self.routed[s] = parent.pack(t)  # made by an enclosing call: its policy decides
                return
            p = p.parent


class TraceFrame(_Saving, _Serving):
    """One call of a remat'd function on the replay engine."""

    def __init__(self, run_fn: Callable[[list[Any]], Any], flat: list[Any], fn_name: str,
                 policy: Callable[..., Any], engine: Any,
                 describe: Callable[[Tensor], str | None] = lambda t: None) -> None:
        self.run = run_fn
        self.describe = describe  # the module attribute an outside tensor came from, for messages
        self.flat: list[Any] = list(flat)
        self.fn_name = fn_name
        self.engine = engine
        parent = active_context()
        self.parent: TraceFrame | None = (parent if isinstance(parent, TraceFrame) and bool(getattr(parent, "forwarding", False))
                                          else None)
        self.trace = Trace(fn_name)
        self.depth: int = 1 + (int(self.parent.depth) if self.parent is not None else 0)  # remat's tracers on the stack
        self._group: Any = None  # the offload engine's group of this call
        self.tracer = Tracer(self.trace, policy)
        self.forwarding = False
        self.recomputes = 0
        self.counts: dict[int, int] = {}  # dropped slot -> packs of it
        self.kept: dict[int, list[_Pack]] = {}  # kept op-made slot -> its packs (a name may drop it later)
        self.offloaded: dict[int, Any] = {}  # slot -> what the offload engine holds for it
        self.routed: dict[int, Any] = {}  # outside slot -> the parent's pack of it (NOTE [nested replay])
        # NOTE [unused outputs in a replay]: (tensor, slot, version, prehook) per output; the slots the last replay
        # skipped
        self._outs: list[tuple[Any, int, int, Any]] = []
        self.skipped: set[int] = set()
        self.view_roots: dict[int, int] = {}  # a dropped view -> the dropped value it is a view of
        self.alias_refs: dict[int, list[Any]] = {}  # a dropped slot -> its views and base, weakly (NOTE [dropped packs])
        self.replaced: dict[int, list[int]] = {}  # a slot whose data ``t.data = ...`` replaced -> its shape (NOTE [data replaced])
        self.made_roots: dict[int, Tensor] = {}  # dropped values the last replay made views of (their writes)
        self.caches: dict[bool, tuple[dict[int, Tensor], dict[int, int], dict[int, int]]] = {}
        self._lock = threading.RLock()
        self._offloaded_any = False
        wself = weakref.ref(self)
        self.trace.on_demote = lambda s: wself()._demote(s)  # type: ignore[union-attr]
        self.trace.offload = lambda s, t, d: wself()._offload_for_replay(s, t, d)  # type: ignore[union-attr]
        self.trace.on_write = lambda key: wself()._storage_written(key)  # type: ignore[union-attr]
        self.trace.on_quiet_write = lambda p: wself()._offload_written_quietly(p)  # type: ignore[union-attr]
        self.replay_offloaded: dict[int, Any] = {}  # slot -> the offload engine's copy of a value the replay reads
        self.measure: Any = None  # a memory budget's observer (``_budgets/budget_policy._Saved``), measuring this call
        # NOTE [kept values written after the call] in replaying.py: slot -> the tensors on its storage (``_prune``)
        self.replay_watch: dict[int, list[tuple[Tensor, int]]] = {}  # (offloaded for the replay)
        self.kept_watch: dict[int, list[tuple[Tensor, int]]] = {}  # (kept)
        if self.parent is not None:
            self.trace.external = lambda s, t: wself()._route_outside(s, t)  # type: ignore[union-attr]

    # ---- forward -------------------------------------------------------------
    def forward(self) -> Any:
        trace = self.trace
        with internal():
            for i, a in enumerate(self.flat):
                if isinstance(a, Tensor):
                    trace.inputs[trace.read(a)] = i
        self.forwarding = True
        try:
            # (one with statement, not an ExitStack: -2.5 us a call)
            with saved_tensors_hooks(self.pack, self.unpack), self.tracer, activated(self), forward_pass():
                try:
                    out = self.run(self.flat)
                except RuntimeError as e:
                    if "support saved tensor hooks" not in str(e):
                        raise
                    raise NeedsRegion(self, e) from e  # NOTE [reentrant region] in region.py
        except BaseException:
            # the kept values held as themselves until the end of the forward pass hold their graph, which holds
            # this frame: let go of everything, or the cycle outlives the exception
            self.trace.stash.clear()
            self.trace.raw.clear()
            self.kept.clear()
            self.trace.forget_drops()
            raise
        finally:
            self.forwarding = False
        self.caches.clear()  # what a backward pass inside the forward pass replayed (partial)
        self.trace.settle()
        self.trace.seal()
        adopt(self.trace)
        self._watch_outputs(out)
        with internal():
            self._prune()
        if self._offloaded_any:
            self.engine.end_of_call()  # NOTE [stream-ordered reuse] in _offload/streams.py
        self.flat = []  # (tensors: outside slots; a list subclass holding an output would hold this frame, unseen by gc)
        return out

    def _watch_outputs(self, out: Any) -> None:
        """NOTE [unused outputs in a replay]: with several outputs, note which of them the backward pass runs."""
        outs = [t for t in optree.tree_leaves(out, none_is_leaf=True)
                if isinstance(t, Tensor) and t.grad_fn is not None]
        if len(outs) < 2 or not self.counts:
            return
        for t in outs:
            s = self.trace.slot_of(t)
            if s is None:
                return  # (an output no step made: every output counts as used)
            ran = _Ran(self)
            node = t.grad_fn
            assert node is not None
            node.register_prehook(ran)
            self._outs.append((weakref.ref(t), s, t._version, weakref.ref(ran)))

    def rewind(self) -> None:
        """Undo what a forward pass cut short did (random state), so that the call can run again."""
        if self.trace.snapshots or self.trace.shadows:
            raise RematError(
                f"remat: {self.fn_name} (or a remat'd function it calls) enters torch.func.grad, vjp, jacrev or "
                "hessian, so remat runs it again as one region (NOTE [reentrant region]), but the first attempt "
                "already wrote a tensor from outside in place (a BatchNorm's running statistics) and running it "
                "again would write it twice. Remat the parts on either side of the inner transform, so that the "
                "part that writes it does not enter it."
            )
        with internal():
            for gen, state in self.trace.first_rng.values():
                gen.set_state(state)

    def _prune(self) -> None:
        """When the forward pass ends: let go of the kept values no replay reads (NOTE [replay]); outside tensors
        stay held (inputs and parameters, as plain autograd holds them)."""
        trace = self.trace
        stash = trace.stash
        if stash or self.replay_offloaded:
            used: set[int] = set(self.counts)  # (the dropped slots, and what the steps that make them read)
            if self.counts:
                for step in plan(trace, used, self._available(False), self._stale_copies(used, False))[0]:
                    used.update(step.reads())
            for s in list(stash):
                if s not in used or type(stash[s]) is weakref.ref:
                    del stash[s]
            for s in [s for s in self.replay_offloaded if s not in used]:  # (copies no replay reads: let go)
                del self.replay_offloaded[s]
            # what the caller may write after the call (a result it returned, ``h += x``), which a copy the engine has not
            # taken yet would read (NOTE [keep last] in _offload/schedule.py): NOTE [kept values written after the call]
            self.replay_watch = watches(trace, self.replay_offloaded, own=True)
            self.kept_watch = watches(trace, [s for s, v in stash.items() if type(v) is not weakref.ref], own=False)
        for snap in trace.shadows.values():
            if snap is not None:
                snap.done()  # (no tensor of the call extends it any more)
        for s in [s for s in self.routed if s in trace.shadowed]:
            # NOTE [outside writes]: this call wrote it, so its replay reads its own copy of the storage, never the
            # parent's value (which a later call may write again: a global two nested calls each write in place);
            # neither this call nor the parent holds or makes it for that
            h = self.routed.pop(s)
            if type(h) is tuple and self.parent is not None:
                counts = self.parent.counts  # (the parent's save of it will not be unpacked: not replayed for it)
                counts[h[0]] -= 1
                if not counts[h[0]]:
                    del counts[h[0]]
            trace.outside[s] = (None, trace.outside[s][1])  # type: ignore[assignment]
        for s in self.routed:
            t, v = trace.outside[s]
            trace.outside[s] = (None, v)  # type: ignore[assignment]  # (the parent holds it)
        if self.counts:
            copy_outside(trace)  # NOTE [outside tensors]
        drops = trace.drops
        for p in drops:
            ds, dref = (p[0], p[2]) if type(p) is tuple else (p.slot, p.ref)
            dt = dref() if dref is not None else None
            if dt is not None and ds not in self.replaced and trace.data_replaced(ds, dt):
                self.replaced[ds] = list(dt.shape)  # NOTE [data replaced]
        if drops and trace.root:
            # NOTE [written after saved]: a dropped tensor's views and its base share its version counter (the caller's
            # h.detach(), a view it returns): held weakly, a write through any of them raises at the unpack
            by_root: dict[int, list[Any]] = {}
            for v, r in trace.root.items():
                ref = trace.refs.get(v)
                if ref is not None:
                    by_root.setdefault(r, []).append(ref)
            shared: dict[int, list[Any]] = {}  # (one list a root: n views of one tensor saved n times held n lists of n)
            for p in drops:
                slot: int = p[0] if type(p) is tuple else p.slot
                r = trace.root.get(slot, slot)
                refs = by_root.get(r)
                if refs or r != slot:
                    if (aliases := shared.get(r)) is None:  # (the live ones: one dead now is never written again)
                        aliases = shared[r] = [a for a in (trace.refs.get(r), *(refs or ())) if a is not None and a() is not None]
                    if type(p) is tuple:
                        self.alias_refs[slot] = aliases
                    else:
                        p.aliases = aliases
        self.view_roots = {p[0]: trace.root[p[0]] for p in drops
                           if type(p) is tuple and trace.root.get(p[0]) in self.counts}
        trace.forget_drops()
        self.kept.clear()  # (a name decides during the forward pass only; the packs hold this frame: no cycle)
        trace.root.clear()
        trace.refs.clear()
        trace.stash_keys.clear()
        if self.parent is not None and stash:
            # the values the replay reads are saved through the parent too (NOTE [nested replay])
            parent = self.parent
            for s, t in list(stash.items()):
                h = self.routed[s] = parent.pack(t)
                while type(h) is _Pack and h.kind == ROUTED:  # (the enclosing call that holds it)
                    h = h.payload
                if type(h) is _Pack and h.kind == KEEP and h.slot in h.frame.trace.producer:
                    h.meta = _FOR_REPLAY  # (not an autograd save: written or freed after the call, made again)
                del stash[s]
