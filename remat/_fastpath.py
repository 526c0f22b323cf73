"""The fast path of save-nothing: no dispatch mode, only saved-tensor hooks, once a first call has shown it safe.

NOTE [fast path]
    Under ``nothing_saveable`` with no ``torch.func`` level and no enclosing remat
    call, the recorder's per-op work buys nothing the backward pass needs: every
    saved tensor but the inputs is recomputed anyway. So, as
    ``torch.utils.checkpoint`` does, a :class:`FastFrame` installs only
    saved-tensor hooks: an input is held by reference, every other saved tensor
    is dropped (its shape and dtype noted), and the recompute re-runs the function
    under capture hooks that take the dropped positions in order and stop as soon
    as the last one is made (the ops after it do not run).

    What the recorder would have checked is learnt once, per remat'd function and
    *signature* (the pytree structure, every input's shape, dtype, device and
    requires_grad, the other leaves' values, the shapes of the module state the
    call reads, the modules' ``training`` flags and the autocast state): the
    first call of a signature runs the full engine (``_hooks.Frame``), and only
    if it was *clean* is a :class:`Plan` cached for the signature. Clean means:
    it read no tensor besides its inputs, the module state of NOTE [state is an
    input] and its own intermediates (no global or closed-over tensor the walk
    missed, no tensor built from Python data), wrote none of them in place, made
    no nested remat call and ran no backward pass of its own, under no
    ``torch.func`` level. The plan also lists the save positions the full engine
    held by reference (the module's parameters) so that the fast path holds them
    too, rather than dropping them and reading them back.

    A later call of a known signature runs fast and still checks, from outside
    the ops: the recompute must save as many tensors, of the same shapes and
    dtypes, at every dropped position (else ``RematError``, as on the full path);
    inputs and module state must not change version during the forward pass or
    between it and the recompute. A fast call that writes module state in place
    (data-dependent, unlike its signature's first call) cannot be replayed
    exactly: it raises ``RematError`` and the signature's plan is forgotten, so
    the next call records again. Anything that changes what the function does
    without changing its signature and without these checks noticing (a Python
    global read as a flag that flips between calls and changes no shape) is
    outside what remat guarantees on either path: the function must be pure.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from . import _torch_internals as ti
from ._ambient import AmbientState
from ._context import INSPECTOR, active_context, internal
from ._errors import RematError
from ._policies import nothing_saveable
from ._reentrant import NeedsRegion
from ._state import Snapshot

__all__ = ["Plan", "FastFrame", "signature", "fast_path_applies", "MAX_PLANS"]

MAX_PLANS = 32  # signatures remembered per remat'd function (a new one past this forgets the oldest)

_AUTOCAST = ("cpu", "cuda")


class Plan:
    """What the first (fully recorded) call of a signature showed: save positions held by reference."""

    __slots__ = ("keep",)

    def __init__(self, keep: frozenset[int]) -> None:
        self.keep = keep


def fast_path_applies(policy: Any) -> bool:
    """Whether a call may take the fast path at all (the plan decides per signature)."""
    return (policy is nothing_saveable and active_context() is None and INSPECTOR.get() is None
            and not ti.interpreter_stack())


def signature(flat: list[Any], statics: dict[int, Any], state: Snapshot) -> tuple[Any, ...] | None:
    """What a plan is valid for; None: no fast path for this call (an input of a tensor subclass)."""
    parts: list[Any] = []
    for a in flat:
        if isinstance(a, torch.Tensor):
            if type(a) is not torch.Tensor and type(a) is not torch.nn.Parameter:
                return None
            parts.append((a.shape, a.dtype, a.device, a.requires_grad))
        else:
            parts.append(_leaf_key(a))
    for i in sorted(statics):
        parts.append(_leaf_key(statics[i]))
    for t in state.tensors:
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            return None
        parts.append((t.shape, t.dtype, t.device, t.requires_grad))
    parts.append(tuple(m.training for m in state.modules))
    parts.append(tuple((torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST))
    return tuple(parts)


def _leaf_key(a: Any) -> Any:
    try:
        hash(a)
    except TypeError:
        return ("id", id(a))
    return (type(a), a)


class _In:
    """An input saved for the backward pass: held by the frame, named by its slot."""

    __slots__ = ("slot",)

    def __init__(self, slot: int) -> None:
        self.slot = slot


class _Kept:
    """A tensor held by reference (module state the plan holds), with its version when saved."""

    __slots__ = ("t", "version")

    def __init__(self, t: torch.Tensor, version: int) -> None:
        self.t = t
        self.version = version


class FastFrame:
    """One call of a save-nothing remat'd function on the fast path (NOTE [fast path])."""

    def __init__(self, run: Callable[[list[Any]], Any], flat: list[Any], fn_name: str, preserve_rng: bool,
                 state: Snapshot, plan: Plan, forget: Callable[[], None]) -> None:
        self.run = run
        self.flat = flat
        self.fn_name = fn_name
        self.state = state
        self.plan = plan
        self.forget = forget  # drops this signature's plan
        self.input_ids = {id(a): i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)}
        self.versions = [a._version if isinstance(a, torch.Tensor) else None for a in flat]
        self.state_versions = [t._version for t in state.tensors]
        self.ambient = AmbientState.capture([a for a in flat if isinstance(a, torch.Tensor)], preserve_rng)
        self.n = 0  # tensors saved so far
        self.drops: dict[int, tuple[Any, ...]] = {}  # position -> shape, dtype, class of the node that made it
        self.last_drop = -1
        self.cache: dict[int, torch.Tensor] = {}  # recomputed, not read yet
        self.forwarding = False
        self.recomputes = 0
        self._lock = threading.RLock()

    # ---- forward ---------------------------------------------------------------
    def forward(self) -> Any:
        self.forwarding = True
        try:
            with ti.saved_tensors_hooks_enabled(), saved_tensors_hooks(self.pack, self.unpack):
                try:
                    out = self.run(self.flat)
                except RuntimeError as e:
                    if "support saved tensor hooks" not in str(e):
                        raise
                    self.forget()
                    raise NeedsRegion(self, e) from e  # NOTE [reentrant region] in _reentrant.py
        finally:
            self.forwarding = False
            self.cache = {}  # what a backward pass inside the forward pass recomputed
        self._check_versions(after_forward=True)
        return out

    def rewind(self) -> None:
        """Put the random state back so that the call can run again (NOTE [reentrant region])."""
        if self.ambient.cpu_rng is not None:
            torch.set_rng_state(self.ambient.cpu_rng)
            for d, st in self.ambient.cuda_rng.items():
                torch.cuda.set_rng_state(st, d)

    def _check_versions(self, after_forward: bool) -> None:
        for i, (a, v0) in enumerate(zip(self.flat, self.versions)):
            if v0 is not None and a._version != v0:
                if after_forward and not self.drops:
                    self.versions[i] = a._version  # nothing will be recomputed: the write is harmless
                    continue
                raise RematError(
                    f"remat: {self.fn_name} modified its input #{i} (shape {list(a.shape)}) in place "
                    + ("during its forward pass; the recompute would read the modified value and give wrong "
                       "gradients. Clone the input inside the function before modifying it (x = x.clone()), or do "
                       "the in-place update outside the remat'd function." if after_forward else
                       "after its forward pass and before its backward pass; the recompute would read the new "
                       "value. Clone it before modifying it, or run the backward pass first.")
                )
        for t, v0 in zip(self.state.tensors, self.state_versions):
            if t._version != v0:
                label = self.state.label_of(t) or f"a tensor of shape {list(t.shape)}"
                if after_forward:
                    self.forget()
                    raise RematError(
                        f"remat: {self.fn_name} wrote {label} in place in this call, though its first call with "
                        "the same input shapes did not; remat's save-nothing fast path (NOTE [fast path]) cannot "
                        "replay such a write. The next call records the function in full again; to record every "
                        "call, use a policy other than nothing_saveable (policies.save_only_these_names() saves "
                        "nothing too)."
                    )
                raise RematError(
                    f"remat: {label}, which {self.fn_name} read, was modified in place after its forward pass and "
                    "before its backward pass (an optimizer step?); the recompute would read the new value. Run "
                    "the backward pass first."
                )

    # ---- hooks -----------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        pos = self.n
        self.n = pos + 1
        slot = self.input_ids.get(id(t))
        if slot is not None and self.flat[slot] is t:
            return _In(slot)
        if pos in self.plan.keep:
            return _Kept(_holdable(t), t._version)
        node = t.grad_fn
        self.drops[pos] = (t.shape, t.dtype, None if node is None else type(node))
        self.last_drop = pos
        return pos

    def unpack(self, p: Any) -> torch.Tensor:
        if type(p) is int:
            with self._lock:
                out = self.cache.pop(p, None)
                if out is None:
                    # not recomputed yet in this backward pass, or read once already (a second backward pass)
                    self.cache = self._recompute()
                    if not self.forwarding:
                        ti.queue_backward_callback(_release(self))
                    out = self.cache.pop(p)
                return out
        if type(p) is _In:
            return self.flat[p.slot]  # type: ignore[no-any-return]
        if p.t._version != p.version:
            raise RematError(
                f"remat: a tensor of shape {list(p.t.shape)} that {self.fn_name} saved for the backward pass was "
                f"modified in place after it was saved (version {p.version} -> {p.t._version}). Do not modify "
                "it before the backward pass; clone it first."
            )
        return p.t  # type: ignore[no-any-return]

    # ---- recompute -------------------------------------------------------------
    def _recompute(self) -> dict[int, torch.Tensor]:
        self.recomputes += 1
        if not self.forwarding:
            self._check_versions(after_forward=False)
        # (a backward pass inside the forward pass: recompute only as far as the forward pass has got)
        capture = _Capture(self.drops, self.n if self.forwarding else self.last_drop + 1, self.fn_name,
                           detach=not torch.is_grad_enabled())
        with contextlib.ExitStack() as es:
            es.enter_context(ti.saved_tensors_hooks_enabled())
            es.enter_context(torch.enable_grad())
            es.enter_context(self.state.restored(self.state.tensors))
            es.enter_context(self.ambient.restored())
            es.enter_context(saved_tensors_hooks(capture.pack, _identity))
            try:
                self.run(self.flat)
            except _Stop:
                pass
        if capture.n < capture.stop_after:
            raise RematError(
                f"remat: the recompute of {self.fn_name} saved {capture.n} tensors for the backward pass where "
                f"its forward pass saved {capture.stop_after} or more; the function must do the same work every "
                "time it is called (no data-dependent branches or changing global state)."
            )
        return capture.captured


def _release(frame: FastFrame) -> Callable[[], None]:
    """At the end of the backward pass, let go of what it did not read (held weakly: NOTE [free as used])."""
    wself = weakref.ref(frame)

    def release() -> None:
        f = wself()
        if f is not None and not f.forwarding:
            f.cache = {}

    return release


class _Stop(Exception):
    """Raised by the capture hook once it has made every dropped tensor."""


def _identity(x: Any) -> Any:
    return x


class _Capture:
    __slots__ = ("wanted", "stop_after", "fn_name", "detach", "n", "captured")

    def __init__(self, wanted: dict[int, tuple[Any, ...]], stop_after: int, fn_name: str,
                 detach: bool) -> None:
        self.wanted = wanted
        self.stop_after = stop_after
        self.fn_name = fn_name
        self.detach = detach
        self.n = 0
        self.captured: dict[int, torch.Tensor] = {}

    def pack(self, t: torch.Tensor) -> Any:
        pos = self.n
        self.n = pos + 1
        meta = self.wanted.get(pos)
        if meta is not None:
            if t.shape != meta[0] or t.dtype != meta[1]:
                raise RematError(
                    f"remat: the recompute of {self.fn_name} saved a tensor of shape {list(t.shape)} {t.dtype} "
                    f"where its forward pass saved {list(meta[0])} {meta[1]} (saved tensor #{pos}); the function "
                    "must compute the same shapes every time it is called (a key/value cache that grows on every "
                    "call changes them: for a Hugging Face model pass use_cache=False)."
                )
            node = t.grad_fn
            if (None if node is None else type(node)) is not meta[2]:
                raise RematError(
                    f"remat: the recompute of {self.fn_name} saved a tensor made by "
                    f"{_node_name(type(node) if node is not None else None)} where its forward pass saved one made by "
                    f"{_node_name(meta[2])} (saved tensor #{pos}); the function must do the same work every time it "
                    "is called (no branch on a flag or global state that changed since the forward pass)."
                )
            with internal():
                self.captured[pos] = t.detach() if self.detach else t
        if self.n >= self.stop_after:
            raise _Stop
        return _holdable(t)


def _node_name(cls: Any) -> str:
    return "no op (an input)" if cls is None else cls.__name__


def _holdable(t: torch.Tensor) -> torch.Tensor:
    """A saved tensor without its graph: holding an output would make a cycle through its own node."""
    if not t.requires_grad:
        return t
    with internal():
        return t.detach()
