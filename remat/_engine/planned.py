"""The planned engine: a remat call that follows the plan its signature's first call recorded (NOTE [fast path]
in ``plans.py``), instead of recording.

NOTE [offloaded and written]
    The full engine's recorder offloads an op's output as the op returns (for
    its replay) and sees every write: a write into a storage with a copy in the
    call gives a tensor saved after it a copy of its own (NOTE [one copy per
    storage] in ``_offload/copies.py``). A planned call with a dispatch mode tells the
    engine in the same way of the storages each in-place op its tap sees was
    given, the plan's or one past it (the target of ``q.data.mul_(2)`` is
    data). One without a mode sees no write. One with a
    dispatch mode holds outputs as the recorder did: a recorded call that wrote
    into any storage it had offloaded leaves no such plan. One without a mode
    (a policy that offloads and drops nothing, or holds nothing for its
    recompute) copies saved tensors only, each as it is saved. What it must not
    miss is a write into a storage copied for an earlier save through a tensor
    whose version counter a later save of it does not share (``unsafe_split``
    pieces, ``.data``): a tensor shares a copy only with tensors of its own
    counter, whose version moves with any write through it. So only a recorded
    call that wrote into a storage copied for a save, and alive, leaves no
    mode-less plan (a storage that died frees its address for another, which a
    write may hit). A call
    that also recomputes leaves none after any such write: the outputs the
    recorder offloaded and then saw written are not held by a plan (its
    recompute would run their matmuls again, where the full engine replays
    them). ``nn.ReLU(inplace=True)`` after a matmul under ``offload_to_cpu`` (the ReLU
    writes the product, which nothing saved before) is planned: before (found
    on 2026-12-02), every such call ran on the full engine (196 -> 34 us an op
    of the in-place MLP's forward pass).

    Not seen, as by any plan without a mode: a write that the signature's
    first call did not make (data-dependent), through a tensor with a version
    counter of its own (``h.data.mul_(2)``, an ``unsafe_split`` piece), into
    a storage copied for a save; a later save of it through the copied
    tensor's counter (``h`` itself, a view of it) shares the copy made before
    the write, where plain autograd reads the written bytes. Such a function
    runs exactly on the full engine: ``remat(f, debug=True)``. (Not sharing
    there would not do: one node that saves ``a`` and ``a[0:1]`` and writes
    ``a`` in its backward must read the slice as a view of the written ``a``,
    as plain autograd does, which only one device copy of the storage gives.)

NOTE [skipped tags]
    A ``checkpoint_name`` tag is an ``aten.alias`` op so that the recorder sees
    the name (NOTE [names decide for the value] in ``_policies.py``). A planned
    call has the decisions already: a tag the plan neither holds, skips as dead
    nor takes a dropped tensor from is let go. ``checkpoint_name`` asks the
    planned call's mode (``skip_name``), which counts the op index as run, and
    returns the tensor itself, as it does outside remat. The forward pass and
    both recomputes let the same tags go, so each saves the same tensors, made
    by the same nodes. Only a mode of this thread lets a tag go (a thread that
    copied the call's context has a mode stack of its own, which sees its
    tags), and only with no functorch transform or forward-AD level open there:
    under one, a tag dispatches more ops than its alias (a dual tensor's is
    followed by forward AD's checks). Not letting a tag go is always safe: its
    alias is the plan's op at that index. A tag cost an autograd node, a trip
    through the mode and one through the replay.

NOTE [value recompute]
    A recompute that builds the graph (grad mode on, capture hooks taking what
    autograd saves) pays for nodes, saved-tensor hooks and a detach per saved
    tensor only to throw the graph away: a backward pass without
    ``create_graph`` reads the values alone. The recorded call knows, for every
    tensor it dropped, which op returned it (the op's index, which of its
    tensors) and how many ops had run when it was saved. So a planned call whose
    backward pass runs without a graph recomputes under ``torch.no_grad()``: its
    replay mode (``ValueReplay``) takes each dropped tensor as that op returns
    it, and stops before the op after the one that saved the last of them. At
    each op it notes the versions of the tensors the forward pass saved by then
    (an in-place op's version moves above the mode, after the op returns), so a
    tensor written between the op that made it and the op that saved it holds
    the write, and one written after it was saved by an op the recompute
    replays raises when read (NOTE [written after saved]). A single tensor is
    held weakly until the next op: torch's binding detaches a factory's output
    (``rand_like``, ``zeros``) that Python holds as it returns, and the function
    would see another tensor (and an extra ``detach``).

    Which op made a dropped tensor is the recorded call's wiring; a planned
    call may save another tensor of the same shape at that position (``c = a if
    x[0, 0] > 0 else b``: the recompute would take ``a`` where the forward pass
    saved ``b``). So the tap notes the outputs the plan takes, and each dropped
    tensor must be the very one its op returned in this call; if one is not,
    that call recomputes with the graph, which takes what autograd saves, in
    order (found on 2026-12-02: before, a wrong gradient without an error). Only
    a tensor an op saved of its inputs is checked: one an op saved of its own
    output (``tanh``, ``softmax``) is that op's output whatever the wiring.

    Grad mode can change what a function runs (torch's
    ``TransformerEncoderLayer`` in eval mode takes a fused op without grad) or
    what it may do (``h.register_hook`` on an intermediate): any op that is not
    the plan's at its index, a dropped tensor of another shape or dtype, one that
    died before its save, or any error gives way to the recompute that builds
    the graph, for that call and the signature's later ones, which checks as
    before and raises if the function really diverged. So does an op that
    reads another Python value than the forward pass did (NOTE [same reads]):
    a value computed from grad mode (``2.0 if torch.is_grad_enabled() else
    1.0``) is the forward pass's again with the graph, and exact; one computed
    from state that changed raises there. (Before 2026-12-04 such a value gave
    a wrong gradient without an error.)

NOTE [written after dropped]
    A write into a tensor after an op saved it, through an alias whose version
    counter is its own (``t.data.mul_(3)`` after ``sin(t)`` saved ``t``), is
    invisible to autograd's check: plain autograd's backward pass reads the
    written bytes. A dropped tensor is made again by the recompute, which must
    then write it again: a planned recompute runs through the last op of the
    plan that writes in place (``_last_write``; the capture does not stop it
    before, the replay stops after), and the write, the same Python on the
    recomputed tensor, lands where it did in the forward pass. Before
    (2026-12-04), the recompute stopped at the last dropped tensor's save, and
    every call after a signature's first read the unwritten value: a wrong
    gradient without an error (the first call, on the full engine, replays
    every op). The recompute stops there, and runs no op past the plan a call
    followed. A call that left its plan (a data-dependent branch) and then
    wrote into the storage of a tensor it dropped (watched through weak
    references to the dropped tensors) cannot replay the write, which its plan
    does not have: its recompute raises ``RematError``, and the signature runs
    on the full engine from then on. Not seen: such a write through a ``.data``
    alias of a dropped tensor whose own object is gone (its storage lives on in
    the alias); watching storages instead costs a storage lookup per saved
    tensor, and a rule that refuses every write past the plan into a tensor made
    before it refuses ordinary code (an inner backward pass's accumulation). A write through the tensor's own counter (``t.detach().mul_``)
    moves its version: ``RematError`` on every call, as plain autograd raises.

NOTE [kept until the forward pass ends]
    A tensor a planned call keeps for the backward pass must be held without its
    graph: held as it is, an op's own output saved by its node would make a cycle
    through that node, which the collector never frees. Detached in the pack hook,
    the detach runs under the tap's dispatch mode and needs a guard to skip it
    (~1 us against 0.4). So the pack hook holds the tensor itself, and the end of
    the forward pass (or its failure) detaches every kept one, with no mode of the
    call's on the stack, as it does the held outputs (``_hold_plain``). Meanwhile a
    backward pass inside the forward pass reads the tensor itself, as autograd
    would; its version is noted at the save, and detaching shares the counter.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import optree
import torch

from .. import _torch_internals as ti
from .._ambient import AmbientState
from .._context import INTERNAL, internal, naming
from .._errors import RematError, input_written_before_backward, input_written_in_forward
from .._offload import Offloaded
from .._ops import (
    RANGE_OPS,
    Half,
    arg_tensors,
    identity_alias,
    ignored,
    profiler_op,
    storage_key,
    tensor_leaves,
    traits,
)
from .._packed import Made
from .._policies import Offloadable
from .._state import Snapshot
from .._torch_internals import TorchDispatchMode, saved_tensors_hooks
from .._wiring import Wiring, describe_difference, first_value, known_tokens, made_token
from .capture import holdable
from .plans import (
    ALIASING,
    RUN,
    TO_COPY,
    Hold,
    Plan,
    cast_agrees,
    off_the_plan,
    skip_tag,
    version_of,
    written_after_saved,
)
from .recompute import planned_recompute
from .region import NeedsRegion

__all__ = ["FastFrame"]

class _In:
    """An input saved for the backward pass: held by the frame, named by its slot, with its version when saved."""

    __slots__ = ("slot", "version")

    def __init__(self, slot: int, version: int) -> None:
        self.slot = slot
        self.version = version


class _Kept:
    """A tensor held by reference (module state the plan holds), with its version when saved."""

    __slots__ = ("t", "version", "__weakref__")

    def __init__(self, t: torch.Tensor, version: int) -> None:
        self.t = t
        self.version = version


class _Holdings(Half):
    """What a planned call holds of its ops' outputs for its recompute, and when it lets go of them (NOTE [planned
    calls]): the forward-pass half of ``FastFrame``, called by its ``Tap``; ``replay.replayed`` hands them back."""

    _offload_group: Any  # (set by FastFrame.__init__, as every attribute this half reads)

    def _hold_plain(self, i: int, out: torch.Tensor) -> None:
        """:meth:`_hold` of one output held as it is (``Plan.plain_holds``; the tap calls it for those)."""
        self.versions_at_hold[i] = [out._version]
        # (held until the forward pass ends, when forward() reads their versions, since an output that died before
        # could have been written in place; then as aliases sharing their version counters, for the caller's writes)
        self.held[i] = self.origins[i] = [out]  # (one alias of it at the end serves as both)

    def _hold(self, i: int, h: Hold, out: Any) -> None:
        """Hold op ``i``'s outputs for the recompute (detached: an output would hold its own node)."""
        # (inside the tap's handler: the mode is off the stack, and no remat mode runs below a planned call)
        # the version lives on the op's own output (a result the caller may hold and write), not on the
        # detached alias, which has a counter of its own: watched through a weak reference, from now (a write
        # later in the forward pass means the held value is not the op's output: forward() lets it run again)
        if h.single and not h.weak and h.offload is None:
            self._hold_plain(i, out)
            return
        if h.single:
            self.versions_at_hold[i] = [out._version]
        if h.weak:
            self.held[i] = [weakref.ref(out)] if h.single else [
                weakref.ref(x) for x in optree.tree_leaves(out, none_is_leaf=True) if isinstance(x, torch.Tensor)]
            if not h.single:
                self.versions_at_hold[i] = [version_of(r) for r in self.held[i]]
            return
        outs = [x for x in optree.tree_leaves(out, none_is_leaf=True) if isinstance(x, torch.Tensor)]
        self.origins[i] = list(outs)
        self.versions_at_hold[i] = [t._version for t in outs]
        with internal():
            if h.offload is not None:
                vals: list[Any] = []
                for t in outs:
                    o = self._offload_saved(t, h.offload)
                    vals.append(t.detach() if o is None else o)
                self.held[i] = vals
            else:
                self.held[i] = [t.detach() for t in outs]

    def _wrote(self, i: int, args: Any, kwargs: Any) -> None:
        """Op ``i`` (-1: an op past the plan) wrote in place (``Tap``), through an alias whose version counter may be
        its own (``q.data.mul_(2)``, an ``unsafe_split`` piece, the storage itself): what is held of the storages
        it wrote (every tensor it was given: at worst an op runs again, a tensor gets a copy of its own) is not
        trusted any more, since no version says so. The offload engine hears of it as the recorder would tell it
        (NOTE [one copy per storage] in ``_offload/copies.py``): a tensor saved later gets a copy of its own."""
        written = {storage_key(t) for t in arg_tensors(args, kwargs or {})}
        written.discard(0)
        if self.held or self.dead_outs:
            self._let_go_written(i, written)
        if self._offload_group is not None:
            self.engine.storage_written(self, written)

    def note_write_past_plan(self, args: Any, kwargs: Any) -> None:
        """NOTE [written after dropped]: an op past the plan wrote in place; if into the storage of a tensor this
        call dropped (alive: another reference holds it), the recompute, which runs the plan's ops only, cannot
        replay the write into its copy."""
        written = {storage_key(t) for t in arg_tensors(args, kwargs or {})}
        written.discard(0)
        for ref in self.dropped_refs:
            t = ref()
            if t is not None and storage_key(t) in written:
                self.wrote_dropped = True
                return

    def _let_go_written(self, i: int, written: set[int]) -> None:
        """:meth:`_wrote`: a held output of another op whose storage op ``i`` wrote is not that op's value any more:
        let go of it, the recompute runs the op again. (A write the recorded call made into a held output has the
        output copied before it, ``Plan.copy_before``; this one's target may differ: which tensor ``.data`` aliases
        is data.)"""
        for k in [k for k in self.held if k != i and k in self.plan.hold and k not in self.copied]:
            for v in self.origins.get(k) or self.held[k]:
                t = v() if type(v) is weakref.ref else v
                if isinstance(t, torch.Tensor) and storage_key(t) in written:
                    del self.held[k]
                    break
        # a dead op's output kept for a save and handed back to the recompute (_hand_back), or noted to be: the same.
        # The recompute replays the write, into the tensor handed back, which the node reads (written twice).
        for k in [k for k in self.held if k not in self.plan.hold]:
            kept = self.held[k][0]()
            if kept is not None and storage_key(kept.t) in written:
                del self.held[k]  # (a placeholder: the replayed write into it reruns the recompute with the op)
        for k in [k for k, (ref, _) in self.dead_outs.items() if (t := ref()) is not None and storage_key(t) in written]:
            del self.dead_outs[k]

    def _note_sources(self, out: Any, want: list[tuple[int, int]]) -> None:
        """NOTE [value recompute]: the tensors an op returned (several) that the plan takes for save positions."""
        outs = out if type(out) is tuple and all(type(t) is torch.Tensor for t in out) else tensor_leaves(out)
        for k, pos in want:
            self.sources[pos] = weakref.ref(outs[k])

    def _copy_held(self, i: int) -> None:
        """Op ``i``'s output, held, is about to be written in place (``Hold.cow``): hold a copy instead, taken now
        as the recorded call's recorder took it, and watch the output weakly (a write is expected: its version is
        not noted). Held as it is if written already (a write the recorded call did not make here): the end of the
        forward pass lets the op run again."""
        held = self.held.get(i)
        if held is None or type(held[0]) is not torch.Tensor or i in self.copied:
            return
        out = held[0]
        if out._version != self.versions_at_hold[i][0]:
            return
        with internal():  # (in the tap's handler, before the writing op: the copy has the op's own values)
            self.held[i] = [out.clone()]
        self.origins[i] = [weakref.ref(out)]
        del self.versions_at_hold[i]
        self.copied.add(i)

    def _offload_saved(self, t: torch.Tensor, decision: Offloadable) -> Offloaded | None:
        """``t``'s handle if ``decision`` moves it, else None. The call's group is looked up once, after its first
        offload (a call that offloads nothing makes none: a new group lets older calls' kept copies go, NOTE [keep
        last] in ``_offload/schedule.py``)."""
        grp = self._offload_group
        o = self.engine.offload_saved(t, decision, self if grp is None else grp)
        if o is not None:
            self._offloaded = True
            if grp is None:
                self._offload_group = self.engine.group(self)
        return o  # type: ignore[no-any-return]

    # ---- hooks -----------------------------------------------------------------


class FastFrame(_Holdings):
    """One call of a remat'd function that follows its signature's plan (NOTE [fast path], NOTE [planned calls])."""

    def __init__(self, run: Callable[[list[Any]], Any], flat: list[Any], fn_name: str, preserve_rng: bool,
                 state: Snapshot, plan: Plan, refuse: Callable[[], None], engine: Any) -> None:
        self.run = run
        self.flat = flat
        self.fn_name = fn_name
        self.state = state
        self.plan = plan
        self.refuse = refuse  # this signature runs on the full engine from now on
        self.engine = engine
        self.keep, self.offload = plan.keep, plan.offload
        self.state_ids = {id(t) for t in state.tensors} if plan.keep is None else None
        self.input_ids = {id(a): i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)}
        self.versions = [a._version if isinstance(a, torch.Tensor) else None for a in flat]
        self.state_versions = [t._version for t in state.tensors]
        self.ambient = AmbientState.capture([a for a in flat if isinstance(a, torch.Tensor)],
                                            preserve_rng and (plan.ops is None or plan.random))
        self.n = 0  # tensors saved so far
        self.drops: dict[int, tuple[Any, ...]] = {}  # position -> shape, dtype, class of the node that made it
        self.last_drop = -1
        self.cache = Made({}, {})  # recomputed, not read yet
        self.forwarding = False
        self.recomputes = 0
        self.held: dict[int, list[Any]] = {}  # op index -> its outputs, detached or offloaded (NOTE [planned calls])
        self.kept_dead = plan.kept_dead
        self.copied: set[int] = set()  # op indices whose held output is a copy (_copy_held)
        # NOTE [value recompute]: save position -> the output of the op the plan takes it from, in this call (Tap),
        # weakly; values_ok: every dropped tensor was that very tensor
        self.sources: dict[int, weakref.ref[torch.Tensor]] = {}
        self.values_ok = plan.values is not None
        self.checked = plan.values.checked if plan.values is not None else frozenset()
        # dead op index -> its output and the output's version as the op returned (_hand_back)
        self.dead_outs: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self.held_versions: dict[int, list[int | None]] = {}
        self.versions_at_hold: dict[int, list[int | None]] = {}
        self.origins: dict[int, list[Any]] = {}  # op index -> its outputs (in the forward pass), then aliases of them
        self.limit = len(plan.ops) if plan.ops is not None else 0  # ops that followed the plan
        self.diverged = False  # an op was not the plan's: every later save is held
        # the dead ops' placeholders in the running recompute: id -> weak reference (an id is reused once one dies)
        self.placeholders: dict[int, weakref.ref[torch.Tensor]] = {}
        self._offloaded = False
        self._offload_group: Any = None  # this call's group in the offload engine, looked up once
        self._lock = threading.RLock()
        self.kept_raw: list[_Kept] = []  # kept saves holding their tensor itself until the forward pass ends
        # NOTE [same reads] in _wiring.py: the tokens of the inputs and module state, and the key of each planned op's
        # arguments in the forward pass (None: a tag the forward pass let go), which every recompute compares
        self.known = known_tokens(flat, state.tensors) if plan.ops is not None else {}
        self.keys: list[Any] = [None] * self.limit
        self.cached_casts: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # NOTE [autocast's cache]
        # NOTE [written after dropped]: the tensors this call dropped (weakly), and whether an op past the plan wrote
        # into the storage of one
        self.dropped_refs: list[weakref.ref[torch.Tensor]] = []
        self.wrote_dropped = False

    # ---- forward ---------------------------------------------------------------
    def forward(self) -> Any:
        self.forwarding = True
        try:
            with ti.saved_tensors_hooks_enabled(), saved_tensors_hooks(self.pack, self.unpack):
                try:
                    if self.plan.ops is None:
                        out = self.run(self.flat)
                    else:
                        tap = Tap(self)
                        with naming(tap), tap:
                            out = self.run(self.flat)
                except RuntimeError as e:
                    if "support saved tensor hooks" not in str(e):
                        raise
                    self.refuse()
                    raise NeedsRegion(self, e) from e  # NOTE [reentrant region] in region.py
        except BaseException:
            self.origins = self.held = {}  # (held strongly during the forward pass only)
            raise
        finally:
            self.forwarding = False
            if self.kept_raw:
                self._detach_kept()
            self.sources.clear()  # (the positions that saved another tensor, or were not reached)
            self.cache = Made({}, {})  # what a backward pass inside the forward pass recomputed
        if self.diverged:
            self.refuse()
        for i, vals in list(self.held.items()):
            outs = self.origins.get(i)
            if vals is outs and i not in self.copied:
                # (one output held as it is, _hold's common case, and what the loop below does with it, inline: the
                # comprehensions cost ~3 us per held output)
                t = vals[0]
                version = t._version
                self.held[i] = self.origins[i] = [ti.detach_below_modes(t)]  # (see below)
                if version != self.versions_at_hold[i][0]:
                    del self.held[i]  # (see below)
                else:
                    self.held_versions[i] = [version]
                continue
            now = [version_of(v) for v in self.origins.get(i, vals)]
            written = any(a is not None and a != b for a, b in zip(now, self.versions_at_hold.get(i, ())))
            if outs is not None:
                # an alias made now, above autograd, shares the output's version counter (a detach in the tap's
                # handler, below autograd, would not): a write through any view of the output, a result of the call
                # included (return y, h.detach()), moves it; and it holds no graph. But an offloaded output's alias would
                # hold the device bytes the offload let go of: watched through a weak reference while the output
                # lives, and by the engine, through such an alias, while its copy has not read the bytes (kept on
                # the device, or copying: NOTE [written while copied] in _offload/copies.py)
                # (a copy's origin, written in the forward pass, is a weak reference already: _copy_held)
                if i not in self.copied:
                    self.origins[i] = [weakref.ref(t) if type(v) is Offloaded else ti.detach_below_modes(t)
                                       for v, t in zip(vals, outs)]
                if vals is outs:
                    self.held[i] = vals = self.origins[i]  # (the output itself until now: held as that alias)
                for v, t, v0 in zip(vals, outs, self.versions_at_hold.get(i, ())):  # (noted with the origins: _hold)
                    if type(v) is Offloaded:
                        # (written since the op ran, too: the tensors saved of it before the write share the copy)
                        self.engine.watch(v, t, v0)  # type: ignore[arg-type]
            if written:
                del self.held[i]  # written in place after the op ran: the recompute runs the op again
                continue
            self.held_versions[i] = now
        if self._offloaded:
            self.engine.end_of_call()  # NOTE [stream-ordered reuse] in _offload/streams.py
        self._check_versions(after_forward=True)  # (after the outputs above are let go: it may raise)
        return out

    def _detach_kept(self) -> None:
        """NOTE [kept until the forward pass ends]: the kept saves let go of their tensors' graphs."""
        kept, self.kept_raw = self.kept_raw, []
        for k in kept:
            k.t = holdable(k.t)

    def rewind(self) -> None:
        """Put the random state back so that the call can run again (NOTE [reentrant region])."""
        self.ambient.rewind()

    def _check_versions(self, after_forward: bool) -> None:
        for i, (a, v0) in enumerate(zip(self.flat, self.versions)):
            if v0 is not None and a._version != v0:
                if after_forward and not self.drops:
                    self.versions[i] = a._version  # nothing will be recomputed: the write is harmless
                    continue
                raise (input_written_in_forward if after_forward else input_written_before_backward)(self.fn_name, i, a)
        for t, v0 in zip(self.state.tensors, self.state_versions):
            if t._version != v0:
                label = self.state.label_of(t) or f"a tensor of shape {list(t.shape)}"
                if after_forward:
                    self.refuse()
                    raise RematError(
                        f"remat: {self.fn_name} wrote {label} in place in this call, though its first call with "
                        "the same input shapes did not; remat's fast path (NOTE [fast path]) cannot replay such a "
                        "write. Later calls of this signature run on the full engine, which can."
                    )
                raise RematError(
                    f"remat: {label}, which {self.fn_name} read, was modified in place after its forward pass and "
                    "before its backward pass (an optimizer step?); the recompute would read the new value. Run "
                    "the backward pass first."
                )

    def pack(self, t: torch.Tensor) -> Any:
        pos = self.n
        self.n = pos + 1
        slot = self.input_ids.get(id(t))
        if slot is not None and self.flat[slot] is t:
            return _In(slot, t._version)
        if self.diverged or (id(t) in self.state_ids if self.keep is None else pos in self.keep):  # type: ignore[operator]
            if self.plan.ops is None:
                kept = _Kept(holdable(t, False), t._version)
            else:
                kept = _Kept(t, t._version)
                if t.requires_grad and not t.is_leaf:
                    # NOTE [kept until the forward pass ends]: detached then, below no mode of remat's
                    self.kept_raw.append(kept)
            if self.kept_dead and pos in self.kept_dead:
                self._hand_back(self.kept_dead[pos], t, kept)
            return kept
        decision = self.offload.get(pos) if self.offload else None
        if decision is not None:
            grp = self._offload_group
            # (unpack tells an Offloaded by type; once the call has a group, the engine directly: a Python call
            # less per saved tensor)
            o = self._offload_saved(t, decision) if grp is None else self.engine.offload_saved(t, decision, grp)
            if o is not None:
                return o
        node = t.grad_fn
        self.drops[pos] = (t.shape, t.dtype, None if node is None else type(node))
        self.last_drop = pos
        self.dropped_refs.append(weakref.ref(t))  # NOTE [written after dropped]
        if self.values_ok and pos in self.checked:
            ref = self.sources.get(pos)
            if ref is None or ref() is not t:
                self.values_ok = False  # NOTE [value recompute]: not the tensor the plan takes for this position
        return pos

    def _hand_back(self, i: int, t: torch.Tensor, kept: _Kept) -> None:
        """NOTE [dead ops]: dead op ``i``'s output is kept: its recompute hands back the kept tensor while the node
        that saved it holds it (a weak reference: a node freed in the forward pass frees it, as plain autograd
        would), and a placeholder once not. Only if it is this call's output of op ``i``, which the tap noted, and
        unwritten since: the recompute replays a write, into the kept tensor's storage."""
        noted = self.dead_outs.get(i)
        if noted is not None and noted[0]() is t and t._version == noted[1]:
            # (unwritten since the op returned: the recompute must get the op's value, and replays any write)
            self.held[i] = [weakref.ref(kept)]

    def unpack(self, p: Any) -> torch.Tensor:
        if type(p) is int:
            # (each position has one reader, its node: a recomputed one is taken without the lock)
            t = self.cache.take_if_made(self.fn_name, p)
            if t is not None:
                return t
            with self._lock:
                t = self.cache.take_if_made(self.fn_name, p)
                if t is not None:
                    return t
                # not recomputed yet in this backward pass, or read once already (a second backward pass)
                self.cache = planned_recompute(self)
                if not self.forwarding:
                    ti.queue_backward_callback(_release(self))
                return self.cache.take(self.fn_name, p)
        if type(p) is _In:
            t = self.flat[p.slot]
            if t._version != p.version:
                raise written_after_saved(self.fn_name, t, p.version)
            return t  # type: ignore[no-any-return]
        if type(p) is Offloaded:
            return self.engine.fetch(p)  # type: ignore[no-any-return]
        if p.t._version != p.version:
            raise written_after_saved(self.fn_name, p.t, p.version)
        return p.t  # type: ignore[no-any-return]

    # ---- recompute -------------------------------------------------------------
    def read_other(self, i: int, func: Any, now: list[Any], then: list[Any]) -> RematError:
        """NOTE [same reads]: the recompute's op ``i`` read other values than the forward pass's."""
        state = self.state

        def label(j: int) -> str | None:
            return state.label_of(state.tensors[j]) if j < len(state.tensors) else None

        what = describe_difference(now, then, label)
        value = first_value(now, then)
        holders = [f"{type(m).__name__}.{k}" for m in state.modules for k, v in vars(m).items()
                   if type(v) in (int, float) and v == value] if value is not None else []
        where = f" (the value of {', '.join(holders[:3])} now)" if holders else ""
        return RematError(
            f"remat: the recompute of {self.fn_name} read other values than its forward pass at op #{i} ({func}): "
            f"{what}{where}. Python state the function reads (a module's attribute, a global, a closed-over value, "
            "which submodule runs, Python's or NumPy's random numbers) changed between the forward and the backward "
            "pass, and the gradient would be that of a computation the forward pass did not do. Change such state "
            "after the backward pass (a schedule's step after loss.backward()), or pass the value to the function "
            "as an argument (NOTE [same reads] in remat/_wiring.py)."
        )

    def _written(self, i: int, v0: int, now: int) -> RematError:
        return RematError(
            f"remat: an output of op #{i} ({self.plan.ops[i]}) that {self.fn_name} kept for its "  # type: ignore[index]
            f"recompute was modified in place after the forward pass (version {v0} -> {now}), e.g. a "
            "result of the function changed before the backward pass. Clone a result before modifying "
            "it, or run the backward pass first."
        )




class Tap(TorchDispatchMode):
    """A planned call's forward pass: count the ops, check each is the plan's, hold the planned outputs."""

    def __init__(self, frame: FastFrame) -> None:
        super().__init__()
        self.frame = frame
        self.ops: tuple[Any, ...] = frame.plan.ops or ()
        self.calls = frame.plan.calls
        self.hold = frame.plan.hold
        self.kept_dead_ops = frame.plan.kept_dead_ops
        self.skip_names = frame.plan.skip_names
        self.copy_before = frame.plan.copy_before
        self.marked = frame.plan.marked
        self.writes = frame.plan.writes
        self.plain_holds = frame.plan.plain_holds
        self.at_op = frame.plan.values.inputs_at_op if frame.plan.values is not None else {}
        self.sources = frame.sources
        self.thread = threading.get_ident()  # (a thread that copied the call's context has a mode stack of its own)
        self.limit = frame.limit
        self.i = 0
        self.keys = frame.keys
        self.wiring = Wiring(frame.known, cached=frame.cached_casts)  # NOTE [same reads]
        self.casts = frame.plan.casts
        self.aliases = frame.plan.aliases
        self.identity = frame.plan.identity  # NOTE [hooks' aliases]: matched only as such, either way

    skip_name = skip_tag  # NOTE [skipped tags]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        i = self.i
        if (i < self.limit and self.ops[i] is func and not INTERNAL.get()
                and (func is not TO_COPY or cast_agrees(self.casts, self.wiring, i, args, kwargs))
                and (func not in ALIASING or (i in self.identity) is identity_alias(func, args, kwargs))):
            wiring = self.wiring
            self.keys[i] = wiring.key(args, kwargs)  # NOTE [same reads]
            call = self.calls[i]
            if i in self.marked:
                if i not in self.plain_holds:
                    out = self._marked(i, call, args, kwargs)
                    if i in self.casts:
                        wiring.note_cast(out, args[0])  # NOTE [autocast's cache]
                    elif i in self.aliases:
                        wiring.note_alias(out, args[0])  # NOTE [hooks' aliases]
                    else:
                        wiring.note(i, out)
                    return out
                out = call(*args, **kwargs) if kwargs else call(*args)
                self.i = i + 1
                self.frame._hold_plain(i, out)
                wiring.note(i, out)
                return out
            out = call(*args, **kwargs) if kwargs else call(*args)
            self.i = i + 1
            if type(out) is torch.Tensor:  # (Wiring.note's common case, inline)
                wiring.made[id(out)] = (made_token(i), weakref.ref(out))
            else:
                wiring.note(i, out)
            return out
        if func in RANGE_OPS:
            return profiler_op(func, args, kwargs or {})  # NOTE [FSDP's hooks] in _dispatch.py
        if not INTERNAL.get():
            out = off_the_plan(self, i, func, types, args, kwargs, None)  # NOTE [autocast's cache]
            if out is not RUN:
                return out
        out = func(*args, **kwargs) if kwargs else func(*args)
        if not (INTERNAL.get() or ignored(func)):
            # not the plan's op (a data-dependent branch), or more ops than the plan has: the plan ends here
            self.i = i + 1
            self.limit = self.frame.limit = min(self.limit, i)
            self.frame.diverged = True
            if traits(func)[0]:
                if self.frame.held or self.frame._offload_group is not None:
                    self.frame._wrote(-1, args, kwargs)
                if self.frame.drops:
                    self.frame.note_write_past_plan(args, kwargs)
        return out

    def _marked(self, i: int, call: Any, args: Any, kwargs: Any) -> Any:
        """The plan's op ``i``, one the forward pass holds, copies before, notes the output of or that writes in place
        (``Plan.marked``)."""
        if i in self.copy_before:
            for k in self.copy_before[i]:
                self.frame._copy_held(k)
        out = call(*args, **kwargs) if kwargs else call(*args)
        self.i = i + 1
        if i in self.writes and (self.frame.held or self.frame._offload_group is not None):
            self.frame._wrote(i, args, kwargs)
        h = self.hold.get(i)
        if h is not None:
            self.frame._hold(i, h, out)
        elif i in self.kept_dead_ops and type(out) is torch.Tensor:
            self.frame.dead_outs[i] = (weakref.ref(out), out._version)  # (a dead op's kept output: _hand_back)
        want = self.at_op.get(i)
        if want is not None:  # (the value recompute takes dropped tensors from this op: note which they are)
            if type(out) is torch.Tensor:
                ref = weakref.ref(out)  # (not the tensor: a reference held changes what torch's binding does)
                for _, pos in want:
                    self.sources[pos] = ref
            else:
                self.frame._note_sources(out, want)
        return out


def _release(frame: FastFrame) -> Callable[[], None]:
    """At the end of the backward pass, let go of what it did not read (held weakly: NOTE [free as used])."""
    wself = weakref.ref(frame)

    def release() -> None:
        f = wself()
        if f is not None and not f.forwarding:
            f.cache = Made({}, {})

    return release
