"""What a plan is: the first call of a signature, recorded, as a plan its later calls follow; its signature
and its cache.

NOTE [fast path]
    Under ``nothing_saveable`` with no ``torch.func`` level and no enclosing remat
    call, the recorder's per-op work buys nothing the backward pass needs: every
    saved tensor but the inputs is recomputed anyway. So, as
    ``torch.utils.checkpoint`` does, a :class:`FastFrame` drops every saved tensor
    but an input (held by reference; the shape and dtype of each dropped one
    noted), and the recompute re-runs the function, taking the dropped tensors
    in order and stopping as soon as the last one is made (the ops after it do
    not run). Unlike ``torch.utils.checkpoint`` it runs the forward pass under
    the planned call's small dispatch mode (``Tap``), which notes what each op
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
    under a dispatch mode (``Tap``) that only counts ops, checks each is the op
    the plan has at that index, and holds the planned outputs; the recompute's
    mode (``Replay``) hands those back at the same indices and runs every other
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
    every later op looks for one among its arguments (``Replay``). A dead op
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
"""

from __future__ import annotations

import threading
import types
import weakref
from typing import Any

import optree
import torch

from .. import _torch_internals as ti
from .._context import CACHES, INSPECTOR, active_context
from .._errors import RematError
from .._ops import LIFTS, OpRecord, dead_value, identity_alias, ignored, storage_key, tensor_leaves, traits
from .._packed import DROP, KEEP, OFFLOAD
from .._policies import Offloadable
from .._state import Snapshot
from .._wiring import Wiring, autocast_cast, known_tokens

__all__ = ["Plan", "plan_of_call", "signature", "fast_path_applies", "plans_for", "MAX_PLANS"]

MAX_PLANS = 32  # signatures remembered per remat'd function (a new one past this forgets the oldest)

_AUTOCAST = ("cpu", "cuda")


class Hold:
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
        self.single = rec.out_spec == ONE_LEAF and rec.consts is None  # one tensor: no pytree to rebuild

    def rebuild(self, tensors: list[Any]) -> Any:
        """The op's output from its tensors (as :meth:`OpRecord.rebuild`, which reads the same two fields)."""
        return OpRecord.rebuild(self, tensors)  # type: ignore[arg-type]


class Dead:
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
                 ops: tuple[Any, ...] | None = None, hold: dict[int, Hold] | None = None,
                 dead: dict[int, Dead] | None = None, random: bool = True) -> None:
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
        self.values: Values | None = None  # NOTE [value recompute]: where each dropped tensor comes from
        # NOTE [dead ops]: save position -> the dead op whose output the recorded call kept there; a planned call hands
        # back the kept tensor while it lives rather than a placeholder
        self.kept_dead: dict[int, int] = {}
        self.kept_dead_ops: frozenset[int] = frozenset()
        self.skip_names: frozenset[int] = frozenset()  # NOTE [skipped tags]: op indices of the tags that may go
        self.copy_before: dict[int, list[int]] = {}  # op index -> the held outputs (Hold.cow) it writes: copy first
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
        """The op indices where a planned forward pass holds, copies before or notes an output (``Tap``): most ops
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
        (``Tap`` holds them inline: most held ops, a matmul's product under ``dots_saveable``). Worked out once."""
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
                dead[i] = Dead(rec)  # nothing the recompute needs reads it: a placeholder (NOTE [dead ops])
                continue
            if rec.stash is None or not rec.stash:
                continue
            if rec.cow:
                if rec.out_spec == ONE_LEAF and rec.consts is None and not isinstance(rec.decision, Offloadable) \
                        and rec.cow_at is not None:
                    hold[i] = Hold(rec, False, cow=True)
                continue
            weak = [isinstance(x, weakref.ref) for x in rec.stash]
            if all(x is not None and (not w or x() is not None) for x, w in zip(rec.stash, weak)):
                hold[i] = Hold(rec, all(weak))
        plan = cls(keep, offload, tuple(r.func for r in ops), hold, dead, any(r.random for r in ops))
        for i, h in hold.items():
            if h.cow:
                plan.copy_before.setdefault(ops[i].cow_at, []).append(i)  # type: ignore[arg-type]
        plan.kept_dead = {pos: i for pos, i in (kept or {}).items() if i in dead and not ops[i].cow}
        plan.kept_dead_ops = frozenset(plan.kept_dead.values())
        return plan


class Values:
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


ONE_LEAF = optree.tree_structure(0)  # type: ignore[arg-type]
ALIAS = torch.ops.aten.alias.default  # what checkpoint_name dispatches (_naming.py)
# the ops an identity alias may be (NOTE [hooks' aliases] in _dispatch.py): only these are asked whether they are one
ALIASING = frozenset({torch.ops.aten.view.default, torch.ops.aten.detach.default})
TO_COPY = torch.ops.aten._to_copy.default  # NOTE [autocast's cache]: autocast's casts


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
        plan.values = Values({p: frame.plan_sources[p] for p in dropped})
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
    return frozenset(i for i, r in enumerate(ops) if r.name is not None and r.func is ALIAS
                     and i not in plan.hold and i not in plan.dead and i not in taken)


def plans_for(fn: Any, key: Any) -> dict[Any, Plan | None]:
    """The plans (signature -> plan) of ``fn`` under ``key`` (policy, static_argnums): shared where possible."""
    if isinstance(fn, types.MethodType):
        owner, key = fn.__self__, (fn.__func__, key)
    else:
        owner = fn
    try:
        hash(key)
        per_owner = CACHES.get().plans.setdefault(owner, {})  # (Caches.plans: keyed weakly by the function)
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


RUN = object()  # FastFrame.replayed: run the op instead


def skip_tag(self: Any) -> bool:
    """NOTE [skipped tags]: whether the tag ``checkpoint_name`` is about to dispatch is one the plan lets go; if
    so, it counts as run (the planned modes' ``skip_name``: ``self`` is one)."""
    i = self.i  # (asked once per tag, on a tagged function's hot path: no helper frame)
    if i in self.aliases and i < self.limit:
        i = past_aliases(self.aliases, self.limit, i)  # NOTE [hooks' aliases] in _dispatch.py: the plan's, before the tag
    if i < self.limit and i in self.skip_names and threading.get_ident() == self.thread and ti.no_levels_open():
        if i > self.i:
            values = self.frame.plan.values
            if values is not None and any(k in values.at_op for k in range(self.i, i)):
                self.frame.values_ok = False  # (as in off_the_plan)
        self.i = i + 1
        return True
    return False


def off_the_plan(mode: Any, i: int, func: Any, types: Any, args: Any, kwargs: Any,
                  cached: dict[tuple[int, torch.dtype], torch.Tensor] | None) -> Any:
    """An op that is not the plan's op ``i`` of a planned mode (``Tap``, ``Replay``): autocast's cast of a leaf the
    other pass read from the cache (run, or in a recompute the cached tensor the forward pass read handed back, and
    not counted: NOTE [autocast's cache]); the plan's op past casts of leaves this pass read from the cache and past
    identity aliases it does not make (those skipped); or an identity alias the plan does not have here (run, not
    counted: NOTE [hooks' aliases] in _dispatch.py). ``RUN``: none of these."""
    leaf = autocast_cast(func, args, kwargs)
    if leaf is not None:
        out = cached.get((id(leaf), kwargs["dtype"])) if cached is not None else None
        if out is None:
            out = func(*args, **kwargs)
        mode.wiring.note_cast(out, leaf)
        return out
    alias = identity_alias(func, args, kwargs) and not ignored(func)
    j = after_cached_casts(mode.ops, mode.casts, i, mode.limit, func, mode.aliases, alias)
    if j > i:
        values = mode.frame.plan.values
        if values is not None and any(k in values.at_op for k in range(i, j)):
            mode.frame.values_ok = False  # (a skipped alias the value recompute takes a dropped tensor from)
        mode.i = j
        return mode.__torch_dispatch__(func, types, args, kwargs)
    if alias:
        # NOTE [hooks' aliases] in _dispatch.py: an identity alias the plan does not have here: run, not counted
        placeholders = getattr(mode, "placeholders", None)
        if placeholders and reads_placeholder(placeholders, args, kwargs):
            return mode._run_tainted(func, args, kwargs)
        out = func(*args, **kwargs)
        mode.wiring.note_alias(out, args[0])
        return out
    return RUN


def cast_agrees(casts: dict[int, Any], wiring: Wiring, i: int, args: Any, kwargs: Any) -> bool:
    """NOTE [autocast's cache]: a ``_to_copy`` at the plan's index ``i`` is the plan's op there only if both cast
    the same leaf (by its token) or neither casts a leaf: autocast casts a block's leaves before its activation, and
    a cast of a leaf one pass read from the cache shifts the others."""
    leaf = autocast_cast(TO_COPY, args, kwargs)
    got = None if leaf is None else wiring.known.get(id(leaf), _UNKNOWN)
    return casts.get(i) == got


_UNKNOWN = object()  # (a leaf that is neither an input nor module state: matches no plan's cast)


def past_aliases(aliases: frozenset[int], limit: int, i: int) -> int:
    """The plan's index past its identity aliases at ``i``, ``i + 1``, ... that this pass does not make."""
    while i < limit and i in aliases:
        i += 1
    return i


def after_cached_casts(ops: tuple[Any, ...], casts: dict[int, Any], i: int, limit: int, func: Any,
                        aliases: frozenset[int] = frozenset(), alias: bool = False) -> int:
    """NOTE [autocast's cache]: where ``func`` (not a cast of a leaf) is the plan's op once the casts of leaves at
    ``i``, ``i + 1``, ... are skipped (read from autocast's cache instead), or ``i`` if it is not. So are identity
    aliases this pass does not make (NOTE [hooks' aliases] in _dispatch.py): every one of them before an op that is
    none (``alias`` False: a hook's ``view`` is not the ``view`` a Linear runs), those of other ops before one."""
    j = i
    while j < limit and (j in aliases and (ops[j] is not func or not alias)
                         or j in casts and (ops[j] is not func or func is TO_COPY)):
        j += 1
    return j if j > i and j < limit and ops[j] is func else i


def reads_placeholder(placeholders: dict[int, weakref.ref[torch.Tensor]], args: tuple[Any, ...],
                       kwargs: dict[str, Any] | None) -> bool:
    """Whether an op's arguments (a tensor, or a list of them, per argument) include a placeholder. By ``id`` first:
    it runs on every op of a recompute that skips dead ops, and an ``id`` of a live object names no other."""
    for a in (*args, *kwargs.values()) if kwargs else args:
        if id(a) in placeholders:
            if is_placeholder(placeholders, a):
                return True
        elif type(a) is list or type(a) is tuple:
            if any(id(x) in placeholders and is_placeholder(placeholders, x) for x in a):
                return True
    return False


def is_placeholder(placeholders: dict[int, weakref.ref[torch.Tensor]], t: Any) -> bool:
    ref = placeholders.get(id(t))
    if ref is None:
        return False
    if ref() is t:
        return True
    del placeholders[id(t)]  # that placeholder died, and its id is another object's now: look no more
    return False


class NeedsGraph(Exception):
    """A value recompute (NOTE [value recompute]) did not run the forward pass's ops, or did not make the tensors it
    saved: the recompute that builds the graph and takes what autograd saves runs instead, and tells."""


def written_after_saved(fn_name: str, t: torch.Tensor, version: int) -> RematError:
    return RematError(
        f"remat: a tensor of shape {list(t.shape)} that {fn_name} saved for the backward pass was modified in place "
        f"after it was saved (version {version} -> {t._version}). Do not modify it before the backward pass; clone "
        "it first."
    )


def version_of(v: Any) -> int | None:
    if isinstance(v, weakref.ref):
        v = v()
    return v._version if isinstance(v, torch.Tensor) else None
