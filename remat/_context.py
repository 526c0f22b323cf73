"""Ambient state of the engine, at the bottom of the imports: which remat call is active, whose ops are running.

Every other module may import this one and it imports none of them, so the
modules above it never need each other for these (see STYLE.md, "Imports go one
way"). Each piece is a ``contextvars.ContextVar``, set and reset by context
managers, so an exception cannot leave it set and threads do not see each
other's.

* :func:`active_context`: the innermost remat context of this thread, a frame in
  its forward pass (``_engine/full.py``'s ``Frame``) or a recompute's capture; nested calls and
  ``checkpoint_name`` look here.
* :data:`INTERNAL` / :func:`internal`: ops run inside are remat's own (a
  detach, a copy), which the dispatch modes let through unrecorded.
* :data:`PENDING_NAME`: set by ``checkpoint_name`` around the ``aten.alias`` that
  carries a name.
* :data:`INSPECTOR`: the observer of a running ``saved_residuals`` (``_inspection/inspect.py``);
  the engine calls its ``on_save(tensor, decision, frame)`` and knows nothing else of it.
* :data:`CACHES` / :func:`own_caches`: the caches of what a function or a module already
  determines (what is learnt per function, the slots of a module tree), weakly keyed so
  that an entry dies with its key; one set for the process unless a body asks for its own.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator
from typing import Any

__all__ = ["INTERNAL", "HOOK_RANGE", "PENDING_NAME", "INSPECTOR", "COMPILED_REGIONS", "ACTIVE", "ROUTES", "internal",
           "active_context", "activated", "CACHES", "Caches", "own_caches"]

INTERNAL: contextvars.ContextVar[bool] = contextvars.ContextVar("remat_internal", default=False)
# NOTE [FSDP's hooks] in _engine/dispatch.py: the profiler range of FSDP2's hook that runs now (its handle, and the token that
# set INTERNAL for it), or None
HOOK_RANGE: contextvars.ContextVar[tuple[Any, Any] | None] = contextvars.ContextVar("remat_hook_range", default=None)
PENDING_NAME: contextvars.ContextVar[str | None] = contextvars.ContextVar("remat_name", default=None)
INSPECTOR: contextvars.ContextVar[Any] = contextvars.ContextVar("remat_inspector", default=None)
# How many remat calls Dynamo is tracing into torch's checkpoint region right now (NOTE [compiled remat] in
# _engine/compiled.py): checkpoint_name tags only inside one. A list, not a ContextVar: Dynamo traces a list's
# mutation as a side effect of the trace, and reads the new value inside the region it speculates.
COMPILED_REGIONS: list[int] = [0]
# the innermost remat context of this thread (active_context(); read as is on hot paths, a frame less)
ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("remat_active", default=None)
# the remat.route_torch_checkpoint blocks open now, in the order they were entered (process-wide, as the routing is:
# NOTE [routing torch's checkpoint] in _api/checkpoint.py)
ROUTES: list[Any] = []


class _Flag:
    """Context manager: a boolean context variable is True for the body (a class: entered on hot paths)."""

    __slots__ = ("var", "value", "was")

    def __init__(self, var: contextvars.ContextVar[Any], value: Any = True) -> None:
        self.var = var
        self.value = value

    def __enter__(self) -> None:
        self.was = self.var.get()
        self.var.set(self.value)

    def __exit__(self, *exc: object) -> None:
        self.var.set(self.was)


def internal() -> _Flag:
    """Context manager: ops run inside are remat's own, not the user's."""
    return _Flag(INTERNAL)


def active_context() -> Any:
    """The innermost remat context of this thread (None outside remat)."""
    return ACTIVE.get()


@contextlib.contextmanager
def activated(ctx: Any) -> Iterator[None]:
    """Make ``ctx`` the active context for the body. (Set inside the ``try``, as every context variable of the library
    is: a ``KeyboardInterrupt`` between a set and its ``try`` would leave it set for the rest of the thread, and
    every later remat call would take a dead call for its enclosing one.)"""
    was = ACTIVE.get()
    try:
        ACTIVE.set(ctx)
        yield
    finally:
        ACTIVE.set(was)


class Caches:
    """What a function or a module tree already determines, computed once and reused, weakly keyed by it.

    * ``learnt``: function (or, for a bound method, its instance) -> what remat learnt about it per policy and
      static arguments (``_engine/signature.py``: whether it enters a ``torch.func`` reverse transform), shared by
      every ``remat`` of it, as JAX caches a trace by the function's identity: ``remat(block, policy=p)(x)``
      written inside a forward pass makes a new wrapper each step and still learns once.
    * ``slots``: root module -> the slots of its tree (``_engine/state.py``), validated on every use.
    * ``devices``: device name -> its measured :class:`~remat.DeviceModel` (``DeviceModel.probe``).
    * ``wrappers``: object (a module, a bound method's instance) -> remat's wrappers that ``remat.checkpoint``'s
      call form made for it, per settings (``_api/checkpoint.py``).
    * ``torch_policies``: a ``context_fn``'s policy function (its id) or set of ops -> the remat policy it was
      translated to, held weakly (``_api/checkpoint.py``).
    * ``answers``: a policy whose answer depends on the op alone (``policies.core.op_only``) -> id(op) -> (the op,
      its decision), asked once (``_engine/trace.py``'s tracer).
    """

    __slots__ = ("learnt", "slots", "devices", "wrappers", "torch_policies", "answers")

    def __init__(self) -> None:
        self.learnt: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()
        self.slots: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self.devices: dict[str, Any] = {}
        self.wrappers: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()
        self.torch_policies: weakref.WeakValueDictionary[Any, Any] = weakref.WeakValueDictionary()
        self.answers: weakref.WeakKeyDictionary[Any, dict[int, Any]] = weakref.WeakKeyDictionary()


# The caches in use: one set for the process (what one thread learnt serves another, as a trace would), unless a
# body runs under own_caches() (a test that must not see what was learnt before it, a server isolating tenants).
# (A mutable default on purpose: every context that sets none shares the process's set.)
CACHES: contextvars.ContextVar[Caches] = contextvars.ContextVar("remat_caches", default=Caches())  # noqa: B039


@contextlib.contextmanager
def own_caches() -> Iterator[Caches]:
    """A fresh, empty set of caches for the body (and the remat'd functions made in it: they keep theirs)."""
    caches = Caches()
    was = CACHES.get()
    try:
        CACHES.set(caches)
        yield caches
    finally:
        CACHES.set(was)
