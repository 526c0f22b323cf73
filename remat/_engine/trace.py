"""The replay engine's record of one call: every ATen op its forward pass ran, replayable without the user's Python.

NOTE [the trace]
    A :class:`Tracer` (a dispatch mode, below autograd) sees each ATen op of the call and stores it as a
    :class:`Step`: the overload, its non-tensor arguments as they were, and every tensor argument as a *slot*
    (an int). A slot names one value of the call: an output of an earlier step (an in-place write gives its
    result a new slot, so a value is never renamed behind a reader's back), or an *outside* tensor (an input
    of the call, a parameter, a buffer, a global, the data behind ``torch.tensor(...)``), held with its version.
    What the replay needs besides (``replaying.py``):

    * random steps note their generator's state before they draw (a seed set inside the function, a user's
      generator, a Megatron-style tracker's fork: whatever the state was, the replay draws the same numbers);
    * factory steps (no tensor argument) pin the dtype and device they produced, and the replay runs under the
      call's default dtype, each step that ran under another (set inside the function) under that one, and so
      for the thread count (``torch.set_default_dtype`` between the passes changes nothing, not even ``i / 7``
      of integers);
    * each step notes whether grad mode was on (a ``torch.no_grad()`` block replays without a graph);
    * the kernel flags of the call (matmul precision, deterministic mode, oneDNN/cuDNN switches, flush_denormal, the
      default dtype, the thread count) are noted once
      per call and set for the replay (``AmbientFlags`` in ``ambient.py``, which every recompute sets).

    The policy is asked about every step as it runs; a step it keeps has its outputs held (weakly until a
    step the replay may run reads them: NOTE [stash liveness] of this engine, ``Trace.read_by_replay``).

NOTE [outside writes]
    A step that writes into an outside tensor (a BatchNorm's running statistics, an accumulator, renormalised
    embedding rows, an input written through a view) would write it again if the replay ran it on the tensor
    itself. Before the first write into an outside tensor's storage the tracer copies the storage
    (``Trace.shadows``); each replay reads and writes views of one fresh copy of it, at each outside tensor's
    geometry (``Trace.shadowed``: two outside tensors on one storage, ``G`` and ``G.view(-1)[4:8]``, see each
    other's writes as in the forward pass), so the real tensor is written once, by the forward pass, and every
    step reads what it read then. Which arguments an op writes comes from its schema
    (``(a!)``), and for the few ops whose schema hides a write, from the argument names that torch's own
    schemas declare written elsewhere (``running_mean``, ``running_var``: ``hidden_write``); a write
    neither shows (a version that moved across a step of a non-ATen op that declares none) makes that step's outputs
    held rather than replayed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import optree
import torch

from .._context import CACHES, INTERNAL, PENDING_NAME, internal
from .._errors import RematError, inference_tensor, sparse_outside_written
from .._policies.core import (
    Decision,
    Offloadable,
    Recompute,
    Saveable,
    decide,
    decide_answer,
    decide_explicit,
    nothing_saveable,
    op_only,
    policy_failed,
)
from .._policies.naming import checkpoint_name
from .._torch_internals import TorchDispatchMode
from . import outside as ox
from .ambient import AmbientFlags, draw_first
from .ops import (
    ALIAS,
    FLAT,
    LIFTS,
    RANGE_OPS,
    Alias,
    OpInfo,
    Step,
    arg_tensors,
    generator_for,
    not_the_policys,
    op_info,
    plain_subclass,
    profiler_op,
    sparse_parts,
)
from .ops import slot_key as _storage_key

__all__ = ["Trace", "Tracer", "unseen_aliases"]

Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_grad_enabled = torch.is_grad_enabled
AS_STRIDED = torch.ops.aten.as_strided.default
_default_dtype = torch.get_default_dtype
_num_threads = torch.get_num_threads


class Trace:
    """One call's record: its steps, its outside tensors and what the policy keeps (NOTE [the trace])."""

    def __init__(self, fn_name: str) -> None:
        self.fn_name = fn_name
        self.steps: list[Step] = []
        self.n = 0  # slots handed out
        self._slot_of: dict[int, tuple[weakref.ref[Tensor], int]] = {}  # id(tensor) -> (ref, slot)
        self.producer: dict[int, Step] = {}  # op-made slot -> its step
        self.refs: dict[int, weakref.ref[Tensor]] = {}  # op-made slot -> its tensor, weakly
        self.on_demote: Callable[[int], None] | None = None  # a name dropped a kept slot (the frame re-packs it)
        self.on_write: Callable[[int], None] | None = None  # a storage about to be written (the offload engine)
        self.on_quiet_write: Callable[[Any], None] | None = None  # an offloaded save written, its version unmoved
        self.root: dict[int, int] = {}  # a view's slot -> the slot it is a view of, transitively (its version counter)
        self.offload: Callable[[int, Tensor, Any], bool] | None = None  # hands a kept slot to the offload engine (True: it did)
        self.outside: dict[int, tuple[Tensor, int]] = {}  # outside slot -> (tensor, version when first read)
        self.outside_keys: dict[int, list[int]] = {}  # storage key -> outside slots living there
        self.inputs: dict[int, int] = {}  # outside slot -> which input of the call (set by the frame)
        self.snapshots: dict[int, Tensor] = {}  # outside slot -> a copy of its value (small ones: ``_prune``)
        self.lifted: dict[int, Any] = {}  # outside slots Python data was lifted from -> a hash of a large one's value
        # NOTE [outside writes]: storage key -> the storage before the call first wrote it; the outside slots on it
        # -> (key, geometry): every replay reads and writes views of one fresh copy of that storage
        self.shadows: dict[int, Any] = {}  # (ox.StorageSnapshot, or None for a wrapper subclass)
        self.shadowed: dict[int, tuple[int, tuple[Any, ...]]] = {}
        self.geometry0: dict[int, tuple[Any, ...]] = {}  # outside slot -> its geometry before an in-place view op
        self.reshaped: set[int] = set()  # outside slots an in-place view op reshaped (t_, unsqueeze_)
        # op-made slot -> the geometry its op made, before an in-place view op (``t.t_()``) changed its tensor's:
        # a kept value is held at it (``made``), as the steps after its op read it
        self.made_geometry: dict[int, tuple[Any, ...]] = {}
        self.whole_keys: set[int] = set()  # outside storages an as_strided view reads: copied whole
        self.stash: dict[int, Any] = {}  # kept slot -> its tensor (strong) or a weak reference
        self.stash_keys: dict[int, list[int]] = {}  # storage key -> kept slots living there
        self.raw: set[int] = set()  # kept slots held as the tensor itself until the forward pass ends (``seal``)
        self.stash_versions: dict[int, int] = {}  # kept slot held strongly -> its version then (a write since: recompute)
        # dropped tensors a write may have moved (after_write), with the tensors the write wrote in their storage
        self.pending: list[tuple[Any, Tensor, list[Tensor]]] = []
        # NOTE [quiet writes]: dropped or offloaded slots a write of the call changed without moving their version
        self.quiet_written: set[int] = set()
        self.copied: set[int] = set()  # kept slots copied (or offloaded) before a write: a replay may read the copy
        # (slot, version when saved) of the dropped tensors' saves a write in the forward pass made stale -> (shape,
        # dtype, version) after the write (NOTE [dropped packs] in traced.py)
        self.moved: dict[tuple[int, int], tuple[Any, Any, int]] = {}
        # the frame's packs of dropped (and offloaded) tensors, in the order saved; by storage key, those indexed so far
        # (at the call's first write in place: a call that writes nothing pays nothing per save)
        self.drops: list[Any] = []
        self.dropped_keys: dict[int, list[Any]] = {}
        self._indexed = 0
        self.key_of: dict[int, int] = {}  # slot -> the storage key its tensor had when the trace met it
        self.parts: dict[int, tuple[int, ...]] = {}  # a sparse slot -> its indices' keys (written as its values may be)
        self.written_keys: set[int] = set()  # storage keys some step wrote in place
        self.first_rng: dict[int, tuple[torch.Generator, torch.Tensor]] = {}  # generator -> state before its first draw
        self.flags = AmbientFlags()
        # the steps that ran under another default dtype or thread count than the call's start (set inside): theirs
        self.dtype0, self.threads0 = torch.get_default_dtype(), torch.get_num_threads()
        self.settings: dict[Step, tuple[torch.dtype, int]] = {}
        self.drew: dict[Step, torch.Tensor] = {}  # a random step: its generator's state after it drew, to check
        self.external: Callable[[int, Tensor], Any] | None = None  # nested calls: an outside tensor the parent made
        self.made_on: set[int] = set()  # the storage keys of the call's ops' outputs (NOTE [unseen aliases]), and
        self.alias_checked: set[int] = set()  # the outside slots asked whether they alias one of those storages
        self.made_keys: tuple[int, dict[int, list[int]]] = (0, {})  # slots indexed so far; storage key -> op-made slots

    # ---- slots ---------------------------------------------------------------
    def slot_of(self, t: Tensor) -> int | None:
        e = self._slot_of.get(id(t))
        if e is not None and e[0]() is t:
            return e[1]
        return None

    def read(self, t: Tensor) -> int:
        """The slot of an argument: an op-made value, or an outside tensor (held, version noted)."""
        e = self._slot_of.get(id(t))
        if e is not None and e[0]() is t:
            return e[1]
        if t.is_inference():
            raise inference_tensor(self.fn_name, "a tensor from outside its arguments (a global, a buffer)", t)
        s = self.n
        self.n = s + 1
        self._slot_of[id(t)] = (weakref.ref(t), s)
        self.outside[s] = (t, t._version)
        key = self.key_of[s] = _storage_key(t)
        self.outside_keys.setdefault(key, []).append(s)
        if t.layout is not torch.strided:  # (a sparse tensor's indices: a write there is a write of it, replayed)
            self.parts[s] = sparse_parts(t)
        snap = self.shadows.get(key) if self.shadows else None
        if snap is not None:  # (first read after the call wrote its storage: from the replay's copy too)
            with internal():
                snap.cover(t)
            self.shadowed[s] = (key, ox.geometry(t))
        if self.external is not None:
            self.external(s, t)  # a nested call: the parent may have made it (NOTE [nested replay])
        return s

    def new_slot(self, t: Tensor, step: Step) -> int:
        s = self.n
        self.n = s + 1
        ref = weakref.ref(t)
        self._slot_of[id(t)] = (ref, s)
        self.refs[s] = ref
        self.producer[s] = step
        try:
            # (_storage_key, inline; an offset is a SymInt only on a fake tensor, whose data_ptr raises first)
            self.key_of[s] = k = t.data_ptr() - t.storage_offset() * t.itemsize or -id(t)  # type: ignore[assignment]
            self.made_on.add(k)  # type: ignore[arg-type]
        except (RuntimeError, NotImplementedError):
            if k := _storage_key(t):  # (a sparse tensor's: its values', and its indices' besides)
                self.key_of[s] = k
                self.made_on.add(k)
                self.made_on.update(self.parts.setdefault(s, sparse_parts(t)))
        return s

    def data_replaced(self, s: int, t: Tensor) -> bool:
        """NOTE [data replaced] in traced.py: whether ``t``'s storage is no longer the one slot ``s``'s op made (an
        empty one's key is its tensor's, not its view's or base's: nothing to replace; 0: no data pointer)."""
        k, now = self.key_of.get(s), _storage_key(t)
        return k is not None and now != 0 and now != k and not (k < 0 and now < 0)

    # ---- what the replay may read instead of running a step ----------------------
    def keep(self, s: int, t: Tensor) -> None:
        self.stash[s] = self.refs[s]
        self.stash_keys.setdefault(self.key_of.get(s, 0), []).append(s)

    def read_by_replay(self, s: int) -> None:
        """A step the replay may run reads slot ``s``: if the policy kept it, hold it now (NOTE [the trace]); if the
        policy offloads it, hand it to the offload engine instead (``offload``, set by the frame)."""
        ref = self.stash.get(s)
        if ref is not None and type(ref) is weakref.ref:
            t = ref()
            if t is None:
                del self.stash[s]
                return
            decision = self.producer[s].decision
            if isinstance(decision, Offloadable) and self.offload is not None and \
                    self.offload(s, self.made(s, t), decision):
                del self.stash[s]
                return
            # the tensor itself until the forward pass ends (a detach made here, below autograd, would have a version
            # counter of its own, blind to the caller's writes through h.detach()): ``seal`` detaches it then
            self.stash[s] = t
            self.stash_versions[s] = t._version
            self.raw.add(s)

    def seal(self) -> None:
        """The forward pass ended, outside every mode: hold kept values as detached aliases, which share their
        version counter (no graph is held: the tensor's node would hold the frame, a cycle through C++)."""
        for s in self.raw:
            t = self.stash.get(s)
            if t is not None and type(t) is not weakref.ref:
                # (a nested call's go to its parent, which must know the tensor itself: ``made`` when they come back)
                self.stash[s] = t.detach() if self.external is not None else self.made(s, t.detach())
        self.raw.clear()
        for s in self.reshaped:  # (an in-place view op moved the version, not the values: a write moves it further)
            t = self.outside[s][0]
            self.outside[s] = (t, t._version)
        # the versions a write after the forward pass would move (the forward's own writes copied the values
        # before them, and its squeeze_ & co. moved the counter without changing a value)
        for s, t in self.stash.items():
            if type(t) is not weakref.ref:
                self.stash_versions[s] = t._version

    def made(self, s: int, t: Tensor) -> Tensor:
        """Kept slot ``s``'s tensor ``t`` (or an alias of it) at the geometry its op made (``made_geometry``)."""
        g = self.made_geometry.get(s) if self.made_geometry else None
        if g is None:
            return t
        with internal():
            return ox.at_geometry(t, g)

    def before_write(self, t: Tensor) -> int:
        """NOTE [outside writes]: an op is about to write ``t`` in place; return its storage key."""
        key = _storage_key(t)
        self.written_keys.add(key)
        outside = self.outside_keys.get(key)
        if self.parts and not outside and any(key in p for s, p in self.parts.items() if s in self.outside):
            raise sparse_outside_written(self.fn_name, t)
        if outside and key in self.made_on:
            outside = unseen_aliases(self, key, outside)  # NOTE [unseen aliases] in _engine/program.py
        if outside:
            with internal():
                if key not in self.shadows:
                    try:
                        self.shadows[key] = ox.StorageSnapshot(self.outside[outside[0]][0], key in self.whole_keys)
                    except (RuntimeError, NotImplementedError):  # (a wrapper subclass: a copy of each slot)
                        self.shadows[key] = None
                snap = self.shadows[key]
                for s in outside:
                    if s not in self.snapshots and s not in self.shadowed:
                        o = self.outside[s][0]
                        if snap is not None:
                            snap.cover(o)
                            # (its geometry when the call first read it: an in-place view op since is replayed)
                            self.shadowed[s] = (key, self.geometry0.get(s) or ox.geometry(o))
                        else:
                            self.snapshots[s] = o.detach().clone()
        kept_here = self.stash_keys.pop(key, ())
        if len(kept_here) > 1 and sum(_alive(self.stash.get(s)) for s in kept_here) > 1:
            # several values the policy keeps on this storage (``unsafe_split``'s pieces and what they split, which
            # no schema calls views): copies of each would not see a write into the others, which a later step
            # reads through them; the replay makes them again instead, aliasing as in the forward pass
            for s in kept_here:
                self.stash.pop(s, None)
                self.stash_versions.pop(s, None)
                self.raw.discard(s)
            kept_here = []
        for s in kept_here:
            # a value the policy keeps, about to be written: keep its value before the write (the replay of a later
            # step reads that), copied, or handed to the offload engine now if the policy offloads it
            v = self.stash.pop(s, None)
            v = v() if type(v) is weakref.ref else v
            if v is None:
                continue
            self.copied.add(s)  # NOTE [quiet writes]
            decision = self.producer[s].decision
            if isinstance(decision, Offloadable) and self.offload is not None and self.offload(s, v, decision):
                continue
            with internal():
                self.stash[s] = c = self.made(s, v.detach()).clone()
                self.stash_versions[s] = c._version
            self.made_geometry.pop(s, None)  # (the copy is at it)
        if self.on_write is not None:
            self.on_write(key)
        return key

    def after_write(self, keys: tuple[int, ...], written: list[Tensor] | None = None) -> None:
        """A step wrote these storages: a dropped tensor there whose version moves was written after its save (its
        unpack raises, as autograd's would; a tensor with a counter of its own, ``unsafe_split``'s, does not move).
        The counter moves above this mode, once the op returns: checked at the next op (``settle``)."""
        dk, drops = self.dropped_keys, self.drops
        for i in range(self._indexed, len(drops)):
            p = drops[i]
            k = self.key_of.get(p[0] if type(p) is tuple else p.slot)  # (a dropped tensor's tuple, or an offload's pack)
            if k is not None:
                dk.setdefault(k, []).append(p)
        self._indexed = len(drops)
        for n, key in enumerate(keys):
            ws = [written[n]] if written is not None else []
            for p in self.dropped_keys.get(key, ()):
                t = (p[2] if type(p) is tuple else p.ref)()
                if t is not None:
                    self.pending.append((p, t, ws))

    def forget_drops(self) -> None:
        """The forward pass ended: no write the tracer sees can move a dropped tensor's version any more."""
        self.drops = []
        self.dropped_keys.clear()
        self._indexed = 0

    def settle(self) -> None:
        for p, t, ws in self.pending:
            if type(p) is tuple:  # (a dropped tensor's pack: NOTE [dropped packs] in traced.py)
                if t._version != p[1]:
                    self.moved[(p[0], p[1])] = (t.shape, t.dtype, t._version)
                elif p[0] in self.copied and ws and _overlaps(ws, t):
                    self.quiet_written.add(p[0])  # NOTE [quiet writes] (only a copy can be stale)
            elif t._version != p.version:
                p.meta = (t.shape, t.dtype, t._version)
            elif ws and _overlaps(ws, t):
                self.quiet_written.add(p.slot)  # NOTE [quiet writes]
                if self.on_quiet_write is not None:
                    self.on_quiet_write(p)
        self.pending.clear()


# NOTE [quiet writes]
#     A write through ``t.data`` (or into an alias with a version counter of its own) changes a saved tensor's values
#     without moving its version: plain autograd reads the written values, without an error. A dropped tensor so
#     written is made by a replay that runs the write again; but a copy taken before the write (the offload engine's
#     of an offloaded save, a kept value's copied at the write) holds the values before it. So a write whose bytes
#     overlap a dropped or offloaded save whose version did not move marks its slot: an offloaded save is then served
#     as a dropped one, and the replay makes such a slot again rather than read a copy (``replaying._stale``). The
#     overlap is exact (``outside.overlap``): a piece of ``unsafe_chunk`` written is not its sibling (``nn.GRUCell``).
class Tracer(TorchDispatchMode):
    """The forward pass's dispatch mode: record each op (NOTE [the trace]) and ask the policy about it."""

    def __init__(self, trace: Trace, policy: Callable[..., Any]) -> None:
        super().__init__()
        self.trace = trace
        self.policy = policy
        self.with_output = getattr(policy, "with_output", None)  # (policies._core.ask: one that reads the output)
        self.nothing = policy is nothing_saveable  # (whose answer is known: not asked per op)
        # a policy whose answer depends on the op alone: asked once per op (and policy), on the short path
        self.answers: dict[int, tuple[Any, Decision]] | None = None
        if not self.nothing and op_only(policy):
            self.answers = CACHES.get().answers.setdefault(policy, {})  # (Caches.answers: keyed weakly by the policy)
        # id(overload) -> its OpInfo, for this call (op_info's cache hashes the overload with a Python method: a frame
        # per op on the hot path; an overload lives as long as torch.ops holds it, and its OpInfo holds it)
        self.infos: dict[int, OpInfo] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        info = self.infos.get(id(func))
        if info is None:
            info = self.infos[id(func)] = op_info(func)
        if info.ignored or INTERNAL.get():
            return profiler_op(func, args, kwargs) if func in RANGE_OPS else func(*args, **kwargs)
        if self.trace.pending:
            self.trace.settle()
        if not info.simple:
            return self._general(func, info, args, kwargs)
        # the short path (OpInfo.simple): positional tensors, no write, no draw
        trace = self.trace
        slot_of = trace._slot_of
        refs = []
        targs = list(args)
        n = len(args)
        plain = True
        for i in info.tpos:
            if i < n:
                a = args[i]
                if isinstance(a, Tensor):
                    if type(a) is not Tensor and type(a) is not _Parameter:
                        plain = False
                    e = slot_of.get(id(a))
                    refs.append((i, -1, e[1] if e is not None and e[0]() is a else trace.read(a)))
                    targs[i] = None
        if not plain:
            return self._general(func, info, args, kwargs)
        step = Step(func, info.call, targs, kwargs, refs)
        step.grad = grad = _grad_enabled()
        out = info.call(*args, **kwargs)
        if self.nothing:
            decision = Recompute
        elif self.answers is not None and (known := self.answers.get(id(func))) is not None and known[0] is func:
            step.decision = decision = known[1]
        elif not_the_policys(arg_tensors(args, kwargs), out):  # (forward AD's internal checks: forward_ad)
            decision = Recompute
        else:
            # (decide's work, inline: the answers most policies give)
            try:
                answer = self.policy(func, *args, **kwargs) if self.with_output is None else \
                    self.with_output(out, func, *args, **kwargs)
            except RematError:
                raise  # (a policy of remat's own that says what is wrong: as it is)
            except Exception as e:  # noqa: BLE001 (the policy's error, never the user's op's)
                raise policy_failed(self.policy, func, kwargs, e) from e
            decision = (Recompute if answer is False or answer is Recompute else Saveable if answer is True
                        else decide_answer(self.policy, func, kwargs, answer))
            step.decision = decision
            if self.answers is not None:
                # (by id, as infos: an overload hashes in Python; held with its answer, so that its id is not reused)
                self.answers[id(func)] = (func, decision)
        if type(out) is Tensor:
            s = trace.new_slot(out, step)
            step.outs.append(s)
            if info.view:
                r = refs[0][2]
                trace.root[s] = trace.root.get(r, r)
            elif decision is not Recompute:
                trace.keep(s, out)
            if not grad:
                step.nograd_outs = [weakref.ref(out)]
        else:
            self._outputs(step, out, decision is not Recompute and not info.view, grad)
        if decision is Recompute and trace.stash:
            stash = trace.stash
            for _, _, r in refs:
                if r in stash:
                    trace.read_by_replay(r)
        if _default_dtype() is not trace.dtype0 or _num_threads() != trace.threads0:
            trace.settings[step] = (_default_dtype(), _num_threads())
        trace.steps.append(step)
        return out

    def _outputs(self, step: Step, out: Any, keep: bool, grad: bool) -> None:
        trace = self.trace
        if isinstance(out, Tensor):
            leaves: Any = [out]
        elif type(out) is tuple and all(type(t) is Tensor for t in out):
            leaves, step.spec = out, FLAT  # (native_layer_norm's and most ops' tuples: no pytree walk, in either pass)
        else:
            leaves, step.spec = optree.tree_flatten(out, none_is_leaf=True)
        for t in leaves:
            if not isinstance(t, Tensor):
                step.outs.append(-1)
                continue
            s = trace.new_slot(t, step)
            step.outs.append(s)
            if not step.replayable:
                trace.stash[s] = t
                trace.stash_versions[s] = t._version
                trace.raw.add(s)
            elif keep:
                trace.keep(s, t)
        if not grad:
            step.nograd_outs = [weakref.ref(t) for t in leaves if isinstance(t, Tensor)]

    def _general(self, func: Any, info: OpInfo, args: Any, kwargs: Any) -> Any:
        """Every other op: lists of tensors, keyword tensors, writes, random draws, factories, names, subclasses."""
        trace = self.trace
        refs: list[tuple[Any, int, int]] = []
        targs = list(args)
        replayable = True
        for i, a in enumerate(args):
            if isinstance(a, Tensor):
                if type(a) is not Tensor and type(a) is not _Parameter and not plain_subclass(type(a)):
                    replayable = False
                refs.append((i, -1, trace.read(a)))
                targs[i] = None
            elif type(a) is list or type(a) is tuple:
                if any(isinstance(x, Tensor) for x in a):
                    targs[i] = [None if isinstance(x, Tensor) else x for x in a]
                    for j, x in enumerate(a):
                        if isinstance(x, Tensor):
                            refs.append((i, j, trace.read(x)))
            elif isinstance(a, (torch.UntypedStorage, torch.TypedStorage)):
                replayable = False
        tkw = kwargs
        for k, a in kwargs.items():
            if isinstance(a, Tensor):
                if tkw is kwargs:
                    tkw = dict(kwargs)
                refs.append((k, -1, trace.read(a)))
                tkw[k] = None
        step = Step(func, info.call, targs, tkw, refs)
        step.inplace_view = info.inplace_view
        if func in LIFTS and refs and refs[0][2] in trace.outside:
            trace.lifted[refs[0][2]] = None  # (a NumPy array's memory, which a write no version shows may change)
        if info.absolute:  # (as_strided of a tensor from outside: the replay's copy of its storage is whole)
            for _, _, r in refs:
                _whole(trace, trace.key_of.get(r, 0))
        if info.inplace_view and refs:
            r = refs[0][2]
            if r in trace.outside:
                if r not in trace.geometry0:
                    trace.geometry0[r] = ox.geometry(args[0])  # (t_, unsqueeze_ on a global: replayed on the copy)
                trace.reshaped.add(r)  # (its version moves, its values do not: ``seal`` notes the version after)
            elif r in trace.producer and r not in trace.made_geometry and r not in trace.copied:
                trace.made_geometry[r] = ox.geometry(args[0])  # (t_ on a value the policy may keep)
        if info.mutable:
            keys = []
            written: list[Any] = []  # (argument positions or names)
            wrote: list[Tensor] = []  # (the tensors, a list argument's each: _foreach_mul_)
            for k in (*info.written, *info.written_kw):
                a = (args[k] if k < len(args) else None) if type(k) is int else kwargs.get(k)
                n = len(wrote)
                for x in (a if type(a) is list or type(a) is tuple else (a,)):
                    if isinstance(x, Tensor):
                        keys.append(trace.before_write(x))
                        wrote.append(x)
                if len(wrote) > n:
                    written.append(k)
            step.writes = tuple(keys)
            if not any(a.requires_grad for a in arg_tensors(args, kwargs)):
                step.quiet = tuple(written)  # (autograd records nothing of this write)
        versions = None
        if not info.trusted and not info.mutable:
            # NOTE [outside writes]: a write no schema declares shows as a version that moved
            versions = [(x, x._version) for x in _outside_args(trace, refs, args, kwargs)]
        step.grad = grad = _grad_enabled()
        gen = generator_for(args, kwargs) if info.random else None
        if gen is not None:
            out, state, drew, held = draw_first(gen, func, info.call, args, kwargs)  # NOTE [draws in threads]
            if drew is not None:
                trace.drew[step] = drew
            replayable, step.rng = replayable and not held, (gen, state)
            trace.first_rng.setdefault(id(gen), (gen, state))
        else:
            replayable, out = replayable and not info.random, info.call(*args, **kwargs)
        if step.writes and trace.drops:
            trace.after_write(step.writes, wrote)
        elif info.inplace_view and trace.drops and args and isinstance(args[0], Tensor):
            # (t.t_(), squeeze_: no value written, but the version moves, and plain autograd refuses a saved tensor
            # so changed: a dropped tensor there whose version moved raises at its unpack)
            trace.after_write((_storage_key(args[0]),))
        if versions:
            for x, v in versions:
                if x._version != v:
                    # NOTE [outside writes]: a write no schema declares; the replay must not run this step (it
                    # would write again, from a value it cannot know): its outputs are held
                    replayable = False
        # the policy
        name = PENDING_NAME.get() if func is ALIAS else None
        explicit = False
        if name is not None:
            decision, explicit = decide_explicit(self.policy, checkpoint_name, args, {"name": name})
        elif not_the_policys(arg_tensors(args, kwargs), out):  # (forward AD's internal checks: forward_ad)
            decision = Recompute
        else:
            decision = decide(self.policy, func, args, kwargs, out)
        step.decision = decision
        step.replayable = replayable
        keep = decision is not Recompute and not info.mutable and not info.random and not info.view
        if keep and refs and isinstance(out, Tensor):
            # (an op that returns its argument's storage although its schema says nothing: not kept either)
            key = _storage_key(out)
            keep = all(_storage_key(a) != key for a in arg_tensors(args, kwargs))
        self._outputs(step, out, keep, grad)
        if info.view and refs:
            # each output is a view of the argument it aliases (its storage's value decides for it)
            first = refs[0][2]
            by_arg = {key: s for key, j, s in refs if j < 0}
            mapped = len(step.outs) == len(info.alias_of)  # (one output per return: no list among them)
            for k, o in enumerate(step.outs):
                if o >= 0:
                    a = info.alias_of[k] if mapped else None
                    r = first if a is None else by_arg.get(a, first)
                    trace.root[o] = trace.root.get(r, r)
        if info.pins and not refs and isinstance(out, Tensor):
            # a factory op: pin what it produced (a default dtype or device changed before the replay)
            if tkw is kwargs:
                tkw = step.kwargs = dict(kwargs)
            for k in info.pins:
                if tkw.get(k) is None:
                    tkw[k] = out.dtype if k == "dtype" else out.device
        if name is not None and refs and (decision is not Recompute or explicit):
            _name_decides(trace, refs[0][2], decision)
        if decision is Recompute or info.mutable or info.random:
            for _, _, r in refs:
                trace.read_by_replay(r)
        if _default_dtype() is not trace.dtype0 or _num_threads() != trace.threads0:
            trace.settings[step] = (_default_dtype(), _num_threads())
        trace.steps.append(step)
        return out


def _overlaps(ws: list[Tensor], t: Tensor) -> bool:
    with internal():  # (``ox.overlap`` runs ops)
        return any(ox.overlap(w, t) for w in ws)


def _alive(v: Any) -> bool:
    """Whether a stash entry still holds its value (a kept value that died may leave its slot under a storage key
    the allocator has handed to another since)."""
    return v is not None and (type(v) is not weakref.ref or v() is not None)


def _outside_args(trace: Trace, refs: list[tuple[Any, int, int]], args: Any, kwargs: Any) -> list[Tensor]:
    out = []
    for k, j, s in refs:
        if s in trace.outside:
            a = args[k] if type(k) is int else kwargs[k]
            out.append(a if j < 0 else a[j])
    return out


def _name_decides(trace: Trace, s: int, decision: Decision) -> None:
    """A ``checkpoint_name`` decides for the op that computed the named value (NOTE [names decide for the value])."""
    s = trace.root.get(s, s)  # (the name of a view names its storage's value)
    step = trace.producer.get(s)
    if step is None or step.rng is not None or not step.replayable:
        return
    if decision is Recompute:
        step.decision = decision
        for o in step.outs:
            trace.stash.pop(o, None)
            if trace.on_demote is not None:
                trace.on_demote(o)
        for r in step.reads():
            trace.read_by_replay(r)
    elif not step.writes and all(trace.key_of.get(o) not in trace.written_keys for o in step.outs if o >= 0):
        # (written in place since its op ran: the value named is not the op's output any more, which the replay
        # makes by running the writes again: it is recomputed)
        step.decision = decision
        for o in step.outs:
            if o < 0:
                continue
            t = trace.refs[o]()
            if o not in trace.stash and t is not None:
                trace.keep(o, t)
            trace.read_by_replay(o)  # it may have been saved as dropped before the name was known


def _whole(trace: Trace, key: int) -> None:
    """An ``as_strided`` view of storage ``key``: if it is outside, its copy is of all of it."""
    if key and key in trace.outside_keys:
        trace.whole_keys.add(key)
        snap = trace.shadows.get(key)
        if snap is not None:
            with internal():
                snap.cover(trace.outside[trace.outside_keys[key][0]][0], whole=True)


def unseen_aliases(trace: Trace, key: int, outside: list[int]) -> list[int]:
    """NOTE [unseen aliases] in _engine/program.py, on the trace, asked when storage ``key`` is about to be written
    (until then an alias read as a tensor from outside reads what the forward pass read): a tensor from outside
    (``nn.Parameter(t[1])``, ``t.data``) on the storage of a live tensor the call's ops made (not a view of one from
    outside), of its dtype's size, becomes a step that makes it from that one, before its first reader (returns the
    slots on ``key`` that stay outside)."""
    upto, index = trace.made_keys
    for i in range(upto, trace.n):
        if i in trace.producer and trace.root.get(i, i) not in trace.outside:  # (not a view of one from outside)
            index.setdefault(trace.key_of.get(i, 0), []).append(i)
    trace.made_keys = (trace.n, index)
    made = index.get(key)
    if not made:
        return outside
    stay: list[int] = []
    for s in outside:
        if s in trace.alias_checked:  # (asked once: only a tensor made before its first read can be what it aliases)
            stay.append(s)
            continue
        trace.alias_checked.add(s)
        t = trace.outside[s][0]
        at = next((i for i, step in enumerate(trace.steps) if s in step.reads()), len(trace.steps))
        before = {id(step) for step in trace.steps[:at]}  # (its alias is made where it was first read)
        try:
            a = None if s in trace.inputs or s in trace.geometry0 or s in trace.lifted else next(
                (m for m in reversed(made) if (x := trace.refs[m]()) is not None and x.dtype.itemsize ==
                 t.dtype.itemsize and id(trace.producer[m]) in before and x.untyped_storage() is t.untyped_storage()),
                None)
        except (RuntimeError, NotImplementedError):  # (no storage: a sparse tensor)
            a = None
        if a is None:
            stay.append(s)
            continue
        step = Step(AS_STRIDED, Alias(t), [None], {}, [(0, -1, a)])
        step.outs.append(s)
        del trace.outside[s]
        trace.shadowed.pop(s, None)
        trace.snapshots.pop(s, None)
        trace.producer[s], trace.refs[s] = step, trace._slot_of[id(t)][0]
        trace.root[s] = trace.root.get(a, a)
        trace.steps.insert(at, step)
    if stay:
        trace.outside_keys[key] = stay
    else:
        del trace.outside_keys[key]
    return stay
