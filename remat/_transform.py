"""The ``remat`` transform: wrap a function so that its activations are not kept between forward and backward."""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, overload

import optree
import torch
from torch import nn

from . import _torch_internals as ti
from ._budget import MemoryBudget
from ._compile import compiled_call, context_fn
from ._context import INSPECTOR, active_context
from ._errors import RematError
from ._fastpath import MAX_PLANS, FastFrame, Plan, fast_path_applies, plans_for, signature
from ._hooks import Frame
from ._offload import default_engine
from ._policies import resolve_policy
from ._recompute import call_nested_replay
from ._reentrant import NeedsRegion, enclosed, run_region
from ._state import brief_name, snapshot

__all__ = ["remat", "checkpoint", "Rematted"]

F = TypeVar("F", bound=Callable[..., Any])


class _Static:
    """Placeholder for a static argument inside the flattened pytree of dynamic ones."""

    __slots__ = ()


_STATIC = _Static()
_MISSING = object()


@overload
def remat(fn: F, *, policy: Any = None, static_argnums: int | Sequence[int] = (),
          preserve_rng_state: bool = True, debug: bool = False) -> F: ...
@overload
def remat(fn: None = None, *, policy: Any = None, static_argnums: int | Sequence[int] = (),
          preserve_rng_state: bool = True, debug: bool = False) -> Callable[[F], F]: ...


def remat(fn: Any = None, *, policy: Any = None, static_argnums: int | Sequence[int] = (),
          preserve_rng_state: bool = True, debug: bool = False) -> Any:
    """Rematerialize: keep less between the forward and the backward pass, recompute the rest.

    ``remat(f, policy=p)`` returns a function with the same results and the same
    gradients as ``f``. Autograd normally keeps every tensor the backward pass
    needs; under ``remat`` the policy decides for each op of ``f`` whether its
    outputs are kept, dropped and recomputed when the backward pass first needs
    them, or offloaded to another device. The default keeps only the inputs.
    Works like ``jax.checkpoint``, under plain autograd (``.backward()``,
    ``torch.autograd.grad``, double backward) and under every ``torch.func``
    transform (``grad``, ``vjp``, ``jacrev``, ``jacfwd``, ``hessian``, ``jvp``,
    ``vmap`` and their nestings), and nests inside itself.

    Args:
        fn: the function. Its arguments and results are pytrees (``optree``) whose
            leaves are tensors or plain values. It must be pure: the recompute
            runs it again on the same inputs and must do the same work.
        policy: a policy from :mod:`remat.policies`, any callable
            ``policy(op, *args, **kwargs)``, or one of the strings
            ``"save-nothing"`` (the default), ``"save-everything"``,
            ``"save-matmuls"``, ``"offload-to-cpu"``.
        static_argnums: positions of arguments passed through untouched (not
            treated as pytrees of tensors), such as flags or modules.
        preserve_rng_state: the recompute sees exactly the random numbers the
            forward pass saw (CPU and every CUDA device in use). Turn off only
            for functions that draw no random numbers, to save the state copy.
        debug: run every call on the full engine, which records each op and checks
            in the recompute that every op and its Python numbers are the same.
            By default only the first call of each input signature does; later
            calls follow the plan it recorded, checking the saved tensors' count,
            shapes, dtypes and producing ops (NOTE [fast path] in
            ``remat/_fastpath.py``). Use it to find a function that is not pure.

    Returns:
        The wrapped function, with ``fn``'s name and docstring. Used bare
        (``@remat``) or with arguments (``@remat(policy=...)``).

    Raises:
        TypeError, ValueError: for a non-callable, an unknown policy or bad
            ``static_argnums``.
        RematError: when a policy returns something that is not a decision, when
            the recompute diverges from the forward pass, or when an input is
            modified in place between the forward and the backward pass.

    Example:
        >>> import torch
        >>> from remat import remat
        >>> @remat(policy="save-matmuls")
        ... def block(W, x):
        ...     return torch.tanh(x @ W).sum()
        >>> W = torch.randn(4, 4, requires_grad=True)
        >>> block(W, torch.randn(2, 4)).backward()
        >>> W.grad.shape
        torch.Size([4, 4])
    """
    if fn is None:
        return functools.partial(
            remat, policy=policy, static_argnums=static_argnums, preserve_rng_state=preserve_rng_state,
            debug=debug,
        )
    if not callable(fn):
        raise TypeError(
            f"remat: expected a function to wrap, got {fn!r} ({type(fn).__name__}); write "
            "remat(f, policy=...) or use @remat(policy=...) as a decorator."
        )
    if ti.is_compiled_callable(fn):
        parts = ti.compiled_parts(fn)
        if parts is not None:
            # remat(torch.compile(f)) means torch.compile(remat(f)), with the same backend and options: remat cannot
            # see inside compiled code, and under torch.compile remat lowers to torch's checkpoint region, which the
            # compiler honours (NOTE [compiled remat] in _compile.py)
            orig, recompile = parts
            return recompile(remat(orig, policy=policy, static_argnums=static_argnums,
                                   preserve_rng_state=preserve_rng_state, debug=debug))
        raise TypeError(
            f"remat: {brief_name(fn)} was compiled by torch.compile, and remat cannot see inside compiled code "
            "(it would run eagerly, or keep everything). Compile outside remat instead: "
            "torch.compile(remat(f, policy=...)), or remat_module(block, policy=...) before "
            "torch.compile(model). Under torch.compile, remat lowers to torch's checkpoint region and the "
            "compiler honours the policy (docs/transforms.md, 'torch.compile')."
        )
    pol = resolve_policy(policy)
    statics = _normalize_argnums(static_argnums)
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(f"remat: preserve_rng_state must be True or False, got {preserve_rng_state!r}")
    if not isinstance(debug, bool):
        raise TypeError(f"remat: debug must be True or False, got {debug!r}")
    if ti.is_compiling():
        # remat(block, policy=...) written inside a function Dynamo traces: no Rematted (its plan cache is
        # global state Dynamo would have to replay), only the compiled call (NOTE [compiled remat] in _compile.py)
        return functools.partial(compiled_call, fn, context_fn(pol), preserve_rng_state)
    return Rematted(fn, pol, statics, preserve_rng_state, debug)


class Rematted:
    """What :func:`remat` returns: the function, rematerialized.

    A callable object rather than a closure so that it survives ``copy.deepcopy``
    and pickling (``torch.save(model)`` after ``block.forward = remat(block.forward)``:
    the copy's forward runs the copy's module) and binds like a function when
    used as a method decorator. ``__wrapped__`` is the original function, so
    ``inspect.signature`` sees its signature.
    """

    def __init__(self, fn: Callable[..., Any], policy: Callable[..., Any], statics: tuple[int, ...],
                 preserve_rng_state: bool, debug: bool = False) -> None:
        self.__remat_target__ = fn
        self.policy = policy
        self.static_argnums = statics
        self.preserve_rng_state = preserve_rng_state
        self.debug = debug
        self._name = brief_name(fn)
        self._region = False  # runs as a reentrant region (NOTE [reentrant region] in _reentrant.py)
        # signature -> plan (NOTE [fast path] in _fastpath.py), shared with every remat of fn with this policy
        self._plans: dict[Any, Plan | None] = plans_for(fn, (policy, statics))
        self._context_fn = context_fn(policy)  # under torch.compile (NOTE [compiled remat] in _compile.py)
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        target = self.__remat_target__
        if ti.is_compiling():  # Dynamo is tracing this call: torch's checkpoint region, with this policy
            return compiled_call(target, self._context_fn, self.preserve_rng_state, *args, **kwargs)
        if isinstance(target, nn.Module):
            return self._call_module(target, args, kwargs)
        statics = self.static_argnums
        while isinstance(target, functools.partial):
            # a partial's tensors are inputs of the call like the arguments (held, re-wrapped for levels)
            n = len(target.args)
            statics = tuple(i + n if i >= 0 else i for i in statics)
            args, kwargs = (*target.args, *args), {**target.keywords, **kwargs}
            target = target.func
        return _call(target, self._name, self.policy, statics, self.preserve_rng_state, args, kwargs, self)

    def _call_module(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``remat(module)(x)``: the module's hooks run once, outside the remat'd region, as under
        :func:`remat.remat_module` (FSDP2's unshard/reshard hooks, DDP's, users' hooks that record
        activations); only ``forward`` is rematerialized, for the duration of this call."""
        own = module.__dict__.get("forward", _MISSING)
        inner = self.__dict__.get("_inner")
        if inner is None or inner.__remat_target__ != module.forward:
            # kept across calls: it holds the fast-path plans (NOTE [fast path] in _fastpath.py)
            inner = self._inner = Rematted(module.forward, self.policy, self.static_argnums, self.preserve_rng_state,
                                           self.debug)
            inner._name = f"{self._name}.forward"
        module.__dict__["forward"] = inner
        try:
            return module(*args, **kwargs)
        finally:
            if own is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.__dict__["forward"] = own

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self if obj is None else types.MethodType(self, obj)

    def __repr__(self) -> str:
        return f"remat({self._name}, policy={getattr(self.policy, '__name__', self.policy)!r})"

    def __reduce__(self) -> Any:
        # a decorated module-level function pickles by reference, as the function would
        mod = sys.modules.get(getattr(self, "__module__", None) or "")
        obj: Any = mod
        for part in (getattr(self, "__qualname__", "") or "").split("."):
            obj = getattr(obj, part, None)
        if obj is self:
            return str(self.__qualname__)  # type: ignore[attr-defined]
        return (Rematted, (self.__remat_target__, self.policy, self.static_argnums, self.preserve_rng_state,
                           self.debug))


checkpoint = remat
remat.checkpoint = remat  # type: ignore[attr-defined]


def _normalize_argnums(static_argnums: Any) -> tuple[int, ...]:
    if isinstance(static_argnums, int) and not isinstance(static_argnums, bool):
        return (static_argnums,)
    try:
        nums = tuple(static_argnums)
    except TypeError:
        nums = None
    if nums is None or not all(isinstance(i, int) and not isinstance(i, bool) for i in nums):
        raise TypeError(
            f"remat: static_argnums must be an int or a sequence of ints, got {static_argnums!r}"
        )
    return nums


def _call(fn: Callable[..., Any], name: str, policy: Callable[..., Any], statics: tuple[int, ...],
          preserve_rng: bool, args: tuple[Any, ...], kwargs: dict[str, Any], owner: Any = None) -> Any:
    n = len(args)
    static_pos = set()
    for i in statics:
        j = i + n if i < 0 else i
        if not 0 <= j < n:
            raise ValueError(
                f"remat: static_argnums={statics} names argument {i}, but {name} was called with "
                f"{n} positional arguments."
            )
        static_pos.add(j)
    dyn = tuple(_STATIC if i in static_pos else a for i, a in enumerate(args))
    flat: list[Any]
    flat, spec = optree.tree_flatten((dyn, kwargs), none_is_leaf=True)  # type: ignore[arg-type]

    # run must not close over args: the frame holds run until the backward pass, and the
    # tensors in args (which a nested call hands to its parent to drop) would stay alive
    static_vals = {i: args[i] for i in static_pos}

    def run(leaves: list[Any]) -> Any:
        dargs, kw = optree.tree_unflatten(spec, leaves)
        full = tuple(static_vals[i] if i in static_vals else a for i, a in enumerate(dargs))
        return fn(*full, **kw)

    if not torch.is_grad_enabled() and not ti.interpreter_stack():
        return run(flat)  # nothing will be saved: no frame needed
    region = owner is not None and owner._region
    ctx = active_context()
    if ctx is not None and not isinstance(ctx, Frame) and not region:
        return call_nested_replay(ctx, run, flat)  # an outer recompute re-runs this call
    # NOTE [state is an input]: what fn reads besides its arguments, held like them
    state = snapshot(fn, [a for a in flat if not isinstance(a, torch.Tensor)] + list(static_vals.values()))
    outermost = not enclosed()
    frame: Any = None
    key = None
    if owner is not None and not owner.debug and not region and ctx is None and fast_path_applies():
        key = signature(flat, static_vals, state)  # NOTE [fast path] in _fastpath.py
    budget, measuring, call_policy = None, None, policy
    if isinstance(policy, MemoryBudget):  # NOTE [memory budget] in _budget.py: decided per signature
        budget = policy
        # per function (its code: identical blocks share a plan) and signature, with the torch.func levels
        code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__func__", None), "__code__", None)
        bkey = (code or type(fn), signature(flat, static_vals, state),
                tuple(str(i.key()) for i in ti.interpreter_stack()))
        call_policy, measuring, fast = budget.bind(bkey)
        if region:
            # a function that enters a torch.func reverse transform runs as a reentrant region every time: it saves
            # nothing (the measuring policy), and never gets a plan (docs/budgets.md)
            measuring = None
        if measuring is not None or not fast:
            key = None  # measuring (it saves nothing): no fast-path plan from it; value-dependent sizes: none
    try:
        if region:
            return run_region(run, flat, name, call_policy, preserve_rng, state)
        if measuring is not None:
            frame = Frame(run, flat, name, call_policy, preserve_rng, default_engine(), state)
            measuring.frame = frame
            tok = INSPECTOR.set(measuring)
            try:
                out = frame.forward()
            finally:
                INSPECTOR.reset(tok)
            assert budget is not None
            budget.learn(bkey, call_policy, measuring, frame.recorder.ops)
            return out
        plan = owner._plans.get(key) if key is not None else None
        if plan is not None:
            frame = FastFrame(run, flat, name, preserve_rng, state, plan, lambda: owner._plans.__setitem__(key, None),
                              default_engine())
            return frame.forward()
        frame = Frame(run, flat, name, call_policy, preserve_rng, default_engine(), state)
        if key is not None and key not in owner._plans:
            plans = owner._plans
            frame.record_plan(lambda: plans.__setitem__(key, None))
        out = frame.forward()
        if key is not None and key not in owner._plans:
            if len(owner._plans) >= MAX_PLANS:
                owner._plans.pop(next(iter(owner._plans)))
            owner._plans[key] = frame.plan  # None: not clean, the full engine every time
        return out
    except NeedsRegion as e:
        # NOTE [reentrant region]: fn (or a remat'd function it calls) enters a torch.func reverse transform
        if frame is not None and e.origin is frame:
            if owner is None:  # (every remat call has its Rematted; a module's forward too)
                raise RematError(f"remat: {name} enters a torch.func reverse transform; this is a bug in remat, "
                                 "please report it") from e.cause
            owner._region = True
        if not outermost:
            raise  # the enclosing calls recorded the attempt: the outermost remat call runs again
        if frame is not None:
            frame.rewind()
        elif e.rewind is not None:
            e.rewind()
    return _call(fn, name, policy, statics, preserve_rng, args, kwargs, owner)

