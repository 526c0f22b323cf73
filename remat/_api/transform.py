"""The ``remat`` transform: wrap a function so that its activations are not kept between forward and backward."""

from __future__ import annotations

import functools
import inspect
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, overload

from torch import nn

from .. import _torch_internals as ti
from .._engine.compiled import compiled_call, context_fn
from .._engine.select import call
from .._engine.signature import learnt_for
from .._engine.state import brief_name
from .._errors import brief_repr
from .._policies.core import is_remat_policy, resolve_policy

__all__ = ["remat", "Rematted"]

F = TypeVar("F", bound=Callable[..., Any])


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
            leaves are tensors or plain values. Under plain autograd its Python
            runs once: the recompute replays the ATen ops its forward pass ran
            (docs/how-it-works.md, "Replay, don't re-run"), so Python state it
            reads may change before the backward pass. Under ``torch.func``
            transforms it runs once too: the recompute replays the torch calls
            the forward pass made, on the transform's rebuilt levels. With
            ``debug=True`` (or tensor subclasses) the recompute runs it again,
            checked op by op: it must then do the same work, or remat raises.
        policy: a policy from :mod:`remat.policies`, any callable
            ``policy(op, *args, **kwargs)``, or one of the strings
            ``"save-nothing"`` (the default), ``"save-everything"``,
            ``"save-matmuls"``, ``"offload-to-cpu"``.
        static_argnums: positions of arguments passed through untouched (not
            treated as pytrees of tensors), such as flags or modules.
        preserve_rng_state: the recompute sees exactly the random numbers the
            forward pass saw (CPU and every CUDA device in use). The replay puts
            back each draw's generator state whatever this says (it costs
            nothing when nothing is drawn); off, a re-run (``debug=True``) skips
            the copy of the generators' states at the start of each call.
        debug: run every call on the re-run engine, which runs the function
            again in the recompute and checks that every op and its Python
            numbers are the same as in the forward pass (a function whose
            Python state changed raises instead of being replayed). It also
            hashes the inputs and module state when the forward pass ends and
            refuses a recompute from values written since through ``.data``,
            which no version counter shows (NOTE [values between the passes]).
            Use it to find a function that is not pure.

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
            f"remat: expected a function to wrap, got {brief_repr(fn)}; write "
            "remat(f, policy=...) or use @remat(policy=...) as a decorator."
        )
    if is_remat_policy(fn):
        raise TypeError(
            f"remat: {brief_repr(fn)} is a policy, passed where the function to wrap goes: name it, "
            "remat(f, policy=...) or @remat(policy=...) as a decorator."
        )
    if inspect.isgeneratorfunction(fn) or inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        raise TypeError(
            f"remat: {brief_name(fn)} is a generator (or async) function: calling it returns before its ops run, so "
            "they would run later, outside remat, and nothing would be rematerialized. Remat the function that "
            "computes each value instead (the body of the loop), or collect the values in a list inside it."
        )
    if ti.is_compiled_callable(fn):
        parts = ti.compiled_parts(fn)
        if parts is not None:
            # remat(torch.compile(f)) means torch.compile(remat(f)), with the same backend and options: remat cannot
            # see inside compiled code, and under torch.compile remat lowers to torch's checkpoint region, which the
            # compiler honours (NOTE [compiled remat] in _engine/compiled.py)
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
        # global state Dynamo would have to replay), only the compiled call (NOTE [compiled remat] in _engine/compiled.py)
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
        self._policy = policy
        self.static_argnums = statics
        self.preserve_rng_state = preserve_rng_state
        self.debug = debug
        self._name = brief_name(fn)
        # what is learnt about fn (whether it runs as a reentrant region: NOTE [reentrant region] in
        # _engine/region.py), shared with every remat of fn with this policy
        self._learnt: dict[str, Any] = learnt_for(fn, (policy, statics))
        self._context_fn = context_fn(policy)  # under torch.compile (NOTE [compiled remat] in _engine/compiled.py)
        functools.update_wrapper(self, fn, updated=())

    @property
    def policy(self) -> Callable[..., Any]:
        """The policy: set it as ``remat(..., policy=)`` takes it (a string shortcut, a callable, None)."""
        return self._policy

    @policy.setter
    def policy(self, policy: Any) -> None:
        self._policy = resolve_policy(policy)
        self._learnt = learnt_for(self.__remat_target__, (self._policy, self.static_argnums))
        self._context_fn = context_fn(self._policy)
        self.__dict__.pop("_inner", None)  # (remat(module)'s call of its forward, made with the policy before)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name in ("debug", "preserve_rng_state", "static_argnums"):
            self.__dict__.pop("_inner", None)  # (remat(module)'s call of its forward, made with the settings before)

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
        out = call(target, self._name, self.policy, statics, self.preserve_rng_state, args, kwargs, self)
        if isinstance(out, (types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType)):
            # (a callable object whose __call__ is a generator function, a function returning one: not known before)
            getattr(out, "close", lambda: None)()  # (an async generator has aclose: unstarted, nothing to do)
            raise TypeError(
                f"remat: {self._name} returned a {type(out).__name__}: its body runs when it is iterated, after the "
                "call, outside remat, and nothing of it would be rematerialized. Return the values (a list) instead, "
                "or remat the function that computes each value (the body of the loop)."
            )
        return out

    def _call_module(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``remat(module)(x)``: the module's hooks run once, outside the remat'd region, as under
        :func:`remat.remat_module` (FSDP2's unshard/reshard hooks, DDP's, users' hooks that record
        activations); only ``forward`` is rematerialized, for the duration of this call."""
        own = module.__dict__.get("forward", _MISSING)
        inner = self.__dict__.get("_inner")
        if inner is None or inner.__remat_target__ != module.forward:
            # kept across calls: it holds what is learnt about the forward method
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
