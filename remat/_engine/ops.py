"""What one op of a call is to the engine: its record (``OpRecord``), its traits, the storage a tensor lives in,
placeholders for the ops a recompute skips, and the ops no remat mode counts as the call's."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import TYPE_CHECKING, Any

import optree
import torch

from .. import _torch_internals as ti
from .._context import HOOK_RANGE, INTERNAL, internal
from .._policies.core import Decision

__all__ = ["Half", "LIFTS", "RANGE_OPS", "OpRecord", "DeadRead", "arg_tensors", "dead_value", "identity_alias", "ignored",
           "is_tainted", "profiler_op", "storage_key", "tensor_leaves", "traits"]

# The base of a half of a class split by concern (the recorder's stash and outside-tensor halves, the frames' pack
# and unpack halves): at run time plain ``object``; to mypy ``Any``, since a half reads attributes the whole class's
# ``__init__`` sets.
if TYPE_CHECKING:
    Half = Any
else:
    Half = object

ALIAS = torch.ops.aten.alias.default


DETACH = torch.ops.aten.detach.default


TO_COPY = torch.ops.aten._to_copy.default


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


OVERWRITES = frozenset({torch.ops.aten.copy_, torch.ops.aten.fill_, torch.ops.aten.zero_})


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


def generator_for(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Generator | None:
    """The generator a random op draws from (None: one the trace does not know)."""
    gen = kwargs.get("generator")
    if gen is not None:
        return gen  # type: ignore[no-any-return]
    dev: Any = None
    for a in args:
        if isinstance(a, torch.Tensor):
            dev = a.device
            break
    if dev is None:
        dev = kwargs.get("device")
    dev = torch.device(dev) if dev is not None else torch.get_default_device()
    if dev.type == "cpu":
        return torch.default_generator
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[idx]
    return None


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


ONE_LEAF = optree.tree_structure(0)  # type: ignore[arg-type]


TENSOR_LEAF = object()  # OpRecord.consts: a tensor leaf of the output


_CONSTANT_TYPES = (int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout,
                   torch.memory_format)


def are_constants(leaves: list[Any]) -> bool:
    """Whether an op output's non-tensor leaves are plain values a replay can hand back as they were."""
    return all(isinstance(x, (torch.Tensor, *_CONSTANT_TYPES)) for x in leaves)


def op_meta(t: torch.Tensor) -> tuple[Any, ...]:
    """Shape, dtype, device, strides; for a wrapper subclass also its layout and its inner tensors' metas, so that
    a placeholder for it is of its class (NOTE [wrapper subclasses])."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return (tuple(t.shape), t.dtype, t.device, tuple(t.stride()))
    layout = ti.wrapper_layout(t)
    if layout is None:
        return (tuple(t.shape), t.dtype, t.device, tuple(t.stride()))
    inner = tuple((n, op_meta(x) if isinstance(x, torch.Tensor) else Opaque(x))
                  for n, x in ((n, getattr(t, n)) for n in layout[1]))
    return (tuple(t.shape), t.dtype, t.device, tuple(t.stride()), layout, inner)


class Opaque:
    """A wrapper subclass's inner value that is no tensor (a DTensor's device mesh): handed back as it is."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def fmt_meta(meta: tuple[Any, ...] | None) -> str:
    if meta is None:
        return "a non-tensor"
    shape, dtype = meta[0], meta[1]
    return f"{list(shape)} {str(dtype).replace('torch.', '')}"


VIEW = torch.ops.aten.view.default


def identity_alias(func: Any, args: Any, kwargs: Any) -> bool:
    """Whether the op returns its one argument again under another name, the same value, shape and strides
    (``detach``, ``view`` to the same shape: ``view_as(x)`` of x): NOTE [hooks' aliases]. Not ``alias``, which
    ``checkpoint_name`` dispatches: a name is the policy's business."""
    if func is DETACH:
        return not kwargs and len(args) == 1
    return (func is VIEW and not kwargs and len(args) == 2 and isinstance(args[0], torch.Tensor)
            and tuple(args[1]) == tuple(args[0].shape))


def storage_key(t: torch.Tensor) -> int:
    """The address of ``t``'s storage, which it shares with its views; a wrapper subclass's is its first inner
    tensor's (a DTensor's: its local shard's), 0 if it has none (NOTE [wrapper subclasses])."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        s = ti.storage_of(t)
        return int(s.data_ptr()) if s is not None else 0


class AliasRef:
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
    versions: list[int | None] | None = None  # of the stashed outputs when the forward pass ended
    live: bool = True  # set by Recorder.prune: False when nothing the recompute needs reads its outputs
    skippable: bool = False  # a pure op allocating fresh outputs: may be skipped when dead
    # NOTE [outside tensors]: (position among the tensor args, tensor, its version when read)
    outside: list[tuple[int, torch.Tensor, int]] | None = None
    subst: dict[int, Any] | None = None  # position -> copy (or ShadowView, None: as is) the recompute reads or writes
    scalars: list[Any] = dataclasses.field(default_factory=list)  # the op's values (NOTE [same reads]): the recompute must pass the same
    lifted: tuple[Any, ...] | None = None  # a lift_fresh: the fingerprint of the value it lifted
    in_keys: list[int] = dataclasses.field(default_factory=list)  # storages of the tensor arguments
    out_keys: list[int] = dataclasses.field(default_factory=list)  # storages of the tensor outputs
    consts: list[Any] | None = None  # an output with non-tensor leaves (numbers): all its leaves, to replay
    # autocast's cast of a leaf, which autocast caches: the leaf, weakly (NOTE [autocast's cache] in _engine/wiring.py)
    cast_leaf: weakref.ref[torch.Tensor] | None = None
    wkey: list[Any] | None = None  # NOTE [same reads] in _engine/wiring.py: the key of the op's arguments (no levels)
    named_from: int | None = None  # a checkpoint_name's alias: the op that made its storage's value before it
    alias: bool = False  # an identity alias (NOTE [hooks' aliases]): a recompute may lack it, or have more
    # a random op: its generator and the generator's state before it drew (the recompute draws the same numbers even
    # where the function seeds inside: NOTE [random ops] in _engine/replay.py)
    rng: tuple[torch.Generator, torch.Tensor] | None = None

    def rebuild(self, tensors: list[Any]) -> Any:
        """The op's output, its tensors replaced by ``tensors`` (its numbers as the forward pass returned them)."""
        if self.consts is None:
            return optree.tree_unflatten(self.out_spec, tensors)
        it = iter(tensors)
        return optree.tree_unflatten(
            self.out_spec, [next(it) if c is TENSOR_LEAF else c for c in self.consts])

    def describe(self) -> str:
        what = f"checkpoint_name({self.name!r})" if self.name is not None else str(self.func)
        return f"{what} -> {', '.join(fmt_meta(m) for m in self.out_meta)}"


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


def cast_of(rec: OpRecord) -> torch.Tensor | None:
    """The leaf ``rec`` cast (NOTE [autocast's cache] in _engine/wiring.py), or None (not such a cast, or the leaf died)."""
    return None if rec.cast_leaf is None else rec.cast_leaf()


def dead_value(meta: tuple[Any, ...] | None) -> Any:
    assert meta is not None
    if len(meta) > 4:  # a wrapper subclass: one of its class around placeholders (NOTE [wrapper subclasses])
        return ti.rewrap(meta[4], {n: m.value if type(m) is Opaque else dead_value(m) for n, m in meta[5]}, meta[0], meta[3])
    shape, dtype, device, stride = meta
    t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    if dtype.is_floating_point or dtype.is_complex:
        t.fill_(float("nan"))
    return t
