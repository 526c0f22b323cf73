"""Tensors a call reads that are not its inputs (module state, globals): the recorder's half that notes what the
forward pass read of them and copies what it is about to overwrite, so that the recompute reads what the forward
pass read (the other half of ``_dispatch.Recorder``; op arguments in ``_engine/outside.py``).

NOTE [outside tensors]); FSDP2 gathers them into the same tensors
    for the backward pass. Its hooks also wrap a module's inputs in an
    ``autograd.Function`` that returns them, inside the range, so the module's
    first op reads an alias no op of the call made: an argument whose storage an
    op of the call made is that op's value (``Recorder.vid(read=True)``), for the
    liveness walk; the recompute's keys take it for that tensor
    (``Wiring._unknown``). A step all-gathers and reduce-scatters as often as
    without remat, as ``torch.utils.checkpoint`` (``tests/test_distributed.py``).

    Should the liveness walk still miss a value made where no mode sees, the
    recompute does not hand a placeholder on: an op it needs that reads one, or a
    saved tensor that shares one's storage, raises ``DeadRead``, and the
    recompute runs again without skipping any op (``_engine/recompute.py``,
    NOTE [one set of checks]).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .. import _torch_internals as ti
from .._context import internal
from .._errors import RematError, empty_written, inference_tensor
from .._policies.core import Offloadable, Saveable
from . import outside as ox
from .ops import LIFTS, OVERWRITES, DeadRead, Half, OpRecord, arg_tensors, storage_key, tensor_leaves

_RENORM = torch.ops.aten.embedding_renorm_.default  # (NOTE [writes into inputs]: written under no_grad by torch)

__all__ = ["OutsideReads", "outside_args", "with_copies"]

class OutsideReads(Half):
    """The recorder's reads of and writes into outside tensors (NOTE [outside tensors])."""

    def is_outside(self, k: int, t: torch.Tensor | None = None) -> bool:
        """Whether storage ``k`` (of ``t``) is neither an input of the call nor made by one of its ops (NOTE [outside
        tensors]). With ``t``: an op's storage only while that op's output lives on that very storage (an address
        freed and handed to a tensor no mode saw, ``torch.tensor``'s data, a wrapper's inner tensor, is outside)."""
        if k == 0 or k in self.input_keys:
            return False
        if k not in self.producers:
            return True
        if t is None:
            return False
        s = ti.storage_of(t)
        return s is not None and self._storage_vid(s) is None

    def _storage_vid(self, storage: Any) -> int | None:
        """The value of the op of the call whose output lives in ``storage`` (None: none made it): only while that
        storage lives (an address freed and handed to a tensor no mode saw, ``torch.tensor``'s data, a wrapper's
        inner tensor, is another value; a storage object lives as long as any tensor on it)."""
        try:
            k = int(storage.data_ptr())
        except (RuntimeError, NotImplementedError):
            return None
        idx = self.producers.get(k) if k else None
        if idx is None:
            return None
        rec = self.ops[idx]
        return next((ov for ov, ok, ref in zip(rec.out_vids, rec.out_keys, rec.stores)
                     if ok == k and ref is not None and ref() is storage), None)

    def _outside_state(self) -> None:
        self.written_outside: set[int] = set()  # storages of outside tensors the call wrote
        self._pending: dict[int, list[tuple[OpRecord, int, torch.Tensor]]] = {}  # outside reads since the last write
        self.shadows: dict[int, Any] = {}  # storage key -> its Shadow (NOTE [written outside storages])
        self.whole_keys: set[int] = set()  # outside storages an as_strided view reads: copied whole
        self.written_tensors: list[torch.Tensor] = []  # outside tensors the call wrote: their versions put back
        self.made_geometry: dict[int, tuple[Any, ...]] = {}  # value -> its geometry before an in-place view op
        self.read_keys: set[int] = set()  # storages the call's ops read so far (but what a batch norm updates)
        self._updating: set[int] = set()  # input storages the op being recorded updates (NOTE [writes into inputs])
        self.free_input_keys: set[int] = set()  # storages of the inputs with no history at any level (set by the frame)
        self.no_levels = False  # no torch.func level around the call (set by the frame)
        self.inputs_written: set[int] = set()  # input storages written as NOTE [writes into inputs] says
        self.inputs_rewritten: set[int] = set()  # input storages written otherwise too (the recompute writes them)
        self.input_read_then_written: torch.Tensor | None = None  # NOTE [hidden writes into inputs]

    def _absolute_view(self, ins: list[torch.Tensor]) -> None:
        """An ``as_strided`` view of an outside storage: its copy is of all of it (``ox.StorageSnapshot``)."""
        with internal():
            for t in ins:
                k = storage_key(t)
                if self.is_outside(k, t):
                    self.whole_keys.add(k)
                    shadow = self.shadows.get(k)
                    if shadow is not None and shadow.snap is not None:
                        shadow.snap.cover(t, whole=True)

    def _outside_reads(self, ins: list[torch.Tensor], keys: list[int], vids: list[int],
                       view: bool = False) -> list[tuple[int, torch.Tensor, int]] | None:
        """The op's reads of outside tensors (NOTE [outside tensors]).

        Held strongly: an outside tensor that dies during the forward pass was replaced (a cache
        slot reassigned, a buffer rebound), exactly what the recompute must notice; the
        temporaries that also die (wrapped scalars) are tiny and pass as equal constants.
        """
        found = None
        if not view:  # (a view reads no value: the ops that read it do)
            self.read_keys.update(k for k in keys if k not in self._updating)
        self._updating.clear()
        for j, (t, k, v) in enumerate(zip(ins, keys, vids)):
            if v in self.made_by or not self.is_outside(k, t):
                continue
            if t.is_inference():
                raise inference_tensor(self.fn_name, "a tensor from outside its arguments (a global, a buffer)", t)
            if found is None:
                found = []
            found.append((j, t, t._version))
        return found

    def _before_mutation(self, func: Any, args: Any, kwargs: Any,
                         ins: list[torch.Tensor]) -> dict[int, Any] | None:
        """Copy-on-write: a stashed output about to be written in place (itself or through a view) is copied first.

        Returns copies of the outside tensors the op is about to write (NOTE [outside tensors]);
        a write only into outside tensors changes no value of the call.
        """
        subst = None
        inside = False
        written = ox.written_positions(func, args, kwargs)
        with internal():
            for j in written:
                t = ins[j]
                k = storage_key(t)
                if k == 0 and self.known_vid(t) is None and t.device.type != "meta":
                    raise empty_written(self.fn_name, t, func)
                if self.is_outside(k, t):
                    # NOTE [written outside storages]: the reads of this storage since its last write, and the
                    # write itself, read and write the recompute's own copy of it
                    shadow = self.shadows.get(k)
                    if shadow is None:
                        shadow = self.shadows[k] = Shadow.of(t, k in self.whole_keys)
                    if not any(w is t for w in self.written_tensors):
                        self.written_tensors.append(t)  # (the recompute puts its version back: ``Frame._recompute``)
                    for rec, pos, read in self._pending.pop(k, ()):
                        if rec.subst is None:
                            rec.subst = {}
                        rec.subst.setdefault(pos, shadow.at(read))
                    self.written_outside.add(k)
                    if subst is None:
                        subst = {}
                    v = self.known_vid(t)
                    # a view the call made of it is one of the copy in the recompute already: written as it is
                    # (the ops after it read that very tensor, as in the forward pass)
                    subst[j] = None if v in self.made_by and shadow.snap is not None else shadow.at(t)
                elif k in self.input_keys and k not in self.producers and (
                        func in ox.HIDDEN_WRITES or func is _RENORM
                        or (k in self.free_input_keys and self._no_gradient_into(k, ins))):
                    # NOTE [writes into inputs]
                    if k in self.read_keys:
                        self.input_read_then_written = t
                    self._updating.add(k)
                    self.inputs_written.add(k)
                    if not any(w is t for w in self.written_tensors):
                        self.written_tensors.append(t)  # (the recompute's write moves its version: put back)
                    if subst is None:
                        subst = {}
                    subst[j] = t.detach().clone()
                else:
                    inside = True
                    if k in self.input_keys:
                        self.inputs_rewritten.add(k)  # (run again on the input itself: it raises, NOTE [writes ...])
        if subst is None or inside:
            self.mutated_inplace = True
            # schema writes: all arguments (over-approximated, as always); batch norm's: the statistics
            self._copy_on_write(func, [ins[j] for j in written] if func in ox.HIDDEN_WRITES
                                else tensor_leaves((args, kwargs)))
        return subst

    # NOTE [written before offloaded]
    #     An output the policy offloads is held weakly until an op the recompute runs reads it (NOTE [stash
    #     liveness]), and only then handed to the offload engine. Written in place before that (LayerNorm's
    #     forward-mode formula divides a sum it made, in place, under jvp, jacfwd and hessian), it is copied before
    #     the write and the copy is kept as a saved output is, on either side of torch.func; under torch.func its
    #     decision becomes Saveable, so that its saved tensors are kept too. An output already handed to the engine
    #     (its copy may be under way) and written in place under torch.func still raises in ``Frame.forward``: that
    #     replay gave wrong gradients. (The replay engine instead hands such an output to the engine at the write:
    #     ``Trace.before_write``.)
    def _no_gradient_into(self, k: int, ins: list[torch.Tensor]) -> bool:
        """Whether an op writing input storage ``k`` reads nothing that may carry a gradient into it: only inputs
        with no history, tensors from outside that need none, and the written storage itself."""
        for a in ins:
            ka = storage_key(a)
            if ka == k or ka in self.free_input_keys or not (a.is_floating_point() or a.is_complex()):
                continue  # (the written storage, an input with no history, an index: no gradient)
            # (with no torch.func level, the tensors an op reads are the call's own, which say whether they need one)
            if (self.is_outside(ka, a) or self.no_levels) and not a.requires_grad:
                continue
            return False
        return True

    # NOTE [writes into inputs]
    #     The full engine's recompute runs the call's ops on its inputs again: a write into an input would happen
    #     twice. A write that carries no gradient (a batch norm's running statistics passed as arguments, whose
    #     schema hides the write; ``embedding_renorm_`` of ``F.embedding(..., max_norm=...)``, which torch runs
    #     under no_grad; a write into an argument with no history at any level and no forward-mode level, of
    #     values with no history either: an accumulator) writes, in the recompute, into a copy of the input
    #     taken before the forward's write: the op reads what it read, the input is written once, and the ops
    #     after it read the input as the forward pass left it, as they read it then. An op of the call that read
    #     such an input before the write would read the written value in the recompute: refused
    #     (``Frame._check_forward_mutation``), never silently different. Other writes into inputs raise there.
    #     The recompute's write still moves the input's version counter (above the dispatch level): put back, as
    #     an outside tensor's (``Recorder.written_tensors``).
    def _copy_on_write(self, func: Any, written: list[torch.Tensor]) -> None:
        # a write that depends on what it overwrites (not a fill, a copy or a random draw)
        partial = (torch.Tag.inplace_view not in func.tags and torch.Tag.nondeterministic_seeded not in func.tags
                   and func.overloadpacket not in OVERWRITES)
        with internal():
            keys = {storage_key(t) for t in written} - {0}
            if torch.Tag.inplace_view not in func.tags:  # squeeze_ & co. change shapes, not data
                self.written |= keys
                if self.on_write is not None and keys:
                    self.on_write(keys)
            else:
                for t in written:  # (held later, a value is held at the geometry its op made: ``promote``)
                    v = self.known_vid(t)
                    if v is not None and v in self.made_by and v not in self.made_geometry:
                        self.made_geometry[v] = ox.geometry(t)
            for rec in self.ops:
                if rec.stash is None:
                    continue
                for pos, ref in enumerate(rec.stash):
                    cur = ref() if isinstance(ref, weakref.ref) else ref
                    if isinstance(cur, torch.Tensor):
                        if storage_key(cur) in keys:
                            rec.stash[pos] = cur.detach().clone()
                            rec.cow = True
                            if partial and isinstance(rec.decision, Offloadable):
                                if self.keep_written_offloads:
                                    # NOTE [written before offloaded]
                                    rec.decision = Saveable
                                else:
                                    self.offloaded_written = func
                    elif cur is not None and cur.engine.shares_storage(cur, keys):
                        if partial:
                            self.offloaded_written = func
                        else:
                            # (a fill: the copy holds the value as its op made it, which the recompute reads; the
                            # forward pass's own write is no write after saving: ``seal`` watches from after it)
                            self.refilled.append(cur)
                        # offloaded: on CUDA the write must wait until its copy to the host ran
                        cur.engine.before_write(cur)

    def _settle_outside(self, rec: OpRecord) -> None:
        assert rec.outside is not None
        keep = []
        for j, t, version in rec.outside:
            if rec.subst is not None and j in rec.subst:
                continue  # served from a copy taken before a write overwrote what it read
            written = storage_key(t) in self.written_outside
            if not written and (t.requires_grad or ox.nbytes(t) > ox.SMALL or self.region):
                # checked by the recompute: the same tensor, unmodified (in a reentrant region, a small one too: the
                # vjp's graph its recompute builds reads the tensor the Python passed, whatever a copy below says)
                keep.append((j, t, version))
                continue
            # read after the call's last write into it: the recompute's copy (NOTE [written outside storages]);
            # or a buffer or constant that needs no gradient and is small (running statistics, a tensor built
            # from Python data): a copy the recompute reads whatever happens to it next (even writes torch does
            # not count as versions, like a batch norm's, outside the call)
            if rec.subst is None:
                rec.subst = {}
            shadow = self.shadows.get(storage_key(t)) if written else None
            rec.subst[j] = shadow.at(t) if shadow is not None else t.detach().clone()
        rec.outside = keep or None


class Shadow:
    """NOTE [written outside storages]
    An outside tensor the call writes in place (a cache slot, a buffer, ``torch.sin(h, out=G[1])``) is not written
    again by the recompute: at the call's first write into its storage the recorder copies the whole storage, and
    every op of the call that reads or writes that storage from then on, and the reads before the write, get a
    view of the recompute's own copy of it at the same geometry (``ShadowView``). The recompute's writes land in
    its copy, so a view the call made of the outside tensor before a write reads the written values after it, as
    in the forward pass. Each recompute starts from a fresh copy of the snapshot (``Replayer.shadows``). Its
    writes still move the version counter of the real tensor (the views it writes through were made above the
    dispatch level): the recompute puts it back (``Recorder.written_tensors``, ``ti.set_version``), so that the
    call's kept views of it and any node outside the call that saved it see what is true, an unchanged tensor.
    """

    __slots__ = ("snap",)

    def __init__(self, snap: ox.StorageSnapshot | None) -> None:
        self.snap = snap  # the storage before the call's first write into it, or None

    @staticmethod
    def of(t: torch.Tensor, whole: bool = False) -> Shadow:
        try:
            return Shadow(ox.StorageSnapshot(t, whole))
        except (RuntimeError, NotImplementedError):  # (a wrapper subclass: copies of each read, as before)
            return Shadow(None)

    def at(self, t: torch.Tensor) -> Any:
        """What the recompute reads for ``t`` (a view of this storage): a view of its copy, or a copy of ``t``."""
        if self.snap is None:
            return t.detach().clone()
        self.snap.cover(t)
        return ShadowView(self, ox.geometry(t))


class ShadowView:
    __slots__ = ("shadow", "geometry")

    def __init__(self, shadow: Shadow, geometry: tuple[Any, ...]) -> None:
        self.shadow = shadow
        self.geometry = geometry

    def view(self, copies: dict[int, Any]) -> torch.Tensor:
        """The view, on the recompute's copy of the storage (``copies``: id of a Shadow -> its copy)."""
        snap = self.shadow.snap
        assert snap is not None
        e = copies.get(id(self.shadow))
        if e is None:
            e = copies[id(self.shadow)] = (self.shadow, snap.copy())
        return snap.view(e[1], self.geometry)


def with_copies(self: Any, rec: OpRecord, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """Op ``rec``'s arguments with the copies the forward pass recorded for it in place (``self``: the full
    engine's ``Replayer``; NOTE [written outside storages])."""
    assert rec.subst is not None
    return ox.replace_tensors(args, kwargs, {
        j: c.clone() if isinstance(c, torch.Tensor) else c.view(self.shadows)
        for j, c in rec.subst.items() if c is not None})


def placeholders(self: Any) -> None:
    """A value built from Python data (``torch.from_numpy(t.numpy())``, ``torch.tensor(t.tolist())``) differs from
    the forward pass's while the recompute handed back placeholders for dead ops (``self``: the full engine's
    ``Replayer``): the data was read from one where no mode sees (NOTE [dead ops]), so run again without skipping."""
    if self.skip_dead and (self.tainted or self.unused_keys):
        raise DeadRead


def outside_args(self: Any, i: int, rec: OpRecord, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """The recompute's half of NOTE [outside tensors] (``self``: the full engine's ``Replayer``): check op ``i``
    reads the forward pass's outside tensors; hand it copies where recorded."""
    with internal():
        ins = arg_tensors(args, kwargs)
        casts: dict[int, torch.Tensor] = {}
        for j, t0, version in rec.outside or ():
            if rec.subst is not None and j in rec.subst:
                continue  # served from a copy taken before a write (not yet settled: a partial recompute)
            cur = ins[j] if j < len(ins) else None
            if cur is None:
                raise self.diverged(f"op #{i} {rec.describe()} has fewer tensor arguments than in the forward pass")
            same = cur is t0 or (storage_key(cur) == storage_key(t0) and ox.geometry(cur) == ox.geometry(t0))
            if not same and self.same_cast(cur, t0):
                # NOTE [autocast's cache]: the cast of one leaf the forward pass read from the cache: the very
                # tensor it read (the cache may hold a cast of the leaf's value before a write since)
                casts[j] = t0
                continue
            if same:
                if cur._version != version:
                    raise RematError(
                        f"remat: a tensor of shape {list(cur.shape)}{self.rec._label(t0)} that "
                        f"{self.rec.fn_name} reads without taking it as an argument was modified in place "
                        f"after its forward pass (version {version} -> {cur._version}), before the "
                        "backward pass recomputed from it; the recompute would read the new value. Run "
                        "the backward pass before updating it (e.g. optimizer.step() after backward()), "
                        "or clone it."
                    )
                continue
            lift = rec.func in LIFTS  # (Python data lifted: its value matters, not the tensor, which a custom
            # autograd.Function returning it made require a gradient since: torch.from_numpy inside its forward)
            if ((lift or (not cur.requires_grad and not t0.requires_grad)) and cur.shape == t0.shape
                    and cur.dtype == t0.dtype and cur.device == t0.device and torch.equal(cur, t0)):
                continue  # a constant made afresh on every call, with the same value
            if lift:
                placeholders(self)  # (the data came from a placeholder: NOTE [dead ops])
            raise RematError(
                f"remat: the recompute of {self.rec.fn_name} read a different tensor of shape "
                f"{list(cur.shape)}{self.rec._label(t0)} than its forward pass did, as argument "
                f"#{j} of op #{i} {rec.func}: a tensor that is not an argument of the function (a "
                "module's parameter or buffer, a closed-over or global tensor) was replaced between "
                "the forward and the backward pass, and gradients would be wrong. Pass it to the "
                "function as an argument, or keep it in place until the backward pass; for modules, "
                "use remat.remat_module(module), whose parameters and buffers remat puts back. A cache the "
                "call itself updates (a key/value cache, a rolling buffer) is such a tensor: for a Hugging Face "
                "model pass use_cache=False (model.config.use_cache = False)."
                + (f" (Its shape was {list(t0.shape)} in the forward pass.)" if cur.shape != t0.shape else "")
            )
        if rec.subst is not None:
            args, kwargs = with_copies(self, rec, args, kwargs)
        if casts:
            args, kwargs = ox.replace_tensors(args, kwargs, casts)
    return args, kwargs
