"""What each op of a call read: its Python values, and which tensor each argument was.

NOTE [same reads]
    A re-run recompute (the routes of docs/how-it-works.md "Where neither
    replay serves") runs the function's Python again. Whatever that Python reads
    besides the call's inputs and module state (a module's ``temperature``, a
    global float, the index of the expert to run, ``random.choice``) may have
    changed since the forward pass, and the recompute would then compute other
    values: the gradient of a computation the forward pass never did, without
    an error (``torch.utils.checkpoint`` has this too). JAX cannot: its backward
    pass replays a trace. remat holds the same line by checking, on every call:
    the forward pass notes, per op, a *key* of its arguments, and each recompute
    compares the key of the op it runs at the same index. A key is the op's
    arguments with every tensor replaced by what it is in that pass:

    * an input of the call: which one (by position; each pass's own inputs, as its
      ops read them, below every ``torch.func`` level);
    * an output of an earlier op of the same pass: which op, which output (the
      wiring, ``h = [a, b][self.idx]``);
    * anything else (a tensor no op of the call made, such as a global): that
      very tensor, held until the backward pass and compared by identity.

    Everything else (numbers, sizes, dtypes, ``reduction`` strings, lists of
    them) is compared by value, NaN equal to NaN. If the inputs and state are
    unwritten (checked by version), the random state is put
    back, and every op reads the same as in the forward pass, the recompute
    computes what the forward pass computed, op by op: whatever Python state
    changed, it changed nothing the recompute reads. If a key differs, the
    recompute raises ``RematError`` naming the op, the argument, both values
    and the module attributes that now hold the new one. An op whose output the
    recompute hands back (held, or dead) is checked too: a stricter rule than
    needed, and one that never needs the analysis of what feeds what.

    NOTE [autocast's cache]: inside an autocast region, autocast caches its cast
    of a leaf that requires grad (a weight) and hands the cached copy to every
    later cast of it in the region: the second of two remat'd calls reading one
    weight (a shared or looped block) reads the cache in its forward pass, and
    its recompute, after the region, casts again. remat keeps no graph of a
    recompute: so an extra cast in a recompute, or a missing one in a forward
    pass, is run or skipped without counting as an op, and
    the token of autocast's cast of a leaf is the same whichever op made it,
    cached or not (``(cast, leaf's token, dtype)``; a cached cast is known by
    its node, a ``ToCopyBackward0`` into the leaf's accumulator). Casts are
    matched by the leaf they cast, not by the op alone (autocast casts a
    block's bias and weight before its float32 activation, and a cached one
    shifts the others). A cast the forward pass read from the cache is handed
    back to the recompute as that very tensor (the cache may hold the cast of
    the leaf's value before an in-place write since; the full engine reads it
    as an outside tensor it recorded). Plain autograd's gradient, bitwise.

    What it costs: building a key is a loop over the op's arguments with a
    dictionary lookup per tensor, and noting its outputs a weak reference
    each, per op, in both passes (1.5-2.5 us an op of tiny blocks on the CPU
    of docs/benchmarks.md). The full engine compares the same keys (without ``torch.func`` levels and
    outside nested calls, whose tensors are not the call's own objects: there
    the values only, :func:`values_key`), with a tensor no op of the call made
    as one marker: it checks those by storage (NOTE [outside tensors] in
    ``_engine/outside_writes.py``).
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch

__all__ = ["Wiring", "autocast_cast", "cast_source", "values_key", "made_token", "known_tokens", "same_key", "describe_difference", "first_value"]



class _Kind:
    """What a tensor argument was (the first item of its token): equal only to itself."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


_INPUT, _MADE, _STORAGE = _Kind("input"), _Kind("op"), _Kind("storage")
_TENSOR = _Kind("a tensor")
_ZERO = _Kind("a float zero of sign")
_CAST = _Kind("autocast's cast of")
_TO_COPY = torch.ops.aten._to_copy.default
_LOW = (torch.bfloat16, torch.float16)
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
_Storage = torch.UntypedStorage


class _Same:
    """A tensor no op of the call made: equal only to a key holding the very same tensor."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def __eq__(self, other: object) -> bool:
        return type(other) is _Same and other.t is self.t

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"a tensor of shape {list(self.t.shape)} that no op of the call made"


class Wiring:
    """One pass (the forward pass, or one recompute) of one call: the key of each op's arguments (NOTE [same reads]).

    ``known``: id -> token of the call's inputs and module state (held by the frame for the whole call, so their ids
    name no other object); each pass notes the outputs of its ops with :meth:`note`.
    """

    __slots__ = ("known", "made", "loose", "cached")

    def __init__(self, known: dict[int, Any], loose: bool = False,
                 cached: dict[tuple[int, torch.dtype], torch.Tensor] | None = None) -> None:
        self.known = known
        # NOTE [autocast's cache]: a forward pass's: (id of the leaf, dtype) -> the cached cast an op read, which the
        # recompute hands back rather than casting the leaf again (its value may have changed since the cache's cast)
        self.cached = cached
        self.made: dict[int, tuple[Any, weakref.ref[torch.Tensor]]] = {}
        # the full engine's: a tensor no op made is one marker (its outside-tensor check compares those by storage,
        # and lets a constant made afresh with the same value pass: NOTE [outside tensors] in _engine/outside_writes.py)
        self.loose = loose

    def key(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> list[Any]:
        """The key of an op's arguments: a list (compared with ``==``, in C), tensors replaced by their tokens.
        (On every op of a re-run call, both passes: the common cases inline, no frame per argument.)"""
        known = self.known
        made = self.made
        key: list[Any] = []
        for a in args:
            ta = type(a)
            if ta is _Tensor or ta is _Parameter:
                t = known.get(id(a))
                if t is None:
                    m = made.get(id(a))
                    t = m[0] if m is not None and m[1]() is a else self._unknown(a)
                key.append(t)
            elif ta is int or ta is bool or (ta is float and a != 0.0):
                key.append(a)  # (the common plain values, inline)
            else:
                key.append(self._token(a))
        if kwargs:
            key.append([(n, self._token(v)) for n, v in kwargs.items()])
        return key

    def _token(self, a: Any) -> Any:
        ta = type(a)
        if ta is _Tensor or ta is _Parameter or isinstance(a, _Tensor):
            i = id(a)
            t = self.known.get(i)
            if t is not None:
                return t
            m = self.made.get(i)
            if m is not None and m[1]() is a:
                return m[0]
            return self._unknown(a)
        return _plain(a, self._token)

    def _unknown(self, a: torch.Tensor) -> Any:
        """A tensor no op of this pass made: autocast's cached cast of a leaf (NOTE [autocast's cache]), an alias of a
        tensor an op made, made where no mode sees (NOTE [FSDP's hooks] in _engine/dispatch.py: that tensor's token), or
        itself."""
        leaf = cast_source(a)
        if leaf is not None:
            if self.cached is not None:
                self.cached[(id(leaf), a.dtype)] = a
            return self.cast_token(leaf, a.dtype)
        if self.loose:
            return _TENSOR
        try:
            key = a.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            key = 0
        if key:
            for tok, ref in reversed(self.made.values()):  # (rare: a hook's alias; the newest first)
                t = ref()
                if t is not None and t.untyped_storage().data_ptr() == key and t.shape == a.shape \
                        and t.stride() == a.stride() and t.storage_offset() == a.storage_offset():
                    return tok
        return _Same(a)

    def cast_token(self, leaf: torch.Tensor, dtype: torch.dtype) -> tuple[Any, ...]:
        """NOTE [autocast's cache]: the token of autocast's cast of ``leaf`` to ``dtype``, whichever op made it."""
        tok = self.known.get(id(leaf))
        return (_CAST, _Same(leaf) if tok is None else tok, dtype)

    def note_cast(self, out: Any, leaf: torch.Tensor) -> None:
        """NOTE [autocast's cache]: ``out`` is autocast's cast of ``leaf`` (cached or not: the same token)."""
        if isinstance(out, _Tensor):
            self.made[id(out)] = (self.cast_token(leaf, out.dtype), weakref.ref(out))

    def note_alias(self, out: Any, src: torch.Tensor) -> None:
        """``out`` is ``src`` under another name (NOTE [hooks' aliases] in _engine/dispatch.py): the same token."""
        if isinstance(out, _Tensor):
            self.made[id(out)] = (self._token(src), weakref.ref(out))

    def note(self, i: int, out: Any) -> None:
        """Op ``i`` returned ``out``: its tensors are that op's outputs in this pass."""
        if type(out) is _Tensor:
            self.made[id(out)] = (made_token(i), weakref.ref(out))
        elif type(out) is tuple or type(out) is list:
            for k, t in enumerate(out):
                if isinstance(t, _Tensor):
                    self.made[id(t)] = ((_MADE, i, k), weakref.ref(t))
        elif isinstance(out, _Tensor):
            self.made[id(out)] = ((_MADE, i, 0), weakref.ref(out))


def autocast_cast(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> torch.Tensor | None:
    """NOTE [autocast's cache]: the leaf this op casts, if it is a cast that autocast caches (a float32 leaf that
    requires grad, not a view, to a 16-bit float dtype and nothing else), else None. (Whether autocast is on cannot
    be asked here: autocast's kernel turns itself off below it. A cast written by hand, ``W.to(torch.bfloat16)``,
    passes too, and may: any cast of a leaf is exact to repeat.)"""
    if func is not _TO_COPY or not args or not kwargs or len(kwargs) != 1:
        return None
    if kwargs.get("dtype") not in _LOW:
        return None
    a = args[0]
    if type(a) is not _Tensor and type(a) is not _Parameter:
        return None
    if not (a.is_leaf and a.requires_grad) or a.dtype is not torch.float32 or a._is_view():
        return None
    return a


def cast_source(t: torch.Tensor) -> torch.Tensor | None:
    """NOTE [autocast's cache]: the leaf ``t`` is a cast of (its node a ``ToCopyBackward0`` whose one input is a
    leaf's accumulator), else None."""
    node = t.grad_fn
    if node is None or type(node).__name__ != "ToCopyBackward0":
        return None
    nxt = node.next_functions
    acc = nxt[0][0] if nxt else None
    leaf = getattr(acc, "variable", None)
    return leaf if isinstance(leaf, _Tensor) else None


def values_key(args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> list[Any]:
    """The values an op got, every tensor replaced by one marker: the full engine's part of NOTE [same reads]
    (it checks which tensor each op reads its own way, by storage: NOTE [outside tensors] in ``_engine/outside_writes.py``; its
    tensors are those below the ``torch.func`` levels, which the recompute rebuilds)."""
    key = [_value(a) for a in args]
    if kwargs:
        key.append([(n, _value(v)) for n, v in kwargs.items()])
    return key


def _value(a: Any) -> Any:
    return _TENSOR if isinstance(a, _Tensor) else _plain(a, _value)


def _plain(a: Any, each: Any) -> Any:
    """A non-tensor argument's part of a key (both kinds of key): a list or tuple item by item (``each``), a storage
    by its size (``set_``: a storage of the pass's own tensors, made anew by each pass), a float zero with its sign
    (0.0 == -0.0, but ``copysign`` tells them apart), anything else as it is."""
    ta = type(a)
    if ta is list or ta is tuple:
        return [each(x) for x in a]
    if ta is _Storage:
        return (_STORAGE, a.nbytes())
    if ta is float and a == 0.0:
        return (_ZERO, math.copysign(1.0, a))
    return a


def made_token(i: int) -> tuple[Any, ...]:
    """The token of op ``i``'s only (or first) output."""
    return (_MADE, i, 0)


def known_tokens(inputs: list[Any], unwrap: Any) -> dict[int, Any]:
    """The tokens of a call's inputs (by position among its leaves), as its ops read them: ``unwrap`` of each (below
    every ``torch.func`` level: ``_torch_internals.unwrap_all``, which this floor does not import). Module state is
    read as outside tensors (NOTE [same reads])."""
    return {id(unwrap(a)): (_INPUT, j) for j, a in enumerate(inputs) if isinstance(a, torch.Tensor)}


def same_key(now: Any, then: Any, loose: bool = False) -> bool:
    """Whether two keys are equal, NaN equal to NaN (``==`` first: the common case, done in C). ``loose`` (the full
    engine's): a tensor no op of the forward pass made (``then``) matches any tensor now (its reads of tensors it did
    not make, a backward pass's inside it included, are checked by storage: NOTE [outside tensors] in
    _engine/outside_writes.py); the reverse does not: a recompute that reads such a tensor where the forward pass read
    an input, a value of the call or a parameter reads another tensor (``src = x if self.flag else self.vec``), which
    no storage check of the forward's outside reads would see."""
    if now == then:
        return True
    if type(now) is float and type(then) is float:
        return now != now and then != then
    if loose and then is _TENSOR and _is_token(now):
        return True
    if type(now) in (tuple, list) and type(then) is type(now) and len(now) == len(then) and not _is_token(now):
        return all(same_key(a, b, loose) for a, b in zip(now, then))
    return False


def _is_token(x: Any) -> bool:
    """A tensor's token (input, state, an op's output, a cast, the marker)."""
    return x is _TENSOR or (type(x) is tuple and bool(x) and type(x[0]) is _Kind and x[0] is not _ZERO)


def _say(tok: Any, label: Any) -> str:
    if type(tok) is list:
        return "[" + ", ".join(_say(x, label) for x in tok) + "]"
    if tok is _TENSOR:
        return "a tensor"
    if type(tok) is tuple and len(tok) == 2 and tok[0] is _INPUT:
        return f"argument #{tok[1]} of the call (a leaf of its inputs)"
    if type(tok) is tuple and len(tok) == 3 and tok[0] is _MADE:
        return f"output #{tok[2]} of op #{tok[1]}"
    if type(tok) is tuple and len(tok) == 3 and tok[0] is _CAST:
        return f"autocast's {tok[2]} cast of {_say(tok[1], label)}"
    if type(tok) is tuple and len(tok) == 2 and tok[0] is _ZERO:
        return "-0.0" if tok[1] < 0 else "0.0"
    return repr(tok)


def describe_difference(now: list[Any], then: list[Any], label: Any) -> str:
    """The first argument where two keys differ, in words (``label``: state slot -> its name, or None)."""
    for j, (a, b) in enumerate(zip(now, then)):
        if not same_key(a, b):
            return f"argument #{j} is {_say(a, label)} in the recompute but {_say(b, label)} in the forward pass"
    return f"it has {len(now)} arguments in the recompute but {len(then)} in the forward pass"


def first_value(now: Any, then: Any) -> Any:
    """The first plain value (not a tensor's token) where two keys differ, or None."""
    if same_key(now, then):
        return None
    if type(now) in (tuple, list) and type(then) is type(now) and len(now) == len(then) and not (
            now and type(now[0]) is _Kind):
        for a, b in zip(now, then):
            v = first_value(a, b)
            if v is not None:
                return v
        return None
    if isinstance(now, (int, float, complex, str)) and not isinstance(now, bool):
        return now
    return None
