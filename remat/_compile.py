"""torch.compile: a remat call that Dynamo traces becomes torch's checkpoint region, decided by the same policy.

NOTE [compiled remat]: remat's eager engine (saved-tensor hooks, a dispatch mode
recording each op) cannot be traced: Dynamo does not compile while a Python
dispatch mode is on the stack, and the hooks would run once, at trace time. So
when ``torch.compile`` traces a remat'd function, the call lowers instead to
``torch.utils.checkpoint.checkpoint(fn, ..., context_fn=...)``, which Dynamo turns
into its activation-checkpoint higher-order op. The context is torch's
selective checkpointing, with remat's policy translated per ATen op by
:class:`CompiledPolicy`:

* ``Saveable`` → ``MUST_SAVE``; ``Recompute`` → ``PREFER_RECOMPUTE``. The
  partitioner then keeps exactly the saved values between the compiled forward
  and backward graphs and recomputes the rest, fused into the backward kernels.
* ``checkpoint_name``: traced as an ``aten.alias`` annotated with its name
  (``_torch_internals.annotate_name``); the policy sees it as a
  ``checkpoint_name`` call, as in eager mode.
* ``Offloadable``: a compiled graph has no place to move a value to another
  device and back, so the value is recomputed instead, with a one-time warning.
* Random ops (dropout): the partitioner never recomputes them; their outputs
  are saved whatever the policy says, so gradients stay exact.

The policy is called while AOTAutograd traces the region, with fake tensors:
policies that look at shapes, dtypes and ops work; one that reads values
cannot, and torch raises when it tries.

One difference from eager remat (as in JAX): a name whose policy answers the
explicit ``Recompute`` does not override the decision for the op that computed
the value (NOTE [names decide for the value] in ``_policies.py``); the compiled
policy decides per op, and the op came first.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from . import _torch_internals as ti
from ._naming import checkpoint_name
from ._policies import Offloadable, Saveable, decide_explicit

__all__ = ["CompiledPolicy", "compiled_call", "context_fn"]

_NAME_OPS = (torch.ops.aten.mul.Tensor, torch.ops.aten.clone.default)  # see _naming._annotated_alias
_CHECKPOINT_KWARGS = frozenset({"use_reentrant", "context_fn", "preserve_rng_state", "determinism_check", "debug"})


_WARNED: set[str] = set()  # policies already warned about offloading under torch.compile (by repr)


class CompiledPolicy:
    """remat's ``policy(op, *args, **kwargs)`` as a torch selective-checkpoint policy ``(ctx, op, *args, **kwargs)``.

    Example:
        >>> import torch
        >>> from torch.utils.checkpoint import CheckpointPolicy
        >>> from remat._compile import CompiledPolicy
        >>> p = CompiledPolicy(lambda op, *a, **k: op is torch.ops.aten.mm.default)
        >>> p(None, torch.ops.aten.mm.default, torch.ones(2, 2), torch.ones(2, 2)) is CheckpointPolicy.MUST_SAVE
        True
    """

    def __init__(self, policy: Callable[..., Any]) -> None:
        self.policy = policy

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        name = ti.annotated_name() if op in _NAME_OPS else None
        if name is not None:
            decision, _ = decide_explicit(self.policy, checkpoint_name, args[:1], {"name": name})
        else:
            decision, _ = decide_explicit(self.policy, op, args, kwargs)
        if decision is Saveable:
            return CheckpointPolicy.MUST_SAVE
        if isinstance(decision, Offloadable) and repr(self.policy) not in _WARNED:
            _WARNED.add(repr(self.policy))
            warnings.warn(
                f"remat: policy {getattr(self.policy, '__name__', self.policy)!r} offloads {op} under "
                "torch.compile, where a compiled graph cannot move values to another device and back; "
                "remat recomputes them instead. Offload outside the compiled region, or choose a policy "
                "that saves or recomputes.", stacklevel=2)
        return CheckpointPolicy.PREFER_RECOMPUTE

    def __repr__(self) -> str:
        return f"CompiledPolicy({self.policy!r})"


def _contexts(spec: Any) -> Any:
    return create_selective_checkpoint_contexts(CompiledPolicy(_build(spec)))


def context_fn(policy: Callable[..., Any]) -> Callable[[], Any]:
    """The ``context_fn`` for ``torch.utils.checkpoint`` that applies ``policy``.

    Dynamo takes a ``context_fn`` only as a function or as a ``functools.partial`` whose
    arguments it can turn into constants, and it cannot rebuild a dataclass instance
    made during its trace (``remat(block, policy=policies.save_only_these_names("attn"))``
    written inside ``forward``). So the partial carries a spec of the policy made of
    constants (functions, classes, strings, numbers, tuples), rebuilt when AOTAutograd
    traces the region."""
    return functools.partial(_contexts, _spec(policy))


_DATACLASS, _FROZENSET = "remat:dataclass", "remat:frozenset"


def _spec(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = tuple((f.name, _spec(getattr(value, f.name))) for f in dataclasses.fields(value))
        return (_DATACLASS, type(value), fields)
    if isinstance(value, frozenset):
        return (_FROZENSET, tuple(sorted(value)))
    if isinstance(value, tuple):
        return tuple(_spec(v) for v in value)
    return value


def _build(spec: Any) -> Any:
    if isinstance(spec, tuple) and spec and spec[0] == _DATACLASS:
        obj = object.__new__(spec[1])  # the fields as they were: no __init__ to run again
        for name, value in spec[2]:
            object.__setattr__(obj, name, _build(value))
        return obj
    if isinstance(spec, tuple) and spec and spec[0] == _FROZENSET:
        return frozenset(spec[1])
    if isinstance(spec, tuple):
        return tuple(_build(v) for v in spec)
    return spec


def compiled_call(fn: Callable[..., Any], ctx_fn: Callable[[], Any], preserve_rng: bool, *args: Any,
                  **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` as a checkpoint region of the program Dynamo is tracing."""
    if kwargs and not _CHECKPOINT_KWARGS.isdisjoint(kwargs):
        fn = functools.partial(fn, **kwargs)  # names torch.utils.checkpoint would take as its own
        kwargs = {}
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=ctx_fn,
                                             preserve_rng_state=preserve_rng, **kwargs)
