"""Inspection: which tensors autograd keeps between the forward and the backward pass, and why.

:func:`saved_residuals` runs the forward pass of a function (with any remat calls,
policies, names and ``torch.func`` transforms inside) and lists every tensor
saved for the backward pass: what happens to it (kept, offloaded, recomputed,
or an input held by reference), its size, the ATen op that allocated it, its
``checkpoint_name`` and the line of user code that produced it. Like JAX's
``print_saved_residuals``, it answers "what does this policy really keep?".

How it sees the saves, from outside the policy machinery:

* an :class:`_Inspector` is held in the :data:`INSPECTOR` context variable while
  the function runs; ``Frame.pack`` (``_engine/full.py``) reports every tensor a remat
  call saves and what it did with it;
* saved-tensor hooks installed around the function see what plain autograd saves
  outside remat calls (kept, by definition);
* a ``TorchDispatchMode`` (:class:`_Allocations`) below every ``torch.func`` layer
  notes, for each op, which storages it allocated, the user's source line and
  ``checkpoint_name`` tags; a saved tensor is matched to its allocation through
  its storage, so views and tensors saved several times collapse into one row.

Nothing of this runs unless an inspector is active.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import sysconfig
import warnings
from collections.abc import Callable
from typing import Any

import optree
import torch

from .. import _torch_internals as ti
from .._api.transform import remat
from .._context import INSPECTOR, INTERNAL, PENDING_NAME, internal
from .._engine.capture import holdable
from .._engine.dispatch import iter_stashed
from .._engine.ops import storage_key, tensor_leaves
from .._torch_internals import TorchDispatchMode, saved_tensors_hooks
from .measure import Config, format_table, measure

__all__ = ["INSPECTOR", "SavedResidual", "saved_residuals", "print_saved_residuals", "format_saved_residuals",
           "MemoryReport", "memory_report"]


DECISIONS = ("kept", "input", "offloaded", "recomputed")  # also the priority when one storage has several
ALIAS = torch.ops.aten.alias.default
_ENGINE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the remat package: its own frames
_SKIP_PREFIXES = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (torch, optree) if m.__file__
) + (sysconfig.get_paths()["stdlib"] + os.sep,)


@dataclasses.dataclass(frozen=True)
class SavedResidual:
    """One storage that autograd saved for the backward pass during the forward pass.

    Attributes:
        shape, dtype, device: of the first tensor saved from this storage, as
            stored (under ``vmap`` with the batch dimension).
        nbytes: size of the storage in bytes.
        decision: ``"kept"`` (held until the backward pass; also everything plain
            autograd saves outside remat calls), ``"input"`` (an input of a nested
            remat call held by reference), ``"offloaded"`` (copied to host memory)
            or ``"recomputed"`` (dropped, recomputed in the backward pass).
        op: the ATen op that allocated the storage (None: allocated before the
            function ran, e.g. an argument).
        name: its ``checkpoint_name`` tag, if any.
        source: ``"file:line"`` of the user's code that produced it.
        count: how many times it was saved (views of one storage, several ops,
            several ``torch.func`` levels).
        scope: the remat'd function that saved it (None: plain autograd).
        argument: where it came from among the function's arguments
            (``"args[0]['W']"``), None if the function allocated it.
        replayed: remat holds it to hand it back in the recompute instead of
            running its op again (a matmul output under ``dots_saveable`` that
            autograd itself does not save, say); memory held all the same.

    Example:
        >>> import torch
        >>> from remat import remat, saved_residuals
        >>> f = remat(lambda x: torch.sin(torch.sin(x)).sum(), policy="save-nothing")
        >>> r = saved_residuals(f, torch.randn(3, 4, requires_grad=True))[-1]
        >>> (r.decision, r.op, r.shape, r.dtype, r.nbytes, r.scope is not None)
        ('recomputed', 'aten.sin.default', (3, 4), torch.float32, 48, True)
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    nbytes: int
    decision: str
    op: str | None
    name: str | None
    source: str | None
    count: int
    scope: str | None
    argument: str | None
    replayed: bool = False


@dataclasses.dataclass
class _Alloc:
    index: int
    op: str
    source: str | None
    name: str | None = None


class _Allocations(TorchDispatchMode):
    """Which op allocated each storage, and from which user line (inspection only)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_key: dict[int, _Alloc] = {}
        self.count = 0
        self.skip: dict[str, bool] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if INTERNAL.get():
            return out
        name = PENDING_NAME.get() if func is ALIAS else None
        ins = {storage_key(t) for t in tensor_leaves((args, kwargs))}
        source: str | None = None
        for t in tensor_leaves(out):
            k = storage_key(t)
            if not k:
                continue
            if k not in ins:
                if source is None:
                    source = self.user_source()
                self.by_key[k] = _Alloc(self.count, _op_name(func), source)
                self.count += 1
            if name is not None and k in self.by_key:
                self.by_key[k].name = name
        return out

    def user_source(self) -> str | None:
        """``file:line`` of the innermost frame outside torch, optree, the stdlib and remat's engine."""
        f: Any = sys._getframe(1)
        while f is not None:
            fn = f.f_code.co_filename
            skip = self.skip.get(fn)
            if skip is None:
                path = os.path.abspath(fn)
                skip = self.skip[fn] = (
                    fn.startswith("<frozen") or path.startswith(_SKIP_PREFIXES) or path.startswith(_ENGINE_DIR + os.sep)
                )
            if not skip:
                return f"{fn}:{f.f_lineno}"
            f = f.f_back
        return None


class _Row:
    __slots__ = ("meta", "nbytes", "decision", "alloc", "count", "scope", "argument", "replayed", "order")

    def __init__(self, meta: tuple[Any, ...], nbytes: int, decision: str, alloc: _Alloc | None, scope: str | None,
                 argument: str | None, order: int) -> None:
        self.meta, self.nbytes, self.decision, self.alloc = meta, nbytes, decision, alloc
        self.count, self.scope, self.argument, self.replayed, self.order = 0, scope, argument, False, order


class _Inspector:
    """Collects what is saved while :func:`saved_residuals` runs the function."""

    def __init__(self, allocs: _Allocations, arguments: dict[int, str]) -> None:
        self.allocs = allocs
        self.arguments = arguments  # storage key -> argument path
        self.rows: dict[Any, _Row] = {}
        self.frames: dict[int, Any] = {}  # the remat calls seen (held until the function returns)

    def on_save(self, t: torch.Tensor, decision: str, frame: Any) -> None:
        """Called for every saved tensor: by ``Frame.pack`` (remat calls) and by our own hooks (frame None)."""
        with internal():
            if frame is not None:
                self.frames.setdefault(id(frame), frame)
            row = self._row(ti.unwrap_all(t), decision, None if frame is None else frame.fn_name)
            row.count += 1
            if DECISIONS.index(decision) < DECISIONS.index(row.decision):
                row.decision = decision

    def _row(self, phys: torch.Tensor, decision: str, scope: str | None) -> _Row:
        k = storage_key(phys)
        alloc = self.allocs.by_key.get(k) if k else None
        key: Any = ("op", alloc.index) if alloc is not None else ("ext", k) if k else ("obj", id(phys))
        row = self.rows.get(key)
        if row is None:
            try:
                nbytes = int(phys.untyped_storage().nbytes())
            except (RuntimeError, NotImplementedError):
                nbytes = phys.numel() * phys.element_size()
            meta = (tuple(phys.shape), phys.dtype, phys.device)
            arg = self.arguments.get(k) if alloc is None and k else None
            row = self.rows[key] = _Row(meta, nbytes, decision, alloc, scope, arg, len(self.rows))
        return row

    def collect_stashes(self) -> None:
        """Outputs a remat call holds to replay them in its recompute (NOTE [stash liveness] in _engine/liveness.py)."""
        with internal():
            for frame in self.frames.values():
                for rec, held in iter_stashed(frame.recorder):
                    if isinstance(held, torch.Tensor):
                        row = self._row(ti.unwrap_all(held), "kept", frame.fn_name)
                        if row.decision == "recomputed":
                            row.decision = "kept"  # dropped as a saved tensor, but held for the replay
                    else:  # offloaded to host memory: the device storage is gone
                        meta = (tuple(held.shape), held.dtype, torch.device("cpu"))
                        nbytes = math.prod(meta[0]) * held.dtype.itemsize
                        alloc = _Alloc(-1, str(rec.func), None, rec.name)
                        row = self.rows[("offloaded", id(held))] = _Row(
                            meta, nbytes, "offloaded", alloc, frame.fn_name, None, len(self.rows))
                    row.count += 1
                    row.replayed = True

    def residuals(self) -> list[SavedResidual]:
        def forward_order(r: _Row) -> tuple[int, int]:  # arguments first, then in the order ops ran
            return (0, r.order) if r.alloc is None else (1, r.alloc.index if r.alloc.index >= 0 else 1 << 62)

        rows = sorted(self.rows.values(), key=forward_order)
        out = []
        for r in rows:
            a = r.alloc
            out.append(SavedResidual(
                shape=r.meta[0], dtype=r.meta[1], device=r.meta[2], nbytes=r.nbytes, decision=r.decision,
                op=None if a is None else a.op, name=None if a is None else a.name,
                source=None if a is None else a.source, count=r.count, scope=r.scope, argument=r.argument,
                replayed=r.replayed,
            ))
        return out


def saved_residuals(f: Callable[..., Any], *args: Any, **kwargs: Any) -> list[SavedResidual]:
    """Run the forward pass of ``f(*args, **kwargs)`` and list the tensors saved for its backward pass.

    ``f`` may contain remat calls with any policy, ``checkpoint_name`` tags and
    ``torch.func`` transforms, and ``saved_residuals`` may itself be called inside
    ``torch.func`` transforms. One :class:`SavedResidual` per storage, in the
    order they were first saved; the backward pass is not run (unless ``f`` runs
    it, as ``torch.func.grad(g)`` does).

    ``torch.func.grad``/``vjp``/``jacrev``/``hessian`` refuse saved-tensor hooks
    that were installed outside them; when ``f`` enters one, it is run a second
    time (with the same random state) without the hooks for plain autograd, and a
    warning says that tensors saved there outside remat calls are not listed.
    Wrap that code in ``remat(..., policy="save-everything")`` to see them.

    Example:
        >>> import torch
        >>> from remat import remat, saved_residuals
        >>> f = remat(lambda W, x: torch.sin(torch.sin(x @ W)).sum(), policy="save-matmuls")
        >>> W = torch.randn(4, 4, requires_grad=True)
        >>> [(r.decision, r.op, r.argument) for r in saved_residuals(f, W, torch.randn(2, 4))]
        [('kept', None, 'args[1]'), ('kept', 'aten.mm.default', None), ('recomputed', 'aten.sin.default', None)]
    """
    if not callable(f):
        raise TypeError(f"saved_residuals: expected a function, got {f!r} ({type(f).__name__})")
    rng = _rng_state()
    try:
        return _run(f, args, kwargs, plain_hooks=True)
    except RuntimeError as e:
        if "saved tensor hooks" not in str(e):
            raise
    warnings.warn(
        f"saved_residuals: {_fn_name(f)} enters torch.func.grad/vjp/jacrev/hessian, which refuse saved-tensor "
        "hooks installed outside them: tensors saved there outside remat calls are not listed (the function "
        "ran a second time to list the rest). Wrap that code in remat(..., policy='save-everything') to see them.",
        stacklevel=2,
    )
    _set_rng_state(rng)
    return _run(f, args, kwargs, plain_hooks=False)


def _run(f: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], plain_hooks: bool) -> list[SavedResidual]:
    allocs = _Allocations()
    insp = _Inspector(allocs, _argument_paths(args, kwargs, f))

    def pack(t: torch.Tensor) -> torch.Tensor:
        insp.on_save(t, "kept", None)
        return holdable(t)  # never the tensor itself: a saved output would make a reference cycle

    was = INSPECTOR.get()
    try:
        INSPECTOR.set(insp)
        with contextlib.ExitStack() as es:
            es.enter_context(allocs)
            if plain_hooks:
                es.enter_context(ti.saved_tensors_hooks_enabled())
                es.enter_context(saved_tensors_hooks(pack, lambda t: t))
            out = f(*args, **kwargs)
        del out
        insp.collect_stashes()
    finally:
        INSPECTOR.set(was)
    return insp.residuals()


def _argument_paths(args: tuple[Any, ...], kwargs: dict[str, Any], f: Any = None) -> dict[int, str]:
    """Storage -> where the caller holds it: an argument's path, or a parameter's or buffer's name when ``f`` is a
    module or a method of one (held by the module anyway: not "held besides the arguments")."""
    paths: dict[int, str] = {}
    target = getattr(f, "__remat_target__", f)
    module = target if isinstance(target, torch.nn.Module) else getattr(target, "__self__", None)
    if isinstance(module, torch.nn.Module):
        with internal():
            for name, t in (*module.named_parameters(), *module.named_buffers()):
                k = storage_key(ti.unwrap_all(t))
                if k and k not in paths:
                    paths[k] = f"{type(module).__name__}.{name}"
    with internal():
        trees: list[tuple[str, Any]] = [("args", args), ("kwargs", kwargs)]
        for root, tree in trees:
            ps, leaves, _ = optree.tree_flatten_with_path(tree, none_is_leaf=True)
            for p, leaf in zip(ps, leaves, strict=True):
                if isinstance(leaf, torch.Tensor):
                    k = storage_key(ti.unwrap_all(leaf))
                    if k and k not in paths:
                        paths[k] = root + "".join(f"[{e!r}]" for e in p)
    return paths


def format_saved_residuals(residuals: list[SavedResidual], title: str = "saved residuals") -> str:
    """An aligned table of :func:`saved_residuals` records, with totals per decision.

    Example:
        >>> import torch
        >>> from remat import remat, saved_residuals, format_saved_residuals
        >>> f = remat(lambda x: torch.sin(x).sum(), policy="save-nothing")
        >>> print(format_saved_residuals(saved_residuals(f, torch.ones(256, requires_grad=True))))
        saved residuals: 1 storage(s), 1 save(s)
        decision   size  shape  dtype    device  op  name  count  held by   source
        kept      1 KiB  [256]  float32  cpu     -   -         1  <lambda>  args[0]
        totals: kept 1 KiB (1); held besides the arguments: 0 B
    """
    head = ["decision", "size", "shape", "dtype", "device", "op", "name", "count", "held by", "source"]
    rows = []
    for r in residuals:
        where = r.argument if r.argument is not None else _short(r.source) if r.source else "-"
        who = (r.scope or "autograd") + (" (replay)" if r.replayed else "")
        rows.append([r.decision, _size(r.nbytes), str(list(r.shape)), str(r.dtype).replace("torch.", ""),
                     str(r.device), r.op or "-", r.name or "-", str(r.count), who, where])
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    right = {1, 7}

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()

    saves = sum(r.count for r in residuals)
    out = [f"{title}: {len(residuals)} storage(s), {saves} save(s)", line(head)] + [line(r) for r in rows]
    totals = []
    for d in DECISIONS:
        sel = [r for r in residuals if r.decision == d]
        if sel:
            totals.append(f"{d} {_size(sum(r.nbytes for r in sel))} ({len(sel)})")
    held = sum(r.nbytes for r in residuals if r.argument is None and r.decision in ("kept", "input"))
    out.append("totals: " + (", ".join(totals) or "nothing saved")
               + f"; held besides the arguments: {_size(held)}")
    return "\n".join(out)


def print_saved_residuals(f: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Print :func:`saved_residuals` of ``f(*args, **kwargs)`` as a table with totals per decision.

    Example:
        >>> import torch
        >>> from remat import remat, print_saved_residuals
        >>> f = remat(lambda W, x: torch.sin(torch.sin(x @ W)).sum(), policy="save-matmuls")
        >>> print_saved_residuals(f, torch.randn(4, 4, requires_grad=True), torch.randn(2, 4))
        ... # doctest: +ELLIPSIS
        saved residuals of <lambda>: 3 storage(s), 4 save(s)
        decision    size  shape   dtype    device  op                name  count  held by            source
        kept        32 B  [2, 4]  float32  cpu     -                 -         1  <lambda>           args[1]
        kept        32 B  [2, 4]  float32  cpu     aten.mm.default   -         2  <lambda> (replay)  <doctest ...>:1
        recomputed  32 B  [2, 4]  float32  cpu     aten.sin.default  -         1  <lambda>           <doctest ...>:1
        totals: kept 64 B (2), recomputed 32 B (1); held besides the arguments: 32 B
    """
    print(format_saved_residuals(saved_residuals(f, *args, **kwargs), f"saved residuals of {_fn_name(f)}"))


def _size(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div:
            v = n / div
            return f"{v:.1f} {unit}" if v < 100 and v != int(v) else f"{int(round(v))} {unit}"
    return f"{n} B"


def _short(source: str) -> str:
    try:
        rel = os.path.relpath(source)
    except ValueError:
        return source
    return rel if not rel.startswith("..") else source


def _fn_name(f: Any) -> str:
    target = getattr(f, "__remat_target__", f)
    if isinstance(target, torch.nn.Module):
        return type(target).__name__  # (a module, or remat(module): its class, not its many-line repr)
    name = getattr(f, "__qualname__", None) or getattr(f, "__name__", None)
    return name if isinstance(name, str) else type(f).__name__  # (a module: its class, not its many-line repr)


def _op_name(func: Any) -> str:
    return str(func)  # an OpOverload prints as "aten.mm.default"


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


# ---- comparing policies ------------------------------------------------------------


@dataclasses.dataclass
class MemoryReport:
    """What each policy cost on one function: ``rows`` are :class:`remat.bench.measure.Result`, first the baseline.

    Returned by :func:`memory_report`; ``str(report)`` is a table with one line per row.

    Example:
        >>> import torch
        >>> from remat import MemoryReport, memory_report
        >>> def make_loss(wrap):
        ...     block = wrap(lambda w, h: torch.tanh(torch.tanh(h @ w) @ w))
        ...     return lambda w, x: block(w, x).pow(2).sum()
        >>> w, x = torch.randn(32, 32, requires_grad=True), torch.randn(16, 32)
        >>> rep = memory_report(make_loss, w, x, policies=["save-matmuls"], steps=1)
        >>> isinstance(rep, MemoryReport), [r.label for r in rep.rows]
        (True, ['no remat', 'save-matmuls'])
        >>> rep.row("save-matmuls").label in str(rep), list(rep.to_dict())
        (True, ['rows'])
    """

    rows: list[Any]

    def __str__(self) -> str:

        return format_table(self.rows)

    def row(self, label: str) -> Any:
        """The result labelled ``label``."""
        for r in self.rows:
            if r.label == label:
                return r
        raise KeyError(f"memory_report: no row {label!r}; rows are {[r.label for r in self.rows]}")

    def to_dict(self) -> dict[str, Any]:
        return {"rows": [r.to_dict() for r in self.rows]}


def memory_report(make_loss: Callable[[Callable[..., Any]], Callable[..., Any]], *args: Any,
                  policies: Any = ("save-nothing", "save-matmuls"), steps: int = 5, warmup: int = 1) -> MemoryReport:
    """Compare policies on one function: retained and peak memory, time per step, FLOPs recomputed.

    ``make_loss(wrap)`` returns the loss function (called as ``loss(*args)``, a
    scalar) with each block that should be remat'd passed through ``wrap``: the
    first row ("no remat") uses ``wrap = lambda f: f``, then one row per policy
    with ``wrap = lambda f: remat(f, policy=p)``. A policy may also be given as a
    ``(label, wrap)`` pair, to compare any wrapper (``torch.utils.checkpoint``...).
    The step is the forward pass and ``torch.autograd.grad`` with respect to the
    arguments that require grad. Memory is measured from outside remat:
    ``torch.cuda`` allocator statistics on CUDA, otherwise a census of live tensor
    storages (see :mod:`remat.bench.measure`); time is a median over interleaved
    rounds; recomputed FLOPs are the backward pass's FLOPs minus the baseline's.

    Example:
        >>> import torch
        >>> from remat import memory_report
        >>> def make_loss(wrap):
        ...     block = wrap(lambda w, h: torch.tanh(torch.tanh(h @ w) @ w))
        ...     return lambda w, x: block(w, block(w, x)).pow(2).sum()
        >>> w, x = torch.randn(64, 64, requires_grad=True), torch.randn(32, 64)
        >>> rep = memory_report(make_loss, w, x, policies=["save-nothing"], steps=2)
        >>> [r.label for r in rep.rows]
        ['no remat', 'save-nothing']
        >>> rep.row("save-nothing").retained_bytes < rep.row("no remat").retained_bytes
        True
    """
    if not callable(make_loss):
        raise TypeError(f"memory_report: make_loss must be a function of wrap, got {make_loss!r}")
    if isinstance(policies, str) or callable(policies) or _is_labelled(policies):
        policies = [policies]
    configs = [Config("no remat", _loss_of(make_loss, lambda f: f))]
    for p in policies:
        if _is_labelled(p):
            label, wrap = p
        else:
            label = p if isinstance(p, str) else _fn_name(p)
            wrap = _remat_wrap(remat, p)
        configs.append(Config(label, _loss_of(make_loss, wrap)))
    return MemoryReport(measure(configs, args, steps=steps, warmup=warmup))


_MAKE_LOSS = ("make_loss is a function of one argument, wrap, that returns the loss function: def make_loss(wrap): "
              "block = wrap(my_block); return lambda w, x: block(w, x).sum(); then memory_report(make_loss, w, x)")


def _loss_of(make_loss: Callable[[Callable[..., Any]], Any], wrap: Callable[..., Any]) -> Callable[..., Any]:
    """``make_loss(wrap)``, with an error that says what ``make_loss`` is when it is the loss function itself."""
    try:
        loss = make_loss(wrap)
    except (TypeError, AttributeError) as e:  # (the loss function itself, called with wrap: x.pow on a function)
        raise TypeError(f"memory_report: make_loss(wrap) raised {type(e).__name__}: {e}. {_MAKE_LOSS}.") from e
    if not callable(loss):
        raise TypeError(f"memory_report: make_loss(wrap) returned {type(loss).__name__}, not a function. {_MAKE_LOSS}.")
    return loss  # type: ignore[no-any-return]


def _is_labelled(p: Any) -> bool:
    return isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and callable(p[1])


def _remat_wrap(remat: Any, policy: Any) -> Callable[[Callable[..., Any]], Any]:
    remat(lambda: None, policy=policy)  # validate the policy now, with remat's own error
    return lambda f: remat(f, policy=policy)
