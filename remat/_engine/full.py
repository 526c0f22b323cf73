"""Saved-tensor hooks and the recompute: what one call of a remat'd function keeps, and how it gets the rest back.

A :class:`Frame` is one call. During its forward pass it installs
``saved_tensors_hooks``: every tensor autograd saves is *kept* (an input or
parameter held by reference, or the output of an op the policy saves),
*offloaded* (copied to host memory by the offload engine) or *dropped*. The
first time the backward pass unpacks a dropped tensor of a given functorch
level, the frame recomputes: it rebuilds the forward's transform stack
(NOTE [per-level replay] in ``_engine/functorch.py``), restores the random-number and
autocast state, re-runs the function under capture hooks and the
:class:`~remat._engine.dispatch.Replayer`, and keeps what that level saved until the
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
    positions to line up, each routed frame records (``Nested``) which of its
    save positions went to the parent, and the routed calls made inside it; the
    outer recompute re-runs each inner call (``call_nested_replay``) under a
    ``_PassThrough`` that saves exactly those positions through the recompute's
    capture again, in forward order (recursively for deeper nesting). Not routed:
    the inner's stash of outputs to replay (``dots_saveable``'s matmul outputs,
    NOTE [stash liveness]) and offloaded tensors, which the inner frame still
    holds itself; a checkpoint_name that drops a value after it was routed leaves
    it to the parent's decision. Under torch.func levels the inner frame holds its own saved
    tensors (its levels differ from the outer's and its recompute rebuilds them).

NOTE [what a recompute holds]
    A recompute runs the function with grad enabled, so that autograd's pack hooks
    hand it the tensors to capture; the graph it builds is thrown away when it
    ends. In a plain backward pass (no ``torch.func`` level, grad mode off: the
    captured tensors are detached), when the function runs no backward pass of its
    own inside (NOTE [backward inside the forward pass]), nothing will differentiate
    that graph, so the saves it does not capture are not held either: the recompute then holds
    only what it captures, not every activation until it ends. What this buys is
    two-level checkpointing's peak: an outer recompute re-runs inner remat calls,
    whose own activations (not routed to the outer call) their frames recompute
    again later, block by block. Under ``create_graph`` or a ``torch.func`` level
    the captured tensors keep their history and the graph holds everything.

NOTE [free as used]
    Each recomputed tensor is let go as soon as the backward pass has read it (as
    ``torch.utils.checkpoint`` does), so memory falls node by node; what is never
    read goes when the backward pass ends. A tensor read again (a second backward
    pass, ``grad_fn._saved_self``) is recomputed again.

NOTE [backward inside the forward pass]
    The function may run a backward pass of its own (``torch.autograd.grad`` for a
    gradient penalty) that reads tensors this call dropped before its forward pass
    has ended. The recompute then runs the function only as far as the forward pass
    got: it stops (``StopRecompute`` from the capture hook in ``recompute.py``) once it has made every
    tensor saved so far, with the forward's recorder paused (it is still on the mode
    stack); the backward pass's own ops are recorded as ops of the call and replayed
    like any other. Its results are released when the forward pass ends. The tensors
    it hands out stand for values of the call, not outside tensors. Not supported
    under torch.func levels or in a routed (nested) call: ``RematError``.

NOTE [unused outputs]
    When the backward pass differentiates only some outputs of the call, the
    recompute skips the ops that feed only the others (JAX's dead-code elimination,
    ``test_remat_eqn_dce``). The frame holds its outputs weakly (an output's node
    would make a cycle through the graph) and asks the engine whether it will run
    each output's node; a prehook (``_Ran``) notes the nodes it already ran, which
    the engine no longer reports (the root), and, held weakly too, tells when an
    output's node died with its tensor (nothing can reach it). Then ``Recorder.unused_ops`` walks the
    ops backwards by storage from the used outputs; the rest are skipped like dead
    ops: the saved tensors they would make are read only by nodes that do not run.
    Plain autograd and a lone ``grad``/``vjp`` level (under deeper nestings every
    output counts as used). The analysis is a guess, checked: the forward's nodes can
    also be reached other than through the outputs (a double backward reaches them
    through the first backward's graph; a value leaked to a global), so when the
    backward pass reads a saved tensor that the recompute handed back as a
    placeholder for a skipped op (or for an op that ran on one: a random op, a write;
    the replayer spreads the mark), the frame recomputes that level again in full
    and serves it from there: never a NaN, at worst one more recompute. A write that
    reads a placeholder never runs on it (its indices are uninitialised memory):
    into placeholders it is skipped, into a real tensor (``embedding_renorm_`` of a
    weight) the level is recomputed in full at once. An output
    written in place since the forward pass has another node: it counts as used.

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

NOTE [kept wrappers revived]
    A kept output at a grad level is held as a dead wrapper of its value below the level (``holdable``: the
    wrapper itself would make a cycle through its node). Read while that level lives and is on top (its own backward
    pass, or a gradient penalty's ``torch.autograd.grad(..., create_graph=True)`` under ``torch.func.grad``, inside
    the call or after it), it is handed back as a live wrapper of the level, to which autograd gives the saved
    tensor's history, as plain autograd's saved variable has it: the dead wrapper, which the level sees through,
    dropped the paths through it from a graph the level differentiates again (off by 3 to 200, silently). The level is
    told by its sentinel (``Level.alive``), not by its number, which functorch hands out again.

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
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .. import _torch_internals as ti
from .._context import INSPECTOR, activated, active_context, internal
from .._errors import RematError, input_written_in_forward, mutation_allowed
from .._policies.core import Offloadable, Recompute
from .._torch_internals import saved_tensors_hooks
from .ambient import AmbientState, no_accumulation
from .capture import holdable
from .dispatch import Recorder
from .functorch import (
    Decomposed,
    Level,
    below_all_levels,
    decompose,
    record_stack,
    saving_height,
)
from .ops import Half, storage_key, tensor_leaves
from .packed import DROP, INPUT, KEEP, OFFLOAD, ROUTED, Made, Nested, Packed, ParentHandle
from .program import Program, ProgramRecorder
from .recompute import fingerprints, run_recompute
from .region import NeedsRegion, forward_pass, rewind_attempt
from .state import Snapshot
from .wiring import Wiring, known_tokens

__all__ = ["Frame"]



class _Saving(Half):
    """The pack hook of a call's forward pass (``Frame.pack``): per saved tensor, keep it, drop it, offload it or
    route it to the enclosing call, as the policy decided for the op that made it; a half of ``Frame``."""

    _tangents_todo: list[tuple[torch.Tensor, int]]  # (set by Frame.__init__, as every attribute this half reads)

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
                p = Packed(self, INPUT, s, pos, slot, phys._version, meta, None)
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
                        # the replay finds it dead (NaN). Both copies share one host copy (_offload/copies.py).
                        self.recorder._promote(self.recorder.vid(phys))
                    p = self._drop(s, pos, phys, meta, rec)
                else:
                    # t itself (the engine detaches): the engine keeps a weakref to catch in-place writes
                    p = Packed(self, OFFLOAD, s, pos, self._offload(t, decision), phys._version, meta, rec)
            elif self.routed:
                # kept by this call's policy: the parent's policy decides whether it survives the
                # forward pass (NOTE [nested remat]); the parent's recompute re-saves this position
                assert self.parent is not None
                self.nested.routed.add(pos)
                was = INSPECTOR.get()  # listed below, in this call's scope, with the parent's decision
                try:
                    INSPECTOR.set(None)
                    handle = self.parent.pack(t)
                finally:
                    INSPECTOR.set(was)
                p = Packed(self, ROUTED, s, pos, handle, phys._version, meta, rec)
            else:  # an input or parameter held by reference, or a saved op output
                held = holdable(t)
                p = Packed(self, KEEP, s, pos, held, phys._version, meta, rec)
                if held is not t and ti.is_dead_wrapper(held):  # NOTE [kept wrappers revived]
                    p.level = next((lv for lv in self.levels if lv.kind == "grad" and lv.level == ti.maybe_level(t)),
                                   None)
                if rec is not None:
                    self._kept.setdefault(storage_key(phys), []).append((p, self.recorder.vid(phys)))
                if rec is not None and rec.stash is not None and any(lv.kind == "grad" for lv in self.levels[:s]):
                    self._mixed.append((p, self.recorder.vid(phys)))  # NOTE [kept under higher-order grad]
            if p.kind == DROP and any(lv.kind == "jvp" for lv in self.levels[: max(s, 0)]):
                # its tangents are read after the forward pass (no op may run inside a pack hook)
                self._tangents_todo.append((t, s))
            insp = INSPECTOR.get()
            if insp is not None:  # remat.saved_residuals is listing what is saved (_inspection/inspect.py)
                final = p
                while final.kind == ROUTED:  # what the enclosing calls decided for it
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
            if rec.stash is None:
                # (the op runs in the recompute, not replayed: a name dropped another of its outputs, or it wrote in
                # place since; what it makes there stands for this one too)
                pass
            elif any(isinstance(r, weakref.ref) for r in rec.stash):
                continue  # an output of the op is gone, it could not be replayed: keep this one
            self.drops[p.height][p.pos] = p.meta
            self.needed_vids.add(vid)
            p.kind, p.payload = DROP, None

    def _offload(self, t: torch.Tensor, decision: Offloadable) -> Any:
        """What the recorder stashes for an output to offload (``t``: the op's own output)."""
        o = self.engine.offload_saved(t, decision, group=self)
        if o is None:
            return t.detach()  # kept; detached, or it would hold its own graph (see holdable)
        self._offloaded = True
        return o

    def _storage_written(self, keys: set[int]) -> None:
        self.engine.storage_written(self, keys)  # NOTE [one copy per storage] in _offload/copies.py

    def _demote(self, key: int) -> None:
        """A checkpoint_name the policy drops names a value already saved as kept: drop it now."""
        for p, vid in self._kept.pop(key, ()):
            if any(lv.kind == "jvp" for lv in self.levels[: max(p.height, 0)]):
                # under a jvp level the recompute must make its tangents too, which only the live wrapper, gone
                # by now, leads to (``_promote_tangents``): it stays kept (the replay read dead placeholders: NaN)
                continue
            p.kind, p.payload = DROP, None
            self.drops.setdefault(p.height, {})[p.pos] = p.meta
            self.needed_vids.add(vid)

    def _drop(self, s: int, pos: int, phys: torch.Tensor, meta: tuple[Any, ...], rec: Any) -> Packed:
        self.drops.setdefault(s, {})[pos] = meta
        v = self.recorder.known_vid(phys)
        if v is None and rec is not None:
            # not a tensor an op of this call returned but a copy of one (a nested call's stash, routed here
            # detached): the recompute must make the output it copies, found by storage
            k = storage_key(phys)
            v = next((ov for ov, ok in zip(rec.out_vids, rec.out_keys) if ok == k), None)
        self.needed_vids.add(v if v is not None else self.recorder.vid(phys))
        if self.levels:
            # the stash may hold what made it (detach): plain tensors, not wrappers of the saving level
            with below_all_levels(), ti.plain_ops_in_pack_hook():
                self.recorder.drop_value(phys)
        else:
            self.recorder.drop_value(phys)  # the recompute must make it again
        # (no torch.func level: the tensor itself, weakly, with its version, so that a write between the passes into
        # a saved result raises as plain autograd's check would; the recompute makes the value before the write)
        # (a view is watched through its base, which shares its version counter and may outlive it)
        watch = (weakref.ref(phys if phys._base is None else phys._base), phys._version) if not self.levels else None
        return Packed(self, DROP, s, pos, watch, 0, meta, rec)



class _Serving(Half):
    """The unpack hook of a call's backward pass (``Frame.unpack``): hand back what was kept, fetch what was
    offloaded, recompute once what was dropped (``recompute.run_recompute``) and let go of it as it is read; a half
    of ``Frame``."""

    _in_cache: list[Any] | None  # (set by Frame.__init__, as every attribute this half reads)
    _refused: RematError | None
    _served: int

    def unpack(self, p: Packed) -> torch.Tensor:
        # The autograd engine runs a graph spanning devices on one thread per device: two of them
        # may reach this call at once. One recompute per level, and consistent bookkeeping.
        with self._lock:
            return self._unpack_counted(p)

    def _unpack_counted(self, p: Packed) -> torch.Tensor:
        if self._refused is not None:
            raise self._refused
        out = self._unpack(p)
        _note_unpacked(out)  # NOTE [backward inside the forward pass]
        if self.routed:
            self._served += 1
            if self._served >= sum(self.counts.values()):
                # this call's backward has read everything: let go of the inputs fetched from the parent
                self._in_cache = None
                self._served = 0
        return out

    def _unpack(self, p: Packed) -> torch.Tensor:
        if p.kind == KEEP:
            self._check_version(p.version, p.meta, ti.unwrap_all(p.payload)._version)
            lv = p.level
            if lv is not None and torch.is_grad_enabled() and lv.alive():
                top = ti.peek_interpreter()  # (the level that saved it, alive, and on top: NOTE [kept wrappers revived])
                if top is not None and int(top.level()) == lv.level:
                    return ti.wrap_for_grad(ti.unwrap_one(p.payload), lv.level)
            return p.payload  # type: ignore[no-any-return]
        if p.kind == OFFLOAD:
            return self.engine.fetch(p.payload)  # type: ignore[no-any-return]
        if p.kind == INPUT:
            return self._inputs()[p.payload]  # type: ignore[no-any-return]
        if p.kind == ROUTED:
            assert self.parent is not None
            return self.parent.unpack(p.payload)
        s = p.height
        if p.payload is not None:  # (a dropped tensor, watched: ``_drop``)
            t = p.payload[0]()
            if t is not None:
                self._check_version(p.payload[1], p.meta, t._version)
        cached = self.cache.get(s)
        if cached is None or p.pos not in cached:
            # not recomputed yet in this backward pass, or read once already (a second backward
            # pass, an inner one during the forward pass, a saved tensor read twice): recompute
            cached = self.cache[s] = self._recompute(s)
            # free at the end of this backward pass even if it does not read everything
            ti.queue_backward_callback(self._release_later())
        # NOTE [free as used]: each recomputed tensor is let go as soon as the backward pass has
        # read it, as torch.utils.checkpoint does, so the backward's peak falls as it goes
        if self._skipped.get(s) and storage_key(ti.unwrap_all(cached[p.pos])) in self._skipped[s]:
            # NOTE [unused outputs]: a node the analysis did not foresee reads it (a double backward reaches
            # the forward's nodes through the first backward's graph): recompute everything, and use that
            cached = self.cache[s] = self._recompute(s, skip_unused=False)
        out = cached.take(self.fn_name, p.pos)  # (NOTE [written after saved] in _engine/packed.py)
        if not cached:
            del self.cache[s]
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
        self._ran.clear()
        for captured in self.cache.values():
            captured.clear()
        self.cache.clear()
        self._in_cache = None
        self._served = 0

    def _reverse(self, flat: list[Any]) -> bool:
        """Whether a backward pass may read this call's saves: a grad level, or plain autograd below the levels
        (forward mode alone, ``jvp`` and ``jacfwd``, saves nothing a backward pass reads)."""
        if any(lv.kind == "grad" for lv in self.levels):
            return True
        return torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and ti.unwrap_all(a).requires_grad for a in [*flat, *self.state.tensors])

    def _check_version(self, version: int, meta: Any, now: int) -> None:
        if now != version:
            if ti.mutation_on_saved_allowed():
                raise mutation_allowed(self.fn_name, f"shape {list(meta[0])}")
            raise RematError(
                f"remat: a tensor of shape {list(meta[0])} that {self.fn_name} saved for the backward "
                f"pass was modified in place after it was saved (version {version} -> {now}). "
                "Do not modify it in place before the backward pass (an input or result of the call, or a "
                "tensor from outside it such as a buffer or cache); write a clone instead."
            )

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

    def _recompute(self, s: int, skip_unused: bool = True) -> Made:
        if self.forwarding:
            # a backward pass inside the forward pass: an input the function wrote so far would be written again by
            # the recompute (into the caller's tensor), and read written: the error the end of the forward pass
            # would raise, raised first
            with internal():
                self._check_forward_mutation(self._forward_inputs)
        # NOTE [written outside storages]: the recompute's writes go to a copy, but move the real tensors' version
        # counters, which are put back
        versions = [(t, t._version) for t in self.recorder.written_tensors]
        made = None
        try:
            with no_accumulation(self.fn_name, [*self.flat, *self.state.tensors]):
                made = run_recompute(self, s, skip_unused, _forwarding_frames())
                return made
        finally:
            if any(t._version != v for t, v in versions):
                # (a made tensor on such a counter, a view of a cache, moves back with it: NOTE [written after saved])
                got: Made = made if made is not None else Made({}, {})
                now = {pos: ti.unwrap_all(t)._version for pos, t in got.items() if pos in got.versions}
                for t, v in versions:
                    ti.set_version(t, v)
                for pos, v in now.items():
                    got.versions[pos] += ti.unwrap_all(got[pos])._version - v


class Frame(_Saving, _Serving):
    """One call of a remat'd function."""

    def __init__(self, run: Callable[[list[Any]], Any], flat: list[Any], fn_name: str,
                 policy: Callable[..., Any], preserve_rng: bool, engine: Any, state: Snapshot) -> None:
        self.run = run
        self.state = state  # NOTE [state is an input]
        self.fn_name = fn_name
        self.levels: list[Level] = record_stack(fn_name)
        h = len(self.levels)
        parent = active_context()
        # Two-level checkpointing (NOTE [nested remat]): inputs saved through the parent.
        self.parent: Frame | None = parent if parent is not None and h == 0 else None
        self.routed = self.parent is not None
        self.nested = Nested()  # the routed calls made in this forward pass, and this call's own routing
        if self.parent is not None:
            self.parent.nested.children.append(self.nested)
        self.engine = engine
        # a weak reference: a bound method would make frame -> recorder -> frame a cycle that
        # holds the stashed activations until the garbage collector runs
        wself = weakref.ref(self)
        self.recorder = Recorder(policy, fn_name, lambda t, d: wself()._offload(t, d))  # type: ignore[union-attr]
        self.recorder.on_demote = lambda key: wself()._demote(key)  # type: ignore[union-attr]
        # NOTE [one copy per storage] in _offload/copies.py: a write ends the sharing of a storage's copy
        self.recorder.on_write = lambda keys: wself()._storage_written(keys)  # type: ignore[union-attr]
        self.recorder.describe_tensor = state.label_of
        self.recorder.keep_written_offloads = h > 0  # NOTE [written before offloaded] in _engine/outside_writes.py
        self._kept: dict[int, list[tuple[Packed, int]]] = {}  # storage key -> kept packs made here, vid
        self._refused: RematError | None = None  # what a backward pass that reads the saves raises
        with internal():
            tensors = [a for a in flat if isinstance(a, torch.Tensor)]
            self.ambient = AmbientState.capture(tensors, preserve_rng)
            self.recorder.generators = self.ambient.generators  # NOTE [generators of your own]
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
        self.cache: dict[int, Made] = {}  # height -> recomputed, not yet read
        self._lock = threading.RLock()  # re-entrant: a recompute may unpack the parent, or itself
        self.forwarding = False  # NOTE [backward inside the forward pass]
        self.recomputes = 0
        self.needed_vids: set[int] = set()
        self._in_cache: list[Any] | None = None  # routed frame: inputs fetched from the parent, this backward
        self._served = 0  # routed frame: unpacks served in this backward
        self._mixed: list[tuple[Packed, int]] = []  # NOTE [kept under higher-order grad]: (packed, vid)
        self._tangents_todo: list[tuple[torch.Tensor, int]] = []  # dropped under a jvp level (_promote_tangents)
        self._offloaded = False  # this call handed a tensor to the offload engine
        # NOTE [unused outputs]: per output, the tensor and its prehook (weakly), its storage and version
        self._outs: list[tuple[Any, int, Any, int]] = []
        self._ran: set[int] = set()  # outputs whose node ran in this backward pass (_Ran)
        self._skipped: dict[int, set[int]] = {}  # height -> storages of placeholders for unused ops
        self.inner_backward = False  # a backward pass inside the forward pass read a saved tensor
        # NOTE [values between the passes] in recompute.py: debug=True fingerprints the inputs and module state when
        # the forward pass ends, and the recompute checks them
        self.watch_values = False
        self.fingerprints: list[Any] | None = None
        self.program: Program | None = None  # NOTE [program replay]: set by the route table under torch.func

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
        if not self.routed:  # NOTE [same reads] in _engine/wiring.py: the tensors are the call's own
            # (module state is read as outside tensors here, checked by storage, and its recompute may read copies
            # of what the call wrote: NOTE [outside tensors]; so one marker like them, not tokens of their own; under
            # torch.func levels the ops read the inputs unwrapped)
            self.recorder.wiring = Wiring(known_tokens(flat, ti.unwrap_all), loose=True)
        with internal():
            self.recorder.input_keys = {storage_key(ti.unwrap_all(a)) for a in flat if isinstance(a, torch.Tensor)}
            self.recorder.no_levels = not self.levels
            # NOTE [writes into inputs] in outside_writes.py (under a forward-mode level, only an integer input, a
            # counter such as a batch norm's ``num_batches_tracked`` passed to hessian: it carries no tangent)
            jvp = any(lv.kind == "jvp" for lv in self.levels)
            self.recorder.free_input_keys = {storage_key(ti.unwrap_all(a)) for a in flat if isinstance(a, torch.Tensor)
                                             and not ti.has_history(a) and not (jvp and (a.is_floating_point() or
                                                                                         a.is_complex()))}
        self.forwarding = True
        try:
            with contextlib.ExitStack() as es:
                es.enter_context(ti.saved_tensors_hooks_enabled())
                es.enter_context(saved_tensors_hooks(self.pack, self.unpack))
                es.enter_context(self.recorder)
                es.enter_context(activated(self))
                es.enter_context(forward_pass())
                if self.program is not None:
                    self.program.start(self, flat, self.state.tensors)
                    es.enter_context(ProgramRecorder(self.program))
                try:
                    out = self.run(flat)
                except RuntimeError as e:
                    if "support saved tensor hooks" not in str(e):
                        raise
                    raise NeedsRegion(self, e) from e  # NOTE [reentrant region] in region.py
            if self.program is not None:
                self.program.finish(out)
            if not self.routed and (not self.levels or (len(self.levels) == 1 and self.levels[0].kind == "grad")):
                # NOTE [unused outputs]: weakly, an output's node would make a cycle through the graph
                self._outs = []
                for i, t in enumerate(tensor_leaves(out)):
                    ran = None
                    if t.grad_fn is not None:  # the engine says nothing of nodes it ran already (the root)
                        ran = _Ran(self, i)
                        t.grad_fn.register_prehook(ran)
                    with internal():
                        key = storage_key(ti.unwrap_all(t))
                    self._outs.append((weakref.ref(t), key, None if ran is None else weakref.ref(ran), t._version))
            if self.levels and self.recorder.offloaded_written is not None and self._reverse(flat):
                self._refused = RematError(
                    f"remat: {self.fn_name} writes in place into a tensor that its offload policy offloads "
                    f"({self.recorder.offloaded_written}, in its code or in a torch function it calls, such as "
                    "cross_entropy with label_smoothing), under torch.func; remat does not support that yet (its replay could "
                    "give wrong gradients). Make the write out of place (h = h * 2 instead of h.mul_(2)), keep "
                    "that op's output out of the offload policy, or use a save or recompute policy under torch.func."
                )
                if any(lv.kind == "grad" for lv in self.levels):
                    raise self._refused
                # (forward mode alone, plain autograd below it: only a backward pass that reads the saves is refused)
            self.forwarding = False
            self._release_all()  # what a backward pass inside the forward pass recomputed (partial)
            with internal():
                self._check_forward_mutation(flat)
                self._replay_kept_above_grad()
                self._promote_tangents()
                with below_all_levels():  # promoting detaches (and may offload) plain tensors
                    if not self.drops and not self.routed:
                        self.recorder.release_stash()  # (nothing dropped: no recompute, no tangents to make)
                    elif any(lv.kind == "jvp" for lv in self.levels) or (
                            self.levels and self.recorder.mutated_inplace
                            and any(isinstance(r.decision, Offloadable) for r in self.recorder.ops)):
                        # under jvp the recompute must also produce tangents, which the saved
                        # primals do not name; under torch.func, an output offloaded and then written in
                        # place (squeeze_) is replayed through copies the walk does not see: no liveness
                        # analysis (NOTE [stash liveness])
                        pass
                    elif not self.needed_vids and not self.routed:
                        self.recorder.release_stash()  # (a routed call's stash goes to the enclosing recompute)
                    else:
                        self.recorder.prune(self.needed_vids)
                    self.recorder.seal()  # its copies must be plain tensors
                    self.recorder.watch_results([ti.unwrap_all(t) for t in tensor_leaves(out)])
                if self._offloaded:
                    self.engine.end_of_call()  # NOTE [stream-ordered reuse] in _offload/streams.py
                if self.watch_values and self.drops and not self.routed:
                    self.fingerprints = fingerprints(list(flat) + self.state.tensors)
            if self.routed:
                # the replay stash too is saved through the parent, whose policy decides whether it survives
                # the forward pass; the parent's recompute re-saves it after re-running this call (_PassThrough)
                assert self.parent is not None
                parent = self.parent
                with internal():
                    self.nested.stash = self.recorder.route_stash(lambda t: ParentHandle(parent, parent.pack(t)))
        finally:
            self.forwarding = False
            if self.program is not None and self.program.frame is not None:
                self.program.spoil("its forward pass raised")
                self.program.finish()
            self.needed_vids = set()
            self._kept = {}
            self._mixed = []
            self._tangents_todo = []
            self.input_ids = {}
            del self._forward_inputs
        return out

    def rewind(self) -> None:
        """Undo what a forward pass cut short did, so that the call can run again (NOTE [reentrant region])."""
        rewind_attempt(self.recorder, self.ambient, self.fn_name)

    def _check_forward_mutation(self, flat: list[Any]) -> None:
        now = [ti.unwrap_all(a)._version if isinstance(a, torch.Tensor) else None for a in flat]
        written = self.recorder.input_read_then_written
        if self.drops and written is not None:  # NOTE [writes into inputs] in outside_writes.py
            route, other = (("under torch.func", "under plain autograd") if self.levels else
                            ("with debug=True", "without debug=True") if self.watch_values else
                            ("on a memory budget's first call, which measures the function", "with a fixed policy"))
            raise RematError(
                f"remat: {self.fn_name} reads an input (shape {list(written.shape)}) and then writes it in place "
                f"(an accumulator, a batch norm's running statistics); {route}, the recompute would read the written "
                "value. Write it before reading it, keep it as a module buffer, or call the function "
                f"{other} (which replays the trace)."
            )
        if self.drops:
            copied = self.recorder.inputs_written - self.recorder.inputs_rewritten
            rewritten = self.recorder.inputs_rewritten
            for i, (a, v0, v1) in enumerate(zip(flat, self.versions, now)):
                if v0 != v1 and not (copied and storage_key(ti.unwrap_all(a)) in copied):
                    raise input_written_in_forward(self.fn_name, i, a)
                if rewritten and isinstance(a, torch.Tensor) and storage_key(ti.unwrap_all(a)) in rewritten:
                    # (through ``.data`` or an alias with a version counter of its own: the version did not move, but
                    # the recompute, which runs the write again, would read the written value)
                    raise input_written_in_forward(self.fn_name, i, a)
        self.versions = now


def _forwarding_frames() -> list[Frame]:
    """The calls in their forward pass on this thread, innermost first (NOTE [backward inside the forward pass])."""
    out = []
    ctx = active_context()
    while isinstance(ctx, Frame) and ctx.forwarding:
        out.append(ctx)
        ctx = ctx.parent
    return out


def _note_unpacked(t: torch.Tensor) -> None:
    """A saved tensor handed to a backward pass that runs inside forward passes: a value of those calls."""
    for frame in _forwarding_frames():
        frame.inner_backward = True
        frame.recorder.note_unpacked(t)


class _Ran:
    """A prehook on an output's node noting that the backward pass ran it (NOTE [unused outputs]); it holds
    the frame weakly, or the node would keep the frame and its stash alive (a cycle through the graph)."""

    __slots__ = ("frame", "i", "__weakref__")

    def __init__(self, frame: Frame, i: int) -> None:
        self.frame = weakref.ref(frame)
        self.i = i

    def __call__(self, grad_outputs: Any) -> None:
        frame = self.frame()
        if frame is not None:
            frame._ran.add(self.i)
            ti.queue_backward_callback(frame._release_later())
