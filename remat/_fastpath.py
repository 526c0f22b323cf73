"""The fast path: a remat call that replays a plan its signature's first call recorded, instead of recording.

NOTE [fast path]
    Under ``nothing_saveable`` with no ``torch.func`` level and no enclosing remat
    call, the recorder's per-op work buys nothing the backward pass needs: every
    saved tensor but the inputs is recomputed anyway. So, as
    ``torch.utils.checkpoint`` does, a :class:`FastFrame` drops every saved tensor
    but an input (held by reference; the shape and dtype of each dropped one
    noted), and the recompute re-runs the function, taking the dropped tensors
    in order and stopping as soon as the last one is made (the ops after it do
    not run). Unlike ``torch.utils.checkpoint`` it runs the forward pass under
    the planned call's small dispatch mode (``_Tap``), which notes what each op
    read, and the recompute under its replay, which checks it: NOTE [same reads]
    in ``_wiring.py``. Until 2026-12-04 a save-nothing call had no mode at all
    (half of torch's cost per op), and a Python number, an expert index or a
    global changed between a call's forward and backward pass gave a wrong
    gradient without an error from a signature's second call on.

    What the recorder would have checked is learnt once, per remat'd function and
    *signature* (the pytree structure, every input's shape, dtype, device and
    requires_grad, the other leaves' values, the shapes of the module state the
    call reads, the modules' ``training`` flags and the autocast state): the
    first call of a signature runs the full engine (``_hooks.Frame``), and only
    if it was *clean* is a :class:`Plan` cached for the signature. Clean means:
    it read no tensor besides its inputs, the module state of NOTE [state is an
    input] and its own intermediates (no global or closed-over tensor the walk
    missed, no tensor built from Python data), wrote none of them in place, made
    no nested remat call and ran no backward pass of its own, under no
    ``torch.func`` level, and wrote no storage it had offloaded a tensor of for
    a save (the full engine gives a tensor of it saved after the write a copy
    of its own, which a planned call, seeing no write, cannot: NOTE [one copy
    per storage]; nor, if it also recomputes, any storage it had offloaded:
    NOTE [offloaded and written]).
    The plan also lists the save positions the full engine held by reference
    (the module's parameters) so that the fast path holds them too, rather than
    dropping them and reading them back.

    A later call of a known signature runs fast and still checks, from outside
    the ops: the recompute must save as many tensors, of the same shapes, dtypes
    and producing node classes, at every dropped position (else ``RematError``, as
    on the full path); inputs and module state must not change version during the
    forward pass or between it and the recompute, nor a saved input before it is
    read. Inputs and module state are recognised by identity, never by save
    position, so a data-dependent extra op cannot make the call hold activations.
    A fast call that writes module state in place (data-dependent, unlike its
    signature's first call) cannot be replayed exactly: it raises ``RematError``
    and the signature runs on the full engine from then on. What a plan cannot
    know, because it changes between calls (a Python number, which expert
    runs), every call checks for itself: its forward pass notes the key of each
    op's arguments, and its recompute compares (NOTE [same reads]). A signature
    whose recorded call fails the full engine's checks in its recompute is never
    planned (every call keeps raising); ``remat(f, debug=True)`` runs every call
    on the full engine.

NOTE [planned calls]
    Every other policy (``dots_saveable``, names, offloading, a callable of your
    own) needs to see the ops, to hold what the policy saves so that the
    recompute hands it back instead of running the op again. But what the
    recorder works out per op (the policy's decision, storages, views, the
    liveness walk of NOTE [stash liveness]) is the same on every call of a
    signature. So the clean first call's outcome is kept in the plan: the op
    overloads in order, and for each op whose outputs the recorder held to the
    end of the forward pass, whether to hold them (detached) or offload them; per
    save position, whether it was held, offloaded or dropped. A later call runs
    under a dispatch mode (``_Tap``) that only counts ops, checks each is the op
    the plan has at that index, and holds the planned outputs; the recompute's
    mode (``_Replay``) hands those back at the same indices and runs every other
    op. The policy is consulted on a signature's first call only, as JAX's
    policies are consulted when a function is traced: policies are functions of
    the op and its arguments; what an op read on a later call is that call's,
    checked by its recompute (NOTE [same reads]). An op that is not the plan's (a data-dependent
    branch) ends the plan for the rest of that call: every later save is held, as
    plain autograd would, and the signature runs on the full engine from then on,
    which drops what the policy drops on every call (so a branch that alternates
    costs one call's extra memory, not every other call's). The recompute
    raises ``RematError`` if its ops differ from the forward's at a planned index.
    Unlike the full engine, a planned call recomputes ops that only feed outputs
    the backward pass does not differentiate. Ops the liveness walk found dead
    hand back placeholders, as on the full engine (NOTE [dead ops]), checked:
    every later op looks for one among its arguments (``_Replay``). A dead op
    whose output the call kept for the backward pass (under ``dots_saveable``,
    an attention block's ``q = a @ W``, which the next matmul saves while its
    own output is held) hands back the kept tensor instead, found through a weak
    reference to what the saving node holds (a node freed in the forward pass
    frees it, as plain autograd would: a placeholder then): no placeholder, and
    no check on the ops after it (2.6 us an op of the tiny blocks' recompute,
    where each block had one).
    An output that a later op of the recorded call wrote in place (``h = x @ W;
    h.relu_()``: the recorder copied it before the write) is held as a copy
    taken where the recorder took it, before the writing op runs (the tap is
    told which op that was: ``Plan.copy_before``), and handed to one recompute,
    which writes it as the forward pass did; a later recompute runs the op. An
    output written before that op (another wiring) is not copied: the op runs
    again in the recompute, as for any held output written in the forward
    pass. A call that dropped nothing has a plan without a mode: no recompute
    will run.

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
    replay mode (``_ValueReplay``) takes each dropped tensor as that op returns
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
import types
import weakref
from collections.abc import Callable
from typing import Any

import optree
import torch

from . import _torch_internals as ti
from ._ambient import AmbientState
from ._context import INSPECTOR, INTERNAL, active_context, internal, naming
from ._dispatch import (
    LIFTS,
    RANGE_OPS,
    OpRecord,
    arg_tensors,
    dead_value,
    identity_alias,
    ignored,
    profiler_op,
    storage_key,
    tensor_leaves,
    traits,
)
from ._errors import RematError, input_written_before_backward, input_written_in_forward, saved_shape_differs
from ._offload import Offloaded
from ._packed import DROP, KEEP, OFFLOAD, Made
from ._policies import Offloadable
from ._reentrant import NeedsRegion
from ._state import Snapshot
from ._torch_internals import TorchDispatchMode, saved_tensors_hooks
from ._wiring import Wiring, autocast_cast, describe_difference, first_value, known_tokens, made_token, same_key

__all__ = ["Plan", "plan_of_call", "FastFrame", "signature", "fast_path_applies", "plans_for", "MAX_PLANS"]

MAX_PLANS = 32  # signatures remembered per remat'd function (a new one past this forgets the oldest)

_AUTOCAST = ("cpu", "cuda")


class _Hold:
    """An op whose outputs a planned call holds for its recompute (NOTE [planned calls])."""

    __slots__ = ("offload", "out_spec", "consts", "single", "weak", "cow")

    def __init__(self, rec: OpRecord, weak: bool, cow: bool = False) -> None:
        # weak: the recorded call held the outputs weakly and they were alive when its forward pass ended (a
        # result of the call, a saved tensor, the base of a view): held weakly again, run again if they died
        self.weak = weak
        # cow: a later op of the recorded call wrote the output in place (h = x @ W; h.relu_()): a copy is held,
        # taken before that op runs, and handed to one recompute, which writes it in turn (NOTE [planned calls])
        self.cow = cow
        self.offload = rec.decision if isinstance(rec.decision, Offloadable) and not weak else None
        self.out_spec = rec.out_spec
        self.consts = rec.consts
        self.single = rec.out_spec == _ONE_LEAF and rec.consts is None  # one tensor: no pytree to rebuild

    def rebuild(self, tensors: list[Any]) -> Any:
        """The op's output from its tensors (as :meth:`OpRecord.rebuild`, which reads the same two fields)."""
        return OpRecord.rebuild(self, tensors)  # type: ignore[arg-type]


class _Dead:
    """An op a planned recompute skips: the shapes of its outputs, for placeholders."""

    __slots__ = ("out_meta", "out_spec", "consts")

    def __init__(self, rec: OpRecord) -> None:
        self.out_meta, self.out_spec, self.consts = rec.out_meta, rec.out_spec, rec.consts

    def placeholders(self) -> Any:
        # (new tensors for each recompute, let go with it: a plan that kept them would hold a dead output's memory
        # for as long as it lives, on the device too)
        return OpRecord.rebuild(self, [dead_value(m) for m in self.out_meta])  # type: ignore[arg-type]


class Plan:
    """What the first (fully recorded) call of a signature showed (NOTE [fast path], NOTE [planned calls]).

    ``keep``: save positions held by reference; ``offload``: save positions offloaded, with the decision;
    ``ops``: the op overloads in order (None: a call that drops nothing, so runs no recompute, has no dispatch
    mode at all); ``hold``: op index -> the outputs to hold for the recompute.
    """

    __slots__ = ("keep", "offload", "ops", "calls", "hold", "dead", "random", "values", "kept_dead", "kept_dead_ops",
                 "skip_names", "copy_before", "writes", "casts", "aliases", "identity", "_marked", "_plain_holds")

    def __init__(self, keep: frozenset[int] | None, offload: dict[int, Offloadable] | None = None,
                 ops: tuple[Any, ...] | None = None, hold: dict[int, _Hold] | None = None,
                 dead: dict[int, _Dead] | None = None, random: bool = True) -> None:
        # None: the recorded call held the module state it read and nothing else, so a call holds what is module
        # state (by identity) rather than trusting save positions, which no op check guards without a mode
        self.keep = keep
        self.offload = offload or {}
        self.ops = ops
        self.calls = tuple(ti.op_call(f) for f in ops) if ops is not None else ()  # what calling each op runs
        self.hold = hold or {}
        self.dead = dead or {}  # op index -> its record (shapes, to make placeholders): NOTE [dead ops]
        # whether the ops draw random numbers (a planned call without any needs no random state: a call
        # that leaves the plan holds every later save, so its recompute runs only the plan's ops)
        self.random = random
        self.values: _Values | None = None  # NOTE [value recompute]: where each dropped tensor comes from
        # NOTE [dead ops]: save position -> the dead op whose output the recorded call kept there; a planned call hands
        # back the kept tensor while it lives rather than a placeholder
        self.kept_dead: dict[int, int] = {}
        self.kept_dead_ops: frozenset[int] = frozenset()
        self.skip_names: frozenset[int] = frozenset()  # NOTE [skipped tags]: op indices of the tags that may go
        self.copy_before: dict[int, list[int]] = {}  # op index -> the held outputs (_Hold.cow) it writes: copy first
        # the op indices of ops that write in place: which tensors one writes may differ from the recorded call's (a
        # data-dependent target), through an alias whose version counter is its own (FastFrame._wrote)
        self.writes: frozenset[int] = frozenset(i for i, f in enumerate(ops or ()) if traits(f)[0])
        # NOTE [autocast's cache] in _wiring.py: op index -> the token of the leaf that autocast's cast there cast
        self.casts: dict[int, Any] = {}
        # NOTE [hooks' aliases] in _dispatch.py: op indices of identity aliases a pass may lack (their outputs take
        # their argument's token)
        self.aliases: frozenset[int] = frozenset()
        self.identity: frozenset[int] = frozenset()  # every identity alias's op index (a pass matches them as such)
        self._marked: frozenset[int] | None = None
        self._plain_holds: frozenset[int] | None = None

    @property
    def marked(self) -> frozenset[int]:
        """The op indices where a planned forward pass holds, copies before or notes an output (``_Tap``): most ops
        are none of these, one lookup for them, not four. Worked out once, from the plan as its first call reads it
        (a value recompute given up later only leaves indices marked that need nothing)."""
        if self._marked is None:
            at_op = self.values.inputs_at_op if self.values is not None else {}
            self._marked = (frozenset(self.hold) | self.kept_dead_ops | frozenset(self.copy_before) | frozenset(at_op)
                            | self.writes | frozenset(self.casts) | self.aliases)
        return self._marked

    @property
    def plain_holds(self) -> frozenset[int]:
        """Of :attr:`marked`, the ops whose one output the forward pass holds as it is and does nothing else with
        (``_Tap`` holds them inline: most held ops, a matmul's product under ``dots_saveable``). Worked out once."""
        if self._plain_holds is None:
            at_op = self.values.inputs_at_op if self.values is not None else {}
            self._plain_holds = frozenset(
                i for i, h in self.hold.items() if h.single and not h.weak and h.offload is None and not h.cow
                and i not in self.kept_dead_ops and i not in self.copy_before and i not in at_op and i not in self.writes
                and i not in self.casts and i not in self.aliases)
        return self._plain_holds

    @classmethod
    def of_ops(cls, keep: frozenset[int] | None, offload: dict[int, Offloadable], ops: list[OpRecord],
               kept: dict[int, int] | None = None) -> Plan:
        """The plan of a recorded call: the ops whose every output the recorder still held when its forward
        pass ended (strongly, offloaded, or weakly and alive) are held again; every other op runs in the recompute.
        ``kept``: save position -> index of the one-output op whose output the call kept there."""
        hold, dead = {}, {}
        for i, rec in enumerate(ops):
            if rec.random or rec.out_spec is None:
                continue
            if (rec.stash is None and not rec.live and rec.skippable) or (
                    rec.stash and all(x is None for x in rec.stash)):
                dead[i] = _Dead(rec)  # nothing the recompute needs reads it: a placeholder (NOTE [dead ops])
                continue
            if rec.stash is None or not rec.stash:
                continue
            if rec.cow:
                if rec.out_spec == _ONE_LEAF and rec.consts is None and not isinstance(rec.decision, Offloadable) \
                        and rec.cow_at is not None:
                    hold[i] = _Hold(rec, False, cow=True)
                continue
            weak = [isinstance(x, weakref.ref) for x in rec.stash]
            if all(x is not None and (not w or x() is not None) for x, w in zip(rec.stash, weak)):
                hold[i] = _Hold(rec, all(weak))
        plan = cls(keep, offload, tuple(r.func for r in ops), hold, dead, any(r.random for r in ops))
        for i, h in hold.items():
            if h.cow:
                plan.copy_before.setdefault(ops[i].cow_at, []).append(i)  # type: ignore[arg-type]
        plan.kept_dead = {pos: i for pos, i in (kept or {}).items() if i in dead and not ops[i].cow}
        plan.kept_dead_ops = frozenset(plan.kept_dead.values())
        return plan


class _Values:
    """NOTE [value recompute]: per op index, the dropped save positions its outputs are (which tensor of the op's,
    which position); per position, how many ops had run when it was saved, and per such count, the positions."""

    __slots__ = ("at_op", "one", "stop", "saved_at", "inputs_at_op", "checked")

    def __init__(self, sources: dict[int, tuple[int, int, int]]) -> None:
        self.at_op: dict[int, list[tuple[int, int]]] = {}
        self.saved_at: dict[int, list[int]] = {}
        # the positions an op saved of its inputs (not its own output, which its node always saves as it returned
        # it): which tensor the call gives that op is the call's wiring, checked on planned calls
        self.inputs_at_op: dict[int, list[tuple[int, int]]] = {}
        for pos, (i, k, n) in sources.items():
            self.at_op.setdefault(i, []).append((k, pos))
            self.saved_at.setdefault(n, []).append(pos)
            if i != n - 1:  # (saved when n ops had run: by op n - 1)
                self.inputs_at_op.setdefault(i, []).append((k, pos))
        self.one = {i: want[0][1] for i, want in self.at_op.items() if len(want) == 1 and want[0][0] == 0}
        self.checked = frozenset(pos for want in self.inputs_at_op.values() for _, pos in want)
        self.stop = {pos: src[2] for pos, src in sources.items()}


_ONE_LEAF = optree.tree_structure(0)  # type: ignore[arg-type]
_ALIAS = torch.ops.aten.alias.default  # what checkpoint_name dispatches (_naming.py)
# the ops an identity alias may be (NOTE [hooks' aliases] in _dispatch.py): only these are asked whether they are one
_ALIASING = frozenset({torch.ops.aten.view.default, torch.ops.aten.detach.default})
_TO_COPY = torch.ops.aten._to_copy.default  # NOTE [autocast's cache]: autocast's casts


def plan_of_call(frame: Any, out: Any) -> Plan | None:
    """The plan a full-engine call (``_hooks.Frame``) leaves for later calls of its signature, or None if it was
    not clean (NOTE [fast path]).

    Not for a call with several differentiable outputs either: only the full engine skips the ops that feed
    outputs a backward pass does not differentiate (NOTE [unused outputs])."""
    rec = frame.recorder
    if sum(1 for t in tensor_leaves(out) if t.requires_grad) > 1:
        return None
    if (frame.routed or frame.levels or frame.nested.children or frame.inner_backward or rec.region
            or rec.written_outside or rec.generators or frame.wrote_saved_offloaded):
        # (a generator of the user's own: only the full engine sees the ops that draw from it; a write into a
        # storage copied for a save: NOTE [offloaded and written])
        return None
    state_keys = {storage_key(ti.unwrap_all(t)) for t in frame.state.tensors}
    for r in rec.ops:
        if r.func in LIFTS or r.subst:
            return None
        for _, t, _ in r.outside or ():
            if storage_key(t) not in state_keys:
                return None
    assert frame.plan_packs is not None
    # (an input is recognised by identity on the fast path: its save positions are not the plan's to keep)
    kept = [p for p, is_input in zip(frame.plan_packs, frame.plan_inputs) if p.kind == KEEP and not is_input]
    state_ids = {id(t) for t in frame.state.tensors}
    keep: frozenset[int] | None = frozenset(p.pos for p in kept)
    if all(id(p.payload) in state_ids for p in kept):
        keep = None  # module state only: held by identity (NOTE [fast path])
    offload = {p.pos: p.record.decision for p in frame.plan_packs if p.kind == OFFLOAD}
    dropped = [p.pos for p in frame.plan_packs if p.kind == DROP]
    if dropped and (rec.offloaded_written or frame.wrote_offloaded):
        return None  # NOTE [offloaded and written]: the full engine replays what a plan's recompute would run again
    plan = Plan.of_ops(keep, offload, rec.ops, frame.plan_kept)
    known = known_tokens(frame.flat, frame.state.tensors)  # NOTE [autocast's cache]: each cast's leaf, by its token
    for i, r in enumerate(rec.ops):
        leaf = None if r.cast_leaf is None else r.cast_leaf()
        if leaf is not None and id(leaf) in known:
            plan.casts[i] = known[id(leaf)]
    if not dropped:
        # no recompute: no dispatch mode at all (such a call copies saved tensors only, at their saves: NOTE
        # [offloaded and written]). A call that recomputes has one even with nothing to hand back: NOTE [same reads]
        return Plan(keep, offload)
    if all(p in frame.plan_sources for p in dropped):
        plan.values = _Values({p: frame.plan_sources[p] for p in dropped})
    plan.skip_names = _skippable_tags(rec.ops, plan)
    _kept_through_tags(plan, rec.ops, frame.plan_kept)
    # NOTE [hooks' aliases] in _dispatch.py: an identity alias a pass may lack is one the plan holds nothing of
    plan.identity = frozenset(i for i, r in enumerate(rec.ops) if r.alias)
    # (one whose output the value recompute takes as a dropped tensor may be missing too: a forward pass without it
    # makes its call recompute with a graph instead, FastFrame.values_ok; a value recompute without it gives way)
    plan.aliases = frozenset(i for i in plan.identity if i not in plan.hold and i not in plan.kept_dead_ops
                             and i not in plan.copy_before and i not in plan.casts and i not in plan.dead)
    return plan


def _kept_through_tags(plan: Plan, ops: list[OpRecord], kept: dict[int, int]) -> None:
    """NOTE [skipped tags]: a tag a planned call lets go hands on its input itself, so a kept output of such a tag
    whose input a dead op made is, in a planned call, that dead op's output, and the recompute hands it back
    instead of a placeholder (``_hand_back``, checked by identity: a call that runs the tag keeps the placeholder).
    A names plan's tagged matmul whose product only the tag's reader saved, say."""
    if not kept or not plan.skip_names or not plan.dead:
        return
    made_by = {vid: j for j, r in enumerate(ops) for vid in r.out_vids}
    for pos, k in kept.items():
        if k in plan.skip_names and len(ops[k].in_vids) == 1:
            j = made_by.get(ops[k].in_vids[0])
            if j is not None and j in plan.dead and not ops[j].cow and len(ops[j].out_vids) == 1:
                plan.kept_dead[pos] = j
    plan.kept_dead_ops = frozenset(plan.kept_dead.values())


def _skippable_tags(ops: list[OpRecord], plan: Plan) -> frozenset[int]:
    """NOTE [skipped tags]: the tags a planned call may let go: the plan neither holds its output, nor skips it as
    dead, nor takes a dropped tensor from it."""
    taken = plan.values.at_op if plan.values is not None else {}
    return frozenset(i for i, r in enumerate(ops) if r.name is not None and r.func is _ALIAS
                     and i not in plan.hold and i not in plan.dead and i not in taken)


# The plans of each function, shared by every remat(...) of it with the same policy and static_argnums, as JAX
# caches a traced function by its identity: remat(block, policy=p)(x) written inside a forward pass makes a
# new wrapper on every step, and still records once per signature. Keyed weakly by the function, or for a
# bound method by its instance and function (two modules of one class may differ in ways no signature shows:
# a config flag). Like the module slots cache in _state.py, a cache of what is already determined.
_PLANS: weakref.WeakKeyDictionary[Any, dict[Any, dict[Any, Plan | None]]] = weakref.WeakKeyDictionary()


def plans_for(fn: Any, key: Any) -> dict[Any, Plan | None]:
    """The plans (signature -> plan) of ``fn`` under ``key`` (policy, static_argnums): shared where possible."""
    if isinstance(fn, types.MethodType):
        owner, key = fn.__self__, (fn.__func__, key)
    else:
        owner = fn
    try:
        hash(key)
        per_owner = _PLANS.setdefault(owner, {})
    except TypeError:  # an unhashable policy, or an owner that takes no weak reference: plans of its own
        return {}
    plans = per_owner.get(key)
    if plans is None:
        if len(per_owner) >= MAX_PLANS:  # (a policy made anew on every call: remat(f, policy=lambda ...))
            per_owner.pop(next(iter(per_owner)))
        plans = per_owner[key] = {}
    return plans


def fast_path_applies() -> bool:
    """Whether a call may take the fast path at all (the plan decides per signature)."""
    return active_context() is None and INSPECTOR.get() is None and not ti.interpreter_stack()


def signature(flat: list[Any], statics: dict[int, Any], state: Snapshot) -> tuple[Any, ...] | None:
    """What a plan is valid for; None: no fast path for this call (an input of a tensor subclass)."""
    parts: list[Any] = []
    for a in flat:
        if isinstance(a, torch.Tensor):
            if type(a) is not torch.Tensor and type(a) is not torch.nn.Parameter:
                return None
            parts.append((a.shape, a.dtype, a.device, a.requires_grad))
        else:
            parts.append(_leaf_key(a))
    for i in sorted(statics):
        parts.append(_leaf_key(statics[i]))
    for t in state.tensors:
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            return None
        parts.append((t.shape, t.dtype, t.device, t.requires_grad))
    parts.append(tuple(m.training for m in state.modules))
    parts.append(tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST))
    return tuple(parts)


_VALUE_TYPES = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device)


def _leaf_key(a: Any) -> Any:
    """A value by value; anything else (a module, a function) by identity, never held by the plan cache."""
    if isinstance(a, _VALUE_TYPES) or (type(a) is tuple and all(isinstance(x, _VALUE_TYPES) for x in a)):
        return (type(a), a)
    return ("id", id(a))


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


class FastFrame:
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
        # NOTE [value recompute]: save position -> the output of the op the plan takes it from, in this call (_Tap),
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
                        tap = _Tap(self)
                        with naming(tap), tap:
                            out = self.run(self.flat)
                except RuntimeError as e:
                    if "support saved tensor hooks" not in str(e):
                        raise
                    self.refuse()
                    raise NeedsRegion(self, e) from e  # NOTE [reentrant region] in _reentrant.py
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
            now = [_version_of(v) for v in self.origins.get(i, vals)]
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
            k.t = _holdable(k.t)

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

    def _hold_plain(self, i: int, out: torch.Tensor) -> None:
        """:meth:`_hold` of one output held as it is (``Plan.plain_holds``; the tap calls it for those)."""
        self.versions_at_hold[i] = [out._version]
        # (held until the forward pass ends, when forward() reads their versions, since an output that died before
        # could have been written in place; then as aliases sharing their version counters, for the caller's writes)
        self.held[i] = self.origins[i] = [out]  # (one alias of it at the end serves as both)

    def _hold(self, i: int, h: _Hold, out: Any) -> None:
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
                self.versions_at_hold[i] = [_version_of(r) for r in self.held[i]]
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
        """Op ``i`` (-1: an op past the plan) wrote in place (``_Tap``), through an alias whose version counter may be
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
        """Op ``i``'s output, held, is about to be written in place (``_Hold.cow``): hold a copy instead, taken now
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
    def pack(self, t: torch.Tensor) -> Any:
        pos = self.n
        self.n = pos + 1
        slot = self.input_ids.get(id(t))
        if slot is not None and self.flat[slot] is t:
            return _In(slot, t._version)
        if self.diverged or (id(t) in self.state_ids if self.keep is None else pos in self.keep):  # type: ignore[operator]
            if self.plan.ops is None:
                kept = _Kept(_holdable(t, False), t._version)
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
                self.cache = self._recompute()
                if not self.forwarding:
                    ti.queue_backward_callback(_release(self))
                return self.cache.take(self.fn_name, p)
        if type(p) is _In:
            t = self.flat[p.slot]
            if t._version != p.version:
                raise _written_after_saved(self.fn_name, t, p.version)
            return t  # type: ignore[no-any-return]
        if type(p) is Offloaded:
            return self.engine.fetch(p)  # type: ignore[no-any-return]
        if p.t._version != p.version:
            raise _written_after_saved(self.fn_name, p.t, p.version)
        return p.t  # type: ignore[no-any-return]

    # ---- recompute -------------------------------------------------------------
    def _recompute(self) -> Made:
        self.recomputes += 1
        if self.wrote_dropped:
            raise RematError(
                f"remat: {self.fn_name} wrote in place into a tensor it had saved for the backward pass, through an "
                "alias with a version counter of its own (.data, or detach()), after an op its signature's first "
                "call did not run (a data-dependent branch): the recompute, which follows that call, cannot replay "
                "the write. The signature runs on the full engine from the next call on (it replays every op); "
                "or write into a clone (NOTE [written after dropped] in remat/_fastpath.py)."
            )
        # (a backward pass inside the forward pass: an input written so far would be written again by the
        # recompute, into the caller's tensor, and read written: the end of the forward pass's error, raised first)
        self._check_versions(after_forward=self.forwarding)
        # (no accumulation check, as the full engine's: an inner backward pass is ops the forward pass did not run,
        # which the replay refuses: NOTE [same reads])
        try:
            return self._run_recompute(skip_dead=bool(self.plan.dead))
        except _PlanWrong:
            self.refuse()  # the recorded call's liveness does not hold for this one
            return self._run_recompute(skip_dead=False)

    def _run_recompute(self, skip_dead: bool) -> Made:
        values = self.plan.values
        if (values is not None and not torch.is_grad_enabled() and not self.forwarding and not self.diverged
                and self.values_ok and self.drops.keys() <= values.stop.keys()):
            try:
                return self._value_recompute(values, skip_dead)
            except _NeedsGraph:
                self.plan.values = None  # (the signature's later calls recompute as below from the start)
        self.placeholders = {}
        # (stops once the last dropped tensor is saved again; inside the forward pass that is before where the
        # forward pass has got, and before any op past the plan, whose random draws the call kept no state for)
        capture = _Capture(self.drops, self.last_drop + 1, self.fn_name,
                           detach=not torch.is_grad_enabled(), placeholders=self.placeholders,
                           mode=self.plan.ops is not None)
        run_to = self._last_write()  # NOTE [written after dropped]: the replay stops after it, not the capture
        capture.hold_stop = run_to >= 0
        with ti.saved_tensors_hooks_enabled(), torch.enable_grad(), self.state.restored(self.state.tensors), \
                self.ambient.restored(), saved_tensors_hooks(capture.pack, _identity):
            try:
                if self.plan.ops is None:
                    self.run(self.flat)
                else:
                    replay = _Replay(self, skip_dead)
                    replay.run_to, replay.capture = run_to, capture
                    with naming(replay), replay:
                        self.run(self.flat)
            except _Stop:
                pass
        self.placeholders = {}
        if capture.n < capture.stop_after:
            raise RematError(
                f"remat: the recompute of {self.fn_name} saved {capture.n} tensors for the backward pass where "
                f"its forward pass saved {capture.stop_after} or more; the function must do the same work every "
                "time it is called (no data-dependent branches or changing global state)."
            )
        return capture.finish()

    def _last_write(self) -> int:
        """NOTE [written after dropped]: the index of the last op of the plan this call followed that writes in
        place (-1: none), which the recompute runs; inside the forward pass, none: it stops where the forward pass
        has got (an op it has not run has no key to check)."""
        if self.forwarding or not self.plan.writes:
            return -1
        return max((i for i in self.plan.writes if i < self.limit), default=-1)

    def _value_recompute(self, values: _Values, skip_dead: bool) -> Made:
        """NOTE [value recompute]: the recompute under ``torch.no_grad()``, the dropped tensors taken as the ops
        return them. It stops once the op that saved the last of them has run."""
        self.placeholders = {}
        # (NOTE [written after dropped]: through the plan's last write, which may write a dropped tensor's storage)
        mode = _ValueReplay(self, skip_dead, values, max(values.stop[self.last_drop], self._last_write() + 1))
        try:
            with torch.no_grad(), self.state.restored(self.state.tensors), self.ambient.restored(), naming(mode), mode:
                out = None
                try:
                    out = self.run(self.flat)
                except _Stop:
                    pass
                mode.settle(mode.i)  # (the function returned after the op that saved the last: out holds it)
                del out
        except (_NeedsGraph, _PlanWrong, RematError):
            raise
        except Exception as e:
            # what the function does only with grad mode on (h.register_hook, retain_grad on an intermediate):
            # the recompute that builds the graph runs it, and raises if the error is the function's own
            raise _NeedsGraph from e
        finally:
            self.placeholders = {}
        made = mode.made
        if mode.i < mode.stop or len(made) != len(self.drops) or len(mode.versions) != len(made):
            raise _NeedsGraph  # ran out of ops first, or a tensor died before its save: the recompute that saves
        return Made(made, mode.versions, plain=True)

    def replayed(self, i: int) -> Any:
        """Op ``i``'s held outputs, for the recompute (NOTE [planned calls])."""
        h = self.plan.hold.get(i)
        if h is None:  # a dead op's kept output (_hand_back)
            kept = self.held[i][0]()
            if kept is None:
                return _RUN  # its node was freed: a placeholder
            if kept.t._version != kept.version:
                raise _written_after_saved(self.fn_name, kept.t, kept.version)
            return ti.detach_below_modes(kept.t)
        origins = self.origins.get(i) or self.held[i]
        v0s = self.held_versions.get(i, ())
        if self.forwarding and i not in self.held_versions:
            # a backward pass inside the forward pass, before its end has checked what it holds: an output written
            # in place since the op returned it is not the op's value any more (plain autograd allows the write
            # where no node saved the output): the op runs again, as the end of the forward pass would decide
            held_at = self.versions_at_hold.get(i, ())
            if any(v is not None and v != v0 for v, v0 in zip((_version_of(o) for o in origins), held_at)):
                return _RUN
        if h.single and h.offload is None:  # (one tensor held, the common case: on the hot path)
            v, orig, v0 = self.held[i][0], origins[0], v0s[0] if v0s else None
            if type(v) is torch.Tensor and type(orig) is torch.Tensor:  # (held strongly: _held_value inline)
                if v0 is not None and orig._version != v0:
                    raise self._written(i, v0, orig._version)
                val = ti.detach_below_modes(v)
            else:
                val = self._held_value(i, v, v0, orig)
            if i in self.copied:
                del self.held[i]  # a copy the recompute writes: handed over once, a later recompute runs the op
            return val
        vals = []
        with internal():
            for v, v0, orig in zip(self.held[i], v0s, origins):
                val = self._held_value(i, v, v0, orig)
                if val is _RUN:
                    return _RUN
                vals.append(val)
        return vals[0] if h.single else h.rebuild(vals)

    def _held_value(self, i: int, v: Any, v0: int | None, orig: Any) -> Any:
        """One held output of op ``i`` for the recompute: checked unwritten since the forward pass; ``_RUN`` if
        it was held weakly and died; fetched if offloaded."""
        if isinstance(v, weakref.ref):
            v = v()
            if v is None:
                return _RUN  # died since the forward pass: run the op again
        now = _version_of(orig)
        if v0 is not None and now is not None and now != v0:
            raise self._written(i, v0, now)
        # (no mode sees remat's own detach)
        return ti.detach_below_modes(v) if isinstance(v, torch.Tensor) else self.engine.fetch(v)

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


_RUN = object()  # FastFrame.replayed: run the op instead


def _written_after_saved(fn_name: str, t: torch.Tensor, version: int) -> RematError:
    return RematError(
        f"remat: a tensor of shape {list(t.shape)} that {fn_name} saved for the backward pass was modified in place "
        f"after it was saved (version {version} -> {t._version}). Do not modify it before the backward pass; clone "
        "it first."
    )


def _version_of(v: Any) -> int | None:
    if isinstance(v, weakref.ref):
        v = v()
    return v._version if isinstance(v, torch.Tensor) else None


class _Tap(TorchDispatchMode):
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

    def skip_name(self) -> bool:
        """NOTE [skipped tags]: whether the tag ``checkpoint_name`` is about to dispatch is one the plan lets go; if
        so, it counts as run."""
        i = self.i  # (asked once per tag, on a tagged function's hot path: no helper frame)
        if i in self.aliases and i < self.limit:
            i = _past_aliases(self.aliases, self.limit, i)  # NOTE [hooks' aliases] in _dispatch.py: the plan's, before the tag
        if i < self.limit and i in self.skip_names and threading.get_ident() == self.thread and ti.no_levels_open():
            if i > self.i:
                values = self.frame.plan.values
                if values is not None and any(k in values.at_op for k in range(self.i, i)):
                    self.frame.values_ok = False  # (as in _off_the_plan)
            self.i = i + 1
            return True
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        i = self.i
        if (i < self.limit and self.ops[i] is func and not INTERNAL.get()
                and (func is not _TO_COPY or _cast_agrees(self.casts, self.wiring, i, args, kwargs))
                and (func not in _ALIASING or (i in self.identity) is identity_alias(func, args, kwargs))):
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
            out = _off_the_plan(self, i, func, types, args, kwargs, None)  # NOTE [autocast's cache]
            if out is not _RUN:
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


class _Replay(TorchDispatchMode):
    """A planned call's recompute: the planned ops' held outputs handed back, dead ops skipped, every other op run.

    A dead op hands back NaN placeholders, as on the full engine (NOTE [dead ops]). The plan's liveness comes
    from the recorded call, so it is checked: what an op computes from a placeholder is one too (a view that
    always runs), and a placeholder captured as a saved tensor, written or drawn on, or read as a number
    (``.item()``) stops the recompute (``_PlanWrong``), which runs again without skipping anything.
    """

    def __init__(self, frame: FastFrame, skip_dead: bool) -> None:
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
        self.capture: _Capture | None = None

    skip_name = _Tap.skip_name  # (the recompute lets the forward pass's tags go: each saved nothing)
    no_grad = False  # (the recompute that builds the graph)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        i = self.i
        if (i < self.limit and self.ops[i] is func and not INTERNAL.get()
                and (func is not _TO_COPY or _cast_agrees(self.casts, self.wiring, i, args, kwargs))
                and (func not in _ALIASING or (i in self.identity) is identity_alias(func, args, kwargs))):
            if i > self.run_to >= 0 and self.capture is not None and self.capture.n >= self.capture.stop_after:
                raise _Stop  # NOTE [written after dropped]: every dropped tensor made, the last write run
            self.i = i + 1
            out = self._planned(i, func, args, kwargs)
            self._note(i, out, args)
            return out
        if func in RANGE_OPS:
            return profiler_op(func, args, kwargs or {})  # NOTE [FSDP's hooks] in _dispatch.py
        if not INTERNAL.get():
            out = _off_the_plan(self, i, func, types, args, kwargs, self.frame.cached_casts)
            if out is not _RUN:
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
                raise _Stop
        if self.placeholders and _reads_placeholder(self.placeholders, args, kwargs):
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
                    raise _NeedsGraph
                raise self.frame.read_other(i, func, now, then)
        out: Any = _RUN
        if i in self.held:
            out = self.frame.replayed(i)
        if out is _RUN:
            d = self.dead.get(i)
            if d is not None:
                out = self._taint(d.placeholders())
            elif self.placeholders and _reads_placeholder(self.placeholders, args, kwargs):
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
            raise _PlanWrong
        out = func(*args, **kwargs) if kwargs else func(*args)
        if not isinstance(out, torch.Tensor) and any(
                x is not None and not isinstance(x, torch.Tensor) for x in optree.tree_leaves(out, none_is_leaf=True)):
            raise _PlanWrong  # a number read from a placeholder (.item()): Python code may branch on it
        return self._taint(out)

    def _taint(self, out: Any) -> Any:
        for t in optree.tree_leaves(out, none_is_leaf=True):
            if isinstance(t, torch.Tensor):
                self.placeholders[id(t)] = weakref.ref(t)
        return out


class _ValueReplay(_Replay):
    """NOTE [value recompute]: :class:`_Replay` under no_grad, taking each dropped tensor as its op returns it, and
    stopping before the op after the one that saved the last of them."""

    no_grad = True

    def __init__(self, frame: FastFrame, skip_dead: bool, values: _Values, stop: int) -> None:
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
                    raise _NeedsGraph  # died before its save (a tensor only an autograd.Function's ctx held)
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
        i = self.i  # (as in _Tap.skip_name)
        if i in self.aliases and i < self.limit:
            i = _past_aliases(self.aliases, self.limit, i)
        if not (i < self.limit and i in self.skip_names and threading.get_ident() == self.thread
                and ti.no_levels_open()):
            return False
        for k in range(self.i, i):  # (the plan's aliases this pass skips, as in __torch_dispatch__)
            if k in self.at_op:
                raise _NeedsGraph
            if self.pending or k in self.saved_at:
                self.settle(k)
            if k >= self.stop:
                raise _Stop
        if self.pending or i in self.saved_at:  # (as for an op, below)
            self.settle(i)
        if i >= self.stop:
            raise _Stop
        self.i = i + 1
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        i = self.i
        if self.ops[i] is func and not INTERNAL.get() and (
                func is not _TO_COPY or _cast_agrees(self.casts, self.wiring, i, args, kwargs)) and (
                func not in _ALIASING or (i in self.identity) is identity_alias(func, args, kwargs)):  # (padded)
            if self.pending or i in self.saved_at:  # (most ops neither return nor follow a save)
                self.settle(i)
            if i >= self.stop:
                raise _Stop  # the op that saved the last dropped tensor has run: stop before the next one
            self.i = i + 1
            out = self._planned(i, func, args, kwargs)
            pos = self.one.get(i)
            if pos is not None and type(out) is torch.Tensor:
                # (the common case, _take_one inlined: the op returned one tensor, dropped at ``pos``)
                meta = self.drops.get(pos)
                if meta is not None:
                    ph = self.placeholders
                    if ph and id(out) in ph and _is_placeholder(ph, out):
                        raise _PlanWrong
                    if out.shape != meta[0] or out.dtype != meta[1]:
                        raise _NeedsGraph
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
            if self.placeholders and _reads_placeholder(self.placeholders, args, kwargs):
                # (an op not of the call, a hook's alias of a placeholder, say: a placeholder too, as in _Replay)
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
                raise _NeedsGraph  # (one the dropped tensors are taken from: the recompute that saves finds them)
            for k in range(i, j):
                if self.pending or k in self.saved_at:
                    self.settle(k)
                if k >= self.stop:
                    raise _Stop
            self.i = j
            return self.__torch_dispatch__(func, types, args, kwargs)
        if i >= self.stop:
            self.settle(i)
            raise _Stop  # (stop <= limit: the ops past the plan come after the last save)
        raise _NeedsGraph  # not the forward pass's op without a graph: maybe with one (a fused path taken)

    def _dropped(self, t: torch.Tensor, pos: int) -> bool:
        """Whether ``t`` is the tensor this call dropped at save position ``pos`` (False: held as an input of the
        call), checked as the recompute that saves checks it."""
        meta = self.drops.get(pos)
        if meta is None:
            return False
        ph = self.placeholders
        if ph and id(t) in ph and _is_placeholder(ph, t):
            raise _PlanWrong
        if t.shape != meta[0] or t.dtype != meta[1]:
            raise _NeedsGraph
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


def _off_the_plan(mode: Any, i: int, func: Any, types: Any, args: Any, kwargs: Any,
                  cached: dict[tuple[int, torch.dtype], torch.Tensor] | None) -> Any:
    """An op that is not the plan's op ``i`` of a planned mode (``_Tap``, ``_Replay``): autocast's cast of a leaf the
    other pass read from the cache (run, or in a recompute the cached tensor the forward pass read handed back, and
    not counted: NOTE [autocast's cache]); the plan's op past casts of leaves this pass read from the cache and past
    identity aliases it does not make (those skipped); or an identity alias the plan does not have here (run, not
    counted: NOTE [hooks' aliases] in _dispatch.py). ``_RUN``: none of these."""
    leaf = autocast_cast(func, args, kwargs)
    if leaf is not None:
        out = cached.get((id(leaf), kwargs["dtype"])) if cached is not None else None
        if out is None:
            out = func(*args, **kwargs)
        mode.wiring.note_cast(out, leaf)
        return out
    alias = identity_alias(func, args, kwargs) and not ignored(func)
    j = _after_cached_casts(mode.ops, mode.casts, i, mode.limit, func, mode.aliases, alias)
    if j > i:
        values = mode.frame.plan.values
        if values is not None and any(k in values.at_op for k in range(i, j)):
            mode.frame.values_ok = False  # (a skipped alias the value recompute takes a dropped tensor from)
        mode.i = j
        return mode.__torch_dispatch__(func, types, args, kwargs)
    if alias:
        # NOTE [hooks' aliases] in _dispatch.py: an identity alias the plan does not have here: run, not counted
        placeholders = getattr(mode, "placeholders", None)
        if placeholders and _reads_placeholder(placeholders, args, kwargs):
            return mode._run_tainted(func, args, kwargs)
        out = func(*args, **kwargs)
        mode.wiring.note_alias(out, args[0])
        return out
    return _RUN


def _cast_agrees(casts: dict[int, Any], wiring: Wiring, i: int, args: Any, kwargs: Any) -> bool:
    """NOTE [autocast's cache]: a ``_to_copy`` at the plan's index ``i`` is the plan's op there only if both cast
    the same leaf (by its token) or neither casts a leaf: autocast casts a block's leaves before its activation, and
    a cast of a leaf one pass read from the cache shifts the others."""
    leaf = autocast_cast(_TO_COPY, args, kwargs)
    got = None if leaf is None else wiring.known.get(id(leaf), _UNKNOWN)
    return casts.get(i) == got


_UNKNOWN = object()  # (a leaf that is neither an input nor module state: matches no plan's cast)


def _past_aliases(aliases: frozenset[int], limit: int, i: int) -> int:
    """The plan's index past its identity aliases at ``i``, ``i + 1``, ... that this pass does not make."""
    while i < limit and i in aliases:
        i += 1
    return i


def _after_cached_casts(ops: tuple[Any, ...], casts: dict[int, Any], i: int, limit: int, func: Any,
                        aliases: frozenset[int] = frozenset(), alias: bool = False) -> int:
    """NOTE [autocast's cache]: where ``func`` (not a cast of a leaf) is the plan's op once the casts of leaves at
    ``i``, ``i + 1``, ... are skipped (read from autocast's cache instead), or ``i`` if it is not. So are identity
    aliases this pass does not make (NOTE [hooks' aliases] in _dispatch.py): every one of them before an op that is
    none (``alias`` False: a hook's ``view`` is not the ``view`` a Linear runs), those of other ops before one."""
    j = i
    while j < limit and (j in aliases and (ops[j] is not func or not alias)
                         or j in casts and (ops[j] is not func or func is _TO_COPY)):
        j += 1
    return j if j > i and j < limit and ops[j] is func else i


def _reads_placeholder(placeholders: dict[int, weakref.ref[torch.Tensor]], args: tuple[Any, ...],
                       kwargs: dict[str, Any] | None) -> bool:
    """Whether an op's arguments (a tensor, or a list of them, per argument) include a placeholder. By ``id`` first:
    it runs on every op of a recompute that skips dead ops, and an ``id`` of a live object names no other."""
    for a in (*args, *kwargs.values()) if kwargs else args:
        if id(a) in placeholders:
            if _is_placeholder(placeholders, a):
                return True
        elif type(a) is list or type(a) is tuple:
            if any(id(x) in placeholders and _is_placeholder(placeholders, x) for x in a):
                return True
    return False


def _is_placeholder(placeholders: dict[int, weakref.ref[torch.Tensor]], t: Any) -> bool:
    ref = placeholders.get(id(t))
    if ref is None:
        return False
    if ref() is t:
        return True
    del placeholders[id(t)]  # that placeholder died, and its id is another object's now: look no more
    return False


class _PlanWrong(Exception):
    """A planned recompute met a placeholder where a value is needed: run it again without skipping ops."""


class _NeedsGraph(Exception):
    """A value recompute (NOTE [value recompute]) did not run the forward pass's ops, or did not make the tensors it
    saved: the recompute that builds the graph and takes what autograd saves runs instead, and tells."""


def _release(frame: FastFrame) -> Callable[[], None]:
    """At the end of the backward pass, let go of what it did not read (held weakly: NOTE [free as used])."""
    wself = weakref.ref(frame)

    def release() -> None:
        f = wself()
        if f is not None and not f.forwarding:
            f.cache = Made({}, {})

    return release


class _Stop(Exception):
    """Raised by the capture hook once it has made every dropped tensor."""


def _identity(x: Any) -> Any:
    return x


class _Capture:
    __slots__ = ("wanted", "stop_after", "fn_name", "detach", "n", "captured", "placeholders", "mode", "versions",
                 "hold_stop")

    def __init__(self, wanted: dict[int, tuple[Any, ...]], stop_after: int, fn_name: str,
                 detach: bool, placeholders: dict[int, weakref.ref[torch.Tensor]], mode: bool) -> None:
        self.placeholders = placeholders
        self.mode = mode  # a planned recompute: remat's replay mode is on the stack
        self.wanted = wanted
        self.stop_after = stop_after
        self.fn_name = fn_name
        self.detach = detach
        self.n = 0
        self.captured: dict[int, torch.Tensor] = {}
        self.versions: dict[int, int] = {}  # position -> version when made (NOTE [written after saved])
        self.hold_stop = False  # NOTE [written after dropped]: the replay stops the recompute, after the last write

    def pack(self, t: torch.Tensor) -> Any:
        pos = self.n
        self.n = pos + 1
        meta = self.wanted.get(pos)
        if meta is not None:
            if t.shape != meta[0] or t.dtype != meta[1]:
                raise saved_shape_differs(self.fn_name, t, meta, pos)
            node = t.grad_fn
            if not _same_maker(None if node is None else type(node), meta[2]):
                raise RematError(
                    f"remat: the recompute of {self.fn_name} saved a tensor made by "
                    f"{_node_name(type(node) if node is not None else None)} where its forward pass saved one made by "
                    f"{_node_name(meta[2])} (saved tensor #{pos}); the function must do the same work every time it "
                    "is called (no branch on a flag or global state that changed since the forward pass)."
                )
            if self.placeholders and _is_placeholder(self.placeholders, t):
                raise _PlanWrong
            held = _holdable(t, self.mode)
            # without create_graph the backward pass needs the value only, not the recompute's graph
            self.captured[pos] = held if self.detach else t
            self.versions[pos] = t._version
        elif t.is_leaf:
            held = t  # an input, a parameter, a replayed output: no node of its own to make a cycle with
        else:
            held = _holdable(t, self.mode)
        if self.n >= self.stop_after and not self.hold_stop:
            raise _Stop
        return held  # (the recompute's own graph: the function may run a backward pass of its own through it)

    def finish(self) -> Made:
        captured, self.captured = self.captured, {}
        return Made(captured, self.versions, plain=True)


def _node_name(cls: Any) -> str:
    return "no op (an input)" if cls is None else cls.__name__


# The nodes of one view, by how torch decomposed ``reshape``/``view``: a Python dispatch mode on the stack in the
# forward pass but not in the recompute (a user's memory census) turns ``view`` into ``_reshape_alias``.
_VIEWS = frozenset({"ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0"})


# The node of a module hook's identity wrapper (global full backward hooks, made under grad mode in one pass only:
# NOTE [hooks' aliases] in _dispatch.py): the same value as whatever made its input, so it matches any maker.
_HOOK_NODES = frozenset({"BackwardHookFunctionBackward"})


def _same_maker(got: Any, want: Any) -> bool:
    """Whether a recomputed saved tensor was made as the forward's was (node classes, a view as any view, a hook's
    identity wrapper as anything)."""
    return got is want or (got is not None and want is not None and got.__name__ in _VIEWS
                           and want.__name__ in _VIEWS) or (
        (got is not None and got.__name__ in _HOOK_NODES) or (want is not None and want.__name__ in _HOOK_NODES))


def _holdable(t: torch.Tensor, mode: bool = True) -> torch.Tensor:
    """A saved tensor without its graph: holding an output would make a cycle through its own node."""
    if not t.requires_grad or t.is_leaf:
        return t  # (a leaf, such as a parameter: no node of its own; is_leaf asks without making the node's Python
        # object, which t.grad_fn does: ~0.4 us a kept tensor, inside a planned call)
    if not mode:
        return t.detach()  # (save-nothing: no mode of remat's is on the stack)
    if type(t) is torch.Tensor:
        return ti.detach_below_modes(t)  # (no mode sees it: no need to mark it remat's own)
    with internal():
        return t.detach()
