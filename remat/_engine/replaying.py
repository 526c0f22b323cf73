"""The recompute of the replay engine: run again the recorded steps a backward pass needs, never the user's Python.

NOTE [replay]
    ``plan`` walks the trace backwards from the slots the backward pass needs (the saved tensors the policy
    dropped) and keeps every step that makes one of them, or that writes into the storage of one (a write
    through a view changes a value without renaming it), until what it needs is *available*: an outside
    tensor (or its snapshot, NOTE [outside writes]), a value the policy kept, one the offload engine holds, or
    one the enclosing call holds for a nested call. ``run`` then calls those steps' overloads in their recorded
    order, below autograd (or, when the backward pass builds a graph, with grad mode as each step had it),
    with autocast off (the trace holds the casts autocast made), the call's kernel flags, and each random
    step's generator state put back (then restored). Each replayed value is let go after its last reader.

    What it refuses, as plain autograd would: an outside tensor the replay reads that was written in place
    since the forward pass read it (its version moved). A saved tensor written in place after it was saved is
    refused at its unpack (``traced.py``).

NOTE [graph replay]
    A backward pass that builds a graph (``create_graph=True``, double backward) needs the dropped tensors with
    their history. Then the replay reads only outside tensors (the inputs with their history), ignores kept
    values (detached), and runs each step with grad mode as it had it. A custom ``autograd.Function`` inside the
    call ran its ops without grad: replayed, their outputs would lack the Function's backward, so a replay with a
    graph through one raises instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Container, Iterable
from typing import Any

import optree
import torch

from .. import _errors as errors
from .. import _torch_internals as ti
from .._context import internal
from .._errors import RematError
from . import outside as ox
from .ambient import draw_as_recorded, put_settings
from .ambient import settings as ambient_settings
from .ops import FLAT, Step, op_info, version_watches
from .trace import Trace, unseen_aliases

__all__ = ["plan", "run", "ancestors", "watches", "adopt"]

Tensor = torch.Tensor
_Parameter = torch.nn.Parameter
set_grad_mode = ti.set_grad_mode


def plan(trace: Trace, wanted: set[int], available: Container[int],
         forced: frozenset[int] = frozenset()) -> tuple[list[Step], list[list[int]]]:
    """The steps to replay, in order, to make the ``wanted`` slots (NOTE [replay]); with each, the slots let go
    after it (read last by it, or made by it and read by none). ``forced``: slots made again although available."""
    need = {s for s in wanted if s not in available} | forced
    if trace.quiet_written:
        need |= _stale(trace, wanted, available)
    if not need:
        return [], []
    # from the last step back: a write into a wanted tensor's storage that autograd does not see (through .data, an
    # alias with a version counter of its own) is part of the value the backward pass reads, as in plain autograd,
    # whenever it happened in the forward pass; a write it sees raises at the unpack (``Trace.after_write``). A call
    # that wrote nothing in place (the common case) needs no storage keys.
    key_of = trace.key_of
    writes = bool(trace.written_keys)
    steps = trace.steps
    need_keys = {key_of.get(s, 0) for s in need} if writes else set()
    parts = trace.parts if writes else {}  # (a sparse tensor's indices: written as its values may be)
    for s in need if parts else ():
        need_keys.update(parts.get(s, ()))
    need_keys.discard(0)
    out: list[Step] = []
    frees: list[list[int]] = []
    read_later: set[int] = set()  # slots a step after this one reads (the walk goes backwards)
    for i in range(len(steps) - 1, -1, -1):
        step = steps[i]
        for o in step.outs:
            if o in need:
                break
        else:
            if not (writes and step.writes and any(k in need_keys for k in step.writes)):
                continue
        out.append(step)
        free = []
        for o in step.outs:
            if o not in read_later and o >= 0 and o not in wanted:
                free.append(o)
        for _, _, s in step.refs:
            if s not in read_later:
                read_later.add(s)
                if s not in wanted:
                    free.append(s)
                if s not in need and s not in available:
                    need.add(s)
            if writes:
                k = key_of.get(s, 0)
                if k:
                    need_keys.add(k)  # a write into what this step reads, before it, is replayed too
                if parts and s in parts:
                    need_keys.update(parts[s])
        frees.append(free)
    out.reverse()
    frees.reverse()
    if writes:
        # a replayed write into a value available as a copy (a kept piece of ``unsafe_chunk``) whose op read a value
        # the replay makes on the same storage: the write belongs in that value, so the piece is made again from it
        extra = set()
        for step in out:
            if step.writes:
                for _, _, s in step.refs:
                    k = key_of.get(s, 0)
                    p = trace.producer.get(s)
                    while p is not None and p.refs and op_info(p.op).view:  # (written through a view of it: b.data)
                        s = p.refs[0][2]
                        p = trace.producer.get(s)
                    if s not in need and k in step.writes and s not in trace.outside:
                        if p is not None and any(r in need and key_of.get(r) == k for _, _, r in p.refs):
                            extra.add(s)
        if extra:
            return plan(trace, wanted, available, forced | extra)
    return out, frees


def _grad_off(source: Callable[[int], Tensor]) -> Callable[[int], Tensor]:
    """``source`` run with grad mode off, as the backward pass that asked for the replay has it."""

    def run(s: int) -> Tensor:
        set_grad_mode(False)
        try:
            return source(s)
        finally:
            set_grad_mode(True)

    return run


def _stale(trace: Trace, wanted: set[int], available: Container[int]) -> set[int]:
    """The wanted slots available only as a copy taken before a write of the call changed them where no version
    counter shows (NOTE [quiet writes] in trace.py): made again, the write with them."""
    quiet = trace.quiet_written
    return {s for s in wanted if s in quiet and s in available} if quiet else set()


def _unfollowed(a: Any) -> Any:
    """``a`` (a tensor, or a list of them) as aliases autograd does not follow (``.data``)."""
    return [x.data for x in a] if type(a) is list or type(a) is tuple else a.data


def ancestors(trace: Trace, slots: set[int]) -> set[int]:
    """Every slot the values of ``slots`` were computed from (writes into their storages included): NOTE [unused
    outputs] in traced.py."""
    anc = set(slots)
    keys = {k for s in slots for k in (trace.key_of.get(s, 0), *trace.parts.get(s, ()))} - {0}
    for step in reversed(trace.steps):
        if any(o in anc for o in step.outs) or any(k in keys for k in step.writes):
            for _, _, s in step.refs:
                if s not in anc:
                    anc.add(s)
                    keys.update((trace.key_of.get(s, 0), *trace.parts.get(s, ())))
                    keys.discard(0)
    return anc


def run(trace: Trace, steps: list[Step], frees: list[list[int]], wanted: set[int], source: Callable[[int], Tensor],
        graph: bool) -> dict[int, Tensor]:
    """Replay ``steps`` (``plan``'s, with what to let go after each); return the ``wanted`` slots' values (NOTE
    [replay])."""
    for step in steps:
        if not step.replayable:
            raise RematError(
                f"remat: cannot replay {step.op} of {trace.fn_name} (a tensor subclass or storage argument, or "
                "a write into a tensor from outside that its schema does not declare); save what it feeds (policy=policies.everything_saveable), or this is a bug "
                "in remat, please report it."
            )
    vals: dict[int, Tensor] = {}
    gens: dict[int, tuple[torch.Generator, Any]] = {}
    with contextlib.ExitStack() as es:
        es.enter_context(internal())
        es.enter_context(ti.outside_legacy_vmap())
        if torch.is_inference_mode_enabled():  # (a backward pass under inference_mode: its values track versions)
            es.enter_context(torch.inference_mode(False))
        # grad mode on, each step run with it as it had it, also below autograd, where it builds no graph: a kernel
        # may read it (``mkldnn_rnn_layer``, float32 ``nn.LSTM`` on the CPU, makes the workspace its backward reads
        # only with grad mode on, and the backward pass runs with it off)
        es.enter_context(torch.enable_grad())
        if graph:
            es.enter_context(ti.saved_tensors_hooks_set_aside())
        else:
            es.enter_context(ti.below_autograd())
        # (remat's unpack hooks, which a source may run, read grad mode as a backward pass building a graph)
        src = source if graph else _grad_off(source)
        for dev in ("cpu", "cuda"):
            if torch.is_autocast_enabled(dev):
                es.enter_context(torch.autocast(dev, enabled=False))
        settings, base = trace.settings, (trace.dtype0, trace.threads0)
        now = ambient_settings()
        undo = trace.flags.set()
        try:
            for k, step in enumerate(steps):
                if settings:  # (a step that ran under a default dtype or thread count the function set: those)
                    put_settings(settings.get(step, base))
                args = list(step.args)
                kwargs = step.kwargs
                for key, j, s in step.refs:
                    v = vals.get(s)
                    if v is None:
                        v = vals[s] = src(s)
                    if j < 0:
                        if type(key) is int:
                            args[key] = v
                        else:
                            if kwargs is step.kwargs:
                                kwargs = dict(kwargs)
                            kwargs[key] = v
                    else:
                        if args[key] is step.args[key]:
                            args[key] = list(args[key])
                        args[key][j] = v
                moved = None
                if step.inplace_view:
                    # (on an alias: the value it reshapes may be a kept value or an outside tensor, read again later;
                    # with a graph, a view, whose counter the op moves: put back after it, the value is unchanged)
                    if graph:
                        moved = (args[0], args[0]._version)
                    args[0] = args[0].view_as(args[0]) if graph else args[0].detach()
                if graph and step.quiet:
                    # a write autograd did not see in the forward pass (through ``t.data``, a detach): nor now, through
                    # an alias with a version counter of its own (a view of a split refuses its base written, and
                    # the version of ``t.data`` moved none of the forward's)
                    for key in step.quiet:
                        if type(key) is int:
                            args[key] = _unfollowed(args[key])
                        else:
                            kwargs = dict(kwargs)
                            kwargs[key] = _unfollowed(kwargs[key])
                if step.rng is not None:
                    gen, state = step.rng
                    if id(gen) not in gens:
                        gens[id(gen)] = (gen, gen.get_state())
                    with torch.set_grad_enabled(step.grad):  # NOTE [draws in threads] in ambient.py
                        out = draw_as_recorded(gen, state, trace.drew.get(step), step.op, step.call, args, kwargs,
                                               trace.fn_name)
                elif not step.grad:
                    with torch.no_grad():
                        out = step.call(*args, **kwargs)
                else:
                    out = step.call(*args, **kwargs)
                if moved is not None:
                    ti.set_version(*moved)
                spec = step.spec
                if spec is None:
                    vals[step.outs[0]] = out
                else:
                    for o, t in zip(step.outs, out if spec is FLAT else optree.tree_leaves(out, none_is_leaf=True)):
                        if o >= 0:
                            vals[o] = t
                for s in frees[k]:
                    vals.pop(s, None)
        finally:
            for put, v in undo:
                put(v)
            if settings:
                put_settings(now)
            for gen, state in gens.values():
                gen.set_state(state)
    made: dict[int, Tensor] = {}
    for s in wanted:
        v = vals.get(s)
        made[s] = v if v is not None else source(s)
    return made


def copy_outside(trace: Trace) -> None:
    """NOTE [outside tensors]: when the forward pass ends, a small outside tensor that needs no gradient (running
    statistics, a mask, torch.tensor's constant), or one lifted inside the call (``torch.as_tensor(array)``) up to
    16 MiB, is copied: the replay reads the forward's value whatever happens to it next, even a write no version shows
    (NumPy's, a batch norm's); a larger lifted one is hashed (``check_lifted``, as the full engine does)."""
    snaps = trace.snapshots
    for s, (t, _) in trace.outside.items():
        if t is not None and s in trace.lifted and ox.nbytes(t) > ox.LIFTED_COPIED:
            with internal():
                trace.lifted[s] = ox.fingerprint(t)
        elif (t is not None and s not in snaps and s not in trace.shadowed and s not in trace.inputs
                and not t.requires_grad and (ox.nbytes(t) <= ox.SMALL or s in trace.lifted)):
            g = trace.geometry0.get(s)  # (reshaped in place since the call read it: as it read it)
            snaps[s] = (ti.detach_below_modes(t) if g is None else ox.at_geometry(t.detach(), g)).clone()


def check_lifted(trace: Trace, s: int, t: torch.Tensor) -> None:
    """The replay reads lifted slot ``s``, ``t``, hashed when the forward pass ended: raise if its values changed."""
    with internal():
        if ox.fingerprint(t) != trace.lifted[s]:
            raise errors.lifted_changed(trace.fn_name, t)


# NOTE [kept values written after the call]
#     A value the replay reads rather than makes (kept by the policy, or offloaded for the replay) may be written in
#     place after the forward pass ends: the caller's residual add into a returned product (``h = block(W, x); h +=
#     x``). Plain autograd is exact there when no node saved ``h`` itself; the replay must read what the forward pass
#     made. Writes through the kept tensor, or its views, move its version (``Trace.stash_versions``), but not those
#     through another tensor of the call on its storage with a counter of its own (``x3d @ W`` returns an
#     ``_unsafe_view`` of the ``mm`` a policy keeps), and an offloaded value's tensor may be let go after the write
#     (a weak reference then says nothing). So when the forward pass ends every tensor of the call still alive on
#     such a value's storage is watched through an alias that shares its version counter and holds no bytes
#     (``version_alias`` in ``_torch_internals.py``); one that moved makes the value again (``TraceFrame._available``).
#     One rule, ``ops.version_watches``, makes the watches of both engines (the full engine's: ``watch_results``).
def watches(trace: Trace, slots: Iterable[int], own: bool) -> dict[int, list[tuple[Tensor, int]]]:
    """NOTE [kept values written after the call]: ``slots`` -> their watches (``version_watches``), of each tensor of
    the call alive on its storage; ``own``: the slot's tensor and its views too (a kept value's share the counter of
    its stash, which ``stash_versions`` watches already)."""
    keys: dict[int, list[int]] = {}
    for s in slots:
        if k := trace.key_of.get(s):
            keys.setdefault(k, []).append(s)
    return version_watches(
        (t, s) for s2, ref in (trace.refs.items() if keys else ()) for s in keys.get(trace.key_of.get(s2, 0), ())
        if (own or (s2 != s and trace.root.get(s2, s2) != s)) and (t := ref()) is not None)


def adopt(trace: Trace) -> None:
    """NOTE [unseen aliases] in ``_engine/program.py``, when the forward pass ends: a tensor of a subclass read from
    outside on a storage the call made (``h.as_subclass(T)``, returned) is made by the replay from the call's value,
    which the caller may write after the call (a tensor from outside written then raised, where plain autograd is
    exact). A plain one (a hook's view inside FSDP2's ranges, whose ops are not the call's) stays read as it is."""
    for key in [k for k in trace.outside_keys if k in trace.made_on]:
        outside = trace.outside_keys[key]
        subs = [s for s in outside if (t := trace.outside[s][0]) is not None and type(t) is not Tensor
                and type(t) is not _Parameter]
        if subs:
            rest = [s for s in outside if s not in subs] + unseen_aliases(trace, key, subs)
            if rest:
                trace.outside_keys[key] = rest
