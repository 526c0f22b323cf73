"""``remat.sequential``: checkpoint a chain of blocks in segments, chosen equal or to fit a byte budget.

NOTE [chain schedules]: a chain ``x -> b_0 -> b_1 -> ... -> b_{n-1}`` is cut into
contiguous segments. A remat'd segment keeps only its input between the forward
and the backward pass; the backward pass recomputes it (under ``policy``) and then
holds its activations while it runs through it. A plain segment keeps its
activations from the forward pass. With ``a_i`` the bytes block ``i`` allocates
(its activations, its output included), ``in_s`` the bytes of a segment's input
and ``c_i`` its FLOPs, a schedule costs

* memory: ``persistent + max transient``, where ``persistent`` is the sum over
  remat'd segments of ``in_s`` (nothing for the chain's own input) plus the sum of
  ``a_i`` over plain blocks, and ``transient`` is a remat'd segment's ``sum a_i``
  (an upper bound: the segment's input is counted in both);
* recompute: the sum of ``c_i`` over remat'd blocks.

A segment may have a schedule of its own (a multi-level schedule): its recompute
runs its inner segments, remat'd ones keeping only their inputs again (NOTE [what a
recompute holds] in ``_engine/full.py``), and backpropagates through them one by one. Its
transient is then that inner schedule's memory (inner persistent + inner max
transient, its first inner segment's input being its own), and its recompute the
segment's FLOPs (but for a last remat'd inner segment, whose output nothing in the
recompute reads: remat does not run it) plus the inner schedule's. ``levels=L``
nests ``L`` levels of equal segments (``nested_segments``). A budget also solves
the best multi-level schedule (``solve_nested`` in ``_budgets/schedules.py``: a dynamic
program over spans, the largest inner transient and persistent bytes, exact on a
grid of ``budget / 48`` steps, checked against every nested schedule of short
chains) and takes it when it recomputes less than the exact single-level one, or
when no single-level schedule fits: halving down to single blocks needs about one
block input per level plus one block.

``segments=k`` cuts ``k`` equal segments and runs the last one plain, as
``torch.utils.checkpoint.checkpoint_sequential`` does (its activations are the
first the backward pass needs: recomputing them would cost time and save no
peak). ``budget=`` solves for the least recompute under the memory bound above,
exactly, by dynamic programming over segment ends with Pareto sets of
(persistent bytes, recompute) for every candidate ``max transient``
(``solve``, checked against brute force in ``tests/test_sequential.py``).
The sizes and FLOPs are measured on the first call of each input signature,
which runs every block remat'd alone (the schedule with the least memory):
``a_i`` is what autograd would have kept for block ``i`` (the tensors remat drops,
and the block's input if it saves it, seen through the engine's observer interface
``_context.INSPECTOR``), and a dispatch mode around each block counts its FLOPs with torch's
formulas. No block runs twice in a forward pass, so module state (BatchNorm's
running statistics) is written once. The solved schedule is
cached per signature and used from the second call on.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from .. import _torch_internals as ti
from .._api.transform import remat
from .._context import INSPECTOR, internal
from .._engine.ops import storage_key
from .._errors import RematError
from .._inspection.measure import FlopCount
from .._policies.core import Offloadable
from .chain_offload import ChainPlan
from .chain_offload import solve as solve_three_way
from .device_model import DeviceModel
from .schedules import Schedule, cost, equal_segments, nested_segments, solve, solve_nested

__all__ = ["sequential", "Sequential", "Schedule", "solve", "solve_nested", "equal_segments", "nested_segments",
           "cost"]


class _Kept:
    """An observer of the engine (``INSPECTOR``): bytes of the storages a block makes autograd keep.

    What remat drops (autograd would have kept it) and the block's input if an op of the block saves
    it; not parameters, nor ``carried`` (the input's storages, when the block before counted them).
    The storages counted are held until the block ends, so that a freed one whose address an op
    reuses is not mistaken for it."""

    def __init__(self, block_input: Any, carried: set[int]) -> None:
        self.bytes = 0
        self.held: dict[int, Any] = {}
        self._carried = carried
        self._input = {_ptr(t) for t in optree.tree_leaves(block_input, none_is_leaf=True)
                       if isinstance(t, torch.Tensor)}

    def on_save(self, t: torch.Tensor, decision: str, frame: Any) -> None:
        with internal():
            s = ti.storage_of(ti.unwrap_all(t))
            if s is None:
                return
            p = s.data_ptr()
            if (decision == "recomputed" or p in self._input) and p not in self._carried and p not in self.held:
                self.held[p] = s
                self.bytes += int(s.nbytes())


def _ptr(t: torch.Tensor) -> int:
    with internal():
        return storage_key(ti.unwrap_all(t))


def _nbytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in optree.tree_leaves(x, none_is_leaf=True)
               if isinstance(t, torch.Tensor))


class _Segment:
    """Blocks ``[start, end)`` run one after the other (what a remat'd segment wraps)."""

    def __init__(self, blocks: Sequence[Callable[[Any], Any]]) -> None:
        self.blocks = list(blocks)

    def __call__(self, x: Any) -> Any:
        for b in self.blocks:
            x = b(x)
        return x


class _Inner:
    """A remat'd segment whose blocks follow a schedule of their own (a multi-level schedule): its recompute
    re-runs the inner remat'd segments, which keep only their inputs again (NOTE [what a recompute holds])."""

    def __init__(self, chain: Sequential, schedule: Schedule) -> None:
        self.chain = chain
        self.schedule = schedule
        self.blocks = chain.blocks  # (what the call reads: the state walk finds the blocks' parameters here)

    def __call__(self, x: Any) -> Any:
        return self.chain._follow(self.schedule, x)


class Sequential:
    """What :func:`sequential` returns: call it on the chain's input."""

    def __init__(self, blocks: Sequence[Callable[[Any], Any]], segments: int | None, budget: int | float | None,
                 policy: Any, levels: int = 1, offload: DeviceModel | bool | None = None,
                 host_budget: int | None = None) -> None:
        self.blocks = list(blocks)
        self.segments = segments
        self.budget = budget
        self.policy = policy
        self.levels = levels
        self.offload = offload or None
        self.host_budget = host_budget
        self.solves = 0  # how many times a budget was solved (once per input signature)
        self.plans: dict[Any, ChainPlan] = {}  # with offload: per input signature, the three-way plan
        self._schedules: dict[Any, Schedule] = {}
        self._runs: dict[Any, Any] = {}

    def _key(self, x: Any) -> Any:
        """The input's signature: shapes, dtypes, devices, values, and whether a tensor of it requires grad (the
        first block saves its input only then: the measured sizes differ)."""
        leaves = optree.tree_leaves(x, none_is_leaf=True)
        return (tuple((tuple(t.shape), t.dtype, t.device) if isinstance(t, torch.Tensor) else t for t in leaves),
                any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves))

    def schedule(self, x: Any) -> Schedule | None:
        """The schedule for input ``x``: equal segments, or under a budget the one solved on the first call
        with this input signature (None before that call)."""
        n = len(self.blocks)
        if self.budget is None:
            if self.levels > 1:
                return nested_segments(n, self.segments or max(2, math.ceil(n ** (1 / self.levels) - 1e-9)),
                                       self.levels)
            return equal_segments(n, self.segments or math.isqrt(n - 1) + 1)
        return self._schedules.get(self._key(x))

    def _run(self, s: int, e: int, inner: Schedule | None = None) -> Any:
        run = self._runs.get((s, e, inner))
        if run is None:
            body = _Segment(self.blocks[s:e]) if inner is None else _Inner(self, inner)
            run = self._runs[(s, e, inner)] = remat(body, policy=self.policy)
        return run

    def _follow(self, sched: Schedule, x: Any) -> Any:
        for i, (s, e, rematted) in enumerate(sched.segments):
            if rematted:
                x = self._run(s, e, sched.sub(i))(x)
            else:
                for j in range(s, e):
                    x = self._offloaded(j)(x) if j in sched.offloaded else self.blocks[j](x)
        return x

    def _offloaded(self, i: int) -> Any:
        """Block ``i``, its activations to host memory at once (NOTE [offloading in a chain])."""
        run = self._runs.get(("offload", i))
        if run is None:
            run = self._runs[("offload", i)] = remat(self.blocks[i], policy=_offload_all)
        return run

    def _first_call(self, x: Any, key: Any) -> Any:
        """Every block remat'd alone, each weighed (NOTE [chain schedules]); then solve the budget."""
        n = len(self.blocks)
        act, inp, flops = [], [], []
        carried = {_ptr(t) for t in optree.tree_leaves(x, none_is_leaf=True) if isinstance(t, torch.Tensor)}
        for i in range(n):
            inp.append(_nbytes(x))
            kept = _Kept(x, carried)
            was = INSPECTOR.get()
            try:
                INSPECTOR.set(kept)
                with FlopCount() as w:
                    x = self._run(i, i + 1)(x)
            finally:
                INSPECTOR.set(was)
            act.append(kept.bytes)
            # the block's output, if it kept it, is counted: the next block must not count it again
            carried = {p for p in (_ptr(t) for t in optree.tree_leaves(x, none_is_leaf=True)
                                   if isinstance(t, torch.Tensor)) if p in kept.held}
            del kept
            flops.append(float(w.total))
        assert self.budget is not None
        budget = int(self.budget * sum(act)) if isinstance(self.budget, float) else int(self.budget)
        found = solve(act, inp, flops, budget)
        # the exact multi-level schedule (on a grid of memory units), where it recomputes less than the exact
        # single-level one, or where no single-level schedule fits
        nested = solve_nested(act, inp, flops, budget)
        if nested is not None and (found is None or (nested.recompute, nested.memory) < (found.recompute,
                                                                                         found.memory)):
            found = nested
        self.solves += 1
        if self.offload is not None:
            plan = solve_three_way(act, inp, flops, budget, self._model(x), self.host_budget, found)
            if plan is not None:
                self.plans[key] = plan
                found = plan.schedule
        if found is None:
            least = cost(nested_segments(n, 2, max(1, math.ceil(math.log2(n)))), act, inp, flops)[0]
            tried = ("; offloading blocks to host memory (offload=) does not fit it either" if self.offload is not None
                     else "; with offload=remat.DeviceModel(...) blocks may also go to host memory")
            raise RematError(
                f"remat.sequential: no schedule of these {n} blocks fits budget={self.budget!r} ({budget} bytes); "
                f"nested halves down to single blocks need {least} bytes by the cost model{tried}. "
                "Raise the budget, or split the blocks finer."
            )
        self._schedules[key] = found
        return x

    def _model(self, x: Any) -> DeviceModel:
        if isinstance(self.offload, DeviceModel):
            return self.offload
        devices = sorted({str(t.device) for t in optree.tree_leaves(x, none_is_leaf=True)
                          if isinstance(t, torch.Tensor)})
        cuda = [d for d in devices if d.startswith("cuda")]
        if not cuda:
            raise RematError(
                f"remat.sequential: offload=True probes the device the chain runs on, but it runs on "
                f"{', '.join(devices) or 'no device'}, where offloading to host memory frees nothing. To plan as if "
                "on a GPU, pass its model: offload=remat.DeviceModel(flops=..., d2h=..., h2d=...)."
            )
        return DeviceModel.probe(cuda[0])

    def __call__(self, x: Any) -> Any:
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            # no graph, so nothing saved, nothing to recompute: the plain loop, and no schedule solved from a call that
            # keeps nothing (a validation pass or a warm-up before training solved one that remat'd nothing, kept by
            # every training step of that shape after it: issue 39)
            for b in self.blocks:
                x = b(x)
            return x
        sched = self.schedule(x)
        if sched is None:
            return self._first_call(x, self._key(x))
        return self._follow(sched, x)

    def __repr__(self) -> str:
        how = f"budget={self.budget!r}" if self.budget is not None else f"segments={self.segments}" + (
            f", levels={self.levels}" if self.levels > 1 else "")
        how += "" if self.offload is None else f", offload={self.offload!r}"
        return f"remat.sequential({len(self.blocks)} blocks, {how})"


_OFFLOAD_ALL = Offloadable(None, "cpu", defer=False)  # (the device bytes must go: NOTE [keep last])


def _offload_all(op: Any, *args: Any, **kwargs: Any) -> Offloadable:
    """An offloaded block's policy: every saved output to host memory, at once."""
    return _OFFLOAD_ALL


def sequential(blocks: Sequence[Callable[[Any], Any]], *, segments: int | None = None,
               budget: int | float | None = None, policy: Any = None, levels: int = 1,
               offload: DeviceModel | bool | None = None, host_budget: int | None = None) -> Sequential:
    """Rematerialize a chain of blocks ``x -> x`` in segments: equal ones, or the fewest recomputes under a budget.

    ``remat.sequential(blocks)(x)`` runs ``blocks[0]`` to ``blocks[-1]`` on ``x``,
    with the same results and gradients as the plain loop, and keeps less between
    the forward and the backward pass: only the inputs of remat'd segments
    (and what ``policy`` saves inside them). With neither ``segments`` nor
    ``budget``, ``ceil(sqrt(n))`` equal segments (memory grows like ``sqrt(n)``).
    ``levels=L`` nests: ``L`` levels of equal remat'd segments, each cut again
    inside (``levels=ceil(log2(n))``, two segments a level: memory grows like
    ``log n``, a block recomputed up to ``L`` times). With ``budget``, the schedule
    with the least recomputed FLOPs whose predicted memory fits (NOTE [chain
    schedules] in ``remat/_budgets/sequential.py``): the best single-level schedule, exactly,
    or a nested one where that fits with less recompute or where no single-level
    one fits; solved on the first call of each input signature and cached. Works
    under plain autograd and the ``torch.func`` transforms, like :func:`remat`.

    Args:
        blocks: functions or modules, each mapping the chain's value (a tensor or
            pytree) to the next.
        segments: cut into this many equal segments; the last runs without remat,
            as in ``torch.utils.checkpoint.checkpoint_sequential``.
        budget: bytes (int), or a fraction (float in [0, 1]) of what the chain
            allocates without remat, for activations kept between forward and
            backward plus the largest recompute.
        policy: the policy inside remat'd segments (default: save nothing).
        levels: with ``segments`` or neither, how many levels of nested segments
            (1: a single level); ``segments`` is then the count per level
            (default ``ceil(n ** (1 / levels))``, at least 2).
        offload: with ``budget``, a :class:`~remat.DeviceModel` (or ``True``: measure the chain's CUDA device):
            a plain block may also be *offloaded*, its activations copied to host memory through the offload
            engine, and the schedule is the one of least modelled step time within the budget (NOTE [offloading
            in a chain] in ``remat/_budgets/chain_offload.py``); ``.plans`` says what it chose and its modelled time.
        host_budget: with ``offload``, the host bytes the offloaded blocks may take (``None``: no bound).

    Returns:
        A callable :class:`Sequential`; ``.schedule(x)`` shows the schedule.

    Raises:
        ValueError: both ``segments`` and ``budget``, or a bad value.
        RematError: a budget no schedule fits (on the first call, which measures the blocks).

    Example:
        >>> import torch, remat
        >>> blocks = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(9)]
        >>> chain = remat.sequential(blocks)
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> chain(x).sum().backward()
        >>> str(chain.schedule(x))
        'remat[0:3] remat[3:6] plain[6:9]'
        >>> wide = [torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))
        ...         for _ in range(6)]
        >>> slow = remat.DeviceModel(flops=1e8, d2h=64e9, h2d=64e9)  # copies cheap next to compute
        >>> chain = remat.sequential(wide, budget=0.1, offload=slow)
        >>> chain(x).sum().backward()
        >>> plan = next(iter(chain.plans.values()))
        >>> str(plan.schedule), plan.seconds < plan.two_way_seconds
        ('offload[0:6]', True)
    """
    if isinstance(blocks, torch.nn.Module) and not isinstance(blocks, (torch.nn.Sequential, torch.nn.ModuleList)):
        raise TypeError(f"remat.sequential: blocks must be a sequence of blocks (a list, an nn.Sequential or an "
                        f"nn.ModuleList), got one {type(blocks).__name__}; for a single module use "
                        "remat_module(module) or remat(module).")
    blocks = list(blocks)
    if not blocks or not all(callable(b) for b in blocks):
        raise TypeError(f"remat.sequential: blocks must be a non-empty sequence of callables, got {blocks!r}")
    if segments is not None and budget is not None:
        raise ValueError("remat.sequential: pass segments or budget, not both")
    if not isinstance(levels, int) or isinstance(levels, bool) or levels < 1:
        raise ValueError(f"remat.sequential: levels must be a positive int, got {levels!r}")
    if levels > 1 and budget is not None:
        raise ValueError("remat.sequential: a budget chooses its own levels; pass levels without a budget")
    if levels > 1 and segments is not None and segments < 2:
        raise ValueError(f"remat.sequential: nested levels need at least 2 segments a level, got {segments}")
    if segments is not None and (not isinstance(segments, int) or isinstance(segments, bool) or segments < 1):
        raise ValueError(f"remat.sequential: segments must be a positive int, got {segments!r}")
    if segments is not None and levels == 1 and segments > len(blocks):
        warnings.warn(
            f"remat.sequential: segments={segments} over {len(blocks)} blocks: a segment holds at least one block, "
            f"so this runs as segments={len(blocks)} (every block its own segment, the last without remat). Pass "
            f"segments <= {len(blocks)}.", UserWarning, stacklevel=2)
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, (int, float)):
            raise TypeError(f"remat.sequential: budget must be bytes (int) or a fraction (float), got {budget!r}")
        if isinstance(budget, float) and not 0.0 <= budget <= 1.0:
            raise ValueError(f"remat.sequential: a fractional budget must be in [0, 1], got {budget}")
        if isinstance(budget, int) and budget < 0:
            raise ValueError(f"remat.sequential: budget must be >= 0 bytes, got {budget}")
    if offload is not None and not isinstance(offload, (bool, DeviceModel)):
        raise TypeError(f"remat.sequential: offload must be True, False, None or a remat.DeviceModel, got {offload!r}")
    if offload and budget is None:
        raise ValueError("remat.sequential: offload weighs copies against recomputes within a budget; pass budget= "
                         "too (or offload every block: remat(block, policy=policies.offload_to_cpu()))")
    if host_budget is not None and (not offload or isinstance(host_budget, bool) or not isinstance(host_budget, int)
                                    or host_budget < 0):
        raise ValueError(f"remat.sequential: host_budget must be bytes (an int >= 0) with offload, got {host_budget!r}")
    return Sequential(blocks, segments, budget, policy, levels, offload if offload else None, host_budget)
