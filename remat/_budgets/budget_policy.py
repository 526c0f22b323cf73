"""``policies.memory_budget``, the policy: measure a call, solve its budget, follow the plan on later calls.

NOTE [budget plans] (the model and the solvers: NOTE [memory budget] in ``_budgets/budget.py``,
NOTE [three-way budget] in ``_budgets/budget_offload.py``):
The graph is measured by the engine, not traced apart: the first call of a
remat'd function with given input shapes (its signature, ``_engine/signature.py``)
runs with nothing saved, which fits any budget, while the engine records every
op (its inputs, outputs, shapes) and reports what autograd saved: under plain autograd the
replay engine's trace and pack hook (``learn_trace``), elsewhere the full engine's recorder
and its observer interface (``_context.INSPECTOR``). The solved plan, the
decision for each op by its position in the call, is used from the second call
on, so later calls cost what a fixed policy costs. A call whose ops differ from the plan's (a data-dependent
branch), or whose kept ops read other shapes (a size set by a Python value the
signature does not see), saves nothing from the first difference on: it stays
within the budget (``_Planned`` checks the shapes of what it keeps: an op's
output size may depend on values, ``nonzero``, a boolean mask).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import time
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
from torch.utils.flop_counter import flop_registry

from .. import _torch_internals as ti
from .._context import INSPECTOR, internal
from .._engine.ops import Alias, op_info
from .._errors import RematError
from .._policies.core import Offloadable, Saveable
from .._policies.naming import checkpoint_name
from .budget import Graph, _closure, full_bytes, solve
from .budget_offload import evaluate as evaluate_three_way
from .budget_offload import solve as solve_three_way
from .device_model import DeviceModel

__all__ = ["MemoryBudget", "BudgetPlan", "memory_budget"]

MAX_SIGNATURES = 32

# ---- measuring a call --------------------------------------------------------------------------------------------


class _Measure:
    """The policy of a signature's first call: saves nothing, and notes each op and its arguments' shapes."""

    __name__ = "memory_budget(measuring)"

    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any]] = []
        self.shapes: list[tuple[Any, ...]] = []  # of each op's tensor arguments: a call following the plan checks them
        self.outs: list[list[tuple[Any, ...]]] = []  # of each op's tensor outputs (``_meta``: the replay engine's call)
        self._out: list[tuple[Any, ...]] = []

    def with_output(self, output: Any, op: Any, /, *args: Any, **kwargs: Any) -> bool:
        self._out = [_meta(t) for t in optree.tree_leaves(output, none_is_leaf=True) if isinstance(t, torch.Tensor)]
        return self(op, *args, **kwargs)

    def __call__(self, op: Any, /, *args: Any, **kwargs: Any) -> bool:
        self.outs.append(self._out)
        self._out = []
        if op is checkpoint_name:
            self.calls.append((op, None))
        else:
            self.calls.append((op, optree.tree_map(_shape, (args, kwargs), none_is_leaf=True)))  # type: ignore[arg-type]
        self.shapes.append(_arg_shapes(args))
        return False


def _meta(t: torch.Tensor) -> tuple[Any, ...]:
    """What ``_bytes`` and ``_flops`` read of an output, as ``OpRecord.out_meta`` holds it."""
    return tuple(t.shape), t.dtype, t.device, t.stride() if t.layout is torch.strided else t.layout


def _shape(x: Any) -> Any:
    return x.shape if isinstance(x, torch.Tensor) else x


def _arg_shapes(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.shape for a in args if isinstance(a, torch.Tensor))


class _Saved:
    """An observer of the engine (``INSPECTOR``): which storages autograd saved, and when."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous
        self.frame: Any = None
        self.saved: list[tuple[int, int, int]] = []  # (storage key, ops recorded so far, bytes)

    def on_save(self, t: torch.Tensor, decision: str, frame: Any) -> None:
        if frame is self.frame:
            self.note(t, len(frame.recorder.ops))
        if self.previous is not None:
            self.previous.on_save(t, decision, frame)

    def note(self, t: torch.Tensor, n: Any) -> None:
        """Autograd saved ``t`` after the call's ``n``-th op (the replay engine's pack hook calls this directly, with
        the last step recorded: ``learn_trace`` counts the steps up to it, an alias step of no op's not counted)."""
        with internal():
            s = ti.storage_of(ti.unwrap_all(t))
            if s is not None:
                self.saved.append((int(s.data_ptr()), n, int(s.nbytes())))


class _StepRecord:
    """A step of the replay engine's trace as the model reads a recorded op (``OpRecord``'s fields it uses)."""

    __slots__ = ("func", "in_keys", "out_keys", "out_meta", "random", "skippable")

    def __init__(self, trace: Any, step: Any, metas: list[tuple[Any, ...]]) -> None:
        info = op_info(step.op)
        self.func, self.random = step.op, info.random
        self.in_keys = [trace.key_of.get(s, 0) for s in step.reads()]
        self.out_keys = [trace.key_of.get(s, 0) for s in step.outs if s >= 0]
        self.out_meta: list[Any] = list(metas) if len(metas) == len(self.out_keys) else [None] * len(self.out_keys)
        self.skippable = (not info.random and not info.mutable and bool(self.out_keys) and step.replayable
                          and not set(self.out_keys) & set(self.in_keys))


def _graph(ops: Sequence[Any], calls: list[tuple[Any, Any]], saved: list[tuple[int, int, int]]) -> Graph:
    """The model (NOTE [memory budget]) of a recorded call: ``ops`` the recorder's records."""
    g = Graph([], [], [], [], [], [], [])
    current: dict[int, int] = {}  # storage key -> the value living there now
    pending = sorted(saved, key=lambda s: s[1])
    j = 0
    for i, rec in enumerate(ops):
        while j < len(pending) and pending[j][1] <= i:
            _save(g, current, pending[j])
            j += 1
        reads = [current[k] for k in rec.in_keys if k in current]
        fresh = [(k, m) for k, m in zip(rec.out_keys, rec.out_meta) if k and m is not None and k not in rec.in_keys]
        mutable = hasattr(rec.func, "_schema") and rec.func._schema.is_mutable
        g.cost.append(0.0 if rec.random else float(_cost(rec, calls[i][1])))
        g.keepable.append(bool(rec.skippable))
        g.reads.append(sorted(set(reads)))
        g.outs.append([])
        if mutable:
            # a write changes the value it writes: making that value now also takes this op and what it reads
            for k in set(rec.in_keys) & set(rec.out_keys):
                v = current.get(k)
                if v is not None:
                    p = g.producer[v]
                    g.reads[p] = sorted(set(g.reads[p]) | (set(reads) - {v}))
                    g.cost[p] += g.cost[i]
                    g.keepable[p] = False
            continue
        for k, m in fresh:
            v = len(g.size)
            g.size.append(_bytes(m))
            g.producer.append(i)
            g.outs[i].append(v)
            current[k] = v
    for s in pending[j:]:
        _save(g, current, s)
    return g


def _save(g: Graph, current: dict[int, int], entry: tuple[int, int, int]) -> None:
    v = current.get(entry[0])
    if v is not None:  # else an input, a parameter: held anyway
        g.size[v] = max(g.size[v], entry[2])
        g.saved.append(v)


def _bytes(meta: tuple[Any, ...]) -> int:
    if len(meta) > 4:  # a wrapper subclass: the bytes of its inner tensors on this process (a DTensor's shard)
        return sum(_bytes(m) for _, m in meta[5] if type(m) is tuple)
    shape, dtype, _, stride = meta[:4]
    if any(d == 0 for d in shape):
        return 0
    if type(stride) is torch.layout:  # (a sparse tensor: counted as dense, an upper bound)
        return math.prod(shape) * dtype.itemsize
    return (1 + sum((d - 1) * abs(st) for d, st in zip(shape, stride))) * dtype.itemsize


def _cost(rec: Any, shapes: Any) -> int:
    """An op's cost: its FLOPs by torch's formula, at least one per element it writes."""
    return max(_flops(rec, shapes), sum(math.prod(m[0]) for m in rec.out_meta if m is not None))


def _flops(rec: Any, shapes: Any) -> int:
    """An op's FLOPs by torch's formulas (``torch.utils.flop_counter``); 0 for ops without one."""
    formula = flop_registry.get(getattr(rec.func, "_overloadpacket", None))
    if formula is None or shapes is None:
        return 0
    args, kwargs = shapes
    outs = [torch.Size(m[0]) if m is not None else None for m in rec.out_meta]
    try:
        return int(formula(*args, **kwargs, out_val=outs[0] if len(outs) == 1 else tuple(outs)))
    except Exception:  # a formula that wants more than the shapes: count the elements
        return 0


# ---- the policy --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BudgetPlan:
    """What ``memory_budget`` chose for one input signature (bytes and FLOPs as its model predicts them).

    ``full_bytes`` is what plain autograd keeps of the values the call makes,
    ``budget_bytes`` the budget in bytes, ``kept_bytes`` what the plan keeps,
    ``recompute_flops`` the FLOPs the recompute runs by torch's formulas (matrix
    products, convolutions, attention) and ``recompute_cost`` the model's cost,
    which also counts one per element of every other op. ``kept`` names the ops
    whose outputs are kept, in call order; ``solve_seconds`` is how long building
    the model and solving it took. A three-way budget (``offload=``) also says
    which ops it offloads (``offloaded``, ``offloaded_bytes`` in host memory), the
    :class:`~remat.DeviceModel` it priced them with (``model``) and the modelled
    step time of its plan (``seconds``) against the keep/recompute plan at the same
    budget (``two_way_seconds``).

    Example:
        >>> import torch
        >>> from remat import remat, policies
        >>> budget = policies.memory_budget(1.0)  # keep everything autograd would
        >>> w = torch.randn(32, 32, requires_grad=True)
        >>> remat(lambda w: torch.tanh(w @ w).sum(), policy=budget)(w).backward()
        >>> plan = next(iter(budget.plans.values()))
        >>> plan.kept_bytes == plan.full_bytes == 32 * 32 * 4, plan.recompute_flops
        (True, 0)
    """

    decisions: tuple[tuple[Any, Any, tuple[Any, ...]], ...] = dataclasses.field(repr=False)
    full_bytes: int
    budget_bytes: int
    kept_bytes: int
    recompute_flops: int
    recompute_cost: float
    kept: tuple[str, ...]
    solve_seconds: float = 0.0
    dynamic: bool = False  # an op's output size depends on values (nonzero, a boolean mask)
    offloaded: tuple[str, ...] = ()  # the ops whose needed outputs go to host memory (a three-way budget)
    offloaded_bytes: int = 0  # what they hold in host memory between the passes
    model: DeviceModel | None = None  # the device model a three-way budget priced its choices with
    seconds: float = 0.0  # the modelled step time of the plan (three-way budgets; NOTE [three-way budget])
    two_way_seconds: float = 0.0  # ... and of the keep/recompute plan at the same budget


class _Planned:
    """The policy of a call following its signature's budget plan: the plan's decision for each op by its position, saving nothing from the
    first op that is not the plan's or reads other shapes (a data-dependent branch or size, a Python setting the
    signature does not see): less is kept, never more."""

    __slots__ = ("decisions", "n", "diverged")
    __name__ = "memory_budget(planned)"

    def __init__(self, decisions: tuple[tuple[Any, Any, tuple[Any, ...]], ...]) -> None:
        self.decisions = decisions
        self.n = 0
        self.diverged = False

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> Any:
        i = self.n
        self.n = i + 1
        if self.diverged or i >= len(self.decisions):
            self.diverged = True
            return False
        planned, keep, shapes = self.decisions[i]
        if planned is not op or (keep and shapes != _arg_shapes(args)):
            self.diverged = True
            return False
        return keep


class MemoryBudget:
    """What :func:`memory_budget` returns: a policy solved per input signature (NOTE [memory budget]).

    ``plans`` maps each signature seen to its :class:`BudgetPlan` (None when the
    measuring call could not be told op from op: that signature saves nothing);
    ``solves`` counts how many times the solver ran.

    Example:
        >>> import torch
        >>> from remat import remat, policies
        >>> budget = policies.memory_budget(0)  # keep nothing: the same as nothing_saveable
        >>> f = remat(lambda x: x.sin().exp().sum(), policy=budget)
        >>> x = torch.randn(16, requires_grad=True)
        >>> f(x).backward(); f(x).backward()
        >>> budget.solves, next(iter(budget.plans.values())).kept_bytes
        (1, 0)
    """

    def __init__(self, budget: int | float, offload: DeviceModel | bool | None = None,
                 host_budget: int | None = None) -> None:
        self.budget = budget
        self.offload = offload or None
        self.host_budget = host_budget
        self.plans: dict[Any, BudgetPlan | None] = {}
        self.solves = 0
        extra = "" if offload is None else f", offload={offload!r}"
        extra += "" if host_budget is None else f", host_budget={host_budget!r}"
        self.__name__ = f"memory_budget({budget!r}{extra})"

    def __repr__(self) -> str:
        return self.__name__

    def __getstate__(self) -> dict[str, Any]:
        # (a pickled or saved model carries the budget, not the plans solved in this process: they are keyed by the
        # functions' code objects, which do not pickle, and the copy solves again on its first call per signature)
        state = dict(self.__dict__)
        state["plans"] = {}
        state.pop("_failed", None)
        return state

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> Any:
        raise RematError(
            f"remat: {self!r} decides per call of a remat'd function, by the position of each op in the call; "
            "it cannot answer for a lone op. Pass it as remat(f, policy=policies.memory_budget(...)) or "
            "remat_module(block, policy=...). Under torch.compile, use torch's own budget instead: "
            "its activation_memory_budget (in the functorch config, docs/budgets.md)."
        )

    def bind(self, key: Any) -> tuple[Callable[..., Any], _Saved | None]:
        """The policy for one call of signature ``key``, and the observer to install when the call measures."""
        plan = self.plans.get(key, _UNSEEN)
        if plan is _UNSEEN:
            return _Measure(), _Saved(INSPECTOR.get())
        if plan is None:
            return _nothing, None
        return _Planned(plan.decisions), None  # type: ignore[union-attr]

    def give_up(self, key: Any) -> None:
        """Signature ``key``'s measuring call raised (its engine refused what the replay serves): the next call
        measures again (a first call that warms a cache up); after a second refusal the signature saves nothing,
        which fits any budget, rather than measure and raise on every call."""
        failed = self.__dict__.setdefault("_failed", {})
        failed[key] = failed.get(key, 0) + 1
        if failed[key] < 2:
            return
        if len(self.plans) >= MAX_SIGNATURES:
            self.plans.pop(next(iter(self.plans)))
        self.plans[key] = None
        del failed[key]

    def learn_trace(self, key: Any, policy: Any, saved: _Saved, trace: Any) -> None:
        """Solve for signature ``key`` from a measuring call the replay engine recorded (NOTE [the trace])."""
        steps = [st for st in trace.steps if type(st.call) is not Alias]  # (no op's: NOTE [unseen aliases])
        upto, n = {}, 0
        for st in trace.steps:
            n += type(st.call) is not Alias
            upto[id(st)] = n
        saved.saved = [(k, upto.get(id(last), 0), b) for k, last, b in saved.saved]
        metas = policy.outs if len(policy.outs) == len(steps) else [[]] * len(steps)
        self.learn(key, policy, saved, [_StepRecord(trace, st, m) for st, m in zip(steps, metas)])

    def learn(self, key: Any, policy: Any, saved: _Saved, ops: Sequence[Any]) -> None:
        """Solve for signature ``key`` from the measuring call's records."""
        if len(self.plans) >= MAX_SIGNATURES:
            self.plans.pop(next(iter(self.plans)))
        if len(policy.calls) != len(ops) or any(c[0] is not r.func and c[0] is not checkpoint_name
                                                 for c, r in zip(policy.calls, ops)):
            self.plans[key] = None  # cannot tell op from op: save nothing, which fits any budget
            return
        self.solves += 1
        t0 = time.perf_counter()
        g = _graph(ops, policy.calls, saved.saved)
        full = full_bytes(g)
        b = self.budget
        limit = int(b * full) if isinstance(b, float) else int(b)
        two = solve(g, limit)
        keep, off = two.keep, frozenset[int]()
        extra: dict[str, Any] = {}
        if self.offload is not None:
            model = self._model(ops)
            three = solve_three_way(g, limit, model, self.host_budget)
            keep, off = three.keep, three.offload
            two_seconds = _seconds(g, two.keep, model)
            extra = {"model": model, "seconds": three.seconds, "two_way_seconds": two_seconds}
        _, cost, ran, need = _closure(g, keep | off)
        flops = sum(_flops(ops[i], policy.calls[i][1]) for i in ran if not ops[i].random)
        move = Offloadable(None, "cpu", defer=False)  # the device bytes must go (NOTE [keep last])
        decisions = tuple((c[0], _decision(g, i, keep, off, move), policy.shapes[i])
                          for i, c in enumerate(policy.calls))
        kept = tuple(str(ops[i].func) for i in sorted(keep) if any(v in need for v in g.outs[i]))
        offloaded = tuple(str(ops[i].func) for i in sorted(off) if any(v in need for v in g.outs[i]))
        kept_bytes = sum(g.size[v] for v in need if g.producer[v] in keep and g.keepable[g.producer[v]])
        host_bytes = sum(g.size[v] for v in need if g.producer[v] in off and g.keepable[g.producer[v]])
        dynamic = any(torch.Tag.dynamic_output_shape in getattr(r.func, "tags", ()) for r in ops)
        self.plans[key] = BudgetPlan(decisions, full, limit, kept_bytes, flops, cost, kept,
                                     time.perf_counter() - t0, dynamic, offloaded, host_bytes, **extra)

    def _model(self, ops: Sequence[Any]) -> DeviceModel:
        """The device model of a three-way budget: given, or probed on the device the call runs on."""
        if isinstance(self.offload, DeviceModel):
            return self.offload
        devices = {m[2] for r in ops for m in r.out_meta if m is not None and len(m) > 2}
        cuda = sorted(str(d) for d in devices if isinstance(d, torch.device) and d.type == "cuda")
        if not cuda:
            raise RematError(
                f"remat: {self!r} probes the device the call runs on, but this call runs on "
                f"{', '.join(sorted(map(str, devices))) or 'no device'}, where offloading to host memory frees "
                "nothing. To plan as if on a GPU (a test, a machine without one), pass the device's model: "
                "memory_budget(b, offload=remat.DeviceModel(flops=..., d2h=..., h2d=...)) or DeviceModel.h200()."
            )
        return DeviceModel.probe(cuda[0])


def _decision(g: Graph, i: int, keep: frozenset[int], off: frozenset[int], move: Offloadable) -> Any:
    if not g.keepable[i]:
        return False
    if i in keep:
        return Saveable
    if i in off:
        return move
    return False


def _seconds(g: Graph, keep: frozenset[int], model: DeviceModel) -> float:
    return evaluate_three_way(g, keep, frozenset(), model).seconds


_UNSEEN: Any = object()


def _nothing(op: Any, *args: Any, **kwargs: Any) -> bool:
    return False


def memory_budget(budget: int | float, offload: DeviceModel | bool | None = None,
                  host_budget: int | None = None) -> MemoryBudget:
    """A policy that keeps what fits ``budget`` and recomputes the rest, choosing the least recompute; with
    ``offload``, it may also move values to host memory, choosing the least modelled time.

    ``budget`` is in bytes (an ``int``) or a fraction of what the function would
    keep without remat (a ``float`` in ``[0, 1]``, as ``torch.compile``'s
    ``activation_memory_budget``): 0 keeps nothing (``nothing_saveable``), 1 keeps
    everything autograd would. The budget counts the values the call makes and
    keeps between the forward and the backward pass, per call; inputs and
    parameters are held anyway and are not counted.

    The first call of a remat'd function with given input shapes, dtypes and
    devices saves nothing (which fits any budget) while it records the call's ops,
    their sizes and FLOPs; the solver then picks which op outputs to keep so that
    the recompute, counted in FLOPs (torch's formulas, and one per element for
    ops without one), is least, knowing that what a recomputed op reads must be
    kept or recomputed too. The plan is cached per signature (``.plans``) and later
    calls cost what a fixed policy costs. The model and solver are explained in
    docs/budgets.md and NOTE [memory budget] in ``remat/_budgets/budget.py``. Works under
    plain autograd and the ``torch.func`` transforms like every policy; under
    ``torch.compile`` use torch's own ``activation_memory_budget`` (docs/budgets.md).

    With ``offload`` (a :class:`~remat.DeviceModel`, or ``True`` to measure the
    CUDA device the call runs on once per process), each op's needed outputs are
    kept on the device, offloaded to host memory (the offload engine, as
    ``offload_to_cpu``) or recomputed, so that the device bytes stay within
    ``budget``, the host bytes within ``host_budget`` and the modelled step time
    (compute, recompute, and the copy time the compute cannot hide) is least
    (NOTE [three-way budget] in ``remat/_budgets/budget_offload.py``). Copies that overlap
    the compute cost nothing, so on a GPU a budget that would recompute matmuls
    often offloads them instead. ``plans`` also says what the plan offloads and
    its modelled time against the keep/recompute plan.

    Args:
        budget: device bytes per call (``int`` >= 0) or a fraction (``float`` in [0, 1]).
        offload: ``None`` or ``False`` (keep or recompute), ``True`` (probe the call's CUDA device; a call on the
            CPU raises, since offloading there frees nothing) or a :class:`~remat.DeviceModel`.
        host_budget: host bytes per call the offloaded values may take (``None``: no bound); only with
            ``offload``.

    Returns:
        A :class:`MemoryBudget` policy. One object keeps one plan per signature;
        share it between the blocks that should share plans, or build one per block.

    Raises:
        TypeError, ValueError: for a budget that is not a non-negative int or a
            float in [0, 1], an ``offload`` that is not a bool or a ``DeviceModel``,
            or a ``host_budget`` that is not a non-negative int or comes without ``offload``.

    Example:
        >>> import torch
        >>> from remat import remat, policies
        >>> policy = policies.memory_budget(0.5)  # keep at most half of what autograd would
        >>> f = remat(lambda w, x: torch.tanh(torch.tanh(x @ w) @ w).sum(), policy=policy)
        >>> w = torch.randn(64, 64, requires_grad=True)
        >>> for _ in range(2):
        ...     f(w, torch.randn(32, 64)).backward()
        >>> plan = next(iter(policy.plans.values()))
        >>> plan.kept_bytes <= plan.budget_bytes == plan.full_bytes // 2
        True
        >>> from remat import DeviceModel
        >>> slow = DeviceModel(flops=1e9, d2h=64e9, h2d=64e9)  # copies cheap next to compute
        >>> policy = policies.memory_budget(0.0, offload=slow)  # nothing stays on the device
        >>> f = remat(lambda w, x: torch.tanh(torch.tanh(x @ w) @ w).sum(), policy=policy)
        >>> for _ in range(2):
        ...     f(w, torch.randn(32, 64)).backward()
        >>> plan = next(iter(policy.plans.values()))
        >>> plan.kept_bytes, plan.offloaded, plan.seconds < plan.two_way_seconds
        (0, ('aten.tanh.default', 'aten.tanh.default'), True)
    """
    if isinstance(budget, numbers.Integral) and not isinstance(budget, bool):
        budget = int(budget)
    elif isinstance(budget, numbers.Real) and not isinstance(budget, bool):
        budget = float(budget)
    if budget == 1 and isinstance(budget, int):
        raise ValueError(
            "memory_budget: budget=1 is one byte (an int budget counts bytes); to keep everything autograd would, "
            "pass the fraction 1.0"
        )
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(
            f"memory_budget: budget must be bytes (an int) or a fraction of what autograd keeps (a float in "
            f"[0, 1]), got {budget!r} ({type(budget).__name__})"
        )
    if isinstance(budget, float) and not 0.0 <= budget <= 1.0:
        raise ValueError(
            f"memory_budget: a float budget is a fraction of what autograd would keep and must lie in [0, 1], "
            f"got {budget!r}: memory_budget(1.0) keeps everything autograd would, memory_budget(0.25) a quarter; "
            "or pass bytes as an int (memory_budget(512 * 2**20) for 512 MiB)"
        )
    if isinstance(budget, int) and budget < 0:
        raise ValueError(f"memory_budget: a byte budget must be >= 0, got {budget}")
    if offload is not None and not isinstance(offload, (bool, DeviceModel)):
        raise TypeError(
            f"memory_budget: offload must be True (probe the call's GPU), False or None (keep or recompute) or a "
            f"remat.DeviceModel(flops=..., d2h=..., h2d=...), got {offload!r} ({type(offload).__name__})"
        )
    if host_budget is not None:
        if not offload:
            raise ValueError(
                "memory_budget: host_budget bounds the host memory of offloaded values; pass offload=True or a "
                "DeviceModel with it, or drop it"
            )
        if isinstance(host_budget, bool) or not isinstance(host_budget, numbers.Integral) or host_budget < 0:
            raise ValueError(f"memory_budget: host_budget must be bytes (an int >= 0) or None, got {host_budget!r}")
        host_budget = int(host_budget)
    return MemoryBudget(budget, offload if offload else None, host_budget)
