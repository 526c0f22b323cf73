"""The dispatch-level view of a remat'd call: ask the policy about every ATen op, replay saved outputs.

A ``TorchDispatchMode`` sees the plain ATen ops below every functorch layer, so it
works under every ``torch.func`` transform (a ``TorchFunctionMode`` does not: it
sees the calls above the layers). In the forward pass :class:`Recorder` asks the
policy about each op, records what ran (op, output shapes) and keeps the outputs
of saveable ops in a stash; in the recompute :class:`Replayer` checks that the
same ops run in the same order and hands back stashed outputs instead of running
the op again, so ``dots_saveable`` recomputes no matrix product.

NOTE [wrapper subclasses]
    A tensor subclass that wraps others (DTensor and its local shard, the
    AsyncCollectiveTensor a collective returns) is made and taken apart in
    Python: ``DTensor.from_local`` and ``to_local`` run no op this mode sees,
    so a DTensor op's output and the local tensor the next plain op reads
    looked unrelated. Under tensor parallel the liveness walk then found the
    GELU between ``up`` and ``down`` dead, and its NaN placeholder became the
    row-wise weight's gradient, no error (issue 39). So a wrapper and the
    tensors it wraps (named by ``__tensor_flatten__``) are one value of the
    call (``Recorder.vid``), its storage is its first inner tensor's
    (``storage_key``: a DTensor op's output is fresh, a view of one is a view,
    as for plain tensors, so the policy's decisions, the stash and dead ops
    work on DTensor ops as on plain ones), and a placeholder for a wrapper is
    one of its class and layout around placeholders (``__tensor_unflatten__``),
    so that a dead DTensor op hands the code after it a DTensor.

NOTE [hooks' aliases]
    Code that is not the function's runs inside it and may differ between the
    forward pass and the recompute: under any dispatch mode ``param.data`` of a
    parameter dispatches a ``detach``, which ``CommDebugMode``'s module hooks do
    in the forward pass only; a global full backward hook (module trackers)
    wraps each module's inputs and outputs in ``BackwardHookFunction``, whose
    outputs are ``view``s of the same shape, under grad mode only (not in a
    recompute without a graph, nor in one run after the mode left). Each is an
    *identity alias*: its one argument again, the same value, shape and strides
    (``identity_alias``). A pass may make more of them or fewer: one the other
    pass lacks is run and not counted, the other pass's are skipped, and its
    output's token (NOTE [same reads] in ``_engine/wiring.py``) is its argument's, so
    the ops after it read the same values whichever pass made it. An alias is
    not checked itself (which parameter a tracker's ``.data`` reads at a given
    position may differ): the ops that read its output are. The state fuzzer
    (``benchmarks/fuzz.py``) runs its programs with such modes and hooks
    around random calls' forward passes, backward passes or both.
    ``torch.utils.checkpoint`` does not compare ops and so never minded them;
    here ``CommDebugMode`` around a remat'd call raised a divergence on every
    call. Other ops the function does not make in both passes are still a
    divergence: only an identity alias is the same value by construction.

NOTE [FSDP's hooks]
    A remat'd function that calls a ``fully_shard``'ed module runs FSDP2's hooks
    inside the call (``remat(lambda x: block(x))``, ``checkpoint(layer.__call__)``,
    a block whose submodules are sharded): in the forward pass its pre-forward
    hook all-gathers the parameters and registers the gathered ones, its
    post-forward hook reshards; in the recompute, which runs in the module's
    backward pass, both return at once (FSDP2's pre-backward hook has gathered
    the parameters already). The ops differ, and until issue 39 remat raised "the
    recompute diverged: op #0 was aten.empty.memory_format". FSDP2 runs each hook
    inside a profiler range named ``FSDP::...``, whose markers every mode sees
    (``profiler_op``): the ops inside one are not the call's (``INTERNAL``), in
    every pass and every mode. The sharded parameters FSDP2 registers between
    calls are not the call's state (``_engine/state.py``): the forward pass reads the
    gathered ones, which are outside tensors, held and checked by identity and
    version (NOTE [outside tensors]
    An op may read a tensor that is neither an input of the call nor made by an
    op of the call: a parameter, a buffer, a closed-over or global tensor, a
    constant built from Python data. NOTE [state is an input] in ``_engine/state.py``
    puts module state and closures back for the recompute; this is the safety
    net for everything it cannot reach, at the dispatch level:

    * an outside tensor that needs a gradient, or is large (> 64 KiB), is held and
      the recompute checks that the same op reads the very same tensor at the same
      version (or an equal one that needs no gradient): else a ``RematError``
      naming it. Held strongly, so a tensor replaced (and freed) during the call
      cannot pass for a temporary;
    * a small one that needs no gradient (running statistics, a mask, a constant
      from ``torch.tensor``) is copied when the forward pass ends and the recompute
      reads the copy: exact whatever happens to it afterwards, including writes
      torch does not count as versions (a batch norm outside the call);
    * the recompute must pass the same Python numbers to each op (a step counter
      in the module: a ``RematError``, not a silently different scale).

    Writes into outside tensors (BatchNorm's running statistics, whose writes the
    op's schema does not declare; any buffer updated in place) happen once, in
    the forward pass: before each such write the forward copies the value about
    to be overwritten (and, for every read of that storage since the last write,
    the value that read saw), and the recompute writes into a copy of it instead,
    reading what the forward read. Reads after the call's last write are served
    from copies taken when the forward pass ends. The frame also hands the
    recompute stand-ins for such buffers, so autograd's view of the real ones
    (their versions, their history) is untouched.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch

from .. import _torch_internals as ti
from .._context import INTERNAL, PENDING_NAME, internal
from .._policies.core import Decision, Offloadable, Recompute, Saveable, decide, decide_explicit
from .._policies.naming import checkpoint_name
from .._torch_internals import TorchDispatchMode
from . import outside as ox
from .ambient import draw_first
from .liveness import StashLiveness
from .ops import (
    ALIAS,
    DETACH,
    LIFTS,
    ONE_LEAF,
    RANGE_OPS,
    TENSOR_LEAF,
    TO_COPY,
    OpRecord,
    are_constants,
    arg_tensors,
    explicit_generator,
    generator_for,
    identity_alias,
    ignored,
    not_the_policys,
    op_meta,
    profiler_op,
    storage_key,
    tensor_leaves,
    traits,
)
from .outside_writes import OutsideReads
from .wiring import Wiring, autocast_cast, values_key

__all__ = ["OpTap", "Recorder", "iter_stashed"]

# remat's own bookkeeping (detach, copies, RNG state) must not be seen as ops of
# the user's function by any remat mode on the stack.


ABSOLUTE_VIEWS = frozenset(getattr(torch.ops.aten, n) for n in ox.ABSOLUTE)  # (NOTE [written outside storages])


class Recorder(StashLiveness, OutsideReads, TorchDispatchMode):
    """Forward pass: ask the policy about each op, record it, stash saveable outputs."""

    def __init__(self, policy: Callable[..., Any], fn_name: str,
                 offload: Callable[[torch.Tensor, Offloadable], Any]) -> None:
        super().__init__()
        self.policy = policy
        self.fn_name = fn_name
        self.offload = offload  # tensor, decision -> what to stash (the tensor or an Offloaded)
        self.ops: list[OpRecord] = []
        self._vid_of: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}  # id(tensor) -> (ref, vid)
        self.next_vid = 0
        self.producers: dict[int, int] = {}  # storage key -> index of the op that allocated it
        self.stash_of: dict[int, tuple[int, int]] = {}  # vid -> (op index, output position)
        self.made_by: dict[int, int] = {}  # vid -> index of the op that returned that tensor
        self.on_demote: Callable[[int], None] | None = None  # storage key: a name dropped it
        self.on_write: Callable[[set[int]], None] | None = None  # storage keys an in-place op is about to write
        self.mutated_inplace = False
        self.offloaded_written: Any = None  # the op that wrote an output to offload in place (Frame.forward)
        self.refilled: list[Any] = []  # offloaded outputs a fill of the forward pass wrote since (``seal``)
        self.keep_written_offloads = False  # under torch.func: NOTE [written before offloaded] in outside_writes.py
        self.written: set[int] = set()  # storage keys an in-place op wrote (over-approximated: all its args)
        self.input_keys: set[int] = set()  # storages of the call's inputs (set by the frame)
        self._outside_state()  # (OutsideReads': the outside tensors read and written)
        self.describe_tensor: Callable[[torch.Tensor], str | None] = lambda t: None
        self.generators: dict[int, tuple[torch.Generator, torch.Tensor]] = {}  # NOTE [generators of your own]
        # NOTE [same reads] in _engine/wiring.py: set by a frame without torch.func levels that is not nested (its tensors are
        # the call's own objects): the key of each op's arguments, which the Replayer compares
        self.wiring: Wiring | None = None
        self._paused = False
        # a reentrant region (_engine/region.py): what the policy saves is held at once, and detach is not an op
        self.region = False

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Ops run inside are not the call's: a recompute during the forward pass (NOTE [backward inside
        the forward pass] in ``_engine/full.py``) runs below this mode, still on the stack."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def vid(self, t: torch.Tensor, read: bool = False) -> int:
        """A number naming this tensor object for the call (never reused, unlike ``id``). ``read``: ``t`` is an op's
        argument, which an op of the call may have made under another name that no mode saw."""
        e = self._vid_of.get(id(t))
        if e is not None and e[0]() is t:
            return e[1]
        inner = ti.inner_tensors(t)
        # NOTE [wrapper subclasses]: a wrapper and the tensors it wraps are one value of the call
        v = next((x for x in map(self.known_vid, inner) if x is not None), None)
        if v is None and read:
            # NOTE [FSDP's hooks]: an alias made where no mode records (a hook's autograd.Function returning its
            # input, FSDP2's around a module's inputs) of a storage an op of the call made: that op's value
            s = ti.storage_of(t)
            v = None if s is None else self._storage_vid(s)
        if v is None:
            v = self.next_vid
            self.next_vid += 1
        self._vid_of[id(t)] = (weakref.ref(t), v)
        for x in inner:
            if self.known_vid(x) is None:
                self._vid_of[id(x)] = (weakref.ref(x), v)
        return v

    def known_vid(self, t: torch.Tensor) -> int | None:
        e = self._vid_of.get(id(t))
        return e[1] if e is not None and e[0]() is t else None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if INTERNAL.get() or self._paused or ignored(func):
            return profiler_op(func, args, kwargs) if func in RANGE_OPS else func(*args, **kwargs)
        if func is DETACH and self.region:
            # (a reentrant region: how many detaches torch.func runs depends on the grad mode, which differs
            # between the region's forward and its backward) the same value under another name
            out = func(*args, **kwargs)
            with internal():
                self._vid_of[id(out)] = (weakref.ref(out), self.vid(args[0]))
            return out
        name = PENDING_NAME.get() if func is ALIAS else None
        ins = arg_tensors(args, kwargs)
        if func.overloadpacket in ABSOLUTE_VIEWS:
            self._absolute_view(ins)
        mutable, random = traits(func)
        mutable = ox.mutates(func, args, mutable)
        subst = self._before_mutation(func, args, kwargs, ins) if mutable else None
        rng = drew = g = None
        held = False
        if random:
            with internal():
                g = generator_for(args, kwargs)  # NOTE [random ops] in _engine/replay.py
        gen = explicit_generator(args, kwargs) if random else None  # (a user's generator)
        if gen is not None and id(gen) not in self.generators:
            with internal():
                self.generators[id(gen)] = (gen, gen.get_state())
        if random and g is not None:
            out, state, drew, held = draw_first(g, func, func, args, kwargs)  # NOTE [draws in threads] in ambient.py
            rng = (g, state)
        else:
            out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            leaves, spec = [out], ONE_LEAF
        else:
            leaves, spec = optree.tree_flatten(out, none_is_leaf=True)
        outs = [t for t in leaves if isinstance(t, torch.Tensor)]

        explicit = False
        if name is not None:
            decision, explicit = decide_explicit(self.policy, checkpoint_name, args, {"name": name})
        elif not_the_policys(ins, outs):  # (forward AD's internal checks under jvp)
            decision = Recompute
        else:
            decision = decide(self.policy, func, args, kwargs, out)
        if held:
            decision = Saveable  # (drawn from a shared generator with another thread alive: NOTE [draws in threads])
        with internal():
            keys = [storage_key(t) for t in ins]
            in_keys = set(keys)
            in_vids = [self.vid(t, read=True) for t in ins]
            for a in args:
                if isinstance(a, (torch.UntypedStorage, torch.TypedStorage)):
                    # a storage argument (``set_``, what ``untyped_storage().copy_`` runs): the value of the op of the
                    # call that made it, if one did (after the tensors: in_vids' positions are the tensors')
                    v = self._storage_vid(a)
                    if v is not None:
                        in_vids.append(v)
            if func in LIFTS and ins and ox.nbytes(ins[0]) > ox.SMALL:
                # a large tensor built from Python data in the call, made afresh by the recompute: not held,
                # the recompute checks it built the same value (a small one is copied like an outside tensor:
                # the recompute reads the forward's value whatever the Python data became)
                outside, lifted = None, ox.fingerprint(ins[0])
            else:
                outside, lifted = self._outside_reads(ins, keys, in_vids, func.is_view), None
                if func in LIFTS and ins:  # (its value now: the lifted tensor is the data's, which a write may change)
                    subst = {**(subst or {}), 0: ins[0].detach().clone()}
            scalars = values_key(args, kwargs)  # NOTE [same reads] in _engine/wiring.py
            if outside and func is TO_COPY and isinstance(decision, Offloadable):
                # a cast of a parameter (autocast's bf16 weights): moving a parameter-sized copy each step
                # costs more than casting again in the recompute, and parameters are kept by reference anyway
                decision = Recompute
            rec = OpRecord(
                func,
                name,
                decision,
                [op_meta(t) for t in outs],
                in_vids,
                [self.vid(t) for t in outs],
                random,
                out_spec=spec if len(outs) == len(leaves) or are_constants(leaves) else None,
            )
            if len(outs) != len(leaves):
                # the numbers, and a marker (not the tensor: the stash decides what is held) per tensor
                rec.consts = [TENSOR_LEAF if isinstance(x, torch.Tensor) else x for x in leaves] if rec.out_spec else None
            rec.outside, rec.subst, rec.scalars, rec.lifted = outside, subst, scalars, lifted
            leaf = autocast_cast(func, args, kwargs)
            rec.cast_leaf = None if leaf is None else weakref.ref(leaf)
            rec.rng, rec.drew, rec.writes, rec.held = rng, drew, mutable, held
            for j, t, _ in outside or ():  # reads a later write in this call would invalidate
                self._pending.setdefault(storage_key(t), []).append((rec, j, t))
            idx = len(self.ops)
            self.ops.append(rec)
            rec.alias = identity_alias(func, args, kwargs)  # NOTE [hooks' aliases]
            if self.wiring is not None:  # NOTE [same reads] in _engine/wiring.py
                rec.wkey = self.wiring.key(args, kwargs)
                if leaf is not None:
                    self.wiring.note_cast(out, leaf)
                elif rec.alias:
                    self.wiring.note_alias(out, args[0])
                else:
                    self.wiring.note(idx, out)
            rec.refs = [weakref.ref(t) for t in outs]
            rec.stores = [None if (st := ti.storage_of(t)) is None else weakref.ref(st) for t in outs]
            for t, v in zip(outs, rec.out_vids):
                # an in-place write returns the outside tensor it wrote: that stays outside
                if not (mutable and subst and self.is_outside(storage_key(t), t)):
                    self.made_by[v] = idx
            if name is not None and ins and (decision is not Recompute or explicit):
                self._name_decides(ins[0], decision, idx)
            rec.in_keys = keys
            rec.out_keys = [storage_key(t) for t in outs]
            for k in rec.out_keys:
                # a checkpoint_name's alias is only the name's carrier (the caller gets the tensor itself): the name
                # decides for the op that made the value (``_name_decides``), which stays its storage's producer
                if k and name is not None:
                    rec.named_from = self.producers.get(k)
                elif k and (k not in in_keys or func in LIFTS):
                    self.producers[k] = idx
                if k and k not in in_keys:
                    # a fresh storage: whatever was written at this address before was another storage, freed
                    # since (the allocator hands addresses back). Its writes are not this output's: held as
                    # written, it would be run again for nothing, as often as the allocator reuses an address
                    self.written.discard(k)
                    self.written_outside.discard(k)
                    self.shadows.pop(k, None)
            # a mutable op (squeeze_, add_, out=) is run again, never replayed: handing back its stashed
            # output would skip the write into its argument, which the caller goes on using. A zero
            # tensor (forward AD's "no tangent") is free to remake and a replayed copy would lose the
            # flag, so the ops that follow (and the op sequence) would differ.
            zero = any(ti.is_zero_tensor(t) for t in outs)
            # NOTE [dead ops]: an op whose outputs nothing live reads need not run in the recompute
            rec.skippable = (not random and not mutable and not zero and bool(outs) and rec.out_spec is not None
                             and all(storage_key(t) not in in_keys for t in outs))
            stashable = (not random or held) and not mutable and not zero and bool(outs) and rec.out_spec is not None
            if any(k in in_keys for k in rec.out_keys):
                # a view (a checkpoint_name alias too) held for the replay would be copied before a write through it,
                # apart from its base's copy, and its replay would hand back that copy, not a view of the base: the
                # replayed write would miss the base. Views cost nothing to run again: run them again
                stashable = False
            if decision is not Recompute and stashable:
                self._stash(rec, idx)
            else:
                # it runs again in the recompute (recomputed, or not replayable: random, a write, no tensor
                # output such as .item()): what it reads must come back there
                for v in in_vids:
                    self._promote(v)
        return out


    def _name_decides(self, x: torch.Tensor, decision: Decision, name_idx: int) -> None:
        """A checkpoint_name decides for the op that computed the named value (JAX: the name is the value).

        Saving the name saves that op's output, so the op is replayed rather than
        recomputed; dropping the name drops it even if the policy saves that op.
        """
        idx = self.producers.get(storage_key(x))
        if idx is None or idx == name_idx or storage_key(x) in self.written:
            # (written in place since its op ran: the op's output is not the named value;
            # the name's own output is stashed as usual)
            return
        rec = self.ops[idx]
        while decision is not Recompute and rec.name is not None and rec.named_from is not None:
            # a name of a named value (checkpoint_name(checkpoint_name(t, "g"), "h")): the value is the op's that
            # made it, which the replay must run the writes after it on (its alias would be a copy)
            idx = rec.named_from
            rec = self.ops[idx]
        if rec.random or rec.out_spec is None:
            return
        rec.decision = decision
        if decision is Recompute:
            self._unstash(rec, idx)
            # it now runs in the recompute: what it reads must come back there
            for v in rec.in_vids:
                self._ensure_recomputable(v)
            if self.on_demote is not None:  # tensors already saved as kept must now be dropped
                self.on_demote(storage_key(x))
        else:
            if rec.stash is None:
                self._stash(rec, idx)
            # it may have been saved as dropped before the name was known: the replay needs it
            self.promote(rec)


    def _label(self, t: torch.Tensor) -> str:
        label = self.describe_tensor(t)
        return f" ({label})" if label else ""


class OpTap(TorchDispatchMode):
    """Keep the tensor outputs of the ops at positions ``wanted``, counted as :class:`Recorder` counts them.

    An outer recompute re-running a routed call taps the outputs that call's forward pass
    stashed and routed to the outer call (NOTE [nested remat] in ``_engine/full.py``).
    """

    def __init__(self, wanted: set[int]) -> None:
        super().__init__()
        self.wanted = wanted
        self.pos = 0
        self.outputs: dict[int, list[torch.Tensor]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in RANGE_OPS:
            return profiler_op(func, args, kwargs)
        out = func(*args, **kwargs)
        if INTERNAL.get() or ignored(func):
            return out
        if self.pos in self.wanted:
            self.outputs[self.pos] = tensor_leaves(out)
        self.pos += 1
        return out


def iter_stashed(recorder: Recorder) -> Iterator[tuple[OpRecord, torch.Tensor | Any]]:
    """Every stashed output still held strongly (for inspection and tests)."""
    for rec in recorder.ops:
        for ref in rec.stash or ():
            if ref is not None and not isinstance(ref, weakref.ref) and not getattr(ref, "routed", False):
                yield rec, ref


