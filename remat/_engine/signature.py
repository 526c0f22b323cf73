"""What one call of a remat'd function is, for what remat learns across calls: its *signature* (a memory budget's
plans are per signature: NOTE [budget plans] in ``_budgets/budget_policy.py``), and what is learnt per function (whether it
enters a ``torch.func`` reverse transform: NOTE [reentrant region] in ``region.py``), shared by every remat of it."""

from __future__ import annotations

import types
from typing import Any

import torch

from .._context import CACHES
from .state import Snapshot

__all__ = ["signature", "learnt_for", "MAX_KEYS"]

MAX_KEYS = 32  # policies (and static arguments) remembered per function (a new one past this forgets the oldest)

_AUTOCAST = ("cpu", "cuda")


def learnt_for(fn: Any, key: Any) -> dict[str, Any]:
    """What remat learnt about ``fn`` under ``key`` (policy, static_argnums), shared by every remat of it (a
    ``remat(f)`` made anew on every call learns from the calls before it)."""
    if isinstance(fn, types.MethodType):
        owner, key = fn.__self__, (fn.__func__, key)
    else:
        owner = fn
    try:
        hash(key)
        per_owner = CACHES.get().learnt.setdefault(owner, {})  # (Caches.learnt: keyed weakly by the function)
    except TypeError:  # an unhashable policy, or an owner that takes no weak reference: its own
        return {}
    learnt = per_owner.get(key)
    if learnt is None:
        if len(per_owner) >= MAX_KEYS:  # (a policy made anew on every call: remat(f, policy=lambda ...))
            per_owner.pop(next(iter(per_owner)))
        learnt = per_owner[key] = {}
    return learnt


def signature(flat: list[Any], statics: dict[int, Any], state: Snapshot) -> tuple[Any, ...] | None:
    """The call's pytree leaves (a tensor by shape, dtype, device and requires_grad; a number by value; anything
    else by its type), its static arguments, the shapes of the module state it reads, the modules' ``training``
    flags and the autocast state; None for an input of a tensor subclass."""
    parts: list[Any] = []
    for a in flat:
        if isinstance(a, torch.Tensor):
            if type(a) is not torch.Tensor and type(a) is not torch.nn.Parameter:
                return None
            parts.append((a.shape, a.dtype, a.device, a.requires_grad))
        else:
            parts.append(_leaf_key(a))
    for i in sorted(statics):
        parts.append(_leaf_key(statics[i]))
    for t in state.tensors:
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            return None
        parts.append((t.shape, t.dtype, t.device, t.requires_grad))
    parts.append(tuple(m.training for m in state.modules))
    parts.append(tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST))
    return tuple(parts)


_VALUE_TYPES = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device)


def _leaf_key(a: Any) -> Any:
    """A value by value; anything else by its type, never held: an object made anew on every call (a key/value cache,
    a mask object) is the same signature each call, which an identity would make a new one each time (a budget then
    measured every call, and its measuring call's re-run raised on every call where it could not serve). A plan
    followed where another object of the type makes other ops keeps nothing from the first op it does not know
    (``_Planned``): less, never more."""
    if isinstance(a, _VALUE_TYPES) or (type(a) is tuple and all(isinstance(x, _VALUE_TYPES) for x in a)):
        return (type(a), a)
    return ("type", type(a))
