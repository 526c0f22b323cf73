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
* ``checkpoint_name``: inside a compiled remat region, traced as ``x * 1`` (a
  copy, exact) annotated with its name (``_torch_internals.annotate_name``); the
  policy sees it as a ``checkpoint_name`` call, as in eager mode. Not an alias or
  a clone: inductor removes those before its partitioner sees the decision. Bool
  and complex values are cloned, so under inductor their names are not seen.
* ``Offloadable`` (to ``"cpu"``) → ``MUST_CPU_OFFLOAD`` while the call that
  compiles runs inside ``remat.offload.compiled_offloading()``: that turns on
  torch's compile-time activation offloading (the partitioner's pass in torch 2.11 to 2.13,
  functorch's ``_activation_offloading``) and hooks the joint graph
  (``_torch_internals.activation_offloading``) to mark those nodes saved and
  ``should_offload``, which is all the pass reads; the forward graph then copies
  them to the host (``prims.device_put``) and the backward graph back. A value
  on another device than the decision's ``src``, or under its ``min_bytes``, is
  saved, as in eager mode; torch's pass keeps views, non-contiguous values and
  graph outputs on the device. Outside that context, on a torch without the
  pass, or to another ``dst``, the value is recomputed instead, with a warning
  once per traced region saying which.
* Random ops (dropout): the partitioner never recomputes them; their outputs
  are saved whatever the policy says, so gradients stay exact.

The policy is called while AOTAutograd traces the region, with fake tensors:
policies that look at shapes, dtypes and ops work; one that reads values
cannot, and torch raises when it tries.

One difference from eager remat (as in JAX): a name whose policy answers the
explicit ``Recompute`` does not override the decision for the op that computed
the value (NOTE [names decide for the value] in ``_policies/core.py``); the compiled
policy decides per op, and the op came first.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from .. import _torch_internals as ti
from .._budgets.budget_policy import MemoryBudget
from .._context import COMPILED_REGIONS
from .._errors import RematError
from .._policies.core import Offloadable, Saveable, decide_explicit
from .._policies.naming import checkpoint_name

__all__ = ["CompiledPolicy", "compiled_call", "context_fn"]

_NAME_OPS = (torch.ops.aten.mul.Tensor, torch.ops.aten.clone.default)  # see _naming._annotated_alias
_CHECKPOINT_KWARGS = frozenset({"use_reentrant", "context_fn", "preserve_rng_state", "determinism_check", "debug"})




def _nbytes(outs: list[torch.Tensor]) -> int | None:
    """The bytes of traced outputs, None when a size is symbolic (dynamic shapes)."""
    try:
        return sum(int(t.nbytes) for t in outs)
    except (RuntimeError, TypeError):
        return None


class CompiledPolicy:
    """remat's ``policy(op, *args, **kwargs)`` as a torch selective-checkpoint policy ``(ctx, op, *args, **kwargs)``.

    Example:
        >>> import torch
        >>> from torch.utils.checkpoint import CheckpointPolicy
        >>> from remat._engine.compiled import CompiledPolicy
        >>> p = CompiledPolicy(lambda op, *a, **k: op is torch.ops.aten.mm.default)
        >>> p(None, torch.ops.aten.mm.default, torch.ones(2, 2), torch.ones(2, 2)) is CheckpointPolicy.MUST_SAVE
        True
    """

    def __init__(self, policy: Callable[..., Any]) -> None:
        self.policy = policy
        # NOTE [writes in a compiled region]: tensors by id (held, so that ids stay unique while tracing)
        self._keep: dict[int, Any] = {}
        self._fresh: set[int] = set()  # made inside the region (not views of its inputs)
        self._root: dict[int, int] = {}  # a view of an input, or a name of it -> the input
        self._readers: dict[int, set[int]] = {}  # input -> the calls that read it
        self._written: set[int] = set()  # inputs written in place
        self._names: set[int] = set()  # checkpoint_name outputs (copies here, aliases in eager mode)
        self._calls = 0
        self._warned = False  # offloading under compile warned about, once per traced region

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        schema = getattr(op, "_schema", None)
        if not getattr(ctx, "is_recompute", False):  # (eager selective checkpointing recomputes after a graph break)
            self._check_writes(ctx, op, schema, args, kwargs)
            self._note_output(ctx, op, schema, args)
        if schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            # an op that writes in place keeps its output (the tensor it wrote: for an input, saving costs
            # nothing), so that an eager recompute after a graph break replays it instead of writing again
            # (BatchNorm's statistics would be updated twice)
            return CheckpointPolicy.MUST_SAVE
        name = ti.annotated_name() if op in _NAME_OPS else None
        if name is not None:
            decision, _ = decide_explicit(_Concrete(self.policy), checkpoint_name, args[:1], {"name": name})
        else:
            decision, _ = decide_explicit(_Concrete(self.policy), op, args, kwargs)
        if decision is Saveable:
            return CheckpointPolicy.MUST_SAVE
        if isinstance(decision, Offloadable):
            return self._offload(ctx, decision, args)
        return CheckpointPolicy.PREFER_RECOMPUTE

    def _offload(self, ctx: Any, decision: Offloadable, args: tuple[Any, ...]) -> CheckpointPolicy:
        """An offload decision: torch's offloading pass where it runs (``remat.offload.compiled_offloading``),
        else a recompute, with a warning."""
        if decision.dst == "cpu" and ti.activation_offloading_on():
            out = getattr(ctx, "op_output", None)  # (torch >= 2.13; before, every output the decision names moves)
            outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
            # (before torch 2.13, no output to look at: the op's tensor arguments say the device)
            where = outs or [t for a in args for t in (a if isinstance(a, (list, tuple)) else (a,)) if isinstance(t, torch.Tensor)]
            if decision.src is not None and any(t.device.type != torch.device(decision.src).type for t in where):
                return CheckpointPolicy.MUST_SAVE  # on another device than src: kept where it is, as in eager mode
            size = _nbytes(outs) if decision.min_bytes else None
            if size is not None and size < decision.min_bytes:  # (a symbolic size: unknown, offloaded)
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.MUST_CPU_OFFLOAD
        if not self._warned:
            # once per traced region; and the message names the policy, not the op, at this one location, so that
            # warnings' own filter (by default once per message and location) shows the regions of one policy once
            self._warned = True
            how = ("wrap the call that compiles in `with remat.offload.compiled_offloading():`"
                   if ti.activation_offloading_available() and decision.dst == "cpu" else
                   f"this torch ({torch.__version__}) has no compile-time offloading pass remat can drive"
                   if decision.dst == "cpu" else f"torch's pass moves values to the host only, not to {decision.dst!r}")
            warnings.warn(
                f"remat: policy {getattr(self.policy, '__name__', self.policy)!r} offloads under torch.compile, "
                f"where remat recomputes what it offloads unless torch's offloading pass runs: {how}. Or offload "
                "outside the compiled region, or choose a policy that saves or recomputes.",
                stacklevel=1)
        return CheckpointPolicy.PREFER_RECOMPUTE

    def _note_output(self, ctx: Any, op: Any, schema: Any, args: tuple[Any, ...]) -> None:
        out = getattr(ctx, "op_output", None)  # torch >= 2.13 hands the policy the op's output
        if out is None:
            return
        is_view = schema is not None and any(r.alias_info is not None for r in schema.returns)
        base = args[0] if is_view and args and isinstance(args[0], torch.Tensor) else None
        named = op in _NAME_OPS and ti.annotated_name() is not None
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor) or id(t) in self._keep:
                continue
            self._keep[id(t)] = t
            if named:
                self._names.add(id(t))
            if base is not None and id(base) in self._names:
                self._names.add(id(t))  # a view of a name
            elif base is not None and id(base) not in self._fresh:
                self._root[id(t)] = self._root_of(base)  # a view of an input
            else:
                self._fresh.add(id(t))

    def _root_of(self, t: Any) -> int:
        self._keep[id(t)] = t
        return self._root.get(id(t), id(t))

    def _check_writes(self, ctx: Any, op: Any, schema: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """NOTE [writes in a compiled region]: torch's compiled checkpoint region recomputes from its inputs as
        they are when the backward pass runs, so a value computed from an input (an argument, a closed-over
        tensor, a module buffer) that the region also writes in place is recomputed from the written value:
        wrong gradients without an error. So an input written in the region may be read by no other op of the
        region, through any view (BatchNorm's running statistics, read and written by the one op that updates
        them, pass); the op that breaks the rule raises. On a torch whose policy hook does not see op outputs
        (< 2.13), views cannot be followed, and every write to a tensor raises."""
        self._calls += 1
        known = hasattr(ctx, "op_output")
        writes = set()
        for i, a in enumerate(schema.arguments if schema is not None else ()):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            t = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(t, torch.Tensor) and id(t) in self._names:
                raise RematError(
                    f"remat: {op} inside a remat'd function under torch.compile writes in place into a value "
                    "returned by checkpoint_name, which is a copy under torch.compile (an alias in eager mode): "
                    "the write would not reach the named tensor. Write out of place, or write before naming.")
            if isinstance(t, torch.Tensor) and id(t) not in self._fresh:
                if not known:
                    self._refuse(op, f"a tensor (on torch {torch.__version__} remat cannot tell whether the "
                                     "region made it; torch >= 2.13 can)")
                writes.add(self._root_of(t))
        tree: Any = (args, kwargs)
        reads = {self._root_of(t) for t in optree.tree_leaves(tree, none_is_leaf=True)
                 if isinstance(t, torch.Tensor) and id(t) not in self._fresh}
        for r in writes:
            if self._readers.get(r, {self._calls}) != {self._calls}:
                self._refuse(op, "an input of the region that another op of the region reads")
            if r in self._written:
                self._refuse(op, "an input of the region that another op of the region writes")
            self._written.add(r)
        for r in reads:
            if r in self._written and r not in writes:
                self._refuse(op, "", read=True)
            self._readers.setdefault(r, set()).add(self._calls)

    def _refuse(self, op: Any, what: str, read: bool = False) -> None:
        head = (f"remat: {op} inside a remat'd function under torch.compile reads an input of the region that "
                "another op of the region writes in place" if read else
                f"remat: {op} inside a remat'd function under torch.compile writes in place into {what}")
        raise RematError(
            f"{head} (an argument, a closed-over tensor or a module buffer); torch's compiled checkpoint region "
            "would recompute from the written value and give wrong gradients. Write it out of place "
            "(y = x * 2 instead of x.mul_(2)), or keep the write outside the remat'd function."
        )

    def __repr__(self) -> str:
        return f"CompiledPolicy({self.policy!r})"


class _Concrete:
    """The policy, with symbolic booleans (a shape comparison under dynamic shapes) made concrete."""

    def __init__(self, policy: Callable[..., Any]) -> None:
        self.policy = policy
        self.__name__ = getattr(policy, "__name__", repr(policy))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.policy(*args, **kwargs)
        return bool(out) if isinstance(out, torch.SymBool) else out

    def __repr__(self) -> str:
        return repr(self.policy)


def _contexts(spec: Any) -> Any:
    policy = _build(spec)
    if isinstance(policy, MemoryBudget):
        raise RematError(
            f"remat: {policy!r} under torch.compile: the budget is solved from the eager ops of each call, which "
            "compiled code does not run. Under torch.compile, drop the remat and set torch's own budget, "
            "activation_memory_budget in the functorch config (the same fraction; docs/budgets.md), or call the "
            "remat'd function outside the compiled region."
        )
    return create_selective_checkpoint_contexts(CompiledPolicy(policy))


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
    COMPILED_REGIONS[0] += 1
    try:
        # (torch's own, bound at import: remat.route_torch_checkpoint skips remat's modules)
        return torch_checkpoint(fn, *args, use_reentrant=False, context_fn=ctx_fn,
                                                 preserve_rng_state=preserve_rng, **kwargs)
    finally:
        COMPILED_REGIONS[0] -= 1
