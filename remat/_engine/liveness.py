"""What the recorder keeps for a call's recompute, and when it lets go: the stash of kept outputs, the liveness walk
over the recorded ops, and the ops a recompute may skip (the half of ``_dispatch.Recorder`` that is not recording).

NOTE [stash liveness]
    Saveable outputs are held weakly while the forward pass runs; an output is
    held strongly ("promoted") only once an op that will be recomputed reads it,
    since only such an op needs the value back in the recompute. A policy that
    saves every op therefore holds nothing extra. When the forward pass ends,
    :meth:`Recorder.prune` walks the ops backwards from the values the recompute
    must produce (the saved tensors that were dropped) and releases every stashed
    output that nothing live reads: JAX keeps exactly the residuals that the
    backward pass or the recompute read, and so do we. A released output is
    replayed as a NaN-filled tensor of the same shape, which only dead values
    consume, so a mistake in this analysis shows up as NaNs, never silently.
    Random ops are always run again (never replayed) so the random stream stays
    aligned with the forward pass.

NOTE [dead ops]
    The same walk marks ops whose outputs nothing live reads (in a transformer
    block: the last matmul and the residual add, whose results the backward pass
    never needs). The recompute does not run them: like a released stashed
    output, a dead op hands back a NaN-filled tensor of the recorded shape. JAX
    gets the same from dead-code elimination; torch.utils.checkpoint runs the
    whole function again. Random, in-place and view ops always run.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from .._context import internal
from .._policies.core import Decision, Offloadable
from . import outside as ox
from .ops import Half, OpRecord, storage_key, traits, version_watches

__all__ = ["StashLiveness"]

class StashLiveness(Half):
    """The recorder's stash and its liveness (NOTE [stash liveness], NOTE [dead ops])."""

    _pending: dict[int, list[tuple[OpRecord, int, torch.Tensor]]]  # (set by Recorder.__init__, as all it reads)
    made_geometry: dict[int, tuple[Any, ...]]  # value -> its geometry before an in-place view op changed it
    shadows: dict[int, Any]
    refilled: list[Any]  # offloaded outputs a fill of the forward pass wrote (outside_writes.py)

    def route_stash(self, route: Callable[[torch.Tensor], Any]) -> list[tuple[int, int]]:
        """Hand every output held for the replay to ``route`` (the enclosing call), in op order; returns where
        they were (op index, output position). Not copies made before an in-place write (``cow``): the
        enclosing recompute would see the written value."""
        out = []
        for idx, rec in enumerate(self.ops):
            if rec.stash is None or rec.cow:
                continue
            for j, held in enumerate(rec.stash):
                if isinstance(held, torch.Tensor):
                    rec.stash[j] = route(held)
                    out.append((idx, j))
        return out

    def note_unpacked(self, t: torch.Tensor) -> None:
        """``t``, recomputed for a backward pass inside the forward pass, stands for a value of the call."""
        with internal():
            self.made_by[self.vid(t)] = -1

    def _stash(self, rec: OpRecord, idx: int) -> None:
        rec.stash = list(rec.refs)
        for pos, v in enumerate(rec.out_vids):
            self.stash_of[v] = (idx, pos)
        if self.region:
            self.promote(rec)  # no saved tensor will say what the backward reads: hold what the policy saves

    def _unstash(self, rec: OpRecord, idx: int) -> None:
        rec.stash = None
        for v in rec.out_vids:
            if self.stash_of.get(v, (None,))[0] == idx:
                del self.stash_of[v]

    def _ensure_recomputable(self, vid: int) -> None:
        """Value ``vid`` is read by an op that runs in the recompute: hold it, or recompute its op too."""
        loc = self.stash_of.get(vid)
        if loc is None:
            return  # made by an op that runs in the recompute, or an input
        rec = self.ops[loc[0]]
        assert rec.stash is not None
        ref = rec.stash[loc[1]]
        if not isinstance(ref, weakref.ref) or ref() is not None:
            self.promote(rec, loc[1])
            return
        # the saved output is gone already: run its op in the recompute as well
        self._unstash(rec, loc[0])
        for v in rec.in_vids:
            self._ensure_recomputable(v)

    def made_here_decision(self, t: torch.Tensor) -> Decision | None:
        """The decision for the op of this call that returned ``t`` itself (None: not made here)."""
        v = self.known_vid(t)
        idx = None if v is None else self.made_by.get(v)
        return None if idx is None or idx < 0 else self.ops[idx].decision

    def drop_value(self, t: torch.Tensor) -> None:
        """``t`` was saved as dropped: the recompute must make it, without the stash holding it.

        A view (or name) of a recomputed output is itself recomputed, which costs
        nothing: holding its stashed output would keep exactly what was dropped.
        Any other op that made it is replayed, so its output is held.
        """
        v = self.known_vid(t)
        loc = None if v is None else self.stash_of.get(v)
        if loc is None:
            return
        rec = self.ops[loc[0]]
        if any(storage_key(r()) != 0 and self.producers.get(storage_key(r())) != loc[0]
               for r in rec.refs if r() is not None) and not isinstance(rec.decision, Offloadable):
            self._unstash(rec, loc[0])
            for iv in rec.in_vids:
                self._ensure_recomputable(iv)
        else:
            self.promote(rec, loc[1])

    def promote_value(self, t: torch.Tensor) -> None:
        """``t`` must come back in the recompute: hold the stashed output of the op that made it."""
        v = self.known_vid(t)
        if v is not None:
            self._promote(v)

    def _promote(self, vid: int) -> None:
        """An op that will be recomputed reads a stashed output: hold it strongly."""
        loc = self.stash_of.get(vid)
        if loc is not None:
            self.promote(self.ops[loc[0]], loc[1])

    def promote(self, rec: OpRecord, pos: int | None = None) -> None:
        """Hold output ``pos`` (all outputs: None) of ``rec`` strongly, offloaded if so decided."""
        if rec.stash is None:
            return
        for i in range(len(rec.stash)) if pos is None else (pos,):
            ref = rec.stash[i]
            if isinstance(ref, weakref.ref):
                t = ref()
                if t is None:
                    continue
                if storage_key(t) in self.written:
                    # written in place since its op ran (and not copied before: it was held weakly
                    # then): what it holds now is not the op's output, so run the op again instead
                    idx = next(j for j, r in enumerate(self.ops) if r is rec)
                    self._unstash(rec, idx)
                    for v in rec.in_vids:
                        self._ensure_recomputable(v)
                    return
                # the engine detaches; it is handed the op's own output so that it can watch that tensor
                # for in-place writes (a detached alias would die at once)
                g = self.made_geometry.get(rec.out_vids[i]) if self.made_geometry else None
                if g is not None:  # (an in-place view op changed its geometry since its op made it: t_)
                    with internal():
                        t = ox.at_geometry(t.detach(), g)
                rec.stash[i] = self.offload(t, rec.decision) if isinstance(rec.decision, Offloadable) else t.detach()

    def seal(self) -> None:
        """End of the forward pass (the kept outputs' versions are watched by ``watch_results``, which each caller runs
        next).

        Outside reads are settled (NOTE [outside tensors]): each is either kept for the
        recompute's check or served from a copy.
        """
        for rec in self.ops:
            if rec.outside is not None:
                self._settle_outside(rec)
        self._pending = {}
        for o in self.refilled:
            o.engine.rewatch(o)
        self.refilled = []
        for shadow in self.shadows.values():
            if shadow.snap is not None:
                shadow.snap.done()
        self.shadows = {}

    def watch_results(self, results: list[torch.Tensor]) -> None:
        """NOTE [kept values written after the call] in ``_engine/replaying.py``, for this engine: a held output (kept,
        offloaded, or routed to the enclosing call) may be written after the forward pass through a tensor of the call
        on its storage that shares no version counter with it (``return y, h.detach()``; ``x3d @ W`` returns an
        ``_unsafe_view`` of the ``mm`` the policy kept; one kept on ``self`` or in a global), and let go after the
        write: each output of the call still alive on a held storage, and each result (``results``: plain tensors,
        unwrapped below every functorch level), is watched through an alias that shares its counter and holds no
        bytes. The recompute runs the op again once a watch moved (``_stale`` in ``replay.py``)."""
        held: dict[int, list[OpRecord]] = {}
        kept = [rec for rec in self.ops if rec.stash is not None and any(h is not None for h in rec.stash)]
        for rec in kept:
            for h, k in zip(rec.stash, rec.out_keys):
                if k and h is not None and not isinstance(h, weakref.ref):
                    held.setdefault(k, []).append(rec)
        # its own outputs (a stash may hold one weakly), every op's output alive on a held storage, the results
        pairs = [(t, id(rec)) for rec in kept for r in rec.refs if (t := r()) is not None]
        pairs += [(t, id(rec)) for o in self.ops for r, k in zip(o.refs, o.out_keys)
                  if k in held and (t := r()) is not None for rec in held[k]]
        pairs += [(t, id(rec)) for t in results if (k := storage_key(t)) in held for rec in held[k]]
        watches = version_watches(pairs)
        for rec in kept:
            rec.watch = watches.get(id(rec))

    def unused_ops(self, used_keys: set[int]) -> set[int]:
        """Ops whose outputs reach none of the storages ``used_keys`` (NOTE [unused outputs] in ``_engine/full.py``).

        Walks the ops backwards by storage, so that a write through a view counts as
        producing its base; a storage freed and reused only makes more ops used.
        """
        active = set(used_keys)
        unused = set()
        for idx in range(len(self.ops) - 1, -1, -1):
            rec = self.ops[idx]
            if not rec.out_keys or 0 in rec.out_keys or any(k in active for k in rec.out_keys):
                active.update(rec.in_keys)
            else:
                unused.add(idx)
        return unused

    def producer(self, phys: torch.Tensor) -> OpRecord | None:
        key = storage_key(phys)
        if key:
            idx = self.producers.get(key)
        else:  # no storage to name it (a wrapper tensor subclass): the op that returned this very tensor
            v = self.known_vid(phys)
            idx = None if v is None else self.made_by.get(v)
        return None if idx is None or idx < 0 else self.ops[idx]

    def release_stash(self) -> None:
        """The call dropped nothing: no recompute will read the stash. Let go of all of it, the copies made before an
        in-place write included (``nn.ReLU(inplace=True)`` after a saved matmul: each a whole activation)."""
        for rec in self.ops:
            rec.live = False
            if rec.stash is not None:
                rec.stash = [None] * len(rec.stash)

    def prune(self, needed_vids: set[int]) -> None:
        """Release stashed outputs nothing live will read (NOTE [stash liveness])."""
        # An in-place write always runs in the recompute (writes are never replayed or skipped), so
        # it is always live: what it writes must be the forward's value, even when the tensor it
        # returns is a view (``r[2:4] = v`` writes r's storage through a slice whose own value
        # nothing reads; a dead ``v`` would write NaN placeholders into r). A stashed output is
        # copied before a write (cow).
        needed = set(needed_vids)
        for rec in reversed(self.ops):
            # (a write its schema hides, such as batch norm's into its running statistics, too)
            is_live = (any(v in needed for v in rec.out_vids) or not rec.out_vids or rec.writes
                       or (hasattr(rec.func, "_schema") and traits(rec.func)[0]))
            rec.live = is_live
            replayed = rec.stash is not None
            if is_live and rec.stash is not None and any(
                v in needed and isinstance(ref, weakref.ref) and ref() is None
                for v, ref in zip(rec.out_vids, rec.stash)
            ):
                # a needed output that nothing held is gone (e.g. a name dropped the value of the op
                # that read it, after that op ran): run this op again rather than replay NaNs
                rec.stash = None
                replayed = False
            if is_live and not replayed:
                needed.update(rec.in_vids)
            if rec.stash is not None:
                if is_live:
                    for i, ref in enumerate(rec.stash):
                        if isinstance(ref, weakref.ref):
                            rec.stash[i] = None if ref() is None else ref
                else:
                    rec.stash = [None] * len(rec.stash)
            if rec.stash is not None and is_live:
                # a live output still referenced now must still be there in the backward pass
                self.promote(rec)
