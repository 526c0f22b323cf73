"""The full engine's recompute: one call of a remat'd function run again, under capture hooks, for what its
backward pass needs (``Frame._recompute`` in ``full.py`` calls :func:`run_recompute`).

The recompute rebuilds the forward's transform stack (NOTE [per-level replay] in ``_functorch.py``), restores the
module state, random-number and autocast state, and re-runs the function under the dispatch
:class:`~remat._dispatch.Replayer` (which hands back what the policy kept and skips dead and unused ops) and a
:class:`Capture`, whose pack hook takes the saved tensors at the positions the forward pass dropped, checks them
against what the forward pass saved there, and stops the run once it has them all. NOTE [unused outputs], NOTE
[what a recompute holds] and NOTE [nested remat] are in ``full.py``: an inner remat call re-run by an outer
recompute goes through :func:`call_nested_replay`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .. import _torch_internals as ti
from .._context import activated, internal
from .._dispatch import DeadRead, OpTap, Replayer, is_tainted, storage_key
from .._errors import RematError, input_written_before_backward, saved_shape_differs
from .._functorch import check_lower_levels, replay
from .._packed import Made, Nested, ParentHandle, made_anew
from .._torch_internals import saved_tensors_hooks
from .plans import is_placeholder

__all__ = ["run_recompute", "unused_ops", "Capture", "StopRecompute", "NOT_HELD", "holdable", "call_nested_replay"]


def run_recompute(frame: Any, s: int, skip_unused: bool, forwarding: list[Any]) -> Made:
    """Re-run ``frame``'s call for saving level ``s`` and return what it saves at the positions the forward pass
    dropped (``forwarding``: the calls still in their forward pass on this thread, whose recorders must not see
    the recompute's ops)."""
    frame.recomputes += 1
    check_lower_levels(frame.levels, s, frame.fn_name)
    flat = frame._inputs()
    for i, (a, v0) in enumerate(zip(flat, frame.versions)):
        if frame.routed and made_anew(frame.flat[i]):
            continue  # a copy from the parent (offloaded or recomputed there): the parent checked its source
        if isinstance(a, torch.Tensor) and v0 is not None and ti.unwrap_all(a)._version != v0:
            raise input_written_before_backward(frame.fn_name, i, a)
    detach = s < 0 and not torch.is_grad_enabled()
    # the replay stash this call routed through its parent: fetched now, outside any mode (NOTE [nested remat])
    routed = [h for r in frame.recorder.ops for h in r.stash or () if isinstance(h, ParentHandle)]
    for h in routed:
        h.value = h.fetch()
    try:
        try:
            return _attempt(frame, s, skip_unused, forwarding, detach, skip_dead=True)
        except DeadRead:
            # NOTE [dead ops]: an op the recompute needs read a placeholder, so the liveness walk missed a value
            # made where no dispatch mode sees it: run the recompute again without skipping any op (exact), and
            # leave no plan for the signature (its liveness came from this call's walk: NOTE [fast path])
            frame.liveness_missed = True
            return _attempt(frame, s, skip_unused, forwarding, detach, skip_dead=False)
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
        n = len(flat)
        vals, target = es.enter_context(
            replay(frame.levels, frame.decs + frame.state_decs, flat + frame.state.tensors, s))
        vals, state_vals = vals[:n], vals[n:]
        written = frame.recorder.written_outside
        if written:
            # state the forward pass wrote (a BatchNorm's statistics): the recompute's writes go to a
            # copy at the dispatch level (NOTE [outside tensors]), but autograd would still bump the real
            # buffer's version and give it the recompute's history: let the recompute write a stand-in
            with internal():
                state_vals = [v.detach().clone() if storage_key(ti.unwrap_all(t)) in written else v
                              for t, v in zip(frame.state.tensors, state_vals)]
        es.enter_context(frame.state.restored(state_vals))
        capture.target = target
        es.enter_context(frame.ambient.restored())
        es.enter_context(saved_tensors_hooks(capture.pack, capture.unpack))
        es.enter_context(replayer)
        es.enter_context(activated(capture))
        try:
            frame.run(vals)
            replayer.finish()
        except StopRecompute:
            pass
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
            "global, under torch.func), pass them as arguments."
        )
    return Made(captured, capture.versions)


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


# NOTE [one set of checks]
#     Both engines' recomputes take what the forward pass dropped through one rule, ``check_saved``: the tensor is
#     not a placeholder of a skipped op (else ``DeadRead``: the recompute runs again without skipping any op, NOTE
#     [dead ops]), it has the shape and dtype the forward pass saved there, and, where the forward pass noted which
#     node made it (a plan does), it was made by the same kind of node. The full engine's recompute also checks
#     every op it runs against the op the forward pass recorded (``Replayer``), and a planned one every op against
#     the plan's (``replay.Replay``), with the same comparison of what each op read (NOTE [same reads] in
#     ``_wiring.py``): a planned call skips recording, never a check.


def check_saved(fn_name: str, t: torch.Tensor, meta: tuple[Any, ...], pos: int, dead: bool) -> None:
    """The checks every recompute applies to a tensor it takes at save position ``pos`` (NOTE [one set of checks]).

    ``meta``: what the forward pass saved there, ``(shape, dtype)`` or ``(shape, dtype, maker node class)``;
    ``dead``: the tensor is, or shares the storage of, a placeholder the recompute made for a skipped op."""
    if dead:
        raise DeadRead  # NOTE [dead ops]: the backward pass would read a placeholder
    if t.shape != meta[0] or t.dtype != meta[1]:
        raise saved_shape_differs(fn_name, t, meta, pos)
    if len(meta) > 2:
        node = t.grad_fn
        if not _same_maker(None if node is None else type(node), meta[2]):
            raise RematError(
                f"remat: the recompute of {fn_name} saved a tensor made by "
                f"{_node_name(type(node) if node is not None else None)} where its forward pass saved one made by "
                f"{_node_name(meta[2])} (saved tensor #{pos}); the function must do the same work every time it "
                "is called (no branch on a flag or global state that changed since the forward pass)."
            )


class StopRecompute(Exception):
    """Raised by a partial recompute's pack hook once it has made every tensor it was asked for."""


class Capture:
    """Saved-tensor hooks of a recompute: keep what the saving level saves, in order."""

    def __init__(self, frame: Any, s: int, detach: bool) -> None:
        self.frame: Any = frame
        self.s = s
        self.target: int | None = None
        self.detach = detach
        # NOTE [what a recompute holds]: nothing will differentiate the recompute's graph (unless the function
        # runs a backward pass of its own inside, which reads it)
        self.drop_unused = detach and not frame.inner_backward and not frame.forwarding
        self.n = 0
        self.fn_name = frame.fn_name
        self.wanted = frame.drops.get(s, {})
        self.captured: dict[int, torch.Tensor] = {}
        self.versions: dict[int, int] = {}  # position -> version when made (NOTE [written after saved])
        self._children = iter(frame.nested.children)
        self.stop_after: int | None = None  # a partial recompute: stop after this many saves
        self.tainted: dict[int, Any] = {}  # the storages of the replayer's placeholders (NOTE [dead ops]): none saved

    def next_nested(self) -> Nested | None:
        """The routing of the next routed call this recompute re-runs (in forward order)."""
        return next(self._children, None)

    def pack(self, t: torch.Tensor) -> Any:
        top = ti.peek_interpreter()
        level = None if top is None else int(top.level())
        if level == self.target:
            pos = self.n
            self.n += 1
            meta = self.wanted.get(pos)
            if meta is not None:
                check_saved(self.fn_name, t, meta, pos, bool(self.tainted) and is_tainted(self.tainted, ti.unwrap_all(t)))
                held = holdable(t)
                self.versions[pos] = ti.unwrap_all(t)._version
                if self.detach and not ti.is_wrapped(t):
                    self.captured[pos] = held  # (one detach serves both)
                else:
                    with internal():
                        self.captured[pos] = t.detach() if self.detach else t
                if self.stop_after is not None and self.n >= self.stop_after:
                    raise StopRecompute
                return held
            if self.stop_after is not None and self.n >= self.stop_after:
                raise StopRecompute
            if self.drop_unused:
                return NOT_HELD  # NOTE [what a recompute holds]
        return holdable(t)

    def unpack(self, t: Any) -> Any:
        return t


class _NotHeld:
    """What a recompute's own graph holds for a tensor nobody will read (NOTE [what a recompute holds]).

    Autograd hands it to ``unpack``, which returns it, only if that graph is differentiated, which never happens;
    a node given it would fail loudly ("expected a Tensor"), never compute with a wrong value."""

    __slots__ = ()


NOT_HELD = _NotHeld()


def holdable(t: torch.Tensor, mode: bool = True) -> torch.Tensor:
    """What to hold for a saved tensor (in a pack hook) without a reference cycle, on either engine.

    A saved output's grad_fn is the node that saves it: holding the tensor itself
    would make a cycle through the C++ graph that Python's gc cannot see, and the
    graph with its activations would leak on every step. Autograd restores the
    graph metadata on unpack, so a plain tensor is detached. A functorch wrapper
    must keep its lower-level history (detach would strip every level), so its
    inner value is re-wrapped in a dead wrapper, which functorch treats as
    transparent, exactly like a saved wrapper of an exited level. ``mode``: one of
    remat's dispatch modes is on the stack (without one, a plain detach).
    """
    if ti.is_wrapped(t):
        top = ti.peek_interpreter()
        if top is not None and ti.maybe_level(t) == int(top.level()) and t.grad_fn is not None:
            return ti.dead_grad_wrapper(ti.unwrap_one(t))
        return t
    if not t.requires_grad or t.is_leaf:
        return t  # (a leaf, such as a parameter: no node of its own; is_leaf asks without making the node's Python
        # object, which t.grad_fn does: ~0.4 us a kept tensor, inside a planned call)
    if not mode:
        return t.detach()  # (save-nothing's forward pass: no mode of remat's is on the stack)
    if type(t) is torch.Tensor:
        return ti.detach_below_modes(t)  # (no mode sees it: no need to mark it remat's own)
    with internal():
        return t.detach()


class _PassThrough:
    """An inner remat call re-run by an outer recompute: its saves are the outer graph's own.

    The positions the call's forward pass routed to the parent (``nested.routed``) are
    saved through ``ctx`` again, so the outer recompute sees them at the same positions.
    """

    def __init__(self, ctx: Any, nested: Nested | None) -> None:
        self.ctx = ctx
        self.routed = set() if nested is None else nested.routed
        self._children = iter(() if nested is None else nested.children)
        self.n = 0
        self.drop_unused = getattr(ctx, "drop_unused", False)  # the outer recompute's graph is never differentiated

    def next_nested(self) -> Nested | None:
        return next(self._children, None)

    def pack(self, t: torch.Tensor) -> Any:
        pos = self.n
        self.n += 1
        if pos in self.routed:
            return self.ctx.pack(t)
        if self.drop_unused:
            # the inner call's own activations: its own frame recomputes them when the backward pass reaches it;
            # holding them here would keep every inner activation until the outer recompute ends
            # (NOTE [what a recompute holds])
            return NOT_HELD
        return holdable(t)

    def unpack(self, t: Any) -> Any:
        return t


def call_nested_replay(ctx: Any, run: Callable[[list[Any]], Any], flat: list[Any]) -> Any:
    """Run an inner remat call inside an outer recompute (NOTE [nested remat])."""
    nested = None
    if not ti.interpreter_stack():  # the forward made a routed frame for this call
        nested = ctx.next_nested()
        for a in flat:
            if isinstance(a, torch.Tensor):
                ctx.pack(a)
    pt = _PassThrough(ctx, nested)
    tap = OpTap({i for i, _ in nested.stash} if nested is not None else set())
    with saved_tensors_hooks(pt.pack, pt.unpack), activated(pt):
        if not tap.wanted:
            return run(flat)
        with tap:
            out = run(flat)
    assert nested is not None
    for i, j in nested.stash:  # the stash the forward pass routed, re-saved in the same order
        ctx.pack(tap.outputs[i][j])
    return out


def identity(x: Any) -> Any:
    return x


class PlannedCapture:
    __slots__ = ("wanted", "stop_after", "fn_name", "detach", "n", "captured", "placeholders", "mode", "versions",
                 "hold_stop")

    def __init__(self, wanted: dict[int, tuple[Any, ...]], stop_after: int, fn_name: str,
                 detach: bool, placeholders: dict[int, weakref.ref[torch.Tensor]], mode: bool) -> None:
        self.placeholders = placeholders
        self.mode = mode  # a planned recompute: remat's replay mode is on the stack
        self.wanted = wanted
        self.stop_after = stop_after
        self.fn_name = fn_name
        self.detach = detach
        self.n = 0
        self.captured: dict[int, torch.Tensor] = {}
        self.versions: dict[int, int] = {}  # position -> version when made (NOTE [written after saved])
        self.hold_stop = False  # NOTE [written after dropped]: the replay stops the recompute, after the last write

    def pack(self, t: torch.Tensor) -> Any:
        pos = self.n
        self.n = pos + 1
        meta = self.wanted.get(pos)
        if meta is not None:
            check_saved(self.fn_name, t, meta, pos, bool(self.placeholders) and is_placeholder(self.placeholders, t))
            held = holdable(t, self.mode)
            # without create_graph the backward pass needs the value only, not the recompute's graph
            self.captured[pos] = held if self.detach else t
            self.versions[pos] = t._version
        elif t.is_leaf:
            held = t  # an input, a parameter, a replayed output: no node of its own to make a cycle with
        else:
            held = holdable(t, self.mode)
        if self.n >= self.stop_after and not self.hold_stop:
            raise StopRecompute
        return held  # (the recompute's own graph: the function may run a backward pass of its own through it)

    def finish(self) -> Made:
        captured, self.captured = self.captured, {}
        return Made(captured, self.versions, plain=True)


def _node_name(cls: Any) -> str:
    return "no op (an input)" if cls is None else cls.__name__


# The nodes of one view, by how torch decomposed ``reshape``/``view``: a Python dispatch mode on the stack in the
# forward pass but not in the recompute (a user's memory census) turns ``view`` into ``_reshape_alias``.
_VIEWS = frozenset({"ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0"})


# The node of a module hook's identity wrapper (global full backward hooks, made under grad mode in one pass only:
# NOTE [hooks' aliases] in _dispatch.py): the same value as whatever made its input, so it matches any maker.
_HOOK_NODES = frozenset({"BackwardHookFunctionBackward"})


def _same_maker(got: Any, want: Any) -> bool:
    """Whether a recomputed saved tensor was made as the forward's was (node classes, a view as any view, a hook's
    identity wrapper as anything)."""
    return got is want or (got is not None and want is not None and got.__name__ in _VIEWS
                           and want.__name__ in _VIEWS) or (
        (got is not None and got.__name__ in _HOOK_NODES) or (want is not None and want.__name__ in _HOOK_NODES))
