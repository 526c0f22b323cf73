"""The offload engine: saved activations to host memory in the forward pass, back in the backward pass.

A remat call whose policy returns :class:`~remat.policies.Offloadable` for an op
hands that op's saved outputs to the engine instead of keeping them. The engine
copies the tensor's whole *storage* once (two saved views of one storage, such as
``q``, ``k`` and ``v`` split from one ``qkv`` product, share one host copy), and
returns a small handle (:class:`Offloaded`) that autograd holds instead of the
tensor, so the device memory goes back to the allocator as soon as the forward
pass drops its own references.

On CUDA (``src`` a CUDA device, ``dst`` ``"cpu"``):

* Device-to-host copies run on a dedicated stream, ordered after the kernel that
  produced the tensor by an event recorded on the current stream, into
  page-locked (pinned) buffers drawn from a reusable pool: once the pool is warm
  no step allocates pinned memory (``pinned_allocations()`` stays flat).
* The forward pass never waits for the host. The device bytes of a running copy
  are held by the engine, not ``record_stream``'ed (NOTE [stream-ordered
  reuse]); past ``max_inflight_bytes`` of running copies per device, the compute
  stream (not the host) is made to wait for the oldest.
* The most recent call's storages are not copied at all until a later call
  offloads (NOTE [keep last]).
* In the backward pass host-to-device copies run on a second stream, in the
  reverse of the order the tensors were saved. The first time the backward pass
  reaches a remat call (NOTE [prefetch]) the engine starts the copies of all that
  call's tensors and of the call the backward pass will reach next, so the copies
  overlap the compute; the backward pass waits on an event only when it reads a
  tensor whose copy is still running. Out of memory while copying ahead, it falls
  back to copying each tensor when read.
* A pinned buffer goes back to the pool when its tensor's handles die, marked
  with the event of the last copy that reads it; it is reused only once that
  event has completed.

Anywhere else (``src`` and ``dst`` both ``"cpu"``, or other device pairs) the same
code runs with synchronous copies, which is what the tests check on machines
without a GPU.

NOTE [keep last]
    The backward pass begins with the call the forward pass ended with: copying
    that call's tensors to the host and straight back is a round trip the
    backward pass would wait for. So on CUDA a call's copies are deferred: its
    storages stay on the device, held by their handles, and their copies start
    when a call ``keep_last`` calls later starts offloading (or just before an
    in-place write into one of them). Whatever is still kept when the backward
    pass arrives is read where it is, like plain autograd's saved tensors.

NOTE [stream-ordered reuse]
    ``record_stream`` lets the caching allocator's reserved memory grow far above
    what is allocated while the host runs ahead, and adds hidden synchronizations.
    Instead, as torchtune and FSDP2 do: a device-to-host copy's source bytes are
    held by the engine until its event is seen complete (polled at the next
    offload and in the backward pass), or until the compute stream has been made
    to wait for it (``wait_event``: no host wait); then dropped, so their reuse is
    ordered after the copy. A host-to-device copy writes into bytes allocated for
    the compute stream, after an event recorded there, and the compute stream
    waits for the copy before reading them or letting them go.

NOTE [one copy per storage]
    Two saved tensors of one storage share its host copy (``q``, ``k``, ``v``
    split from one product) when the storage has not changed since the copy: the
    version is the same. Views share their base's version counter, so that is
    the test, but not every alias does: ``unsafe_split`` and ``unsafe_chunk``
    (what ``nn.GRU``'s CPU cell splits its gate products with) make tensors of
    one storage with counters of their own. Written in place one after the other
    (``a1.sigmoid_()``, then ``a2.sigmoid_()``), each at version 1 when saved,
    the second shared the copy made before its write: a wrong gradient without
    an error. So the call's recorder tells the engine of every storage an op is
    about to write, and a tensor saved after that gets a copy of its own.

    A small slice (under half its storage) gets a copy of the bytes it spans, unless
    the storage already has a whole copy in the call, which it shares. Shared, the
    slice comes back as a view of the same device bytes as the whole tensor, as in
    plain autograd, where a node that saved ``a`` and ``a[0:1]`` and writes ``a`` in
    its backward reads the written bytes through the slice; from a copy of its own
    it read the saved ones, a wrong gradient without an error. So when a whole copy
    is made after a slice's span copy (saved in the other order), the slice's handle
    moves to the whole copy too, if the storage is unchanged since and the span was
    never read. Unchanged is asked of the version counter of the tensor copied (its
    ``_base``'s, or its own), not of the saved tensor's, which may be another's: an
    alias with no view metadata (``y.detach()``, ``y.data``, an ``unsafe_split``
    piece) has a counter of its own or shares ``y``'s unseen. (Comparing the saved
    tensor's version with the copy's compared two counters: after ``d = y.data;
    y.add_(1)``, ``d[1:]``, at ``d``'s unmoved version, shared the bytes from before
    the write, a wrong gradient without an error on a planned call. Sharing only
    with tensors of the same ``_base`` then gave a node that saved ``a`` and
    ``a.detach()[1:]`` and writes ``a`` in its backward two copies, and the slice
    the saved bytes: wrong too.) A write through yet another counter (``d.add_(1)``
    before ``d[1:]`` is saved) is seen only by an op-level observer: the call's
    recorder, or a plan's tap (NOTE [offloaded and written]). A copy kept on the
    device (NOTE [keep last]) or still being made watches one counter for writes
    (NOTE [written while copied]): it is shared, or a span moved to it, by a tensor
    of another ``_base`` only at that counter's version and spanning half the
    storage or more (a ``.detach()`` alias), as a write through a small
    ``unsafe_split`` piece after the call (refused by plain autograd) was read
    unseen through the whole tensor's kept bytes. So a small slice of ``a.detach()``
    saved with ``a`` while ``a``'s copy runs (on CUDA) does not see a backward's
    write into ``a``: a known gap, tested as such.

NOTE [written while copied]
    Autograd refuses a saved tensor written in place after it was saved. The engine
    holds an offloaded tensor's copy, not the tensor, so it keeps an alias of the
    tensor (the same version counter and storage, no extra memory) for as long as
    the bytes may still be read: while kept (NOTE [keep last]) and while a copy to
    the host is running. A write in that window moves the version, and reading the
    tensor back raises ``RematError``, even if the tensor itself is gone by then: on
    CUDA the write may have run before or during the copy, so the host bytes cannot
    be trusted. Once the copy is known to have read the bytes (its event complete,
    or the compute stream made to wait for it), the alias is let go; a later write
    is seen through the tensor while it lives, as before.

NOTE [reads of one device copy]
    In plain autograd two ops that saved one tensor read the same tensor: a
    backward that writes into what it read (a custom ``Function`` doing
    ``a.mul_(2)`` on its saved ``a``) moves its version, and the other op's read
    raises. The engine hands each read a tensor of its own over a device copy,
    so it watches them instead: per handle, the tensor handed out and its
    version then, held for as long as the device copy itself is (until every
    handle has been read; then weakly). A read first checks the tensors handed
    out over every copy of the same saved storage in the call (a whole copy,
    the span of a small slice, kept ones reading the storage in place), and the
    bytes their readers wrote that were put on record when a copy's tensors
    were let go, copied out, replaced or died with it
    (``_StorageReads.written``): a byte in common with one written raises
    ``RematError``, where handing the reader the written bytes gave a wrong
    gradient without an error. Bytes count exactly, by address
    (``unsafe_split``'s column blocks share a copy and interleave without
    sharing a byte). Whether two tensors share a version counter cannot be
    asked, so a write through an ``unsafe_split`` alias (which torch leaves
    unchecked: those aliases must not be written in place) raises for a reader
    of the same bytes where plain autograd reads them. Checking the tensors
    handed out, not a counter shared through views, holds however the read ran
    (views made inside a dispatch mode's handler share no counter). A handle
    read again gets the tensor it was given, if it lives over the same bytes,
    so a Jacobian row by row over one retained graph holds one per handle.
    Held weakly, the bytes are read again only while every tensor handed out
    over them lives; otherwise the host bytes, which nothing writes, are copied
    again. A write the engine cannot see (by a tensor that died after every
    handle of its copy was read; into a copy other than the reader's, once its
    tensor died) leaves the reader the saved values, where plain autograd raises.

NOTE [default engine]
    One engine serves every remat call of a thread (so prefetching can look from
    one call to the next, and the pinned pool is reused across steps). It lives
    in a context variable, created on first use; an engine with other settings is
    installed with :func:`use_engine`.

NOTE [prefetch]
    Calls ("groups": one per remat call) are numbered in the order they first
    offload in the forward pass. The backward pass visits them in reverse, so
    when it first reads a tensor of group ``g`` the engine starts the copies of
    every tensor of ``g`` not yet on the device and of the nearest live group
    offloaded before ``g``. A device copy is held strongly until each handle of
    its storage has been read once, then weakly (so it is freed as soon as
    autograd drops it, and a second backward pass copies again).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import itertools
import os
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import _torch_internals as _ti
from ._context import internal
from ._errors import RematError

__all__ = ["OffloadEngine", "Offloaded", "default_engine", "use_engine"]

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
    tok = _ENGINE.set(engine)
    try:
        yield engine
    finally:
        _ENGINE.reset(tok)


def _default_pinned_cap() -> int | None:
    """Half the host's physical memory: page-locked memory the OS cannot swap, so a leak (a graph kept
    alive step after step) must end in a clear error, not a frozen machine. None where unknown."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // 2
    except (ValueError, OSError, AttributeError):
        return None


def _alloc_pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class _PinnedPool:
    """Page-locked host buffers, reused by size class once the last copy using them is done.

    Sizes are rounded up to a power of two (at least 4 KiB), as PyTorch's own
    pinned-memory allocator does underneath, so a step that offloads the same
    shapes as the step before reuses every buffer.
    """

    # a size class not asked for in this many acquisitions gives its free buffers back (shapes that vary
    # from step to step would otherwise leave a buffer behind in every class they ever used)
    IDLE_ACQUIRES = 1024

    def __init__(self, max_bytes: int | None = None, alloc: Callable[[int], torch.Tensor] | None = None) -> None:
        self.max_bytes = max_bytes
        self.alloc = alloc or _alloc_pinned
        self._tick = 0
        self._last_use: dict[int, int] = {}  # size class -> tick of its last acquisition
        self.trimmed = 0  # free buffers given back because their size class went unused
        self.free: dict[int, list[tuple[torch.Tensor, Any]]] = collections.defaultdict(list)
        self.allocated_bytes = 0
        self.allocations = 0  # buffers allocated (stays flat once warm)
        self.reuses = 0
        self.evictions = 0  # free buffers dropped at the cap to make room for another size
        # buffers come back from whichever thread drops the last reference (the autograd engine runs
        # one thread per device), and from __del__ whenever the garbage collector runs, possibly on a
        # thread inside acquire: release only appends to a deque (atomic, takes no lock) and acquire
        # drains it under the lock. A lock taken in release could deadlock there.
        self._lock = threading.Lock()
        self._returned: collections.deque[tuple[torch.Tensor, Any]] = collections.deque()

    @staticmethod
    def size_class(nbytes: int) -> int:
        return max(4096, 1 << max(nbytes - 1, 0).bit_length())

    def acquire(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            return self._acquire(nbytes)

    def _drain(self) -> None:
        while self._returned:
            buf, ready = self._returned.popleft()
            self.free[buf.numel()].append((buf, ready))

    def _evict(self, need: int) -> None:
        """At the cap: drop free buffers of other sizes whose copies are done, until ``need`` more bytes fit."""
        for cls in sorted(self.free, reverse=True):
            bucket = self.free[cls]
            for entry in list(bucket):
                if self.max_bytes is None or self.allocated_bytes + need <= self.max_bytes:
                    return
                if entry[1] is None or entry[1].query():
                    bucket.remove(entry)
                    self.allocated_bytes -= cls
                    self.evictions += 1

    def _trim(self) -> None:
        for cls, last in list(self._last_use.items()):
            if self._tick - last > self.IDLE_ACQUIRES and self.free.get(cls):
                keep = [(b, ev) for b, ev in self.free[cls] if ev is not None and not ev.query()]
                n = len(self.free[cls]) - len(keep)
                self.free[cls] = keep
                self.allocated_bytes -= n * cls
                self.trimmed += n

    def _acquire(self, nbytes: int) -> torch.Tensor:
        self._drain()
        cls = self.size_class(nbytes)
        self._tick += 1
        self._last_use[cls] = self._tick
        if self._tick % 64 == 0:
            self._trim()
        bucket = self.free[cls]
        for i, (buf, ev) in enumerate(bucket):
            if ev is None or ev.query():
                del bucket[i]
                self.reuses += 1
                return buf
        if self.max_bytes is not None and self.allocated_bytes + cls > self.max_bytes:
            self._evict(cls)
        if self.max_bytes is not None and self.allocated_bytes + cls > self.max_bytes:
            if bucket:  # at the cap: wait for a buffer of this size whose copy is still running
                buf, ev = bucket.pop(0)
                ev.synchronize()
                self.reuses += 1
                return buf
            raise RematError(
                f"remat: offloading a {nbytes / 2**20:.1f} MiB tensor needs {cls / 2**20:.1f} MiB more pinned "
                f"host memory, past the engine's max_pinned_bytes={self.max_bytes} "
                f"({self.allocated_bytes / 2**30:.2f} GiB pinned already). Raise max_pinned_bytes, offload "
                "fewer tensors (a larger min_bytes, a names policy), or save/recompute some instead."
            )
        try:
            buf = self.alloc(cls)
        except RuntimeError as e:
            raise RematError(
                f"remat: could not allocate {cls / 2**20:.1f} MiB of pinned host memory for offloading "
                f"({self.allocated_bytes / 2**30:.2f} GiB pinned so far): {e}. Offload fewer tensors "
                "(a larger min_bytes, a names policy), free host memory, or use "
                "OffloadEngine(pin_memory=False) (synchronous copies into pageable memory)."
            ) from e
        self.allocated_bytes += cls
        self.allocations += 1
        return buf

    def release(self, buf: torch.Tensor, ready: Any) -> None:
        self._returned.append((buf, ready))

    def empty(self) -> int:
        """Drop every free buffer; returns the bytes dropped."""
        with self._lock:
            self._drain()
            n = sum(b.numel() for bucket in self.free.values() for b, _ in bucket)
            self.free.clear()
            self.allocated_bytes -= n
            return n


# A tensor's bytes in its storage: (first byte, shape, strides in bytes, element size)
_Geometry = tuple[int, tuple[int, ...], tuple[int, ...], int]


def _geometry(t: torch.Tensor, base: int = 0) -> _Geometry:
    """``t``'s :data:`_Geometry`, its bytes counted from byte ``base`` of its storage."""
    es = t.element_size()
    return int(t.storage_offset()) * es - base, tuple(t.shape), tuple(int(st) * es for st in t.stride()), es


class _StorageReads:
    """NOTE [reads of one device copy]: the copies of one saved storage in one call (a whole copy, the span of a
    small slice, a copy made after a write), and the bytes of it their readers wrote, counted in its own bytes."""

    __slots__ = ("origin", "copies", "written")

    def __init__(self, origin: Any) -> None:
        self.origin = origin  # (the weak reference whose id keys it: held, so that the id is not reused)
        self.copies: list[weakref.ref[_Copy]] = []
        self.written: list[_Geometry] = []


def _note_written(c: _Copy, weakly: bool = False) -> None:
    """NOTE [reads of one device copy]: keep, with its storage's reads, the bytes that tensors ``c`` handed out
    wrote (they may die, or ``c`` may, before a later read of those bytes); ``weakly``: hold them weakly from now
    on."""
    given = c.given
    for k, (t, v, base) in given.items():
        x = t() if type(t) is weakref.ref else t
        if x is not None and x._version != v:
            if c.reads is None:  # (a storage with one copy in the call: a record of its own)
                c.reads = _StorageReads(c.origin)
                c.reads.copies.append(weakref.ref(c))
            c.reads.written.append(_geometry(x, base))
            given[k] = (t, x._version, base)
        if weakly and x is t:
            given[k] = (weakref.ref(x), given[k][1], base)


def _overlap(g: _Geometry, h: _Geometry, max_addresses: int = 1 << 24) -> bool:
    """Whether two tensors' bytes (:data:`_Geometry`, in one storage) have one in common, exactly, by their
    elements' addresses (``unsafe_split``'s column blocks interleave without sharing one). Asked only where one of
    them was written, so its cost matters little; past ``max_addresses`` bytes each: True (an error rather than a
    guess)."""
    def extent(x: _Geometry) -> tuple[int, int, int]:
        lo = hi = x[0]
        n = 1
        for size, st in zip(x[1], x[2]):
            n *= size
            if st >= 0:
                hi += (size - 1) * st
            else:
                lo += (size - 1) * st
        return lo, hi + x[3], n * x[3]

    (a, b, n), (lo, hi, m) = extent(g), extent(h)
    if n == 0 or m == 0 or a >= hi or lo >= b:
        return False
    if n > max_addresses or m > max_addresses:
        return True

    def addresses(x: _Geometry) -> torch.Tensor:
        addr = torch.full((), x[0], dtype=torch.int64)
        for size, st in zip(x[1], x[2]):
            addr = addr.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * st
        return (addr.reshape(-1, 1) + torch.arange(x[3], dtype=torch.int64)).reshape(-1)

    with internal():  # (remat's modes let its ops through)
        return bool(torch.isin(addresses(h), addresses(g)).any())


def _span(t: torch.Tensor, es: int, offset: int) -> tuple[int, int]:
    """The bytes ``[lo, hi)`` of its storage that a strided tensor that is not contiguous reads (lo a multiple of
    its element size), given what the caller has asked of it already: ``t.element_size()``, ``t.storage_offset()``
    (a contiguous one's are ``offset * es`` on, ``t.nbytes`` of them: :meth:`OffloadEngine._offload`)."""
    if t.numel() == 0:
        return 0, 0
    lo = offset
    hi = lo + 1
    for size, stride in zip(t.shape, t.stride()):
        if stride >= 0:
            hi += (size - 1) * stride
        else:
            lo += (size - 1) * stride
    return int(lo) * es, int(hi) * es


class _Group:
    """The offloaded storages of one remat call."""

    __slots__ = ("gid", "copies", "by_storage", "spans", "reached", "deferred", "origins", "reads", "__weakref__")

    def __init__(self, gid: int) -> None:
        self.gid = gid
        self.copies: list[weakref.ref[_Copy]] = []
        self.deferred: list[weakref.ref[_Copy]] = []  # copies not started yet (NOTE [keep last])
        # per storage (data pointer), its whole copy in this call: the storage, its version then, the copy, and the
        # tensor whose version counter the copied tensor shares (it, or the base it is a view of)
        self.by_storage: dict[int, tuple[Any, int, weakref.ref[_Copy], weakref.ref[torch.Tensor]]] = {}
        # per storage (data pointer), the span copies of small slices made before any whole copy: each with the
        # storage's version then and its handle, to move to a whole copy made later (NOTE [one copy per storage])
        self.spans: dict[int, list[tuple[int, weakref.ref[_Copy], weakref.ref[Offloaded], Any]]] = {}
        # per saved storage (by the id of the weak reference its copies hold), how many copies it has, and, for
        # one with more than one, the reads of all of them (NOTE [reads of one device copy])
        self.origins: dict[int, int] = {}
        self.reads: dict[int, _StorageReads] = {}
        self.reached = False


# a copy no handle has read: one read-only empty table for all (a dict per copy costs on the forward pass's hot path)
_NOTHING_GIVEN: Any = types.MappingProxyType({})


class _Copy:
    """One storage's bytes on the host, and its device copy while the backward pass needs it: a :class:`_HostCopy`,
    which handles read, or a solo handle's own (NOTE [solo handles])."""

    __slots__ = ("engine", "cid", "group", "src", "nbytes", "host", "buf", "d2h_done", "dev", "dev_weak",
                 "h2d_done", "live", "pending", "round", "deferred", "vsrc", "saved_version", "given",
                 "origin", "origin_lo", "reads", "__weakref__")

    engine: OffloadEngine
    cid: int
    group: _Group | None
    src: torch.device
    nbytes: int
    host: torch.Tensor | None
    buf: torch.Tensor | None  # the pool buffer behind host (pinned path only)
    d2h_done: Any
    dev: torch.Tensor | None  # device bytes, held strongly until every handle read them
    dev_weak: weakref.ref[Any] | None  # ...then weakly (the device storage)
    h2d_done: Any
    live: int
    pending: int
    round: int
    deferred: tuple[torch.Tensor, torch.device] | None  # kept on the device (NOTE [keep last])
    # NOTE [written while copied]: until the copy has read the bytes (kept, or a copy still running), an alias of the
    # saved tensor (same version counter, same storage: no extra memory), to see writes
    vsrc: torch.Tensor | None
    saved_version: int | None  # if the bytes were written before their copy had read them: raise
    given: dict[int, tuple[Any, int, int]]
    origin: Any
    origin_lo: int
    reads: _StorageReads | None

    def __init__(self, engine: OffloadEngine, cid: int, group: _Group | None, src: torch.device, nbytes: int,
                 origin: Any = None, origin_lo: int = 0) -> None:
        # (few statements: a copy is made per offloaded storage, on the forward pass's hot path)
        self.engine, self.cid, self.group, self.src, self.nbytes, self.origin, self.origin_lo = \
            engine, cid, group, src, nbytes, origin, origin_lo
        self.host = self.buf = self.d2h_done = self.dev = self.dev_weak = self.h2d_done = self.deferred = \
            self.vsrc = self.saved_version = self.reads = None
        # NOTE [reads of one device copy]: per handle (by its key), the tensor handed out over dev (held as dev is,
        # strongly then weakly), its version then, and the byte of its storage where the saved storage's first
        # would be; origin: the saved storage (a weak reference: a token for it), origin_lo: its byte where this
        # copy starts; reads: the reads of all the storage's copies in this call, once this one has been read
        self.given = _NOTHING_GIVEN  # (one dict for all until a handle is read)
        # live handles; handles not yet read since the last host-to-device copy; host-to-device copies started
        self.live = self.pending = self.round = 0

    def __del__(self) -> None:
        if self.buf is not None:
            self.engine._pool.release(self.buf, self.h2d_done or self.d2h_done)
        if self.given and self.group is not None and self.group.origins.get(id(self.origin), 1) > 1:
            _note_written(self)  # its handles died after their reads: what these wrote stays known to the others


class _HostCopy(_Copy):
    """A copy handles read (every copy but a solo handle's own)."""

    __slots__ = ()


# NOTE [solo handles]: the common case of an offload on the forward pass's hot path (OffloadEngine.offload_saved: no
# dispatch mode, not CUDA, a synchronous copy of a tensor that is all of its storage's bytes, their first copy in the
# call) makes one object, not two: a handle that is its own copy (an Offloaded whose _copy is None, with the copy's
# fields). A later tensor of the call saved from the same storage gets a handle of its own that reads the solo's copy,
# as it would read a _HostCopy. The solo counts itself among its copy's live handles until it dies; if autograd lets
# it go unread while such another handle lives, its count stays (the object lives on as the copy), so the device copy
# is held strongly until those handles die rather than until they have read it; solos are never CUDA copies (each
# Python object costs ~3 k instructions made and let go, per saved tensor).
_new_object = object.__new__
_CPU = torch.device("cpu")
# (the probes of the offload engine's hot path, as module globals: ~0.1 us less each than through _ti's attributes)
_dispatch_modes_pushed = _ti.dispatch_modes_pushed
_pre_dispatch_modes_pushed = _ti.pre_dispatch_modes_pushed
_is_grad_enabled = torch.is_grad_enabled
_Tensor, _BOOL = torch.Tensor, torch.bool


class Offloaded(_Copy):
    """What autograd holds instead of an offloaded tensor: a view (dtype, shape, strides) of a host copy.

    Made by :meth:`OffloadEngine.offload`; :meth:`OffloadEngine.fetch` gives the tensor back.

    Example:
        >>> import torch
        >>> from remat.offload import OffloadEngine, Offloaded
        >>> eng = OffloadEngine()
        >>> x = torch.arange(6.0).reshape(2, 3)
        >>> h = eng.offload(x.t(), "cpu")
        >>> isinstance(h, Offloaded), tuple(h.shape), h.stride
        (True, (3, 2), (1, 3))
        >>> torch.equal(eng.fetch(h), x.t())
        True
    """

    __slots__ = ("_copy", "_layout", "offset", "version", "orig", "seen", "key")

    _copy: _Copy | None  # None: a solo, its own copy
    _layout: tuple[torch.dtype, torch.Size, tuple[int, ...]] | None
    offset: int
    version: int
    orig: weakref.ref[torch.Tensor]
    seen: int
    key: int

    def __init__(self, engine: OffloadEngine, copy: _Copy, t: torch.Tensor, offset: int, version: int) -> None:
        # (a handle of copy: none of _Copy's fields is its own; a solo is made by OffloadEngine.offload_saved)
        # key: names the handle in its copy's table of reads for as long as the engine lives (an id is reused once
        # the handle dies, and a later handle of the same copy must not be given the dead one's tensor); one is
        # drawn only for a handle that is read
        self.engine, self._copy, self.key = engine, copy, -1  # (given by _view, at its first read)
        # offset: t's first element, counted from the first copied byte (a copy of the span of a small view starts
        # at t's); version: t's (both read by the caller already: a call into torch each, per saved tensor).
        # _layout: t's dtype, shape and strides; None for a solo, whose host tensor has them (a copy of t itself,
        # which spares the three calls into torch per saved tensor)
        self._layout = (t.dtype, t.shape, t.stride())
        self.offset, self.version = offset, version
        self.orig = weakref.ref(t)  # to catch in-place writes after saving, as autograd does
        self.seen = 0  # the copy's round this handle last read
        copy.live += 1

    @property
    def copy(self) -> _Copy:
        """The host copy this handle reads: another object's, or its own (a solo: NOTE [solo handles])."""
        return self._copy or self

    @property
    def dtype(self) -> torch.dtype:
        lay = self._layout
        return lay[0] if lay is not None else self.host.dtype  # type: ignore[union-attr]

    @property
    def shape(self) -> torch.Size:
        lay = self._layout
        return lay[1] if lay is not None else self.host.shape  # type: ignore[union-attr]

    @property
    def stride(self) -> tuple[int, ...]:
        lay = self._layout
        return lay[2] if lay is not None else self.host.stride()  # type: ignore[union-attr]

    def __del__(self) -> None:
        try:
            c = self._copy
        except AttributeError:  # (its __init__ raised)
            return
        if c is None:  # a solo: its copy goes with it (_Copy.__del__, inline: a solo has no pool buffer, never CUDA)
            if self.given and self.group is not None and self.group.origins.get(id(self.origin), 1) > 1:
                _note_written(self)
            return
        c.live -= 1
        if self.seen != c.round:
            c.engine._read(c)


# dtypes no tensor of which is quantized or has its conjugate bit (torch sets the bit on complex tensors only): the
# two questions are asked of the others alone (a call into torch each, per saved tensor)
_REAL_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8,
                          torch.int16, torch.int32, torch.int64, torch.bool})
_STAT_KEYS = ("offloaded", "copies", "offloaded_bytes", "shared", "kept_on_device", "fetched", "h2d", "h2d_bytes",
              "prefetched", "prefetch_oom", "stream_waits")


class OffloadEngine:
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
        if not isinstance(max_inflight_bytes, int) or max_inflight_bytes <= 0:
            raise ValueError(f"OffloadEngine: max_inflight_bytes must be a positive int, got {max_inflight_bytes!r}")
        if max_pinned_bytes is not None and (not isinstance(max_pinned_bytes, int) or max_pinned_bytes < 0):
            raise ValueError(f"OffloadEngine: max_pinned_bytes must be None or an int >= 0, got {max_pinned_bytes!r}")
        if not isinstance(keep_last, int) or keep_last < 0:
            raise ValueError(f"OffloadEngine: keep_last must be an int >= 0, got {keep_last!r}")
        self._pin_memory = pin_memory
        self.keep_last = keep_last
        # (per source device and destination name: whether the source keeps (NOTE [keep last]), whether the copy runs
        # asynchronously (_asynchronous), the destination device; looked up once per copy (_route))
        self._routes: dict[tuple[torch.device, str], tuple[bool, bool, torch.device]] = {}
        self._from_cpu: dict[str, torch.device | None] = {}  # (per destination name: _plain_from_cpu)
        self._keep_devices = frozenset({"cuda"})  # (tests add "cpu")
        self.max_inflight_bytes = max_inflight_bytes
        self.prefetch = prefetch
        self.trace: list[tuple[str, int, int]] | None = [] if trace else None
        self._pool = _PinnedPool(_default_pinned_cap() if max_pinned_bytes is None else max_pinned_bytes)
        self._d2h: dict[torch.device, Any] = {}
        self._h2d: dict[torch.device, Any] = {}
        # per source device: copies to the host still running (event, bytes), and their bytes; one device's
        # copies do not hold back another's forward pass
        self._inflight: dict[torch.device, collections.deque[tuple[Any, int, Any, Any]]] = collections.defaultdict(
            collections.deque)
        self._inflight_bytes: collections.Counter[torch.device] = collections.Counter()
        # the autograd engine runs one thread per device: offload, fetch and the bookkeeping of reads
        # (also from a handle's __del__, whenever the garbage collector runs) take this lock
        self._lock = threading.RLock()
        self._groups: weakref.WeakKeyDictionary[Any, _Group] = weakref.WeakKeyDictionary()
        self._order: list[weakref.ref[_Group]] = []  # groups in the order they first offloaded
        self._next_gid = 0
        self._next_cid = 0
        self._handle_keys = itertools.count()  # (Offloaded.key)
        self._devices: dict[str, torch.device] = {"cpu": _CPU}  # (a policy's device strings, parsed once)
        self._kinds: dict[str, str] = {}  # (a policy's device strings: the type of device each names)
        # (a device's type, looked up: torch.device.type makes a new string, ~0.4 us, on the hot path of both passes)
        self._types: dict[torch.device, str] = {}
        # (a plain dict, every key present: a Counter's += costs ~0.25 us against a dict's ~0.07, several per saved
        # tensor on the forward pass's hot path)
        self._stats: dict[str, int] = dict.fromkeys(_STAT_KEYS, 0)
        # the solo handles made since stats was last read, and their bytes (NOTE [solo handles]: two attributes
        # counted, ~0.4 us less per saved tensor than three counters of the dict, which stats adds them to)
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

    @property
    def pin_memory(self) -> bool:
        return self._pin_memory

    @pin_memory.setter
    def pin_memory(self, value: bool) -> None:
        self._pin_memory = value
        self._routes.clear()  # (each copy's route is looked up: _route)
        self._from_cpu.clear()

    @property
    def _keep_devices(self) -> frozenset[str]:
        """The device types where keeping a call's storages saves a round trip (NOTE [keep last])."""
        return self._keep_types

    @_keep_devices.setter
    def _keep_devices(self, value: frozenset[str]) -> None:
        self._keep_types = value
        self._routes.clear()
        self._from_cpu.clear()

    # ---- forward ---------------------------------------------------------------
    def applies(self, t: torch.Tensor, decision: Any) -> bool:
        """Whether ``decision`` (an Offloadable) moves ``t``: right source device, plain strided (no conjugate or
        negative bit, not quantized or nested), large enough."""
        return self._bytes_moved(t, decision) > 0

    def _bytes_moved(self, t: torch.Tensor, decision: Any) -> int:
        """:meth:`applies`: ``t``'s size in bytes if ``decision`` moves it, else 0 (its caller reads it)."""
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            return 0
        name = decision.src
        if name is not None:
            kind = self._kinds.get(name)
            if kind is None:
                kind = self._kinds[name] = self._type(self._device(name))
            # (t.is_cpu and t.is_cuda are flags; t.device.type makes a device and a string, ~0.4 us, per saved tensor)
            if not (t.is_cpu if kind == "cpu" else t.is_cuda if kind == "cuda" else self._type(t.device) == kind):
                return 0
        if t.layout is not torch.strided or t.is_meta or t.is_neg() or t.is_nested or _ti.is_zero_tensor(t) \
                or (t.dtype not in _REAL_DTYPES and (t.is_conj() or t.is_quantized)):
            # rebuilt from raw storage, a conjugate or negative view would lose its bit: keep these; a zero tensor
            # (forward AD's zero tangent, under hessian) has no storage at all, and costs nothing kept
            return 0
        nbytes: int = t.nbytes
        return nbytes if nbytes >= decision.min_bytes else 0

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
        if _ti.no_modes_pushed():  # (the common case, from a pack hook on the fast path: nothing to pop)
            with self._lock:
                return self._offload(t, dst, group)
        with _ti.no_dispatch_modes(), self._lock:
            return self._offload(t, dst, group)

    def offload_saved(self, t: torch.Tensor, decision: Any, group: Any = None) -> Offloaded | None:
        """:meth:`applies`, then :meth:`offload_below_modes`, in one call: ``t``'s handle, or None where
        ``decision`` (an Offloadable) does not move it (the caller keeps it). The saved-tensor hooks' entry, once
        per saved tensor on the forward pass's hot path: its common case (no dispatch mode, a synchronous copy of
        a plain CPU tensor that is all of its storage's bytes, in order, their first copy in the call) runs here,
        the steps of :meth:`_offload`, :meth:`_copy_out`, :meth:`_copy_raw` and :meth:`_register` inline (each Python
        call costs ~0.1-0.2 us, per saved tensor), and makes one object, a solo handle (NOTE [solo handles]); every
        other case runs through them."""
        grp = group
        src_kind = decision.src
        if not t.is_cpu or type(grp) is not _Group or type(t) is not _Tensor \
                or (src_kind is not None and self._kinds.get(src_kind) != "cpu") or _dispatch_modes_pushed() \
                or _pre_dispatch_modes_pushed():
            # (not the CPU: graph capture, asynchronous copies, kept storages; a mode to pop; a group to look up)
            return self._offload_saved_slowly(t, decision, group)
        # _bytes_moved's questions, of a plain CPU tensor (never meta) from a decision that moves CPU tensors
        dtype = t.dtype
        # (a zero tensor, forward AD's, and a layout other than strided are told by their storage below)
        if t.is_neg() or t.is_nested or dtype not in _REAL_DTYPES:
            return self._offload_saved_slowly(t, decision, group)
        try:
            nbytes = t.nbytes
        except RuntimeError:  # (a sparse tensor has no nbytes; _bytes_moved keeps it)
            return self._offload_saved_slowly(t, decision, group)
        if nbytes < decision.min_bytes:
            return None
        dst = decision.dst
        with self._lock:
            try:
                storage = t.untyped_storage()
                key = storage.data_ptr()
            except RuntimeError:
                # (no storage to copy: sparse or mkldnn tensors raise NotImplementedError, a RuntimeError; a zero
                # tensor, forward AD's, has no data pointer; _bytes_moved keeps them all)
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
                self._take_spans(grp, key, o, t if base is None else base)
            return o

    def _offload_saved_slowly(self, t: torch.Tensor, decision: Any, group: Any) -> Offloaded | None:
        """:meth:`offload_saved` of a tensor its common case does not take."""
        return self.offload_below_modes(t, decision.dst, group) if self._bytes_moved(t, decision) else None

    def group(self, key: Any) -> _Group:
        """The group of the remat call ``key`` (made now if it has none), to pass as ``group`` to
        :meth:`offload_below_modes`."""
        with self._lock:
            grp = self._group(key)
        assert grp is not None
        return grp

    def _type(self, dev: torch.device) -> str:
        t = self._types.get(dev)
        if t is None:
            t = self._types[dev] = dev.type
        return t

    def _device(self, name: str) -> torch.device:
        dev = self._devices.get(name)
        if dev is None:
            dev = self._devices[name] = torch.device(name)
        return dev

    def _offload(self, t: torch.Tensor, dst: str, group: Any) -> Offloaded:
        if _ti.cuda_graph_capturing(t):
            raise RematError(
                "remat: an offload policy ran under CUDA graph capture; its copies to host memory and "
                "pinned-buffer pool are host-side work a graph cannot replay. Capture with a save or "
                "recompute policy, or offload outside the captured region."
            )
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
                self._register(grp, key, copy, version, t)
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
            copy = self._shared_copy(grp, storage, key, root, t, version)
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
            self._register(grp, key, copy, version, t)
        self._stats["offloaded"] += 1
        return Offloaded(self, copy, t, offset, version)

    def _register(self, grp: _Group, key: int, copy: _Copy, version: int, t: torch.Tensor) -> None:
        """``copy`` is of the whole storage ``key`` that ``t`` (at ``version``) is saved from: later tensors of the
        call saved from it share it while it is unchanged (NOTE [one copy per storage])."""
        cref = weakref.ref(copy)
        grp.copies.append(cref)
        base = t._base
        root = t if base is None else base
        grp.by_storage[key] = (copy.origin, version, cref, weakref.ref(root))
        if grp.spans:
            self._take_spans(grp, key, copy, root)

    @staticmethod
    def _take_spans(grp: _Group, key: int, whole: _Copy, root: torch.Tensor) -> None:
        """NOTE [one copy per storage]: the handles of slices of this storage, copied as spans before its whole copy
        ``whole`` was made, read the whole copy instead, if no span was read and the slice's version counter (its
        ``_base``'s, or its own) has not moved since its span was copied; of a counter other than ``root``'s (the
        tensor copied whole, or its base), only if the whole copy has read its bytes (not kept: its write check
        watches ``root``'s counter)."""
        for ver, sref, oref, rref in grp.spans.pop(key, ()):
            span, o = sref(), oref()
            r = rref()
            if (span is None or o is None or o._copy is not span or r is None or r._version != ver
                    or (r is not root and whole.vsrc is not None)
                    or span.origin is not whole.origin or span.round or span.given):
                continue
            o.offset += span.origin_lo // o.dtype.itemsize
            o._copy = whole
            span.live -= 1
            whole.live += 1

    def _group(self, key: Any) -> _Group | None:
        if key is None:
            return None
        grp = self._groups.get(key)
        if grp is None:
            grp = self._groups[key] = _Group(self._next_gid)
            self._next_gid += 1
            self._order = [r for r in self._order if r() is not None]
            self._order.append(weakref.ref(grp))
            self._flush_older()
        return grp

    def storage_written(self, group: Any, keys: set[int]) -> bool:
        """NOTE [one copy per storage]: an op of the call ``group`` is about to write these storages (by data
        pointer): a tensor saved after it gets a copy of its own. Returns whether one of them had a copy to share."""
        grp = self._groups.get(group)
        shared = False
        if grp is not None:
            with self._lock:
                for k in keys:
                    shared = grp.by_storage.pop(k, None) is not None or shared
                    shared = grp.spans.pop(k, None) is not None or shared
        return shared

    @staticmethod
    def _shared_copy(grp: _Group, storage: Any, key: int, root: torch.Tensor, t: torch.Tensor,
                     version: int) -> _Copy | None:
        """The copy already made of this storage (data pointer ``key``) in this call, if the version counter of the
        tensor it was made of has not moved since (NOTE [one copy per storage]): not ``t``'s version, which may be
        another counter's (``y.add_(1)`` after ``d = y.data``: ``d`` still at the version ``y`` was copied at)."""
        ent = grp.by_storage.get(key)
        if ent is None:
            return None
        sref, ver, cref, rref = ent
        c = cref()
        if c is None or sref() is not storage:
            return None
        # (t's counter or another: a .detach() or .data alias, an unsafe_split piece; a write through another
        # counter than the copied tensor's is the recorder's or the tap's to report: storage_written. Of another
        # counter, only a copy that has read its bytes: a kept one's write check watches the copied tensor's counter)
        r = rref()
        if r is None or r._version != ver:
            return None
        if r is root or c.vsrc is None:
            return c
        # a copy that has not read its bytes (kept, or copying) watches the copied tensor's counter for writes
        # (NOTE [written while copied]), which t's may not be: only a tensor at its version spanning half the storage
        # or more (a .detach() alias; an unsafe_split piece, as GRU's thirds, is smaller)
        if version != ver:
            return None
        lo, hi = _span(t, t.element_size(), t.storage_offset())  # type: ignore[arg-type]
        return c if 2 * (hi - lo) >= c.nbytes else None

    def _copy_out(self, t: torch.Tensor, storage: Any, dst: str, grp: _Group | None,
                  lo: int, hi: int, whole: bool = False) -> _Copy:
        """Copy bytes ``[lo, hi)`` of ``storage``, ``t``'s (``whole``: they are ``t``'s own, all of them, in order)."""
        nbytes = hi - lo
        device = t.device
        origin = weakref.ref(storage)
        c = _HostCopy(self, self._next_cid, grp, device, nbytes, origin, lo)
        self._next_cid += 1
        route = self._routes.get((device, dst)) or self._route(device, dst)
        asynchronous = route[1]
        to = route[2]
        if grp is None:
            keep = False
        else:
            # (weakref.ref gives the storage's one weak reference while it lives: a token shared by its copies)
            grp.origins[id(origin)] = grp.origins.get(id(origin), 0) + 1
            keep = route[0] and self.keep_last > 0
        if whole and not keep and not asynchronous:
            # a synchronous copy has read the bytes when it returns (NOTE [written while copied] holds nothing); it
            # copies t itself, so the host copy is of t's dtype, which fetch never reads (only the storage). A pack
            # hook runs without grad mode: t's own copy holds no graph, where elsewhere its detached alias's must not
            self._copy_raw(c, t if not torch.is_grad_enabled() else t.detach(), to, False)
            return c
        raw = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, lo, (nbytes,), (1,))
        c.vsrc, c.saved_version = t.detach(), t._version  # NOTE [written while copied]
        if keep:
            c.dev, c.deferred = raw, (raw, to)  # NOTE [keep last]: copied when a later call offloads
            grp.deferred.append(weakref.ref(c))  # type: ignore[union-attr]
            self._stats["kept_on_device"] += 1
            self._log("keep", c)
            return c
        self._copy_raw(c, raw, to, asynchronous)
        return c

    def _route(self, device: torch.device, dst: str) -> tuple[bool, bool, torch.device]:
        """Whether a copy from ``device`` to the device named ``dst`` keeps (NOTE [keep last]) and runs asynchronously
        (:meth:`_asynchronous`), and the device ``dst`` names: worked out once per pair (three lookups and two calls
        cost ~1 us, per copy)."""
        to = self._device(dst)
        route = self._routes[(device, dst)] = (self._type(device) in self._keep_devices,
                                               self._asynchronous(device, to), to)
        return route

    def _plain_from_cpu(self, dst: str) -> torch.device | None:
        """The device ``dst`` names if a copy from the CPU there is synchronous and kept nowhere (:meth:`_route`),
        else None: ``offload_saved``'s common case looks it up once per saved tensor (a route's lookup and two of its
        fields cost ~0.15 us more)."""
        keep, asynchronous, to = self._routes.get((_CPU, dst)) or self._route(_CPU, dst)
        plain = None if keep or asynchronous else to
        self._from_cpu[dst] = plain
        return plain

    def _asynchronous(self, src: torch.device, dst: torch.device) -> bool:
        """Whether a copy from ``src`` to ``dst`` runs asynchronously, into a pinned buffer (else: synchronously,
        done when :meth:`_copy_raw` returns)."""
        return self.pin_memory and self._type(src) == "cuda" and self._type(dst) == "cpu"

    def _copy_raw(self, c: _Copy, raw: torch.Tensor, dst: torch.device, asynchronous: bool) -> None:
        """Start the copy of ``raw`` (uint8 bytes; on the synchronous path also a tensor that is exactly its
        storage) to ``dst`` (``asynchronous``: what :meth:`_asynchronous` says of the pair); :meth:`_settle` once it
        has read the bytes."""
        if asynchronous:
            self._d2h_async(c, raw)  # settled when its event is seen complete, or the compute stream waits on it
        else:  # synchronous (CPU, pageable memory, other device pairs); clone: fewer arguments to parse
            c.host = raw.clone() if c.src == dst else raw.to(dst, copy=True)
            if c.vsrc is not None:
                self._settle(c)
        stats = self._stats
        stats["copies"] += 1
        stats["offloaded_bytes"] += c.nbytes
        if self.trace is not None:
            self._log("d2h", c)

    def _flush(self, c: _Copy) -> None:
        """Start the copy of a kept storage (NOTE [keep last]) and let go of the device bytes."""
        assert c.deferred is not None
        raw, dst = c.deferred
        c.deferred = None
        _note_written(c, weakly=True)  # NOTE [reads of one device copy]: what a reader wrote is copied as it is
        self._copy_raw(c, raw, dst, self._asynchronous(c.src, dst))
        c.dev = None

    @staticmethod
    def _settle(c: _Copy | None) -> None:
        """NOTE [written while copied]: ``c``'s copy has read its bytes, or work queued from now on on the compute
        stream runs after it: whether the bytes were written since they were saved is known now, and final."""
        if c is not None and c.vsrc is not None:
            if c.vsrc._version == c.saved_version:
                c.saved_version = None  # unchanged since it was saved: the copy holds what was saved
            c.vsrc = None

    def _flush_older(self) -> None:
        """A call started offloading: start the copies of the calls older than the ``keep_last`` newest."""
        groups = [r() for r in self._order]
        for grp in groups[: max(len(groups) - self.keep_last, 0)]:
            if grp is None or not grp.deferred:
                continue
            for ref in grp.deferred:
                c = ref()
                if c is not None and c.deferred is not None:
                    self._flush(c)
            grp.deferred = []

    def _stream(self, table: dict[torch.device, Any], dev: torch.device) -> Any:
        s = table.get(dev)
        if s is None:
            s = table[dev] = torch.cuda.Stream(device=dev)
        return s

    def _d2h_async(self, c: _Copy, raw: torch.Tensor) -> None:
        self._bound_inflight(c.nbytes, raw.device)
        buf = self._pool.acquire(c.nbytes)
        try:
            self._d2h_start(c, raw, buf)
        except BaseException:
            self._pool.release(buf, None)  # nothing was queued into it: back to the pool
            raise

    def _d2h_start(self, c: _Copy, raw: torch.Tensor, buf: torch.Tensor) -> None:
        cur = torch.cuda.current_stream(raw.device)
        side = self._stream(self._d2h, raw.device)
        produced = torch.cuda.Event()
        produced.record(cur)
        side.wait_event(produced)  # after the kernel that wrote the tensor; the host does not wait
        with torch.cuda.stream(side):
            c.host = buf[: c.nbytes]
            c.host.copy_(raw, non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        # NOTE [stream-ordered reuse]: the device bytes are held (not record_stream'ed) until the copy is
        # known done, or until the compute stream has been made to wait for it; only then dropped
        c.buf = buf
        self._running(c, raw, done)

    def _running(self, c: _Copy, raw: torch.Tensor, done: Any) -> None:
        """``c``'s copy from ``raw`` was queued; ``done`` completes when it has read the bytes."""
        c.d2h_done = done
        self._inflight[raw.device].append((done, c.nbytes, raw, weakref.ref(c)))
        self._inflight_bytes[raw.device] += c.nbytes

    def _bound_inflight(self, nbytes: int, device: torch.device) -> None:
        """Drop the finished copies' device bytes; past ``max_inflight_bytes`` of running ones, make the
        compute stream (not the host) wait for the oldest, then drop its bytes (NOTE [stream-ordered reuse])."""
        queue = self._inflight[device]
        while queue:
            ev, n, _, cref = queue[0]
            if not ev.query():
                if self._inflight_bytes[device] + nbytes <= self.max_inflight_bytes:
                    return
                self._stream_wait(device, ev)
                self._stats["stream_waits"] += 1
            queue.popleft()
            self._inflight_bytes[device] -= n
            self._settle(cref())

    def end_of_call(self) -> None:
        """A remat call's forward pass ended: let go of the device bytes of its finished copies now,
        rather than at the next offload or read (they would be held through the rest of the forward)."""
        with self._lock:
            for device in list(self._inflight):
                self._poll(device)

    def _poll(self, device: torch.device) -> None:
        """Drop the device bytes of the copies to the host that have finished."""
        queue = self._inflight.get(device)
        while queue and queue[0][0].query():
            _, n, _, cref = queue.popleft()
            self._inflight_bytes[device] -= n
            self._settle(cref())

    @staticmethod
    def _stream_wait(device: torch.device, ev: Any) -> None:
        """Work queued next on ``device``'s current stream runs after ``ev`` (the host does not wait)."""
        torch.cuda.current_stream(device).wait_event(ev)

    def watch(self, o: Offloaded, t: torch.Tensor, version: int) -> None:
        """NOTE [written while copied]: if ``o``'s copy has not read its bytes yet (kept, or still copying), it
        watches ``t``'s version counter from now on, through an alias made here, by autograd (``o`` was made in a
        dispatch mode's handler, below autograd, where an alias has a counter of its own that a write through the
        caller's tensors does not move: ``t`` is the same tensor, seen from above). ``version``: ``t``'s when ``o``
        was made (a write since then raises at the copy's reads)."""
        with self._lock:
            c = o._copy or o
            if c.vsrc is None:
                return  # the copy has the bytes: what o's reader reads is what was saved
            c.vsrc, c.saved_version = t.detach(), version
            o.version = version

    def shares_storage(self, o: Offloaded, storage_keys: set[int]) -> bool:
        """Whether the tensor ``o`` was copied from lives in one of these storages (by data pointer). While the
        copy has not read the bytes (kept, or copying), its alias of them answers (NOTE [written while copied]): the
        tensor itself may be gone (a product only written through ``unsafe_chunk`` pieces, as ``nn.GRUCell`` does
        on the CPU), and a write must still wait for the copy, or be copied after it."""
        src = (o._copy or o).vsrc
        if src is None:
            src = o.orig()
        return src is not None and int(src.untyped_storage().data_ptr()) in storage_keys

    def before_write(self, o: Offloaded) -> None:
        """An op is about to write into ``o``'s source tensor: it must wait until the copy has read it."""
        c = o._copy or o
        if c.deferred is not None:
            with self._lock:
                if c.deferred is not None:
                    self._flush(c)  # a kept storage: copy what was saved before the write
        if c.d2h_done is not None:
            self._stream_wait(c.src, c.d2h_done)
            self._settle(c)  # the write is queued after the copy

    # ---- backward --------------------------------------------------------------
    def fetch(self, o: Offloaded) -> torch.Tensor:
        """The tensor back on its source device; the current stream waits for its copy if still running."""
        with self._lock, internal():  # (no torch.no_grad(): fresh tensors over remat's own bytes)
            c = o._copy or o
            orig = c.vsrc if c.vsrc is not None else o.orig()
            now = orig._version if orig is not None else (-1 if c.saved_version is not None else o.version)
            if now != o.version:
                raise RematError(
                    f"remat: a tensor of shape {list(o.shape)} that was offloaded for the backward pass was "
                    f"modified in place after it was saved (version {o.version} -> "
                    f"{'a later one' if now < 0 else now}). Do not modify intermediate results in place after "
                    "an op has used them; clone them first."
                )
            grp = c.group
            if grp is not None and (c.dev is None or not grp.reached):
                self._reach(grp, c)
            dev = c.dev
            if dev is None:
                s = c.dev_weak() if c.dev_weak is not None else None
                # the bytes held weakly are found again only if every tensor read over them lives (held through
                # this read): one that died may have written them unseen (a gradient AccumulateGrad kept and added
                # into); else the host bytes, which nothing writes, are copied again
                readers = [t() if type(t) is weakref.ref else t for t, _, _ in c.given.values()]
                if s is not None and all(r is not None for r in readers):
                    dev = torch.empty(0, dtype=torch.uint8, device=c.src).set_(s)
                else:
                    self._start_h2d(c)
                    dev = c.dev
            assert dev is not None
            out = self._view(c, o, dev)
            if self._written(c, out, dev):
                raise RematError(
                    f"remat: a tensor of shape {list(o.shape)} that was offloaded for the backward pass was "
                    "modified in place in the backward pass, by the backward of an op that read it, and is read "
                    "again now (by another op that saved it, or a second time). Plain autograd raises here too "
                    "('modified by an inplace operation'). Clone a saved tensor in your autograd.Function's "
                    "backward before writing into it."
                )
            if c.h2d_done is not None:
                torch.cuda.current_stream(c.src).wait_event(c.h2d_done)
                self._poll(c.src)
            if o.seen != c.round:
                o.seen = c.round
                self._read(c)
            self._stats["fetched"] += 1
            if self.trace is not None:
                self._log("use", c)
            return out

    @staticmethod
    def _view(c: _Copy, o: Offloaded, dev: torch.Tensor) -> torch.Tensor:
        """``o``'s tensor over the device bytes ``dev``: what it was given before if that lives over them (its
        version is checked with the others'), else a new one, noted (NOTE [reads of one device copy])."""
        if o.key < 0:
            o.key = next(c.engine._handle_keys)
        prev = c.given.get(o.key)
        if prev is not None:
            t = prev[0]
            out = t() if type(t) is weakref.ref else t
            if out is not None and out.untyped_storage().data_ptr() == dev.untyped_storage().data_ptr():
                return out  # type: ignore[no-any-return]
        if c.given is _NOTHING_GIVEN:
            c.given = {}
            if dev is c.dev and dev.dtype == o.dtype and o.offset == 0 and dev.storage_offset() == 0 \
                    and dev.shape == o.shape and dev.stride() == o.stride:
                # the first reader of a copy of the whole tensor (the synchronous path copies it as a tensor of its
                # own dtype and layout): the copy itself, a tensor of its own, not yet handed to anyone
                c.given[o.key] = (dev, dev._version, -c.origin_lo)
                return dev
        # a kept storage is read in place: dev is then a view of it, starting where the copy would
        offset = o.offset + dev.storage_offset() // o.dtype.itemsize
        out = torch.empty(0, dtype=o.dtype, device=c.src).set_(dev.untyped_storage(), offset, o.shape, o.stride)
        c.given[o.key] = (out if c.dev is not None else weakref.ref(out), out._version,
                          int(dev.storage_offset()) - c.origin_lo)
        return out

    @staticmethod
    def _written(c: _Copy, out: torch.Tensor, dev: torch.Tensor) -> bool:
        """NOTE [reads of one device copy]: whether bytes ``out`` (over ``dev``, ``c``'s device bytes) reads were
        written through a tensor handed out over a copy of the same saved storage in this call (a tensor of
        ``c``'s that died was put on record by the copy's last read, or its bytes were copied again: fetch)."""
        reads = c.reads
        grp = c.group
        if reads is None and grp is not None and grp.origins.get(id(c.origin), 1) > 1:
            # (the first read of a copy whose storage has others in the call: it joins the storage's reads)
            reads = grp.reads.get(id(c.origin))
            if reads is None:
                reads = grp.reads[id(c.origin)] = _StorageReads(c.origin)
            reads.copies.append(weakref.ref(c))
            c.reads = reads
        copies = (c,) if reads is None else [r() for r in reads.copies]
        mine = None  # out's bytes, worked out only where something was written
        for other in copies:
            if other is None:
                continue
            for t, v, base in other.given.values():
                x = t() if type(t) is weakref.ref else t
                if x is not None and x._version != v:
                    mine = mine or _geometry(out, int(dev.storage_offset()) - c.origin_lo)
                    if _overlap(_geometry(x, base), mine):
                        return True
        if reads is not None and reads.written:
            mine = mine or _geometry(out, int(dev.storage_offset()) - c.origin_lo)
            if any(_overlap(g, mine) for g in reads.written):
                return True
        return False

    def _read(self, c: _Copy) -> None:
        """One more handle of ``c`` has been read (or died unread): past the last, hold the device copy weakly."""
        with self._lock:
            self._read_locked(c)

    def _read_locked(self, c: _Copy) -> None:
        if c.deferred is not None:
            return  # never copied: the device bytes are all there is, held until the handles die
        c.pending -= 1
        if c.pending <= 0 and c.dev is not None:
            if c.h2d_done is not None:  # dropped maybe unread: its reuse must come after the copy into it
                self._stream_wait(c.src, c.h2d_done)
            c.dev_weak = weakref.ref(c.dev.untyped_storage())
            c.dev = None
            _note_written(c, weakly=True)

    def _start_h2d(self, c: _Copy, ahead: bool = False) -> None:
        assert c.host is not None
        if c.d2h_done is not None and self._type(c.src) == "cuda" and self._type(c.host.device) == "cpu":
            # NOTE [stream-ordered reuse]: the device bytes belong to the compute stream (which reads them,
            # and frees them in its own order); the copy stream writes them after that stream's earlier work
            cur = torch.cuda.current_stream(c.src)
            dev = torch.empty(c.nbytes, dtype=torch.uint8, device=c.src)
            allocated = torch.cuda.Event()
            allocated.record(cur)
            side = self._stream(self._h2d, c.src)
            with torch.cuda.stream(side):
                side.wait_event(c.d2h_done)
                side.wait_event(allocated)
                dev.copy_(c.host, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(side)
            c.dev, c.h2d_done = dev, ev
        else:  # synchronous; a fresh copy even on the CPU, so the CPU runs the same life cycle as CUDA
            c.dev = c.host.to(c.src, copy=True)
        _note_written(c)  # (what the last round's reads wrote stays known; the new round's read other bytes)
        c.given = _NOTHING_GIVEN
        c.round += 1
        c.pending = c.live
        self._stats["h2d"] += 1
        self._stats["h2d_bytes"] += c.nbytes
        if ahead:
            self._stats["prefetched"] += 1
        self._log("h2d", c)

    def _reach(self, grp: _Group, needed: _Copy) -> None:
        """The backward pass reached ``grp``: fetch all of it and the group it reaches next (NOTE [prefetch])."""
        grp.reached = True
        if not self.prefetch:
            return
        self._start_group(grp, needed)
        self._order = [r for r in self._order if r() is not None]
        groups = [r() for r in self._order]
        i = next((k for k, g in enumerate(groups) if g is grp), 0)
        if i > 0:
            nxt = groups[i - 1]
            assert nxt is not None
            self._start_group(nxt)

    def _start_group(self, grp: _Group, needed: _Copy | None = None) -> None:
        """Start the copies back of ``grp`` (``needed``: the one being read now, not ahead of need)."""
        # the backward pass reads a call's tensors in the reverse of the order they were saved: copy the
        # last-saved first, so the first one needed arrives first
        for ref in reversed(grp.copies):
            c = ref()
            if c is not None and c.live > 0 and c.dev is None and (c.dev_weak is None or c.dev_weak() is None):
                try:
                    self._start_h2d(c, ahead=c is not needed)
                except torch.OutOfMemoryError:
                    # no room to copy ahead: the rest of this group is copied back when read
                    self._stats["prefetch_oom"] += 1
                    return

    # ---- inspection ------------------------------------------------------------
    def _log(self, what: str, c: _Copy) -> None:
        if self.trace is not None:
            self.trace.append((what, -1 if c.group is None else c.group.gid, c.cid))

    def pinned_bytes(self) -> int:
        """Bytes of pinned host memory the pool holds (in use or free)."""
        return self._pool.allocated_bytes

    def pinned_allocations(self) -> int:
        """Pinned buffers allocated so far; flat from step to step once the pool is warm."""
        return self._pool.allocations

    def empty_cache(self) -> int:
        """Hand the pool's free pinned buffers back to PyTorch; returns the bytes released."""
        return self._pool.empty()
