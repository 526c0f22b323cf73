"""``checkpoint_name``: tag a value so that name policies can see it."""

from __future__ import annotations

import functools
from typing import Any, TypeVar

import optree
import torch

from .. import _torch_internals as ti
from .._context import COMPILED_REGIONS, INSPECTOR, PENDING_NAME, active_context

__all__ = ["checkpoint_name"]

T = TypeVar("T")


def checkpoint_name(x: T, name: str) -> T:
    """Return ``x`` unchanged, tagged with ``name`` for the policies of the enclosing ``remat``.

    ``x`` may be a tensor or a pytree of tensors. Inside a ``remat``'d function a
    policy sees the tag as a call whose ``op`` is ``checkpoint_name`` itself, with
    the name in ``kwargs["name"]``, and decides for the tagged value alone:
    :func:`remat.policies.save_only_these_names` keeps it,
    :func:`remat.policies.save_anything_except_these_names` drops it. Outside
    ``remat`` it does nothing (:func:`remat.saved_residuals` still shows the name,
    as JAX's does). Works under every ``torch.func`` transform: the tag
    is an ``aten.alias`` seen by remat's dispatch mode below the functorch layers.

    Args:
        x: a tensor or a pytree whose leaves are tensors (other leaves pass through).
        name: the name policies match on.

    Returns:
        ``x`` itself.

    Example:
        >>> import torch
        >>> from remat import remat, checkpoint_name, policies
        >>> @remat(policy=policies.save_only_these_names("hidden"))
        ... def f(x):
        ...     h = checkpoint_name(torch.tanh(x), "hidden")
        ...     return (h * h).sum()
        >>> x = torch.randn(4, requires_grad=True)
        >>> f(x).backward()
        >>> torch.allclose(x.grad, 2 * torch.tanh(x) * (1 - torch.tanh(x) ** 2))
        True
    """
    if not isinstance(name, str):
        raise TypeError(f"checkpoint_name: name must be a string, got {name!r} ({type(name).__name__})")
    if ti.is_compiling():
        if not COMPILED_REGIONS[0]:
            return x  # compiled code outside a remat'd function: nothing to tag, as in eager mode
        return optree.tree_map(functools.partial(_annotated_alias, name), x,  # type: ignore[arg-type,return-value]
                               none_is_leaf=True)
    if active_context() is None and INSPECTOR.get() is None:
        return x  # outside remat, and not listed by saved_residuals: nothing to tag
    if isinstance(x, torch.Tensor):
        return _tag(name, x)  # type: ignore[return-value]  # (one tensor, the common case: no tree to map)
    return optree.tree_map(functools.partial(_tag, name), x,  # type: ignore[arg-type,return-value]
                           none_is_leaf=True)


def _tag(name: str, leaf: Any) -> Any:
    """Run the name's ``aten.alias`` of a tensor leaf, seen by remat's modes with the name pending; return the leaf.

    The alias is only the name's carrier (a name decides for the op that made the value, NOTE [names decide for
    the value]): the caller gets the tensor itself, as outside ``remat``, so that an in-place view op on it
    (``n.t_()``, ``n.unsqueeze_(0)``, ``n.detach_()``) changes the tensor it named, as in plain code."""
    if not isinstance(leaf, torch.Tensor):
        return leaf
    was = PENDING_NAME.get()
    try:
        PENDING_NAME.set(name)
        _ALIAS(leaf)
    finally:
        PENDING_NAME.set(was)
    return leaf


_ALIAS = torch.ops.aten.alias.default


def _annotated_alias(name: str, leaf: Any) -> Any:
    """Under torch.compile: an exact copy whose node carries the name (NOTE [compiled remat] in _engine/compiled.py)."""
    if not isinstance(leaf, torch.Tensor):
        return leaf
    with ti.annotate_name(name):
        if leaf.dtype is not torch.bool and not leaf.is_complex():
            return torch.ops.aten.mul(leaf, 1)  # exact; inductor removes a clone before the partitioner sees it
        return torch.ops.aten.clone(leaf)
