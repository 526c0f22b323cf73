"""The full engine's recompute: one call of a remat'd function run again, under capture hooks, for what its
backward pass needs (``Frame._recompute`` in ``full.py`` calls :func:`run_recompute`).

The recompute rebuilds the forward's transform stack (NOTE [per-level replay] in ``_engine/functorch.py``), restores the
module state, random-number and autocast state, and re-runs the function under the dispatch
:class:`~remat._engine.dispatch.Replayer` (which hands back what the policy kept and skips dead and unused ops) and a
:class:`Capture`, whose pack hook takes the saved tensors at the positions the forward pass dropped, checks them
against what the forward pass saved there, and stops the run once it has them all. NOTE [unused outputs], NOTE
[what a recompute holds] and NOTE [nested remat] are in ``full.py``: an inner remat call re-run by an outer
recompute goes through :func:`call_nested_replay`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from .. import _torch_internals as ti
from .._context import activated, active_context, internal
from .._errors import RematError, ended_level_read, input_written_before_backward, internal_error
from .._torch_internals import saved_tensors_hooks
from . import outside as ox
from .capture import Capture, PassThrough, StopRecompute
from .dispatch import OpTap
from .functorch import below_all_levels, check_lower_levels, replay
from .ops import DeadRead, storage_key
from .packed import Made, ParentHandle, made_anew
from .program import GAVE_WAY, NoHookRegistration
from .replay import Replayer
from .wiring import known_tokens

__all__ = ["fingerprints", "check_fingerprints", "run_recompute", "unused_ops", "call_nested_replay"]


def run_recompute(frame: Any, s: int, skip_unused: bool, forwarding: list[Any]) -> Made:
    """Re-run ``frame``'s call for saving level ``s`` and return what it saves at the positions the forward pass
    dropped (``forwarding``: the calls still in their forward pass on this thread, whose recorders must not see
    the recompute's ops)."""
    frame.recomputes += 1
    check_lower_levels(frame.levels, s, frame.fn_name)
    flat = frame._inputs()
    read: set[int] | None = None  # the storages the call's ops read (an input none reads reaches nothing)
    for i, (a, v0) in enumerate(zip(flat, frame.versions)):
        if frame.routed and made_anew(frame.flat[i]):
            continue  # a copy from the parent (offloaded or recomputed there): the parent checked its source
        if isinstance(a, torch.Tensor) and v0 is not None and ti.unwrap_all(a)._version != v0:
            if read is None:
                read = {k for r in frame.recorder.ops for k in r.in_keys}
            with internal():
                if storage_key(ti.unwrap_all(a)) not in read:
                    continue
            raise input_written_before_backward(frame.fn_name, i, a)
    if frame.fingerprints is not None:
        check_fingerprints(frame, flat)
    detach = s < 0 and not torch.is_grad_enabled()
    # the replay stash this call routed through its parent: fetched now, outside any mode (NOTE [nested remat])
    routed = [h for r in frame.recorder.ops for h in r.stash or () if isinstance(h, ParentHandle)]
    for h in routed:
        h.value = h.fetch()
    try:
        if sum(1 for lv in frame.levels if lv.kind == "grad") > 1 and \
                any(r.stash is not None for r in frame.recorder.ops):
            # NOTE [dead ops] under two reverse levels (grad(grad), jacrev(grad), grad(vjp)) with outputs kept
            # (NOTE [kept under higher-order grad]): the outer level's backward pass walks the inner's, which saved
            # the recompute's values where no capture hook sees a placeholder read (NaN gradients, an index of
            # uninitialised memory); every op runs
            return _attempt(frame, s, skip_unused, forwarding, detach, skip_dead=False)
        try:
            return _attempt(frame, s, skip_unused, forwarding, detach, skip_dead=True)
        except DeadRead:
            # NOTE [dead ops]: an op the recompute needs read a placeholder, so the liveness walk missed a value
            # made where no dispatch mode sees it: run the recompute again without skipping any op (exact)
            try:
                return _attempt(frame, s, skip_unused, forwarding, detach, skip_dead=False)
            except DeadRead:
                raise internal_error(f"the recompute of {frame.fn_name} read a value it let go of, with no op skipped") from None
    finally:
        for h in routed:
            h.value = None


def _attempt(frame: Any, s: int, skip_unused: bool, forwarding: list[Any], detach: bool, skip_dead: bool) -> Made:
    """One run of the recompute (``run_recompute``); ``skip_dead``: dead ops hand back placeholders."""
    flat = frame._inputs()
    capture = Capture(frame, s, detach)
    # the backward pass of the outputs' own level (plain autograd, or a lone grad/vjp level)
    unused = (unused_ops(frame, s) if skip_unused and skip_dead and not frame.forwarding
              and s == len(frame.levels) - 1 else set())
    # NOTE [backward inside the forward pass]
    partial = frame.forwarding
    if partial:
        if frame.levels:
            raise RematError(
                f"remat: {frame.fn_name} runs a backward pass (torch.autograd.grad) inside its own forward "
                "pass that reads a tensor remat dropped, under torch.func transforms, which remat does not "
                "support yet. Use a policy that saves what the inner backward pass reads "
                "(policies.everything_saveable), or remat the function outside the transform."
            )
        capture.stop_after = frame.counts.get(s, 0)
    replayer = Replayer(frame.recorder, unused, skip_dead)
    capture.tainted = replayer.tainted
    with contextlib.ExitStack() as es:
        # every call still in its forward pass has its recorder on the mode stack: none of them may see
        # the recompute's ops (this call's, if it is forwarding, and its enclosing calls')
        for f in forwarding:
            es.enter_context(f.recorder.paused())
        es.enter_context(ti.saved_tensors_hooks_enabled())
        es.enter_context(ti.outside_legacy_vmap())
        if torch.is_inference_mode_enabled():  # (a backward pass under inference_mode: its values track versions)
            es.enter_context(torch.inference_mode(False))
        n = len(flat)
        vals, target = es.enter_context(
            replay(frame.levels, frame.decs + frame.state_decs, flat + frame.state.tensors, s))
        vals, state_vals = vals[:n], vals[n:]
        if replayer.wiring is not None:  # (the recompute's inputs: a routed call's come from its parent, anew)
            replayer.wiring.known = known_tokens(vals, ti.unwrap_all)
        written = frame.recorder.written_outside
        if written:
            # state the forward pass wrote (a BatchNorm's statistics): the recompute's writes go to a
            # copy at the dispatch level (NOTE [outside tensors]), but autograd would still bump the real
            # buffer's version and give it the recompute's history: let the recompute write a stand-in
            with internal():
                # (a stand-in of a parameter needs a gradient as it does, so that the ops reading it save what the
                # forward pass's saved: nn.Embedding(max_norm=...) renormalises its weight's rows under no_grad)
                state_vals = [_stand_in(v) if storage_key(ti.unwrap_all(t)) in written else v
                              for t, v in zip(frame.state.tensors, state_vals)]
        es.enter_context(frame.state.restored(state_vals))
        capture.target = target
        es.enter_context(frame.ambient.restored())
        es.enter_context(saved_tensors_hooks(capture.pack, capture.unpack))
        es.enter_context(replayer)
        es.enter_context(activated(capture))
        try:
            program = frame.program
            # NOTE [program replay]: the forward's calls, not its Python
            if program is None or program.spoiled is not None or not program.replay(vals, state_vals):
                with NoHookRegistration():
                    frame.run(vals)
            replayer.finish()
        except StopRecompute:
            pass
        except RuntimeError as e:
            if "level <= current_level" in str(e):  # (functorch's assert on a wrapper of a level that ended)
                raise RematError(str(ended_level_read(frame.fn_name)) + _opaque_hint(flat)) from e
            raise
    frame._skipped[s] = replayer.unused_keys
    captured, capture.captured, capture.frame = capture.captured, {}, None  # no cycle via the hooks
    if partial and capture.n >= frame.counts.get(s, 0):
        pass  # stopped once it had made everything saved so far
    elif capture.n != frame.counts.get(s, 0):
        raise RematError(
            f"remat: the recompute of {frame.fn_name} saved {capture.n} tensors for the backward pass "
            f"where its forward pass saved {frame.counts.get(s, 0)}; the function must do the same "
            "work every time it is called (no data-dependent branches or changing global state). If it "
            "reads tensors that are not its arguments from somewhere remat does not look (a dict or a "
            "global, under torch.func), pass them as arguments." + _opaque_hint(flat)
        )
    return Made(captured, capture.versions)


def _opaque_hint(flat: list[Any]) -> str:
    """A hint naming the arguments that hold tensors remat cannot see into (an object of a class no pytree knows:
    its tensors are not inputs of the call, and under torch.func the recompute reads the forward's)."""
    kinds = sorted({type(a).__name__ for a in flat if not isinstance(a, torch.Tensor) and any(
        isinstance(v, torch.Tensor) for v in getattr(a, "__dict__", {}).values())})
    if not kinds:
        return ""
    return (f" An argument of type {', '.join(kinds)} holds tensors that remat does not see as arguments (its class "
            "is not a pytree): pass them in a dataclass, a dict or a tuple, or register the class with "
            "optree.register_pytree_node.")


def _stand_in(v: torch.Tensor) -> torch.Tensor:
    """A copy of state the call wrote, for its recompute to write; one that needs a gradient as ``v`` does, and is
    no leaf (a write into a leaf that needs one raises: ``g.mul_(1.5)`` under grad mode). Under ``torch.func`` a
    clone of ``v`` at its level (a detached copy there would need no gradient at the level, and the ops reading it
    would save less than the forward pass's; so too where it needs none at its own level but does at an outer one:
    a gradient penalty's ``grad(grad(f))`` differentiates the weight ``nn.Embedding(max_norm=...)`` renormalises only
    at the outer level, and a detached copy lost that level's history, silently)."""
    if ti.interpreter_stack() and ti.is_wrapped(v):
        return v.clone()
    c = v.detach().clone()
    return c.requires_grad_().clone() if v.requires_grad and c.is_leaf else c


def unused_ops(frame: Any, s: int) -> set[int]:
    """NOTE [unused outputs]: the ops the recompute may skip because they feed only outputs this backward
    pass does not differentiate (JAX removes them with its dead-code elimination, ``test_remat_eqn_dce``).

    An output whose tensor is still alive is unused when the engine will not run its node; one whose
    tensor and node both died (its prehook with it) is unused too; otherwise it counts as used. The ops
    reaching no used output are skipped like dead ops (NOTE [dead ops]): the saved tensors they would
    make are read only by nodes that do not run.
    """
    if not frame._outs:
        return set()
    used: set[int] = set()
    skipped = False
    for i, (ref, key, ran, version) in enumerate(frame._outs):
        t = ref()
        if t is None:
            # the tensor died: its node too (and the prehook it held) unless something computed from it lives
            # (only on the first recompute: a later one is usually a double backward, which reaches the
            # forward's nodes through the first backward's graph, and would recompute twice)
            if ran is not None and ran() is None and s not in frame._skipped:
                skipped = True
            else:
                used.add(key)
            continue
        node = t.grad_fn  # (written in place since: not the node the forward made, so it cannot tell)
        if node is None or t._version != version or i in frame._ran or ti.will_engine_execute(node):
            used.add(key)
        else:
            skipped = True
    return frame.recorder.unused_ops(used) if skipped else set()


class NestedProgram:
    """NOTE [nested programs] in program.py: a remat call inside another full-engine call's forward pass (under
    ``torch.func``, a memory budget's measuring call), as one call of the enclosing call's program. The enclosing recompute runs it as a nested call (``call_nested_replay``)
    whose body is the inner call's program, on the inputs and the module state and closed-over tensors the
    enclosing program hands it (its values then); its Python only where that program gives way."""

    def __init__(self, program: Any, run: Callable[[list[Any]], Any], n: int) -> None:
        self.program = program
        self.run = run
        self.n = n  # (the call's leaves, then its state)

    def __call__(self, *leaves: Any) -> Any:
        flat, state = list(leaves[:self.n]), list(leaves[self.n:])

        def body(vals: list[Any]) -> Any:
            if self.program.spoiled is None:
                out = self.program.result(vals, state)
                if out is not GAVE_WAY:
                    return out
            return self.run(vals)

        return call_nested_replay(active_context(), body, flat)


def call_nested_replay(ctx: Any, run: Callable[[list[Any]], Any], flat: list[Any]) -> Any:
    """Run an inner remat call inside an outer recompute (NOTE [nested remat])."""
    nested = None
    if not ti.interpreter_stack():  # the forward made a routed frame for this call
        nested = ctx.next_nested()
        for a in flat:
            if isinstance(a, torch.Tensor):
                ctx.pack(a)
    pt = PassThrough(ctx, nested)
    tap = OpTap({i for i, _ in nested.stash} if nested is not None else set())
    with saved_tensors_hooks(pt.pack, pt.unpack), activated(pt):
        if not tap.wanted:
            return run(flat)
        with tap:
            out = run(flat)
    assert nested is not None
    for i, j in nested.stash:  # the stash the forward pass routed, re-saved in the same order
        outs = tap.outputs.get(i)
        if outs is None or j >= len(outs):
            raise RematError(
                f"remat: an enclosing recompute ran a nested remat'd call again and did not meet op #{i} of its "
                "forward pass (the inner call ran other ops; seen with a memory_budget plan that another function "
                "of the same code learned). Give the inner call a fixed policy, or a memory_budget of its own; if "
                "neither applies, please report it with the code."
            )
        ctx.pack(outs[j])
    return out


# NOTE [values between the passes]
#     A write into an input or a module's parameter between the forward and the backward pass moves its version
#     counter, and the recompute refuses it (``input_written_before_backward``; the outside-tensor check for module
#     state). A write through ``.data`` (or into a detached alias made by ``torch.no_grad`` code) moves no counter:
#     nothing tells remat, and by default the recompute computes from the written values, as
#     ``torch.utils.checkpoint`` does (docs/how-it-works.md says what plain autograd then does). Seeing it takes
#     the values themselves, which costs a pass over every input and parameter on every call; so only
#     ``debug=True`` pays it: when the forward pass ends, a call that dropped
#     anything keeps a hash of each plain input and module-state tensor (``_outside.fingerprint``, holding nothing),
#     and its recompute compares before it runs, raising ``RematError`` that names the tensor.


def fingerprints(tensors: list[Any]) -> list[Any]:
    """NOTE [values between the passes]: a hash of each plain tensor of ``tensors`` (None for anything else)."""
    out: list[Any] = []
    with internal(), below_all_levels():  # (under a torch.func level, an op on a plain tensor returns a wrapper)
        for t in tensors:
            u = ti.unwrap_all(t) if isinstance(t, torch.Tensor) else None
            plain = u is not None and type(u) in (torch.Tensor, torch.nn.Parameter) and u.layout == torch.strided
            out.append(ox.fingerprint(u) if plain else None)  # type: ignore[arg-type]
    return out


def check_fingerprints(frame: Any, flat: list[Any]) -> None:
    """NOTE [values between the passes]: raise if an input or module-state tensor's value changed since the forward
    pass ended without moving its version counter."""
    tensors = list(flat) + frame.state.tensors
    now = fingerprints(tensors)
    for i, (a, b, t) in enumerate(zip(frame.fingerprints, now, tensors)):
        if a is not None and a != b:
            n = len(flat)
            what = f"input #{i}" if i < n else f"the tensor {frame.state.label_of(t) or f'#{i - n} of its module state'}"
            raise RematError(
                f"remat: {what} (shape {list(t.shape)}) of {frame.fn_name} changed value between its forward and its "
                "backward pass (written in place, through .data or a detached alias, or under torch.no_grad()): the "
                "recompute would compute from the new values, and the gradient would not be that of the forward "
                "pass's computation. Update it after the backward pass (optimizer.step() after backward()), or write "
                "a clone; NOTE [values between the passes] in remat/_engine/recompute.py."
            )
