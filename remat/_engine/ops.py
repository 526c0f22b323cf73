"""What one op of a call is to the engine: its record (``OpRecord`` on the full engine, ``Step`` on the trace), its
traits, the storage a tensor lives in, placeholders for the ops a recompute skips, and the ops no remat mode counts as
the call's."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import optree
import torch

from .. import _torch_internals as ti
from .._context import HOOK_RANGE, INTERNAL, internal
from .._policies.core import Decision, Recompute
from . import outside as ox

__all__ = ["slot_key", "sparse_parts", "plain_subclass", "OpInfo", "op_info", "hidden_write", "declared_written_names", "Half", "LIFTS", "RANGE_OPS", "OpRecord", "DeadRead", "arg_tensors", "dead_value", "identity_alias", "ignored",
           "is_tainted", "profiler_op", "storage_key", "tensor_leaves", "traits", "version_watches", "storage_freed"]

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


def not_the_policys(ins: list[torch.Tensor], out: Any) -> bool:
    """Forward AD's internal ops (``to(device='meta')`` of an efficient zero tensor, which has no storage; ops on meta
    tensors): nothing to keep, and a policy that reads the zero tensor's values would crash the process: not asked."""
    outs = tensor_leaves(out)
    return (bool(outs) and all(t.is_meta for t in outs)) or any(ti.is_zero_tensor(t) for t in ins)


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


def explicit_generator(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Generator | None:
    """The generator handed to a random op: a keyword, or positional as ``poisson``'s and ``binomial``'s; or None."""
    gen = kwargs.get("generator")
    return gen if gen is not None else next((a for a in args if isinstance(a, torch.Generator)), None)


def generator_for(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Generator | None:
    """The generator a random op draws from (None: one the trace does not know)."""
    gen = explicit_generator(args, kwargs)
    if gen is not None:
        return gen
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
        # (a sparse tensor has no strides: its layout stands in for them)
        return (tuple(t.shape), t.dtype, t.device, tuple(t.stride()) if t.layout is torch.strided else t.layout)
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


def slot_key(t: torch.Tensor) -> int:
    """The address of ``t``'s storage (shared by its views) without making its Python object (costlier than recording
    an op, as the trace does for each); an empty one's is ``-id(t)``, a sparse tensor's its values' (``sp.values()``:
    ``sparse_parts`` names its other storages), else 0."""
    try:
        return int(t.data_ptr() - t.storage_offset() * t.itemsize) or -id(t)
    except (RuntimeError, NotImplementedError):
        if t.is_meta or t.layout not in _SPARSE:
            return 0
        with internal():  # (the getters are ATen ops, which no remat mode may count as the call's)
            return slot_key(t._values() if t.layout is torch.sparse_coo else t.values())


_SPARSE = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def sparse_parts(t: torch.Tensor) -> tuple[int, ...]:
    """The storage keys of a sparse tensor's indices (a COO tensor's; a compressed one's two), which a write may change
    as it may its values (``sp._indices().zero_()``, ``csr.col_indices().fill_(0)``): its slot's keys on the trace
    besides ``slot_key``'s; () for any other tensor."""
    lay = t.layout
    if lay not in _SPARSE or t.is_meta:
        return ()
    with internal():
        if lay is torch.sparse_coo:
            return (slot_key(t._indices()),)
        compressed, plain = ((t.crow_indices(), t.col_indices()) if lay in (torch.sparse_csr, torch.sparse_bsr)
                             else (t.ccol_indices(), t.row_indices()))
        return slot_key(compressed), slot_key(plain)


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
    stores: list[Any] = dataclasses.field(default_factory=list)  # weakrefs to the outputs' storages (or None)
    stash: list[Any] | None = None  # per output: weakref, tensor, offloaded handle or None
    cow: bool = False  # a stashed output was later mutated in place: replay a copy
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
    drew: torch.Tensor | None = None  # and its state after (NOTE [draws in threads] in _engine/ambient.py)
    writes: bool = False  # writes an argument in place, its schema saying so or not (batch norm's statistics)
    held: bool = False  # drawn from a shared generator with another thread alive: held (NOTE [draws in threads])
    # its own outputs and every tensor of the call alive on a held output's storage when the forward pass ended (its
    # results, every op's output): their ``version_watches``, made by ``Recorder.watch_results``
    watch: list[tuple[torch.Tensor, int]] | None = None

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
    if type(stride) is torch.layout:  # (a sparse tensor's: a dense one's entries, each stored; blocks of one)
        block = (1, 1) if stride in (torch.sparse_bsr, torch.sparse_bsc) else None
        return dead_value((shape, dtype, device, torch.empty(shape).stride())).to_sparse(layout=stride, blocksize=block)
    t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    if dtype.is_floating_point or dtype.is_complex:
        t.fill_(float("nan"))
    return t


# ---- what an op's schema says (the replay engine's record, ``trace.py``) ----------------------------------------


def hidden_write(name: str) -> bool:
    """Whether an argument of this name is written by an op whose schema declares no write: the running statistics
    (``running_mean``, ``running_var``, ``running_min``, ``running_max``), which ``native_batch_norm`` and its
    kin update in place undeclared. The rule is what torch's own schemas say: every argument name some ATen op
    declares written (``Tensor(a!) running_mean``, ``_native_batch_norm_legit``) and that is not an in-place or
    out= op's generic ``self``/``out`` starts with ``running_`` (``declared_written_names``, checked against the
    installed torch by ``tests/test_replay.py``; scanning every schema costs ~1.7 s, too long for a first call)."""
    return name.startswith("running_")


@functools.cache
def declared_written_names() -> frozenset[str]:
    """Argument names that some ATen op's schema declares written, outside in-place and out= overloads (whose
    ``self`` and ``out`` every such op writes): derived from torch's schemas."""
    declared: set[str] = set()
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        if packet is None or not hasattr(packet, "overloads"):
            continue
        try:
            overloads = packet.overloads()
        except Exception:  # noqa: BLE001 (an odd packet: skip it)
            continue
        for o in overloads:
            op = getattr(packet, o, None)
            # (an out= overload writes its out arguments, an in-place one its self: not hidden writes; torch 2.11
            # has no tags for them, their names say it)
            if op is None or "out" in o.split("_") or name.endswith("_"):
                continue
            for a in op._schema.arguments:
                if a.alias_info is not None and a.alias_info.is_write and not a.kwarg_only:
                    declared.add(a.name)
    return frozenset(declared)


class OpInfo:
    """What an op's schema says that the trace needs, computed once per overload."""

    __slots__ = ("written", "written_kw", "random", "pins", "hidden", "mutable", "tpos", "simple", "view", "trusted",
                 "call", "inplace_view", "ignored", "func", "alias_of", "absolute")

    def __init__(self, func: Any) -> None:
        self.func = func
        self.ignored = ignored(func)  # not an op of the call (a profiler marker, a size query)
        schema = func._schema
        written: list[int] = []
        written_kw: list[str] = []
        hidden: list[int] = []
        tpos: list[int] = []
        other = False  # a list of tensors, or a keyword-only tensor
        names = set()
        for i, a in enumerate(schema.arguments):
            names.add(a.name)
            kind = _tensor_kind(a.type)
            if kind == 1 and not a.kwarg_only:
                tpos.append(i)
            elif kind:
                other = True
            w = a.alias_info is not None and a.alias_info.is_write
            if w:
                if a.kwarg_only:
                    written_kw.append(a.name)
                else:
                    written.append(i)
            elif not a.kwarg_only and hidden_write(a.name):
                hidden.append(i)  # NOTE [outside writes]: a write the schema does not declare
        # (squeeze_, transpose_, as_strided_: they change a tensor's shape, not its data; replayed on an alias)
        self.inplace_view = torch.Tag.inplace_view in func.tags
        if self.inplace_view:
            written = []
        self.written = tuple(written) + tuple(hidden)
        self.written_kw = tuple(written_kw)
        self.hidden = bool(hidden)
        self.mutable = bool(self.written or self.written_kw)
        self.random = torch.Tag.nondeterministic_seeded in func.tags
        self.pins = tuple(n for n in ("dtype", "device") if n in names)
        self.tpos = tuple(tpos)
        self.call = ti.op_call(func)  # (its C++ callable: one Python frame less per op, in both passes)
        # its outputs alias an argument (a view): never kept for the replay, which runs views again for free
        self.view = any(r.alias_info is not None for r in schema.returns)
        # per output, the argument it aliases, by the alias set the schema names: its position, or its name if it is
        # keyword-only (an out= op's results alias its out arguments, not its first one); None: none named (each
        # view of a list of views aliases the first argument, as every view that writes nothing does)
        alias_of: list[int | str | None] = []
        for r in schema.returns:
            sets = r.alias_info.before_set if r.alias_info is not None else set()
            alias_of.append(next((a.name if a.kwarg_only else i for i, a in enumerate(schema.arguments)
                                  if sets and a.alias_info is not None and a.alias_info.before_set & sets), None))
        self.alias_of = tuple(alias_of)
        # ATen's schemas say what an op writes (but for the hidden writes above); another namespace's may not: a
        # version that moved across such an op is a write nobody declared (NOTE [outside writes])
        self.trusted = getattr(func, "namespace", None) in ("aten", "prims")
        # the common case, recorded by the short path: tensors only as positional arguments, no write, no draw, not
        # a factory (which pins its dtype), a schema to trust
        # an offset from the storage's first byte (as_strided): a copy of an outside storage must be whole
        self.absolute = func.overloadpacket.__name__ in ox.ABSOLUTE
        self.simple = (not other and not self.mutable and not self.random and bool(tpos) and self.trusted
                       and func is not ALIAS and not self.inplace_view and not self.absolute and func not in LIFTS)


def _tensor_kind(t: Any) -> int:
    """1: a Tensor (or Tensor?) argument; 2: a list of them; 0: anything else."""
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    if isinstance(t, torch.TensorType):
        return 1
    if isinstance(t, torch.ListType):
        e = t.getElementType()
        if isinstance(e, torch.OptionalType):
            e = e.getElementType()
        if isinstance(e, torch.TensorType):
            return 2
    return 0


@functools.cache
def op_info(func: Any) -> OpInfo:
    return OpInfo(func)


_TENSOR_TF = torch.Tensor.__torch_function__.__func__  # type: ignore[attr-defined]
_DISABLED_TF = torch.nn.Parameter.__torch_function__  # (torch's "disabled" one, which a Parameter has)


def plain_subclass(cls: type) -> bool:
    """Whether ``cls`` subclasses ``Tensor`` (or ``nn.Parameter``) in Python and overrides neither
    ``__torch_function__`` nor ``__torch_dispatch__`` (``class MyT(torch.Tensor): pass``): an op reads it as a plain
    tensor, and a replay may read it and make it as one (``Alias``). Asked each time (two lookups; a cache by class
    would hold every class defined in a loop, and miss a ``__torch_function__`` set on the class later)."""
    tf = getattr(cls, "__torch_function__", None)
    return (getattr(tf, "__func__", tf) in (_TENSOR_TF, _DISABLED_TF)
            and getattr(cls, "__torch_dispatch__", None) is torch.Tensor.__torch_dispatch__)


class Alias:
    """NOTE [unseen aliases] in _engine/program.py: make a tensor of the geometry, type and ``requires_grad`` of one
    the forward pass made where no torch function or op was seen, on the storage of the replay's value of a tensor
    it aliased."""

    def __init__(self, t: torch.Tensor) -> None:
        self.geometry = ox.view_geometry(t)
        self.dtype = t.dtype  # (of the size of the base's: a dtype view of it)
        self.cls = type(t)  # (a Parameter, or a plain subclass: ``plain_subclass``)
        self.requires_grad = t.requires_grad

    def __call__(self, base: torch.Tensor) -> torch.Tensor:
        a = base.detach()
        if a.dtype != self.dtype or ox.view_geometry(a) != self.geometry:
            with internal():  # (no op of the forward pass's: a dispatch mode checking the replay's ops sees none)
                a = a.view(self.dtype).as_strided(*self.geometry)
        if issubclass(self.cls, torch.nn.Parameter):  # (its own __new__ is not run: its arguments are its own)
            return torch.nn.Parameter.__new__(self.cls, a, self.requires_grad)  # type: ignore[arg-type]
        if self.cls is not torch.Tensor:
            with internal():
                a = a.as_subclass(self.cls)  # type: ignore[arg-type]
        return a.requires_grad_() if self.requires_grad else a


FLAT = "flat"  # Step.spec of an op that returns a flat tuple of tensors


class Step:
    """One recorded op: ``op(*args, **kwargs)`` with the tensors at ``refs`` taken from slots."""

    __slots__ = ("op", "call", "args", "kwargs", "refs", "outs", "inplace_view", "spec", "rng", "grad", "decision", "writes",
                 "nograd_outs", "replayable", "quiet")

    def __init__(self, op: Any, call: Any, args: list[Any], kwargs: dict[str, Any],
                 refs: list[tuple[Any, int, int]]) -> None:
        self.op = op
        self.call = call
        self.inplace_view = False  # changes its argument's shape in place: replayed on an alias of it
        self.args = args  # tensors replaced by None
        self.kwargs = kwargs
        self.refs = refs  # (argument index or keyword, position in a list argument or -1, slot)
        self.outs: list[int] = []  # the slots of its tensor outputs, in order (-1: not a tensor)
        self.spec: Any = None  # the output's pytree structure, when it is not one tensor (FLAT: a flat tuple of them)
        self.rng: tuple[torch.Generator, torch.Tensor] | None = None  # generator state before a random op
        self.grad = True  # grad mode was on
        self.decision: Decision = Recompute
        self.writes: tuple[int, ...] = ()  # storage keys it writes
        self.nograd_outs: list[weakref.ref[torch.Tensor]] | None = None  # ran without grad: its outputs (custom Functions)
        self.replayable = True
        # a write none of whose arguments needed a gradient (into ``t.data``, a detach): what it wrote, which a replay
        # that builds a graph writes through an alias autograd does not follow, as in the forward pass
        self.quiet: tuple[Any, ...] = ()

    def reads(self) -> list[int]:
        return [s for _, _, s in self.refs]


_K = TypeVar("_K", bound=Hashable)


def version_watches(pairs: Iterable[tuple[torch.Tensor, _K]]) -> dict[_K, list[tuple[torch.Tensor, int]]]:
    """NOTE [kept values written after the call] in ``_engine/replaying.py``, for both engines: each (tensor of the
    call alive when the forward pass ends, what a write to it makes stale) -> that value's watches, each (an alias
    sharing the tensor's version counter and none of its bytes, its version then); one alias a tensor."""
    made: dict[int, tuple[torch.Tensor, int]] = {}
    out: dict[_K, list[tuple[torch.Tensor, int]]] = {}
    for t, what in pairs:
        if not t.is_inference():  # (no version counter to watch: no write can reach it either)
            if (w := made.get(id(t))) is None:
                w = made[id(t)] = (ti.version_alias(t), t._version)
            out.setdefault(what, []).append(w)
    return out


def storage_freed(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage no longer holds its elements: the caller let go of a kept value's memory (FSDP's
    ``untyped_storage().resize_(0)``), which moves no version counter; the replay makes the value again."""
    try:
        if t.layout is not torch.strided or not t.numel():
            return False
        end = t.storage_offset() + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1
        return bool(t.untyped_storage().nbytes() < end * t.element_size())
    except (RuntimeError, NotImplementedError):  # (no storage to ask: a subclass, a fake tensor)
        return False
