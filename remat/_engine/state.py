"""What a remat'd function reads besides its arguments: module state and closures, found and put back.

NOTE [state is an input]
    A function often reads tensors that are not among its arguments: the
    parameters and buffers of the modules it calls (a bound ``forward``, a
    module passed as the function, a ``functools.partial`` holding one) and
    tensors it closes over. They are inputs of the call like the arguments.
    The recompute runs in the backward pass, by which time
    ``torch.func.functional_call`` has put the module's own parameters back and
    ``vjp``'s level has exited: reading them again would compute with other
    values. So each call takes a :class:`Snapshot` of the state it can reach
    (walking the function object: bound ``self``, partial arguments, closure
    cells, default arguments (``def counted(*a, _fwd=blk.forward)``), nested functions, modules and their submodules, and the functions,
    partials and modules in the lists, tuples and dicts those hold: a list of
    ``functools.partial(block, params)``; not other callable objects, whose
    tensors the call may never read), holds those tensors
    until its backward pass like its inputs, and the recompute runs with them
    put back (:meth:`Snapshot.restored`): module slots set in ``_parameters`` /
    ``_buffers`` (what ``functional_call`` itself does), closure cells pointed
    at the same values. Containers of blocks (a list of partials, a module's
    submodules) are put back too: a block replaced between the forward and the
    backward pass is not what the recompute runs. Under torch.func the held tensors are re-wrapped for the
    rebuilt levels exactly like the arguments (NOTE [per-level replay]).

    What the walk cannot reach (a tensor in a global, in a dict inside a
    closure that was mutated, an attribute of an arbitrary object) is caught
    by the recompute's check that every op reads the same outside tensors as
    in the forward pass (NOTE [outside tensors] in ``_engine/outside_writes.py``): a
    ``RematError`` naming the tensor, never a wrong gradient.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
import weakref
from collections.abc import Iterator
from typing import Any

import optree
import torch
from torch import nn

from .. import _torch_internals as ti
from .._context import CACHES
from .._torch_internals import unwrap_all
from .ops import storage_key

__all__ = ["Snapshot", "snapshot", "brief_name"]

_MAX_DEPTH = 4  # functions reached through closures of closures of ...
_MISSING = object()


class _Slot:
    """Where one piece of state lives, how to read it and set it."""

    __slots__ = ("owner", "kind", "name", "label")

    def __init__(self, owner: Any, kind: str, name: Any, label: str) -> None:
        # a module's _parameters or _buffers dict (kind "_parameters"/"_buffers": not the module, which the
        # cache of module slots must not hold), a cell ("cell"), an object ("attr") or a functools.partial's
        # argument ("partial": name is its index, or its keyword), a function's default arguments ("defaults",
        # "kwdefaults": the whole tuple or dict)
        self.owner = owner
        self.kind = kind
        self.name = name
        self.label = label  # for messages: "GPT2Block.attn.c_attn.weight"

    def get(self) -> Any:
        if self.kind == "cell":
            return self.owner.cell_contents
        if self.kind == "attr":
            return self.owner.__dict__[self.name]
        if self.kind == "partial":
            p = self.owner
            return p.args[self.name] if isinstance(self.name, int) else p.keywords[self.name]
        if self.kind == "defaults":
            return self.owner.__defaults__
        if self.kind == "kwdefaults":
            return self.owner.__kwdefaults__
        return self.owner[self.name]

    def set(self, value: Any) -> None:
        if self.kind == "cell":
            self.owner.cell_contents = value
        elif self.kind == "attr":
            self.owner.__dict__[self.name] = value
        elif self.kind == "partial":  # (a partial's arguments are read-only but for its pickling protocol)
            p = self.owner
            args, keywords = list(p.args), dict(p.keywords)
            if isinstance(self.name, int):
                args[self.name] = value
            else:
                keywords[self.name] = value
            p.__setstate__((p.func, tuple(args), keywords, p.__dict__ or None))
        elif self.kind == "defaults":
            self.owner.__defaults__ = value
        elif self.kind == "kwdefaults":
            self.owner.__kwdefaults__ = value
        else:  # what torch.func.functional_call does (nn.utils._named_member_accessor.swap_tensor)
            self.owner[self.name] = value


class Snapshot:
    """The state one call read: slots, and per slot the value (a tensor, or a pytree of them for a cell)."""

    __slots__ = ("slots", "values", "specs", "tensors", "modules", "children", "lazy")

    def __init__(self) -> None:
        self.lazy = False  # a lazy module's parameters are not made yet (its first forward pass makes them)
        self.modules: list[nn.Module] = []  # every module walked (their training flags are part of the signature)
        # per module with submodules, its submodules at the forward pass (put back for the recompute)
        self.children: list[tuple[nn.Module, tuple[tuple[str, Any], ...]]] = []
        self.slots: list[_Slot] = []
        self.values: list[Any] = []  # the slot's value at the forward pass
        self.specs: list[Any] = []  # None: the value is a tensor; else the treespec of a container
        self.tensors: list[torch.Tensor] = []  # every tensor, flat, in slot order

    def _add(self, slot: _Slot, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            self.slots.append(slot)
            self.values.append(value)
            self.specs.append(None)
            self.tensors.append(value)
            return
        leaves, spec = optree.tree_flatten(value, none_is_leaf=True)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        # (a list of blocks holds no tensor, but a block replaced before the backward pass must not be what the
        # recompute runs: the container is put back like one of tensors)
        if tensors or any(_walkable(x) for x in leaves):
            self.slots.append(slot)
            self.values.append((value, leaves))  # the leaves as they were: the container may change later
            self.specs.append(spec)
            self.tensors.extend(tensors)

    @contextlib.contextmanager
    def restored(self, tensors: list[torch.Tensor]) -> Iterator[None]:
        """Run with every slot holding what it held in the forward pass (``tensors``: the held
        tensors, re-wrapped for the recompute's levels). Slots already holding exactly that are
        left alone (the common case: no functional_call, no transform)."""
        undo: list[tuple[_Slot, Any]] = []
        undo_children: list[tuple[dict[str, Any], str, Any]] = []
        it = iter(tensors)
        try:
            for m, items in self.children:
                mods = m._modules
                for name, child in items:
                    cur = mods.get(name, _MISSING)
                    if cur is not child:
                        undo_children.append((mods, name, cur))
                        mods[name] = child
            for slot, value, spec in zip(self.slots, self.values, self.specs):
                want: Any
                if spec is None:
                    want = next(it)
                else:
                    container, leaves = value
                    new = [next(it) if isinstance(x, torch.Tensor) else x for x in leaves]
                    want = container
                    if not _holds(container, new):
                        want = optree.tree_unflatten(spec, new)  # a new container: the user's is left alone
                cur = slot.get()
                if cur is not want:
                    undo.append((slot, cur))
                    slot.set(want)
            yield
        finally:
            for slot, cur in reversed(undo):
                slot.set(cur)
            for mods, name, cur in reversed(undo_children):
                if cur is _MISSING:
                    del mods[name]
                else:
                    mods[name] = cur

    def label_of(self, t: torch.Tensor) -> str | None:
        """The slot a (plain) tensor came from, for messages: same storage as a held tensor."""
        key = storage_key(t)
        for slot, value, spec in zip(self.slots, self.values, self.specs):
            for x in [value] if spec is None else value[1]:
                if isinstance(x, torch.Tensor) and storage_key(unwrap_all(x)) == key:
                    return slot.label
        return None


def _holds(container: Any, leaves: list[Any]) -> bool:
    """Does ``container`` hold exactly these leaves now (same objects, same structure)?"""
    try:
        now = optree.tree_leaves(container, none_is_leaf=True)
    except Exception:
        return False
    return len(now) == len(leaves) and all(a is b for a, b in zip(now, leaves))


def snapshot(fn: Any, extra: list[Any]) -> Snapshot:
    """The state ``fn`` can reach (and the non-tensor arguments in ``extra``: modules, functions)."""
    snap = Snapshot()
    seen: set[int] = set()
    _walk(fn, snap, seen, brief_name(fn), 0)
    for a in extra:
        if not isinstance(a, torch.Tensor) and (callable(a) or isinstance(a, nn.Module)):
            _walk(a, snap, seen, brief_name(a), 0)
    return snap


def _walk(obj: Any, snap: Snapshot, seen: set[int], label: str, depth: int) -> None:
    if id(obj) in seen or depth > _MAX_DEPTH:
        return
    seen.add(id(obj))
    if isinstance(obj, nn.Module):
        _walk_module(obj, snap, seen)
    elif isinstance(obj, types.MethodType):
        owner = obj.__self__
        owner_label = label.rpartition(".")[0] or label
        if isinstance(owner, nn.Module):
            _walk(owner, snap, seen, owner_label, depth)
        elif not isinstance(owner, type) and id(owner) not in seen:
            seen.add(id(owner))
            _walk_attrs(owner, snap, seen, owner_label, depth)
        _walk(obj.__func__, snap, seen, label, depth)
    elif isinstance(obj, functools.partial):
        _walk(obj.func, snap, seen, label, depth + 1)
        for name, a in (*enumerate(obj.args), *obj.keywords.items()):
            if isinstance(a, nn.Module) or callable(a):
                _walk(a, snap, seen, brief_name(a), depth + 1)
            elif isinstance(a, (torch.Tensor, list, tuple, dict)):
                # functools.partial(block, params): the params are state of the call like a closure's
                snap._add(_Slot(obj, "partial", name, f"{label}'s argument {name!r}"), a)
                _walk_leaves(a, snap, seen, label, depth + 1)
    elif isinstance(obj, types.FunctionType):
        # default arguments are state as closure cells are: def counted(*a, _fwd=blk.forward, **k) binds a module
        # (or a loop variable) through a default; put back as a whole (the tuple or dict is the function's)
        for kind, defaults in (("defaults", obj.__defaults__), ("kwdefaults", obj.__kwdefaults__)):
            if defaults:
                _walk_defaults(obj, kind, defaults, snap, seen, label, depth)
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell (a name assigned later)
                continue
            if isinstance(value, nn.Module) or isinstance(value, (types.FunctionType, types.MethodType,
                                                                   functools.partial)):
                _walk(value, snap, seen, f"{label}:{name}", depth + 1)
            elif isinstance(value, (torch.Tensor, list, tuple, dict)) and id(cell) not in seen:
                seen.add(id(cell))
                snap._add(_Slot(cell, "cell", name, f"{name} (closed over by {label})"), value)
                _walk_leaves(value, snap, seen, f"{label}:{name}", depth + 1)
    elif hasattr(obj, "__remat_target__"):  # remat's own wrappers: look at what they wrap
        _walk(obj.__remat_target__, snap, seen, label, depth)
    elif not isinstance(obj, type) and callable(obj):
        _walk_attrs(obj, snap, seen, label, depth)


def _walk_defaults(fn: types.FunctionType, kind: str, defaults: Any, snap: Snapshot, seen: set[int], label: str,
                   depth: int) -> None:
    """A function's ``__defaults__`` (a tuple) or ``__kwdefaults__`` (a dict): the modules and functions in it are
    walked, its tensors (and containers of them) are state, held and put back like a closure's."""
    items = enumerate(defaults) if kind == "defaults" else defaults.items()
    holds = False
    for name, value in items:
        if isinstance(value, nn.Module) or isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
            _walk(value, snap, seen, f"{label}:{name}", depth + 1)
        elif isinstance(value, (torch.Tensor, list, tuple, dict)):
            holds = True
            _walk_leaves(value, snap, seen, f"{label}:{name}", depth + 1)
    if holds:
        snap._add(_Slot(fn, kind, kind, f"the default arguments of {label}"), defaults)


def _walkable(x: Any) -> bool:
    """What the walk follows inside a container: modules, functions, methods, partials (not any callable object:
    its tensors would be state the call may never read, whose in-place updates a re-run recompute refuses)."""
    return isinstance(x, (nn.Module, types.FunctionType, types.MethodType, functools.partial))


def _walk_leaves(container: Any, snap: Snapshot, seen: set[int], label: str, depth: int) -> None:
    """The modules and functions in a list, tuple or dict the call reads (a list of blocks, of partials)."""
    if isinstance(container, torch.Tensor):
        return
    for x in optree.tree_leaves(container, none_is_leaf=True):
        if _walkable(x):
            _walk(x, snap, seen, brief_name(x), depth)


def _walk_attrs(obj: Any, snap: Snapshot, seen: set[int], label: str, depth: int) -> None:
    """An object's own tensors and modules (one level): a callable object, or a method's ``self``."""
    for name, value in list(getattr(obj, "__dict__", {}).items()):
        if isinstance(value, (torch.Tensor, list, tuple, dict)):
            snap._add(_Slot(obj, "attr", name, f"{label}.{name}"), value)
            _walk_leaves(value, snap, seen, f"{label}.{name}", depth + 1)
        elif isinstance(value, nn.Module):
            _walk(value, snap, seen, f"{label}.{name}", depth + 1)


def _walk_module(root: nn.Module, snap: Snapshot, seen: set[int]) -> None:
    slots, values, specs, tensors = snap.slots, snap.values, snap.specs, snap.tensors
    mods, sharded, lazy = _module_slots(root)
    snap.lazy = snap.lazy or lazy
    # NOTE [FSDP's hooks] in _engine/dispatch.py: a parameter FSDP2 holds sharded between calls is not the call's state: its
    # hooks, inside the call, register the gathered one, which the forward pass reads and FSDP2 gathers again for the
    # recompute (each read checked by identity and version: NOTE [outside tensors])
    skip = {id(t) for ref in sharded if (m := ref()) is not None for t in ti.fsdp_sharded_params(m)} if sharded else ()
    for mref, mslots in mods:
        m = mref()
        if m is None or (m is not root and id(m) in seen):
            continue
        seen.add(id(m))
        snap.modules.append(m)
        if m._modules:  # a child replaced before the backward pass must not be what the recompute runs
            snap.children.append((m, tuple(m._modules.items())))
        for slot in mslots:
            t = slot.owner[slot.name]  # a parameter or buffer: a tensor, or None
            if t is not None and id(t) not in skip:
                slots.append(slot)
                values.append(t)
                specs.append(None)
                tensors.append(t)


# The slots of a module tree, per root module (Caches.slots in _context.py): walking named_modules() and building labels on every
# call costs ~50 us for a transformer block, reading cached slots a few. Validated on each use by the
# sizes of the dicts (a parameter, buffer or submodule registered or removed since) and the identity of
# every child module (one replaced); a slot missed by any other change would still be caught by the
# recompute's check (NOTE [outside tensors]).
_Mods = list[tuple[weakref.ref[nn.Module], list[_Slot]]]  # (weakly: the cache must not keep its key alive)


def _module_slots(root: nn.Module) -> tuple[_Mods, list[weakref.ref[nn.Module]], bool]:
    """The slots of every module in the tree, the modules of it sharded by FSDP2 (weakly), and whether a lazy module
    (``nn.LazyLinear``) has not made its parameters yet (then nothing is cached: its first forward pass makes them)."""
    cache = CACHES.get().slots  # (Caches.slots: keyed weakly by the root module)
    cached = cache.get(root)
    if cached is not None and [len(d) for d in cached[0]] == cached[1] and all(
            a is b for a, b in zip(_children(cached[2]), cached[4])):
        return cached[2], cached[3], False
    fsdp = sys.modules.get("torch.distributed.fsdp")  # nothing is sharded unless FSDP was imported
    fsdp_module = getattr(fsdp, "FSDPModule", None)
    sharded: list[weakref.ref[nn.Module]] = []
    dicts: list[Any] = []
    out: _Mods = []
    label = type(root).__name__
    scripted: list[str] = []  # (a TorchScript module's tensors are read as outside tensors: its C++ dicts cannot swap)
    for prefix, m in root.named_modules(remove_duplicate=False):
        if any(prefix == p or prefix.startswith(p + ".") for p in scripted):
            continue
        if isinstance(m, torch.jit.ScriptModule):
            scripted.append(prefix)
            continue
        where = f"{label}.{prefix}" if prefix else label
        slots = [_Slot(getattr(m, kind), kind, name, f"{where}.{name}") for kind in ("_parameters", "_buffers")
                 for name in getattr(m, kind)]
        out.append((weakref.ref(m), slots))
        dicts += [m._parameters, m._buffers, m._modules]
        if fsdp_module is not None and isinstance(m, fsdp_module):
            sharded.append(weakref.ref(m))
    if any(nn.parameter.is_lazy(s.owner[s.name]) for _, slots in out for s in slots):
        return out, sharded, True
    cache[root] = (dicts, [len(d) for d in dicts], out, sharded, _children(out))
    return out, sharded, False


def _children(mods: _Mods) -> list[Any]:
    """Every child module of the cached tree, in order: a replaced submodule invalidates the cache."""
    return [c for mref, _ in mods if (m := mref()) is not None for c in m._modules.values()]


def brief_name(fn: Any, limit: int = 60) -> str:
    """A short name for messages: ``GPT2Block.forward``, ``MLP``, ``f``; never a long repr."""
    if isinstance(fn, functools.partial):
        return brief_name(fn.func, limit)
    if isinstance(fn, nn.Module):
        return type(fn).__name__
    if hasattr(fn, "__remat_target__"):
        return brief_name(fn.__remat_target__, limit)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if isinstance(name, str):
        return name.rpartition("<locals>.")[2]
    text = f"{type(fn).__name__} object"
    return text if len(text) <= limit else text[: limit - 3] + "..."
