"""The offload engine itself (:class:`OffloadEngine`), and the engine that serves the remat calls of a context.

:class:`OffloadEngine` is what the saved-tensor hooks call: ``offload_saved``
once per saved tensor in the forward pass (its common case inline, NOTE [solo
handles] in ``copies.py``), and ``fetch`` once per read in the backward pass. In
the forward pass it decides which copy a tensor gets: a copy of its own, a share
of its storage's copy in the call, or a copy of the bytes a small slice spans
(NOTE [one copy per storage] in ``copies.py``). When copies are started, kept,
prefetched and read back is ``schedule.py``'s (the class it builds on, ``fetch``
included); how the bytes move is ``streams.py``'s.

NOTE [default engine]
    One engine serves every remat call of a thread (so prefetching can look from
    one call to the next, and the pinned pool is reused across steps). It lives
    in a context variable, created on first use; an engine with other settings is
    installed with :func:`use_engine`.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from .. import _torch_internals as _ti
from .._context import internal
from .._errors import RematError
from .copies import _NOTHING_GIVEN, Offloaded, _Copy, _Group
from .geometry import _span
from .routes import _CPU, _REAL_DTYPES
from .schedule import _Schedule

__all__ = ["OffloadEngine", "default_engine", "use_engine"]

_ENGINE: contextvars.ContextVar[OffloadEngine | None] = contextvars.ContextVar("remat_engine", default=None)


def default_engine() -> OffloadEngine:
    """The engine serving remat calls in this context (NOTE [default engine]).

    Example:
        >>> from remat.offload import OffloadEngine, default_engine, use_engine
        >>> isinstance(default_engine(), OffloadEngine), default_engine() is default_engine()
        (True, True)
        >>> eng = OffloadEngine()
        >>> with use_engine(eng):
        ...     default_engine() is eng
        True
    """
    eng = _ENGINE.get()
    if eng is None:
        eng = OffloadEngine()
        _ENGINE.set(eng)
    return eng


@contextlib.contextmanager
def use_engine(engine: OffloadEngine) -> Iterator[OffloadEngine]:
    """Make ``engine`` serve the remat calls started inside the ``with`` block.

    Example:
        >>> import torch
        >>> from remat import remat, policies
        >>> from remat.offload import OffloadEngine, use_engine
        >>> f = remat(lambda x: x.exp().sin().sum(), policy=policies.offload_to_cpu(min_bytes=0))
        >>> x = torch.randn(256, requires_grad=True)
        >>> with use_engine(OffloadEngine()) as eng:
        ...     f(x).backward()
        >>> eng.stats["offloaded"] > 0, eng.stats["fetched"] > 0
        (True, True)
    """
    if not isinstance(engine, OffloadEngine):
        raise TypeError(f"use_engine: expected an OffloadEngine, got {engine!r} ({type(engine).__name__})")
    was = _ENGINE.get()
    try:
        _ENGINE.set(engine)
        yield engine
    finally:
        _ENGINE.set(was)


_new_object = object.__new__
# (the probes of the offload engine's hot path, as module globals: ~0.1 us less each than through _ti's attributes)
_dispatch_modes_pushed = _ti.dispatch_modes_pushed
_pre_dispatch_modes_pushed = _ti.pre_dispatch_modes_pushed
_is_grad_enabled = torch.is_grad_enabled
_Tensor, _BOOL = torch.Tensor, torch.bool


class OffloadEngine(_Schedule):
    """Moves saved tensors to host memory and back; one serves all remat calls of a thread.

    Args:
        pin_memory: copy CUDA tensors into page-locked host buffers from a
            reusable pool (asynchronous copies). ``False``: pageable memory and
            synchronous copies.
        max_inflight_bytes: bound, per device, on the bytes of device-to-host
            copies still running; past it the compute stream (not the host)
            waits for the oldest copy (NOTE [stream-ordered reuse]).
        max_pinned_bytes: bound on the pinned pool (``None``: half the host's
            physical memory); past it, after evicting free buffers of other
            sizes, offloading raises :class:`~remat.RematError`. Free buffers of
            a size no longer asked for are given back after a while.
        prefetch: in the backward pass, start the copies of a remat call's
            tensors, and of the call the backward pass reaches next, when it
            first reads one of them (NOTE [prefetch]). ``False``: each tensor
            is copied back when it is read.
        trace: record ``(event, group, copy)`` tuples in ``engine.trace``
            (``"d2h"``, ``"h2d"``, ``"use"``, ``"keep"``), for tests and debugging.
        keep_last: on CUDA, the tensors of the ``keep_last`` most recent remat
            calls stay on the device until a later call offloads (NOTE [keep
            last]): the backward pass starts with them, so their round trip
            would only be waited for. ``0``: offload everything at once.

    ``engine.stats`` (a dict, every key present) counts handles offloaded (``offloaded``), host copies made
    and their bytes (``copies``, ``offloaded_bytes``), handles that shared a copy
    (``shared``), storages kept on the device (``kept_on_device``), reads
    (``fetched``), host-to-device copies (``h2d``, ``h2d_bytes``; of which started ahead of need:
    ``prefetched``; copies ahead given up for lack of memory: ``prefetch_oom``) and
    the times the compute stream was made to wait for a copy past the in-flight
    budget (``stream_waits``; the host itself never waits in the forward pass).

    Example:
        >>> import torch
        >>> from remat import remat, policies
        >>> from remat.offload import OffloadEngine, use_engine
        >>> eng = OffloadEngine()
        >>> f = remat(lambda x: x.sin().exp().sum(), policy=policies.offload_to_cpu(min_bytes=0))
        >>> x = torch.randn(1000, requires_grad=True)
        >>> with use_engine(eng):
        ...     f(x).backward()
        >>> eng.stats["offloaded"] > 0
        True
    """

    def __init__(self, pin_memory: bool = True, max_inflight_bytes: int = 8 << 30, max_pinned_bytes: int | None = None,
                 prefetch: bool = True, trace: bool = False, keep_last: int = 1) -> None:
        self._dsts: set[str] = set()  # the destinations offloaded to: checked (and warned about) once each
        _check_settings(max_inflight_bytes, max_pinned_bytes, keep_last)
        super().__init__(pin_memory, max_inflight_bytes, max_pinned_bytes, prefetch, trace, keep_last)
        # the solo handles made since stats was last read, and their bytes (NOTE [solo handles]: ~0.4 us less each)
        self._solos = self._solo_bytes = 0

    @property
    def stats(self) -> dict[str, int]:
        """The counters (see the class's docstring)."""
        with self._lock:
            stats = self._stats
            if self._solos:
                stats["copies"] += self._solos
                stats["offloaded"] += self._solos
                stats["offloaded_bytes"] += self._solo_bytes
                self._solos = self._solo_bytes = 0
            return stats

    # ---- forward ---------------------------------------------------------------
    def applies(self, t: torch.Tensor, decision: Any) -> bool:
        """Whether ``decision`` (an Offloadable) moves ``t``: right source device, plain strided (no conjugate or
        negative bit, not quantized or nested), large enough."""
        return self._routes.bytes_moved(t, decision) > 0

    def offload(self, t: torch.Tensor, dst: str, group: Any = None) -> Offloaded:
        """Start copying ``t``'s storage to device ``dst``; the caller then drops ``t``.

        The whole storage is copied once per call and shared by its views (``q``, ``k``, ``v`` split
        from one product), unless ``t`` spans less than half of it (a small slice of a large
        buffer): then only the bytes it spans (NOTE [one copy per storage]).
        """
        with self._lock, internal():  # (remat's modes let its ops through)
            return self._offload(t, dst, group)

    def offload_below_modes(self, t: torch.Tensor, dst: str, group: Any = None) -> Offloaded:
        """:meth:`offload`, its ops run with every dispatch mode popped: remat's own copy, not an op of the
        user's modes, of a tracer (make_fx inside ``torch.func.linearize``) or of remat's recorder.

        ``group``: the call's key, or the group :meth:`group` gave for it (a call that offloads many tensors
        looks its group up once)."""
        if _ti.no_modes_pushed():  # (the common case, from a traced call's pack hook: nothing to pop)
            with self._lock:
                return self._offload(t, dst, group)
        with _ti.no_dispatch_modes(), self._lock:
            return self._offload(t, dst, group)

    def offload_saved(self, t: torch.Tensor, decision: Any, group: Any = None, own_modes: int = 0) -> Offloaded | None:
        """:meth:`applies`, then :meth:`offload_below_modes`, in one call: ``t``'s handle, or None where
        ``decision`` (an Offloadable) does not move it (the caller keeps it). The saved-tensor hooks' entry, once
        per saved tensor on the forward pass's hot path: its common case (no dispatch mode, a synchronous copy of
        a plain CPU tensor that is all of its storage's bytes, in order, their first copy in the call) runs here,
        the steps of :meth:`_offload`, :meth:`_copy_out`, :meth:`_copy_raw` and ``_Group.register`` inline (each Python
        call costs ~0.1-0.2 us, per saved tensor), and makes one object, a solo handle (NOTE [solo handles]); every
        other case runs through them. ``own_modes``: how many dispatch modes on the stack are remat's own, which let
        the copy through unseen (the replay engine's tracers, called from a pack hook under ``internal()``)."""
        if not decision.defer and group is not None:  # NOTE [keep last]: this call's copies start at once
            group = self.group(group) if type(group) is not _Group else group
            group.now = True
        grp = group
        src_kind = decision.src
        if not t.is_cpu or type(grp) is not _Group or type(t) is not _Tensor \
                or (src_kind is not None and self._kinds.get(src_kind) != "cpu") or _dispatch_modes_pushed() != own_modes \
                or _pre_dispatch_modes_pushed():
            # (not the CPU: graph capture, asynchronous copies, kept storages; a mode to pop; a group to look up)
            return self._offload_saved_slowly(t, decision, group)
        # _Routes.bytes_moved's questions, of a plain CPU tensor (never meta) from a decision that moves CPU tensors
        dtype = t.dtype
        # (a zero tensor, forward AD's, and a layout other than strided are told by their storage below)
        if t.is_neg() or t.is_nested or dtype not in _REAL_DTYPES:
            return self._offload_saved_slowly(t, decision, group)
        try:
            nbytes = t.nbytes
        except RuntimeError:  # (a sparse tensor has no nbytes; bytes_moved keeps it)
            return self._offload_saved_slowly(t, decision, group)
        if nbytes < decision.min_bytes:
            return None
        dst = decision.dst
        if dst not in self._dsts:
            _first_offload_to(t, dst, self._dsts)
        with self._lock:
            try:
                storage = t.untyped_storage()
                key = storage.data_ptr()
            except RuntimeError:
                # (no storage to copy: sparse or mkldnn tensors raise NotImplementedError, a RuntimeError; a zero
                # tensor, forward AD's, has no data pointer; bytes_moved keeps them all)
                return self._offload_saved_slowly(t, decision, group)
            total = storage.nbytes()
            device = _CPU
            to = self._from_cpu.get(dst) or self._plain_from_cpu(dst)
            # (contiguous, as many bytes as its storage: it starts at byte 0, no storage offset to ask. Not a bool:
            # its copy writes 1 for every nonzero byte, and a view of another dtype may share it)
            if to is None or key in grp.by_storage or nbytes != total or not t.is_contiguous() or dtype is _BOOL:
                return self._offload(t, dst, grp)
            # copied synchronously (not kept: NOTE [keep last]), the copy has read the bytes when it returns (NOTE
            # [written while copied] holds nothing); it copies t itself, so the host copy is of t's dtype, which fetch
            # never reads (only the storage). A pack hook runs without grad mode: t's own copy holds no graph, where
            # elsewhere its detached alias's must not
            origin = weakref.ref(storage)
            o = _new_object(Offloaded)  # NOTE [solo handles]: a handle that is its own copy
            # (the copy's fields, as _Copy.__init__ sets them: a Python call costs ~0.2 us, per saved tensor)
            o.engine, o.cid, o.group, o.src, o.nbytes, o.origin, o.origin_lo = \
                self, self._next_cid, grp, device, total, origin, 0
            o.buf = o.d2h_done = o.dev = o.dev_weak = o.h2d_done = o.deferred = o.vsrc = o.saved_version = \
                o.reads = None
            o.given = _NOTHING_GIVEN
            o.pending = o.round = 0
            self._next_cid += 1
            if own_modes:  # (a plain CPU tensor: no mode of remat's needs to see its copy)
                with _ti.python_dispatch_off():
                    src = t if not _is_grad_enabled() else t.detach()
                    o.host = src.clone() if to is device or device == to else src.to(to, copy=True)
            else:
                src = t if not _is_grad_enabled() else t.detach()
                o.host = src.clone() if to is device or device == to else src.to(to, copy=True)
            self._solos += 1
            self._solo_bytes += total
            if self.trace is not None:
                self._log("d2h", o)
            # (weakref.ref gives the storage's one weak reference while it lives: a token shared by its copies)
            origins = grp.origins
            oid = id(origin)
            if oid in origins:  # (a storage copied before, written since: NOTE [one copy per storage])
                origins[oid] += 1
            else:
                origins[oid] = 1
            oref: weakref.ref[_Copy] = weakref.ref(o)
            grp.copies.append(oref)
            base = t._base
            version = t._version
            # (the handle's fields: Offloaded.__init__'s, its layout the host copy's)
            o._copy = o._layout = None
            o.key = -1
            o.offset = o.seen = 0
            o.live = 1
            o.version = version
            o.orig = orig = weakref.ref(t)
            grp.by_storage[key] = (origin, version, oref, orig if base is None else weakref.ref(base))
            if grp.spans:
                grp.take_spans(key, o, t if base is None else base)
            return o

    def _offload_saved_slowly(self, t: torch.Tensor, decision: Any, group: Any) -> Offloaded | None:
        """:meth:`offload_saved` of a tensor its common case does not take."""
        return self.offload_below_modes(t, decision.dst, group) if self._routes.bytes_moved(t, decision) else None

    def _offload(self, t: torch.Tensor, dst: str, group: Any) -> Offloaded:
        if _ti.cuda_graph_capturing(t):
            raise RematError(
                "remat: an offload policy ran under CUDA graph capture; its copies to host memory and "
                "pinned-buffer pool are host-side work a graph cannot replay. Capture with a save or "
                "recompute policy, or offload outside the captured region."
            )
        if dst not in self._dsts:
            _first_offload_to(t, dst, self._dsts)
        # (t's facts are its detached alias's: t is detached only where a copy needs it, _copy_out)
        storage = t.untyped_storage()
        grp = group if type(group) is _Group else self._group(group)
        total = storage.nbytes()
        key = storage.data_ptr()
        version = t._version
        if (grp is None or key not in grp.by_storage) and t.is_contiguous() and t.nbytes == total \
                and not t.storage_offset():
            # t is exactly its storage's bytes, in order, their first copy in the call (offload_saved's common case).
            # Not a bool: its copy writes 1 for every nonzero byte, and a view of another dtype may share it
            copy = self._copy_out(t, storage, dst, grp, 0, total, whole=t.dtype is not torch.bool)
            if grp is not None:
                grp.register(key, copy, version, t)
            self._stats["offloaded"] += 1
            return Offloaded(self, copy, t, 0, version)
        return self._offload_part(t, storage, grp, total, key, version, dst)

    def _offload_part(self, t: torch.Tensor, storage: Any, grp: _Group | None, total: int, key: int, version: int,
                      dst: str) -> Offloaded:
        """:meth:`_offload` of a tensor that is not all its storage's bytes in order (a slice, a transpose), or
        whose storage the call has copied already."""
        # the tensor whose version counter t shares, as a view (a span copy's handle moves to a whole copy only if
        # that counter has not moved since: NOTE [one copy per storage])
        base = t._base
        root = t if base is None else base
        if grp is not None and key in grp.by_storage:
            copy = grp.shared_copy(storage, key, root, t, version)
            if copy is not None:  # (a whole copy starts at byte 0: t's bytes need not be worked out)
                self._stats["shared"] += 1
                self._stats["offloaded"] += 1
                return Offloaded(self, copy, t, t.storage_offset(), version)  # type: ignore[arg-type]
        contiguous = t.is_contiguous()
        es = t.element_size()
        offset: int = t.storage_offset()  # type: ignore[assignment]
        if contiguous:  # (inline: a Python call costs ~0.5 us, once per saved tensor)
            lo = offset * es
            hi = lo + t.nbytes
            if hi == lo:
                lo = hi = 0
        else:
            lo, hi = _span(t, es, offset)
        if 2 * (hi - lo) < total:  # a small slice: a copy of the bytes it spans
            span = self._copy_out(t, storage, dst, grp, lo, hi)
            self._stats["offloaded"] += 1
            o = Offloaded(self, span, t, offset - lo // es, version)
            if grp is not None:
                sref = weakref.ref(span)
                grp.copies.append(sref)
                grp.spans.setdefault(key, []).append((version, sref, weakref.ref(o), weakref.ref(root)))
            return o
        whole = contiguous and lo == 0 and hi == total and t.dtype is not torch.bool  # (as in _offload)
        copy = self._copy_out(t, storage, dst, grp, 0, total, whole=whole)
        if grp is not None:
            grp.register(key, copy, version, t)
        self._stats["offloaded"] += 1
        return Offloaded(self, copy, t, offset, version)


def _first_offload_to(t: torch.Tensor, dst: str, dsts: set[str]) -> None:
    """The first offload of an engine to ``dst`` (then noted in ``dsts``): a device this process has none of raises,
    saying so (a policy written for a GPU machine on a CPU-only one: torch's bare "Torch not compiled with CUDA
    enabled" otherwise); one to the device type ``t`` is on frees no memory, which is said (a policy written for a
    GPU, run on a CPU-only machine, would otherwise offload nothing useful without a word)."""
    kind = torch.device(dst).type
    if kind == "cuda" and not torch.cuda.is_available():
        raise RematError(
            f"remat: an offload policy moves a tensor of shape {list(t.shape)} from {t.device.type} to {dst!r}, but "
            "this process sees no CUDA device (torch.cuda.is_available() is False): offload to 'cpu' "
            "(Offloadable(src, 'cpu'), offload_to_cpu()), or save memory with policy=\"save-nothing\" instead."
        )
    dsts.add(dst)
    if t.device.type == kind:
        warnings.warn(
            f"remat: an offload policy moves tensors from {t.device.type} to {dst}, the device they are on: the copy "
            "frees no memory (the policy exists for tensors on a GPU). On a CPU-only run, save memory with "
            "policy=\"save-nothing\" or \"save-matmuls\" instead; this is said once per offload engine.",
            UserWarning, stacklevel=4)


def _check_settings(max_inflight_bytes: Any, max_pinned_bytes: Any, keep_last: Any) -> None:
    if not isinstance(max_inflight_bytes, int) or max_inflight_bytes <= 0:
        raise ValueError(f"OffloadEngine: max_inflight_bytes must be a positive int, got {max_inflight_bytes!r}")
    if max_pinned_bytes is not None and (not isinstance(max_pinned_bytes, int) or max_pinned_bytes < 0):
        raise ValueError(f"OffloadEngine: max_pinned_bytes must be None or an int >= 0, got {max_pinned_bytes!r}")
    if not isinstance(keep_last, int) or keep_last < 0:
        raise ValueError(f"OffloadEngine: keep_last must be an int >= 0, got {keep_last!r}")
