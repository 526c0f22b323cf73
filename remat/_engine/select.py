"""Which engine runs one call of a remat'd function: the route table, read top to bottom, first match wins.

====  ==========================================================  ============================================
 #    when                                                        route
====  ==========================================================  ============================================
 1    nothing will be saved (no grad, no ``torch.func`` level),   the function, plainly
      or ``make_fx`` is tracing (NOTE [under make_fx])
 2    an outer re-run recompute is re-running this call           ``recompute.call_nested_replay``
 3    the function enters a ``torch.func`` reverse transform      ``region.run_region`` (NOTE [reentrant region])
 4    a memory budget is still measuring this signature           ``traced.TraceFrame`` where 5 holds, else
                                                                  ``full.Frame``, measuring (NOTE [memory budget])
 5    plain autograd: no ``torch.func`` level, plain tensors,     ``traced.TraceFrame``: the forward pass is
      not ``debug``, no ``saved_residuals`` listening             recorded, the recompute replays it
 6    otherwise                                                   ``full.Frame``
====  ==========================================================  ============================================

On routes 4 and 6 (unless ``debug``), the recompute replays the call's program, the torch calls its forward pass
made (NOTE [program replay] in program.py), where it can; otherwise (``debug``, a program that gives way) it re-runs
the function's Python, checking each op against the forward pass's; docs/how-it-works.md lists why each case that
takes them cannot replay. A call inside a traced call (route 5) that cannot be traced itself runs plainly: the enclosing
trace records its ops. A call of route 4 to 6 that finds, mid-way, that the function enters a reverse transform
(``NeedsRegion``) marks its function as a region and runs again from the top (route 3), from the outermost remat
call.
"""

from __future__ import annotations

import collections.abc
import sys
import warnings
from collections.abc import Callable
from typing import Any

import optree
import torch

from .. import _torch_internals as ti
from .._budgets.budget_policy import MemoryBudget
from .._context import INSPECTOR, active_context, internal
from .._errors import RematError, hooks_disabled, inference_tensor
from .._offload import default_engine
from .._policies.core import nothing_saveable
from .frame import CallFrame
from .full import Frame
from .leaves import dataclass_fields
from .program import Program
from .recompute import NestedProgram, call_nested_replay
from .region import NeedsRegion, enclosed, run_region
from .signature import signature
from .state import snapshot
from .traced import TraceFrame

__all__ = ["call"]


class _Static:
    """Placeholder for a static argument inside the flattened pytree of dynamic ones."""

    __slots__ = ()


_STATIC = _Static()
_ENGINES: tuple[type[CallFrame], ...] = (Frame, TraceFrame)  # (mypy checks that both engines' frames are CallFrames)


def traceable(flat: list[Any], state_tensors: list[torch.Tensor], modules: list[Any]) -> bool:
    """Whether the replay engine takes a call of these inputs and module state: plain tensors only (a wrapper
    subclass such as DTensor makes values in Python where no mode sees: the full engine handles those), and no
    FSDP2 module below the first one the call reaches: FSDP2 frees such a module's gathered parameters after its
    forward pass and gathers them again only when the backward pass reaches it, after the replay would read them
    (NOTE [FSDP's hooks] in _engine/dispatch.py; the full engine runs the hooks again)."""
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    if fsdp is not None and any(isinstance(m, fsdp) for m in modules[1:]):
        return False
    return all(type(t) is torch.Tensor or type(t) is torch.nn.Parameter
               for t in (*(a for a in flat if isinstance(a, torch.Tensor)), *state_tensors))


def call(fn: Callable[..., Any], name: str, policy: Callable[..., Any], statics: tuple[int, ...],
         preserve_rng: bool, args: tuple[Any, ...], kwargs: dict[str, Any], owner: Any = None,
         attempt: int = 0, draws: list[tuple[Any, torch.Tensor]] | None = None) -> Any:
    """Run one call of ``fn`` under ``policy`` on the engine the route table picks (``owner``: its ``Rematted``,
    which holds what is learnt about the function: whether it is a region)."""
    flat, run, static_vals = _flatten(fn, name, statics, args, kwargs)
    for i, a in enumerate(flat):
        if isinstance(a, collections.abc.Iterator) and not isinstance(a, torch.Tensor):
            raise TypeError(
                f"remat: {name} was called with a {type(a).__name__} (an iterator) among its arguments (leaf #{i}); "
                "an iterator is used up by the forward pass, and a recompute that runs the function again would "
                "find it empty. Pass a list or a tuple instead (list(...) of it)."
            )
    # 1. nothing will be saved: no frame needed
    if not torch.is_grad_enabled() and not ti.interpreter_stack():
        return run(flat)
    if ti.tracing_with_make_fx():
        # NOTE [under make_fx]: a trace (torch.func.linearize's of its jvp, make_fx's) would record the recompute's ops
        # but neither the generator states a replayed random op puts back nor the offload engine's copies: the
        # traced graph would draw other numbers, or read trace-time constants. The function runs as it is.
        return run(flat)
    # (what is learnt about the function is shared by every remat of it: a remat(f) made anew on every call inside
    # another remat'd function learns it from the first attempt)
    region = owner is not None and owner._learnt.get("region", False)
    ctx = active_context()
    # 2. an outer recompute re-runs this call
    if ctx is not None and not isinstance(ctx, (Frame, TraceFrame)) and not region:
        return call_nested_replay(ctx, run, flat)
    # NOTE [state is an input]: what fn reads besides its arguments, held like them
    state = snapshot(fn, [a for a in flat if not isinstance(a, torch.Tensor)] + list(static_vals.values()))
    if state.lazy:
        warnings.warn(f"remat: {name} reaches a lazy module (nn.LazyLinear & co.) whose parameters are not made yet: "
                      "this call, which makes them, runs without remat (it keeps what plain autograd keeps); the "
                      "calls after it are remat'd.", stacklevel=3)
        return run(flat)
    with internal():  # (is_inference is a torch function: an enclosing call's program must not record it)
        for i, a in enumerate(flat):
            if isinstance(a, torch.Tensor) and ti.unwrap_all(a).is_inference():
                raise inference_tensor(name, f"its input #{i}", a)
    outermost = not enclosed()
    in_trace = isinstance(ctx, TraceFrame)
    # the replay engine (NOTE [the trace] in trace.py): no torch.func level, no listener, plain tensors
    traced = ((ctx is None or in_trace) and owner is not None and not owner.debug and not region
              and INSPECTOR.get() is None and not ti.interpreter_stack()
              and traceable(flat, state.tensors, state.modules))
    if in_trace and not traced:
        return run(flat)  # inside a traced call that this call cannot join: the enclosing trace records it
    if (msg := ti.saved_tensors_hooks_disabled_message()) is not None and not ti.interpreter_stack():
        # (under torch.func, the transform's own: remat's hooks are safe there)
        if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in (*flat, *state.tensors)):
            return run(flat)  # nothing needs a gradient: nothing will be saved
        raise hooks_disabled(name, msg)
    frame: CallFrame | None = None
    budget, measuring, call_policy = None, None, policy
    if isinstance(policy, MemoryBudget):  # NOTE [budget plans] in _budgets/budget_policy.py: decided per signature
        budget = policy
        # per function (its code: identical blocks share a plan) and signature, with the torch.func levels
        code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__func__", None), "__code__", None)
        bkey = (code or type(fn), signature(flat, static_vals, state),
                tuple(str(i.key()) for i in ti.interpreter_stack()))
        call_policy, measuring = budget.bind(bkey)
        if in_trace and measuring is not None:
            # inside a traced call, which records this one: no frame of its own to measure with; it saves nothing
            # (the enclosing call's policy decides what survives), and learns its plan when called on its own
            call_policy, measuring = nothing_saveable, None
        if region:
            # a function that enters a torch.func reverse transform runs as a reentrant region every time: it saves
            # nothing (the measuring policy), and never gets a plan (docs/budgets.md)
            measuring = None
    try:
        # 3. the function enters a torch.func reverse transform
        if region:
            return run_region(run, flat, name, call_policy, preserve_rng, state, draws)
        # 4. a memory budget measuring this signature: on the replay engine where it serves (NOTE [budget plans])
        if measuring is not None and traced:
            frame = TraceFrame(run, flat, name, call_policy, default_engine(), state.label_of)
            frame.measure = measuring
            assert budget is not None
            try:
                out = frame.forward()
            except RematError:
                budget.give_up(bkey)  # (as below: after a second refusal the signature saves nothing)
                raise
            budget.learn_trace(bkey, call_policy, measuring, frame.trace)
            return out
        if measuring is not None:
            frame = Frame(run, flat, name, call_policy, preserve_rng, default_engine(), state)
            frame.watch_values = owner is not None and owner.debug  # NOTE [values between the passes]
            outer = _with_program(frame, ctx, owner)  # NOTE [program replay]: its recompute replays too
            measuring.frame = frame
            was = INSPECTOR.get()
            try:
                INSPECTOR.set(measuring)
                out = _forward(frame, outer, run, flat, state.tensors)
            except RematError:
                # the measuring call's engine refused what the replay serves (an input written in place): after a
                # second refusal the signature saves nothing, on the replay engine, rather than measure and raise
                assert budget is not None
                budget.give_up(bkey)
                raise
            finally:
                INSPECTOR.set(was)
            assert budget is not None
            budget.learn(bkey, call_policy, measuring, frame.recorder.ops)
            return out
        # 5. the replay engine
        if traced:
            frame = TraceFrame(run, flat, name, call_policy, default_engine(), state.label_of)
            return frame.forward()
        # 6. the full engine
        frame = Frame(run, flat, name, call_policy, preserve_rng, default_engine(), state)
        frame.watch_values = owner is not None and owner.debug  # NOTE [values between the passes]
        outer = _with_program(frame, ctx, owner)  # NOTE [program replay]: the recompute replays the forward's calls
        return _forward(frame, outer, run, flat, state.tensors)
    except NeedsRegion as e:
        # NOTE [reentrant region]: fn (or a remat'd function it calls) enters a torch.func reverse transform
        if frame is not None and e.origin is frame:
            if owner is None:  # (every remat call has its Rematted; a module's forward too)
                raise RematError(f"remat: {name} enters a torch.func reverse transform; this is a bug in remat, "
                                 "please report it") from e.cause
            owner._learnt["region"] = True
        if not outermost:
            raise  # the enclosing calls recorded the attempt: the outermost remat call runs again
        if frame is not None:
            draws = _draws(frame) if e.origin is frame else None
            frame.rewind()
        elif e.rewind is not None:
            e.rewind()
    if attempt >= 3:
        raise RematError(
            f"remat: {name} (or a remat'd function it calls) enters torch.func.grad, vjp, jacrev or hessian, and "
            "running it again as one region (NOTE [reentrant region]) did not settle after 3 attempts; this is a "
            "bug in remat, please report it. Meanwhile, remat the parts on either side of the inner transform."
        )
    return call(fn, name, policy, statics, preserve_rng, args, kwargs, owner, attempt + 1, draws)


def _draws(frame: CallFrame) -> list[tuple[Any, torch.Tensor]]:
    """The generators a forward pass cut short drew from, with their states before each draw, in order."""
    if isinstance(frame, TraceFrame):
        return [s.rng for s in frame.trace.steps if s.rng is not None]
    assert isinstance(frame, Frame)
    return [r.rng for r in frame.recorder.ops if r.rng is not None]


def _with_program(frame: Frame, ctx: Any, owner: Any) -> Program | None:
    """Give a full-engine call its program (NOTE [program replay]): an outermost call, or one nested in a call whose
    program can record it as one of its calls (NOTE [nested programs] in program.py: returned, that program)."""
    if owner is None or owner.debug:
        return None
    outer = ctx.program if isinstance(ctx, Frame) and ctx.program is not None and ctx.program.takes_nested() else None
    if ctx is None or outer is not None:
        frame.program = Program(frame.fn_name)
        frame.program.nested = outer is not None
    return outer


def _forward(frame: Frame, outer: Program | None, run: Callable[[list[Any]], Any], flat: list[Any],
             state: list[torch.Tensor]) -> Any:
    """The call's forward pass; nested, as one call of the enclosing program, replayed as this call's program."""
    if outer is None or frame.program is None:
        return frame.forward()
    return outer.record_nested(NestedProgram(frame.program, run, len(flat)), flat, state, frame.forward)


def _flatten(fn: Callable[..., Any], name: str, statics: tuple[int, ...], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> tuple[list[Any], Callable[[list[Any]], Any], dict[int, Any]]:
    """The call's leaves (static arguments left out), the function of them that runs ``fn``, and the statics."""
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
    flat, collapse = dataclass_fields(flat)

    # run must not close over args: the frame holds run until the backward pass, and the
    # tensors in args (which a nested call hands to its parent to drop) would stay alive
    static_vals = {i: args[i] for i in static_pos}
    # ...but until its first run: the forward pass, given these very leaves, runs on the caller's own containers (a
    # list the function appends to is the caller's, as in plain autograd); a recompute, on rebuilt ones
    first: list[Any] = [args, kwargs, flat]

    def run(leaves: list[Any]) -> Any:
        if first:
            a0, kw0, flat0 = first
            first.clear()
            if len(leaves) == len(flat0) and all(x is y for x, y in zip(leaves, flat0)):
                return fn(*a0, **kw0)
        dargs, kw = optree.tree_unflatten(spec, leaves if collapse is None else collapse(leaves))
        full = tuple(static_vals[i] if i in static_vals else a for i, a in enumerate(dargs))
        return fn(*full, **kw)

    return flat, run, static_vals
