"""``checkpoint_name``: tag a value so that name policies can see it."""

from __future__ import annotations

import functools
from typing import Any, TypeVar

import optree
import torch

from . import _torch_internals as ti
from ._context import ACTIVE, COMPILED_REGIONS, INSPECTOR, NAMING, PENDING_NAME, active_context

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
        ``x``, with the same values (tensors as aliases that share memory).

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
    planned = NAMING.get() if not torch.compiler.is_dynamo_compiling() else False  # (Dynamo cannot trace .get)
    if (type(planned) is not bool and planned is not None and type(x) is torch.Tensor and type(name) is str
            and ACTIVE.get() is None and INSPECTOR.get() is None and planned.skip_name()):
        # a planned call's mode lets this tag go (NOTE [skipped tags] in _engine/planned.py), asked first and in few
        # frames: the hot path of a tagged function's planned calls, where each frame costs 0.3-0.7 us (its code is
        # cold between the ops around it). A planned call runs in eager mode only.
        return x
    if not isinstance(name, str):
        raise TypeError(f"checkpoint_name: name must be a string, got {name!r} ({type(name).__name__})")
    if ti.is_compiling():
        if not COMPILED_REGIONS[0]:
            return x  # compiled code outside a remat'd function: nothing to tag, as in eager mode
        return optree.tree_map(functools.partial(_annotated_alias, name), x,  # type: ignore[arg-type,return-value]
                               none_is_leaf=True)
    if active_context() is None and INSPECTOR.get() is None:
        if not planned:
            return x  # outside remat, and not listed by saved_residuals: nothing to tag
        if planned is True:
            planned = None  # (else a planned call's mode, which may let the tag go: NOTE [skipped tags] in _engine/planned.py)
    else:
        planned = None
    if isinstance(x, torch.Tensor):
        return _tag(name, planned, x)  # type: ignore[return-value]  # (one tensor, the common case: no tree to map)
    return optree.tree_map(functools.partial(_tag, name, planned), x,  # type: ignore[arg-type,return-value]
                           none_is_leaf=True)


def _tag(name: str, planned: Any, leaf: Any) -> Any:
    """The name's ``aten.alias`` of a tensor leaf, seen by remat's dispatch mode with the name pending; or the leaf
    itself where a planned call's mode lets the tag go."""
    if not isinstance(leaf, torch.Tensor):
        return leaf
    if planned is not None and planned.skip_name():
        return leaf
    tok = PENDING_NAME.set(name)
    try:
        return _ALIAS(leaf)
    finally:
        PENDING_NAME.reset(tok)


_ALIAS = torch.ops.aten.alias.default


def _annotated_alias(name: str, leaf: Any) -> Any:
    """Under torch.compile: an exact copy whose node carries the name (NOTE [compiled remat] in _engine/compiled.py)."""
    if not isinstance(leaf, torch.Tensor):
        return leaf
    with ti.annotate_name(name):
        if leaf.dtype is not torch.bool and not leaf.is_complex():
            return torch.ops.aten.mul(leaf, 1)  # exact; inductor removes a clone before the partitioner sees it
        return torch.ops.aten.clone(leaf)
