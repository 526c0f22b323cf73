"""The dispatch-level view of a remat'd call: ask the policy about every ATen op, replay saved outputs.

A ``TorchDispatchMode`` sees the plain ATen ops below every functorch layer, so it
works under every ``torch.func`` transform (a ``TorchFunctionMode`` does not: it
sees the calls above the layers). In the forward pass :class:`Recorder` asks the
policy about each op, records what ran (op, output shapes) and keeps the outputs
of saveable ops in a stash; in the recompute :class:`Replayer` checks that the
same ops run in the same order and hands back stashed outputs instead of running
the op again, so ``dots_saveable`` recomputes no matrix product.

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
    output's token (NOTE [same reads] in ``_wiring.py``) is its argument's, so
    the ops after it read the same values whichever pass made it. An alias is
    not checked itself (which parameter a tracker's ``.data`` reads at a given
    position may differ): the ops that read its output are. A planned call
    skips the plan's aliases before a ``checkpoint_name`` tag it lets go too,
    and a saved tensor a hook's view made (``BackwardHookFunctionBackward``)
    matches any maker. A call that skips one the plan takes a dropped tensor
    from recomputes with a graph (``FastFrame.values_ok``). The state fuzzer
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
    calls are not the call's state (``_state.py``): the forward pass reads the
    gathered ones, which are outside tensors, held and checked by identity and
    version (NOTE [outside tensors]); FSDP2 gathers them into the same tensors
    for the backward pass. Its hooks also wrap a module's inputs in an
    ``autograd.Function`` that returns them, inside the range, so the module's
    first op reads an alias no op of the call made: an argument whose storage an
    op of the call made is that op's value (``Recorder.vid(read=True)``), for the
    liveness walk; the planned calls' keys take it for that tensor
    (``Wiring._unknown``). A step all-gathers and reduce-scatters as often as
    without remat, as ``torch.utils.checkpoint`` (``tests/test_distributed.py``).

    Should the liveness walk still miss a value made where no mode sees, the
    recompute does not hand a placeholder on: an op it needs that reads one, or a
    saved tensor that shares one's storage, raises ``DeadRead``, and the
    recompute runs again without skipping any op, and the signature is never
    planned (``_engine/recompute.py``, NOTE [one set of checks]).

NOTE [outside tensors]
    An op may read a tensor that is neither an input of the call nor made by an
    op of the call: a parameter, a buffer, a closed-over or global tensor, a
    constant built from Python data. NOTE [state is an input] in ``_state.py``
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
import dataclasses
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch

from . import _outside as ox
from . import _torch_internals as ti
from ._context import HOOK_RANGE, INTERNAL, PENDING_NAME, internal
from ._errors import RematError
from ._naming import checkpoint_name
from ._policies import Decision, Offloadable, Recompute, Saveable, decide, decide_explicit
from ._torch_internals import TorchDispatchMode
from ._wiring import Wiring, autocast_cast, cast_source, describe_difference, same_key, values_key

__all__ = ["LIFTS", "ignored", "traits", "dead_value", "arg_tensors", "OpRecord", "OpTap", "Recorder", "Replayer"]

# remat's own bookkeeping (detach, copies, RNG state) must not be seen as ops of
# the user's function by any remat mode on the stack.

_ALIAS = torch.ops.aten.alias.default
_DETACH = torch.ops.aten.detach.default
_TO_COPY = torch.ops.aten._to_copy.default
# A tensor built from Python data (torch.tensor(...)) enters dispatch through these: their output
# is a value of the call, made afresh each time, not an outside tensor.
LIFTS = frozenset({torch.ops.aten.lift_fresh.default, torch.ops.aten.lift.default,
                    torch.ops.aten.lift_fresh_copy.default})


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [x for x in optree.tree_leaves(tree, none_is_leaf=True) if isinstance(x, torch.Tensor)]


def arg_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors among an ATen op's arguments (a tensor, or a list of them, per argument)."""
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


_OVERWRITES = frozenset({torch.ops.aten.copy_, torch.ops.aten.fill_, torch.ops.aten.zero_})


@functools.cache
def traits(func: Any) -> tuple[bool, bool]:
    """(mutates an argument, draws random numbers) for an ATen op; fixed per op, so cached."""
    return bool(func._schema.is_mutable), torch.Tag.nondeterministic_seeded in func.tags


_METADATA = frozenset({torch.ops.aten.sym_size, torch.ops.aten.sym_stride, torch.ops.aten.sym_numel,
                       torch.ops.aten.sym_storage_offset})


_RANGE_ENTER = torch.ops.profiler._record_function_enter_new.default
_RANGE_EXIT = torch.ops.profiler._record_function_exit._RecordFunction
RANGE_OPS = frozenset({_RANGE_ENTER, _RANGE_EXIT})
_HOOK_RANGES = ("FSDP::",)  # the profiler ranges FSDP2 runs its hooks in (pre/post forward, all-gather, reshard)


def profiler_op(func: Any, args: Any, kwargs: Any) -> Any:
    """Run a profiler marker (``RANGE_OPS``). NOTE [FSDP's hooks]: one that opens a range of FSDP2's hooks makes every
    op until it closes remat's own (``INTERNAL``: every mode lets it through unrecorded); its close ends that."""
    out = func(*args, **kwargs)
    # (the range's handle is a TorchScript object, which crosses into Python as a new wrapper each time: its hash is
    # the object's, the same for the handle the close is given)
    if func is _RANGE_ENTER:
        if HOOK_RANGE.get() is None and args and isinstance(args[0], str) and args[0].startswith(_HOOK_RANGES):
            HOOK_RANGE.set((hash(out), INTERNAL.set(True)))
    else:
        hook = HOOK_RANGE.get()
        if hook is not None and args and hash(args[0]) == hook[0]:
            HOOK_RANGE.set(None)
            INTERNAL.reset(hook[1])
    return out


@functools.cache
def ignored(func: Any) -> bool:
    """Not ops of the call: profiler markers (``record_function``, also run by FSDP2's hooks) and the size
    queries a tensor subclass with custom sizes dispatches, which torch makes whenever it needs a size (their
    number differs between the forward pass and the recompute). Neither computes a value."""
    return getattr(func, "namespace", None) == "profiler" or getattr(func, "overloadpacket", None) in _METADATA


_ONE_LEAF = optree.tree_structure(0)  # type: ignore[arg-type]
_TENSOR = object()  # OpRecord.consts: a tensor leaf of the output
_CONSTANT_TYPES = (int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout,
                   torch.memory_format)


def _constants(leaves: list[Any]) -> bool:
    """Whether an op output's non-tensor leaves are plain values a replay can hand back as they were."""
    return all(isinstance(x, (torch.Tensor, *_CONSTANT_TYPES)) for x in leaves)


def _meta(t: torch.Tensor) -> tuple[Any, ...]:
    """Shape, dtype, device, strides; for a wrapper subclass also its layout and its inner tensors' metas, so that
    a placeholder for it is of its class (NOTE [wrapper subclasses])."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return (tuple(t.shape), t.dtype, t.device, tuple(t.stride()))
    layout = ti.wrapper_layout(t)
    if layout is None:
        return (tuple(t.shape), t.dtype, t.device, tuple(t.stride()))
    inner = tuple((n, _meta(x) if isinstance(x, torch.Tensor) else _Opaque(x))
                  for n, x in ((n, getattr(t, n)) for n in layout[1]))
    return (tuple(t.shape), t.dtype, t.device, tuple(t.stride()), layout, inner)


class _Opaque:
    """A wrapper subclass's inner value that is no tensor (a DTensor's device mesh): handed back as it is."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _fmt(meta: tuple[Any, ...] | None) -> str:
    if meta is None:
        return "a non-tensor"
    shape, dtype = meta[0], meta[1]
    return f"{list(shape)} {str(dtype).replace('torch.', '')}"


_VIEW = torch.ops.aten.view.default


def identity_alias(func: Any, args: Any, kwargs: Any) -> bool:
    """Whether the op returns its one argument again under another name, the same value, shape and strides
    (``detach``, ``view`` to the same shape: ``view_as(x)`` of x): NOTE [hooks' aliases]. Not ``alias``, which
    ``checkpoint_name`` dispatches: a name is the policy's business."""
    if func is _DETACH:
        return not kwargs and len(args) == 1
    return (func is _VIEW and not kwargs and len(args) == 2 and isinstance(args[0], torch.Tensor)
            and tuple(args[1]) == tuple(args[0].shape))


def storage_key(t: torch.Tensor) -> int:
    """The address of ``t``'s storage, which it shares with its views; a wrapper subclass's is its first inner
    tensor's (a DTensor's: its local shard's), 0 if it has none (NOTE [wrapper subclasses])."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        s = ti.storage_of(t)
        return int(s.data_ptr()) if s is not None else 0


class _Alias:
    """Called like a weak reference, but holds: an alias of a result that shares its version counter
    (``Recorder.watch_results``)."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def __call__(self) -> torch.Tensor:
        return self.t


@dataclasses.dataclass
class OpRecord:
    func: Any
    name: str | None
    decision: Decision
    out_meta: list[tuple[Any, ...] | None]
    in_vids: list[int]
    out_vids: list[int]
    random: bool
    out_spec: Any = None  # how to rebuild the op's output from its tensors (None: not replayable)
    refs: list[Any] = dataclasses.field(default_factory=list)  # weakrefs to the outputs
    stash: list[Any] | None = None  # per output: weakref, tensor, offloaded handle or None
    cow: bool = False  # a stashed output was later mutated in place: replay a copy
    cow_at: int | None = None  # the index of the op whose write made the copy (a planned call copies there too)
    versions: list[int | None] | None = None  # of the stashed outputs when the forward pass ended
    live: bool = True  # set by Recorder.prune: False when nothing the recompute needs reads its outputs
    skippable: bool = False  # a pure op allocating fresh outputs: may be skipped when dead
    # NOTE [outside tensors]: (position among the tensor args, tensor, its version when read)
    outside: list[tuple[int, torch.Tensor, int]] | None = None
    subst: dict[int, torch.Tensor] | None = None  # position -> copy the recompute reads or writes instead
    scalars: list[Any] = dataclasses.field(default_factory=list)  # the op's values (NOTE [same reads]): the recompute must pass the same
    lifted: tuple[Any, ...] | None = None  # a lift_fresh: the fingerprint of the value it lifted
    in_keys: list[int] = dataclasses.field(default_factory=list)  # storages of the tensor arguments
    out_keys: list[int] = dataclasses.field(default_factory=list)  # storages of the tensor outputs
    consts: list[Any] | None = None  # an output with non-tensor leaves (numbers): all its leaves, to replay
    # autocast's cast of a leaf, which autocast caches: the leaf, weakly (NOTE [autocast's cache] in _wiring.py)
    cast_leaf: weakref.ref[torch.Tensor] | None = None
    wkey: list[Any] | None = None  # NOTE [same reads] in _wiring.py: the key of the op's arguments (no levels)
    alias: bool = False  # an identity alias (NOTE [hooks' aliases]): a recompute may lack it, or have more

    def rebuild(self, tensors: list[Any]) -> Any:
        """The op's output, its tensors replaced by ``tensors`` (its numbers as the forward pass returned them)."""
        if self.consts is None:
            return optree.tree_unflatten(self.out_spec, tensors)
        it = iter(tensors)
        return optree.tree_unflatten(
            self.out_spec, [next(it) if c is _TENSOR else c for c in self.consts])

    def describe(self) -> str:
        what = f"checkpoint_name({self.name!r})" if self.name is not None else str(self.func)
        return f"{what} -> {', '.join(_fmt(m) for m in self.out_meta)}"


class Recorder(TorchDispatchMode):
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
        self.offloaded_written = False  # an output to offload was written in place (see Frame.forward)
        self.written: set[int] = set()  # storage keys an in-place op wrote (over-approximated: all its args)
        self.input_keys: set[int] = set()  # storages of the call's inputs (set by the frame)
        self.written_outside: set[int] = set()  # storages of outside tensors the call wrote
        self._pending: dict[int, list[tuple[OpRecord, int, torch.Tensor]]] = {}  # outside reads since the last write
        self.describe_tensor: Callable[[torch.Tensor], str | None] = lambda t: None
        # NOTE [generators of your own] (_ambient.py): the call's AmbientState.generators, set by its engine
        self.generators: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        # NOTE [same reads] in _wiring.py: set by a frame without torch.func levels that is not nested (its tensors are
        # the call's own objects): the key of each op's arguments, which the Replayer compares
        self.wiring: Wiring | None = None
        self._paused = False
        # a reentrant region (_engine/region.py): what the policy saves is held at once, and detach is not an op
        self.region = False

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

    def _storage_vid(self, storage: Any) -> int | None:
        """The value of the op of the call whose output lives in ``storage`` (None: none made it)."""
        try:
            k = int(storage.data_ptr())
        except (RuntimeError, NotImplementedError):
            return None
        idx = self.producers.get(k) if k else None
        if idx is None:
            return None
        rec = self.ops[idx]
        return next((ov for ov, ok in zip(rec.out_vids, rec.out_keys) if ok == k), None)

    def known_vid(self, t: torch.Tensor) -> int | None:
        e = self._vid_of.get(id(t))
        return e[1] if e is not None and e[0]() is t else None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if INTERNAL.get() or self._paused or ignored(func):
            return profiler_op(func, args, kwargs) if func in RANGE_OPS else func(*args, **kwargs)
        if func is _DETACH and self.region:
            # (a reentrant region: how many detaches torch.func runs depends on the grad mode, which differs
            # between the region's forward and its backward) the same value under another name
            out = func(*args, **kwargs)
            with internal():
                self._vid_of[id(out)] = (weakref.ref(out), self.vid(args[0]))
            return out
        name = PENDING_NAME.get() if func is _ALIAS else None
        ins = arg_tensors(args, kwargs)
        mutable, random = traits(func)
        mutable = ox.mutates(func, args, mutable)
        subst = self._before_mutation(func, args, kwargs, ins) if mutable else None
        gen = kwargs.get("generator") if random else None
        if gen is not None and id(gen) not in self.generators:
            with internal():
                self.generators[id(gen)] = (gen, gen.get_state())
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            leaves, spec = [out], _ONE_LEAF
        else:
            leaves, spec = optree.tree_flatten(out, none_is_leaf=True)
        outs = [t for t in leaves if isinstance(t, torch.Tensor)]

        explicit = False
        if name is not None:
            decision, explicit = decide_explicit(self.policy, checkpoint_name, args, {"name": name})
        else:
            decision = decide(self.policy, func, args, kwargs)
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
                outside, lifted = self._outside_reads(ins, keys, in_vids), None
            scalars = values_key(args, kwargs)  # NOTE [same reads] in _wiring.py
            if outside and func is _TO_COPY and isinstance(decision, Offloadable):
                # a cast of a parameter (autocast's bf16 weights): moving a parameter-sized copy each step
                # costs more than casting again in the recompute, and parameters are kept by reference anyway
                decision = Recompute
            rec = OpRecord(
                func,
                name,
                decision,
                [_meta(t) for t in outs],
                in_vids,
                [self.vid(t) for t in outs],
                random,
                out_spec=spec if len(outs) == len(leaves) or _constants(leaves) else None,
            )
            if len(outs) != len(leaves):
                # the numbers, and a marker (not the tensor: the stash decides what is held) per tensor
                rec.consts = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves] if rec.out_spec else None
            rec.outside, rec.subst, rec.scalars, rec.lifted = outside, subst, scalars, lifted
            leaf = autocast_cast(func, args, kwargs)
            rec.cast_leaf = None if leaf is None else weakref.ref(leaf)
            for j, t, _ in outside or ():  # reads a later write in this call would invalidate
                self._pending.setdefault(storage_key(t), []).append((rec, j, t))
            idx = len(self.ops)
            self.ops.append(rec)
            rec.alias = identity_alias(func, args, kwargs)  # NOTE [hooks' aliases]
            if self.wiring is not None:  # NOTE [same reads] in _wiring.py
                rec.wkey = self.wiring.key(args, kwargs)
                if leaf is not None:
                    self.wiring.note_cast(out, leaf)
                elif rec.alias:
                    self.wiring.note_alias(out, args[0])
                else:
                    self.wiring.note(idx, out)
            rec.refs = [weakref.ref(t) for t in outs]
            for t, v in zip(outs, rec.out_vids):
                # an in-place write returns the outside tensor it wrote: that stays outside
                if not (subst and self.is_outside(storage_key(t))):
                    self.made_by[v] = idx
            if name is not None and ins and (decision is not Recompute or explicit):
                self._name_decides(ins[0], decision, idx)
            rec.in_keys = keys
            rec.out_keys = [storage_key(t) for t in outs]
            for k in rec.out_keys:
                # a checkpoint_name alias shares its input's storage; its decision (the name's)
                # governs that storage when it is saved, not the decision of the op that allocated it
                if k and (k not in in_keys or name is not None or func in LIFTS):
                    self.producers[k] = idx
            # a mutable op (squeeze_, add_, out=) is run again, never replayed: handing back its stashed
            # output would skip the write into its argument, which the caller goes on using. A zero
            # tensor (forward AD's "no tangent") is free to remake and a replayed copy would lose the
            # flag, so the ops that follow (and the op sequence) would differ.
            zero = any(ti.is_zero_tensor(t) for t in outs)
            # NOTE [dead ops]: an op whose outputs nothing live reads need not run in the recompute
            rec.skippable = (not random and not mutable and not zero and bool(outs) and rec.out_spec is not None
                             and all(storage_key(t) not in in_keys for t in outs))
            stashable = not random and not mutable and not zero and bool(outs) and rec.out_spec is not None
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

    def _stash(self, rec: OpRecord, idx: int) -> None:
        rec.stash = list(rec.refs)
        for pos, v in enumerate(rec.out_vids):
            self.stash_of[v] = (idx, pos)
        if self.region:
            self.promote(rec)  # no saved tensor will say what the backward reads: hold what the policy saves

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
                rec.stash[i] = self.offload(t, rec.decision) if isinstance(rec.decision, Offloadable) else t.detach()

    def is_outside(self, k: int) -> bool:
        """Whether storage ``k`` is neither an input of the call nor made by one of its ops (NOTE [outside tensors])."""
        return k != 0 and k not in self.producers and k not in self.input_keys

    def _outside_reads(self, ins: list[torch.Tensor], keys: list[int],
                       vids: list[int]) -> list[tuple[int, torch.Tensor, int]] | None:
        """The op's reads of outside tensors (NOTE [outside tensors]).

        Held strongly: an outside tensor that dies during the forward pass was replaced (a cache
        slot reassigned, a buffer rebound), exactly what the recompute must notice; the
        temporaries that also die (wrapped scalars) are tiny and pass as equal constants.
        """
        found = None
        for j, (t, k, v) in enumerate(zip(ins, keys, vids)):
            if v in self.made_by or not self.is_outside(k):
                continue
            if found is None:
                found = []
            found.append((j, t, t._version))
        return found

    def _before_mutation(self, func: Any, args: Any, kwargs: Any,
                         ins: list[torch.Tensor]) -> dict[int, torch.Tensor] | None:
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
                if self.is_outside(k):
                    # the reads of this storage since its last write saw what it holds now: copy it for them
                    # (at their own geometry), and the value about to be overwritten for the write itself
                    for rec, pos, read in self._pending.pop(k, ()):
                        if rec.subst is None:
                            rec.subst = {}
                        rec.subst.setdefault(pos, read.detach().clone())
                    self.written_outside.add(k)
                    if subst is None:
                        subst = {}
                    subst[j] = t.detach().clone()
                else:
                    inside = True
        if subst is None or inside:
            self.mutated_inplace = True
            # schema writes: all arguments (over-approximated, as always); batch norm's: the statistics
            self._copy_on_write(func, [ins[j] for j in written] if func in ox.HIDDEN_WRITES
                                else tensor_leaves((args, kwargs)))
        return subst

    def _copy_on_write(self, func: Any, written: list[torch.Tensor]) -> None:
        # a write that depends on what it overwrites (not a fill, a copy or a random draw)
        partial = (torch.Tag.inplace_view not in func.tags and torch.Tag.nondeterministic_seeded not in func.tags
                   and func.overloadpacket not in _OVERWRITES)
        with internal():
            keys = {storage_key(t) for t in written} - {0}
            if torch.Tag.inplace_view not in func.tags:  # squeeze_ & co. change shapes, not data
                self.written |= keys
                if self.on_write is not None and keys:
                    self.on_write(keys)
            for rec in self.ops:
                if rec.stash is None:
                    continue
                for pos, ref in enumerate(rec.stash):
                    cur = ref() if isinstance(ref, weakref.ref) else ref
                    if isinstance(cur, torch.Tensor):
                        if storage_key(cur) in keys:
                            rec.stash[pos] = cur.detach().clone()
                            rec.cow = True
                            if rec.cow_at is None:
                                rec.cow_at = len(self.ops)  # (the writing op's record comes next)
                            self.offloaded_written |= partial and isinstance(rec.decision, Offloadable)
                    elif cur is not None and cur.engine.shares_storage(cur, keys):
                        self.offloaded_written |= partial
                        # offloaded: on CUDA the write must wait until its copy to the host ran
                        cur.engine.before_write(cur)

    def seal(self) -> None:
        """End of the forward pass: note the version of every output kept for the replay.

        The version lives on the op's own output (a result the caller may hold),
        not on the detached alias in the stash, which has a counter of its own.
        Outside reads are settled (NOTE [outside tensors]): each is either kept for the
        recompute's check or served from a copy.
        """
        for rec in self.ops:
            if rec.stash is not None:
                outs = [r() for r in rec.refs]
                rec.versions = [None if o is None else o._version for o in outs]
            if rec.outside is not None:
                self._settle_outside(rec)
        self._pending = {}

    def watch_results(self, results: list[torch.Tensor]) -> None:
        """A held output whose own tensor died may still be written through a result of the call that shares its
        storage (``return y, h.detach()``): watch that result's version instead (it moves with every write),
        through an alias held here that shares its version counter, so that the watch outlives the caller's
        reference to the result (a write, then ``del`` of the result, was a wrong gradient without an error)."""
        by_key = {storage_key(t): t for t in results}
        by_key.pop(0, None)
        if not by_key:
            return
        for rec in self.ops:
            if rec.stash is None or rec.versions is None:
                continue
            for j, (held, v) in enumerate(zip(rec.stash, rec.versions)):
                if v is None and isinstance(held, torch.Tensor):
                    res = by_key.get(storage_key(held))
                    if res is not None:
                        rec.refs[j] = _Alias(ti.detach_below_modes(res))  # (the held output's storage: no more)
                        rec.versions[j] = res._version

    def _settle_outside(self, rec: OpRecord) -> None:
        assert rec.outside is not None
        keep = []
        for j, t, version in rec.outside:
            if rec.subst is not None and j in rec.subst:
                continue  # served from a copy taken before a write overwrote what it read
            written = storage_key(t) in self.written_outside
            if not written and (t.requires_grad or ox.nbytes(t) > ox.SMALL):
                keep.append((j, t, version))  # checked by the recompute: the same tensor, unmodified
                continue
            # read after the call's last write into it: its value now; or a buffer or constant that needs
            # no gradient and is small (running statistics, a tensor built from Python data): a copy the
            # recompute reads whatever happens to it next (even writes torch does not count as versions,
            # like a batch norm's, outside the call)
            if rec.subst is None:
                rec.subst = {}
            rec.subst[j] = t.detach().clone()
        rec.outside = keep or None

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

    def _label(self, t: torch.Tensor) -> str:
        label = self.describe_tensor(t)
        return f" ({label})" if label else ""

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
            is_live = (any(v in needed for v in rec.out_vids) or not rec.out_vids
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


class DeadRead(Exception):
    """NOTE [dead ops]: an op the recompute needs read a placeholder, or the backward pass would: the liveness walk
    missed a value (made where no dispatch mode sees it). The recompute runs again without skipping ops."""


def is_tainted(tainted: dict[int, Any], t: torch.Tensor) -> bool:
    """Whether ``t`` shares a storage with a placeholder (NOTE [dead ops]): an alias made where no mode saw does. By
    the storage object (torch keeps one Python object per live storage; a freed one's address may be reused)."""
    with internal():
        s = ti.storage_of(t)
        if s is None:
            return False
        ref = tainted.get(s.data_ptr())
        return ref is not None and ref() is s


class Replayer(TorchDispatchMode):
    """Recompute: the same ops in the same order; stashed outputs handed back, not recomputed."""

    def __init__(self, recorder: Recorder, unused: set[int] = frozenset(),  # type: ignore[assignment]
                 skip_dead: bool = True) -> None:
        super().__init__()
        self.rec = recorder
        self.skip_dead = skip_dead
        # NOTE [dead ops]: the storages of the placeholders handed back for dead ops, and of what ops computed from
        # them: an op the recompute needs reading one, or one saved for the backward pass, is DeadRead (by storage:
        # an alias of one made where no mode sees is one too)
        self.tainted: dict[int, Any] = {}
        self.pos = 0
        self.unused = unused  # ops feeding only outputs this backward pass does not differentiate
        self.unused_keys: set[int] = set()  # storages of the placeholders handed back for them
        # NOTE [autocast's cache] in _wiring.py: id -> (leaf, weakref) of the casts the recompute ran past the ops
        self.casts: dict[int, tuple[torch.Tensor, weakref.ref[torch.Tensor]]] = {}
        self.wiring = None if recorder.wiring is None else Wiring(recorder.wiring.known, loose=True)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if INTERNAL.get() or ignored(func):
            return profiler_op(func, args, kwargs) if func in RANGE_OPS else func(*args, **kwargs)
        if func is _DETACH and self.rec.region:
            return func(*args, **kwargs)
        ops = self.rec.ops
        i = self.pos
        rec = ops[i] if i < len(ops) else None
        # NOTE [autocast's cache] in _wiring.py: a cast of a leaf matches the forward pass's cast of that leaf only
        leaf = autocast_cast(func, args, kwargs) if func is _TO_COPY else None
        alias = (func is _VIEW or func is _DETACH) and identity_alias(func, args, kwargs)
        if alias and (rec is None or not rec.alias or func is not rec.func):
            # NOTE [hooks' aliases]: the forward pass's next alias of this op, past its aliases of others; or one the
            # forward pass did not make here: run, not counted
            j = i
            while j < len(ops) and ops[j].alias and ops[j].func is not func:
                j += 1
            if j < len(ops) and ops[j].alias and ops[j].func is func:
                i, rec = j, ops[j]
            else:
                out = func(*args, **kwargs)
                if self.wiring is not None:
                    self.wiring.note_alias(out, args[0])
                return out
        if rec is None or func is not rec.func or (func is _TO_COPY and _cast_of(rec) is not leaf):
            if leaf is not None:  # a cast the forward pass read from autocast's cache: run, not counted
                out = func(*args, **kwargs)
                self.casts[id(out)] = (leaf, weakref.ref(out))
                if self.wiring is not None:
                    self.wiring.note_cast(out, leaf)
                return out
            j = i
            while j < len(ops) and (ops[j].alias or ops[j].cast_leaf is not None and (
                    ops[j].func is not func or func is _TO_COPY)):
                # (casts of the forward pass's this recompute read from autocast's cache; identity aliases it lacks)
                j += 1
            if j > i and j < len(ops) and ops[j].func is func:
                i, rec = j, ops[j]
        elif rec.alias and not alias:
            # NOTE [hooks' aliases]: the forward pass's identity aliases this recompute does not make
            j = i
            while j < len(ops) and ops[j].alias:
                j += 1
            if j < len(ops) and ops[j].func is func:
                i, rec = j, ops[j]
        self.pos = i + 1
        if rec is None:
            raise self._diverged(f"it ran {func} after the {len(ops)} ops of the forward pass", cache_hint=True)
        if func is not rec.func:
            raise self._diverged(f"op #{i} was {rec.describe()} in the forward pass but {func} now", cache_hint=True)
        wiring = self.wiring
        if rec.alias and alias:
            # NOTE [hooks' aliases]: the same value under another name, whichever tensor a hook's alias of the forward
            # pass at this position read: its output takes its argument's token, which the ops after it are checked by
            out = func(*args, **kwargs)
            if wiring is not None:
                wiring.note_alias(out, args[0])
            if self.tainted and is_tainted(self.tainted, args[0]):
                self._taint([out])
            return out
        if wiring is None or rec.wkey is None:
            return self._run(i, rec, func, args, kwargs)
        now = wiring.key(args, kwargs)  # NOTE [same reads] in _wiring.py: the values and which tensor each is
        if now != rec.wkey and not same_key(now, rec.wkey, loose=True):
            raise self._diverged(
                f"op #{i} {func} read other values than in the forward pass: "
                f"{describe_difference(now, rec.wkey, lambda j: None)} (a Python value computed from state that "
                "changed, such as a step counter, a module's attribute or a global, or another tensor picked by it)"
            )
        out = self._run(i, rec, func, args, kwargs)
        leaf = _cast_of(rec)
        if leaf is not None:
            wiring.note_cast(out, leaf)
        elif rec.alias:
            wiring.note_alias(out, args[0])
        else:
            wiring.note(i, out)
        return out

    def _run(self, i: int, rec: OpRecord, func: Any, args: Any, kwargs: Any) -> Any:
        """The recorded op ``i`` in the recompute: a placeholder, its stashed outputs, or run (checked)."""
        if rec.skippable and i in self.unused:
            with internal():  # NOTE [unused outputs]
                dead = [dead_value(m) for m in rec.out_meta]
                self.unused_keys.update(storage_key(t) for t in dead)
                return rec.rebuild(dead)
        if rec.stash is not None and not rec.random and (self.skip_dead or all(
                x is not None for x in rec.stash)):
            return self._replay(rec, func, args, kwargs)
        if not rec.live and rec.skippable and self.skip_dead:
            with internal():  # dead: nothing needed reads it (NOTE [dead ops])
                return rec.rebuild(self._taint([dead_value(m) for m in rec.out_meta]))
        tainted = bool(self.tainted) and any(is_tainted(self.tainted, t) for t in arg_tensors(args, kwargs))
        if tainted and rec.live:
            raise DeadRead
        if rec.scalars and rec.wkey is None:  # NOTE [same reads] in _wiring.py: the values, where no key was noted
            values = values_key(args, kwargs)
            if values != rec.scalars and not same_key(values, rec.scalars):
                raise self._diverged(
                    f"op #{i} {func} read other values than in the forward pass: "
                    f"{describe_difference(values, list(rec.scalars), lambda j: None)} (a Python value computed from state "
                    "that changed, such as a step counter, a module's attribute or a global)"
                )
        if rec.outside is not None or rec.subst is not None:
            args, kwargs = self._outside_args(i, rec, args, kwargs)
        if rec.random and self.unused_keys:
            args, kwargs = self._no_placeholders(args, kwargs)
        if rec.lifted is not None:
            with internal():
                now = ox.fingerprint(arg_tensors(args, kwargs)[0])
            if now != rec.lifted:
                raise self._diverged(
                    f"op #{i} {func} lifted a tensor built from Python data (torch.tensor, torch.from_numpy) "
                    f"of shape {list(now[0])} whose value differs from the forward pass's (data read from "
                    "state that changed in between)"
                )
        out = func(*args, **kwargs)
        outs = tensor_leaves(out)
        if self.unused_keys:
            # an op that ran on a placeholder (a random op, a write) made a placeholder too (NOTE [unused outputs])
            with internal():
                if any(storage_key(t) in self.unused_keys for t in arg_tensors(args, kwargs)):
                    self.unused_keys.update(storage_key(t) for t in outs)
        if tainted:
            self._taint(outs)  # (a view of a placeholder, run as views always are: a placeholder too)
        got = [_meta(t)[:2] for t in outs]
        want = [m[:2] if m is not None else None for m in rec.out_meta]
        if got != want:
            raise self._diverged(
                f"op #{i} {func} produced {', '.join(_fmt(m) for m in got)} in the recompute but "
                f"{', '.join(_fmt(m) for m in want)} in the forward pass", cache_hint=True
            )
        return out

    def _taint(self, ts: list[Any]) -> list[Any]:
        with internal():
            for t in ts:
                if isinstance(t, torch.Tensor):
                    s = ti.storage_of(t)
                    if s is not None:
                        self.tainted[s.data_ptr()] = weakref.ref(s)
        return ts

    def _no_placeholders(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """A random op reading a placeholder (NOTE [unused outputs]) must still draw its numbers, on valid values
        (a NaN probability is an error): zeros of the same shape stand in; its outputs are placeholders too."""
        with internal():
            ins = arg_tensors(args, kwargs)
            new = {j: torch.zeros_like(t) for j, t in enumerate(ins) if storage_key(t) in self.unused_keys}
            if not new:
                return args, kwargs
            self.unused_keys.update(storage_key(t) for t in new.values())
            return ox.replace_tensors(args, kwargs, new)

    def _replay(self, rec: OpRecord, func: Any, args: Any, kwargs: Any) -> Any:
        assert rec.stash is not None
        vals: list[Any] = []
        versions = rec.versions or [None] * len(rec.stash)
        with internal():
            for ref, meta, v0 in zip(rec.stash, rec.out_meta, versions):
                t = ref() if isinstance(ref, weakref.ref) else ref
                if t is None:
                    t = self._taint([dead_value(meta)])[0]
                elif getattr(t, "routed", False):
                    # held by the enclosing call (NOTE [nested remat] in _engine/full.py), fetched before this recompute
                    # began (fetching may run the enclosing call's recompute, which cannot run inside a mode)
                    t = t.value.detach()
                elif not isinstance(t, torch.Tensor):
                    t = t.engine.fetch(t)  # offloaded: bring it back
                else:
                    orig = rec.refs[len(vals)]() if v0 is not None else None
                    if orig is not None and orig._version != v0:
                        raise RematError(
                            f"remat: the output of {rec.describe()} that {self.rec.fn_name} kept for its "
                            f"recompute was modified in place after the forward pass (version {v0} -> "
                            f"{orig._version}), e.g. a result of the function changed before the backward pass. "
                            "Clone a result before modifying it, or run the backward pass first."
                        )
                    t = t.clone() if rec.cow else t.detach()
                vals.append(t)
        return rec.rebuild(vals)

    def _outside_args(self, i: int, rec: OpRecord, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """Check the op reads the forward's outside tensors; hand it copies where recorded (NOTE [outside tensors])."""
        with internal():
            ins = arg_tensors(args, kwargs)
            casts: dict[int, torch.Tensor] = {}
            for j, t0, version in rec.outside or ():
                if rec.subst is not None and j in rec.subst:
                    continue  # served from a copy taken before a write (not yet settled: a partial recompute)
                cur = ins[j] if j < len(ins) else None
                if cur is None:
                    raise self._diverged(f"op #{i} {rec.describe()} has fewer tensor arguments than in the forward pass")
                same = cur is t0 or (storage_key(cur) == storage_key(t0) and ox.geometry(cur) == ox.geometry(t0))
                if not same and self._same_cast(cur, t0):
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
                if (not cur.requires_grad and not t0.requires_grad and cur.shape == t0.shape
                        and cur.dtype == t0.dtype and cur.device == t0.device and torch.equal(cur, t0)):
                    continue  # a constant made afresh on every call, with the same value
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
                args, kwargs = ox.replace_tensors(args, kwargs, {j: c.clone() for j, c in rec.subst.items()})
            if casts:
                args, kwargs = ox.replace_tensors(args, kwargs, casts)
        return args, kwargs

    def _same_cast(self, cur: torch.Tensor, t0: torch.Tensor) -> bool:
        """NOTE [autocast's cache]: ``t0`` (read in the forward pass) is autocast's cast of a leaf, and ``cur``
        (read now) the cast of the same leaf to the same dtype, made by this recompute or cached."""
        leaf = cast_source(t0)
        if leaf is None or cur.dtype != t0.dtype or cur.shape != t0.shape:
            return False
        made = self.casts.get(id(cur))
        if made is not None and made[1]() is cur:
            return made[0] is leaf
        return cast_source(cur) is leaf

    def finish(self) -> None:
        while self.pos < len(self.rec.ops) and self.rec.ops[self.pos].alias:
            self.pos += 1  # NOTE [hooks' aliases]
        if self.pos != len(self.rec.ops):
            nxt = self.rec.ops[self.pos]
            raise self._diverged(
                f"it stopped after {self.pos} ops; the forward pass went on with {nxt.describe()}"
            )

    def _diverged(self, what: str, cache_hint: bool = False) -> RematError:
        """``cache_hint``: the difference is one of ops or shapes, which a key/value cache makes (a message about a
        value or a tensor of the same shape suggests none: issue 38, a hint at a cache the caller had turned off was
        wrong advice)."""
        return RematError(
            f"remat: the recompute of {self.rec.fn_name} diverged from its forward pass: {what}. "
            "The wrapped function must run the same ops on the same shapes every time it is "
            "called with the same inputs: avoid data-dependent Python branches on values that "
            "change between forward and backward, global state that changes (counters, caches, "
            "a module switched between train() and eval()), and in-place mutation of inputs."
            + (" A key/value cache that grows on every call changes the shapes: for a Hugging Face model pass "
               "use_cache=False (model.config.use_cache = False)." if cache_hint else "")
        )


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


def _cast_of(rec: OpRecord) -> torch.Tensor | None:
    """The leaf ``rec`` cast (NOTE [autocast's cache] in _wiring.py), or None (not such a cast, or the leaf died)."""
    return None if rec.cast_leaf is None else rec.cast_leaf()


def dead_value(meta: tuple[Any, ...] | None) -> Any:
    assert meta is not None
    if len(meta) > 4:  # a wrapper subclass: one of its class around placeholders (NOTE [wrapper subclasses])
        return ti.rewrap(meta[4], {n: m.value if type(m) is _Opaque else dead_value(m) for n, m in meta[5]}, meta[0], meta[3])
    shape, dtype, device, stride = meta
    t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    if dtype.is_floating_point or dtype.is_complex:
        t.fill_(float("nan"))
    return t


def iter_stashed(recorder: Recorder) -> Iterator[tuple[OpRecord, torch.Tensor | Any]]:
    """Every stashed output still held strongly (for inspection and tests)."""
    for rec in recorder.ops:
        for ref in rec.stash or ():
            if ref is not None and not isinstance(ref, weakref.ref) and not getattr(ref, "routed", False):
                yield rec, ref


__all__ += ["storage_key", "tensor_leaves", "iter_stashed", "Saveable", "Offloadable"]
