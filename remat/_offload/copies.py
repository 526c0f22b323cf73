"""The host copies of offloaded storages, the handles autograd holds, and the record of one call that shares them.

A :class:`_Copy` is one storage's bytes on the host, and its device copy while
the backward pass needs it; an :class:`Offloaded` handle, which autograd holds
instead of the tensor, is a view (dtype, shape, strides) of one. A
:class:`_Group` holds one remat call's copies and answers which copy a tensor
saved later from the same storage shares (NOTE [one copy per storage]). The
functions at the end are a read's checks: which tensor a handle is given over a
device copy, and whether bytes it reads were written by another reader (NOTE
[reads of one device copy]). Nothing here starts a copy or decides when: that
is the engine's (``streams.py``, ``schedule.py``, ``engine.py``).

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
    the write, a wrong gradient without an error. Sharing only
    with tensors of the same ``_base`` then gave a node that saved ``a`` and
    ``a.detach()[1:]`` and writes ``a`` in its backward two copies, and the slice
    the saved bytes: wrong too.) A write through yet another counter (``d.add_(1)``
    before ``d[1:]`` is saved) is seen only by an op-level observer: the call's
    recorder. A copy kept on the
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
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from .geometry import _Geometry, _geometry, _overlap, _span
from .pool import _PinnedPool

__all__ = ["Offloaded", "_Copy", "_Group", "_HostCopy", "_NOTHING_GIVEN", "_Owner", "_StorageReads", "_note_written",
           "_settle", "_view", "_written"]


class _Owner(Protocol):
    """What a copy asks of the engine that made it (the engine, ``engine.py``, is one): its pinned pool, which a
    copy's pool buffer goes back to when the copy dies; the numbers that name handles in a copy's table of reads
    (:func:`_view`); and :meth:`_read`, told of a handle that dies unread."""

    @property
    def _pool(self) -> _PinnedPool: ...

    @property
    def _handle_keys(self) -> Iterator[int]: ...

    def _read(self, c: _Copy) -> None: ...


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


class _Group:
    """The offloaded storages of one remat call, and which copy of them a tensor saved later shares (NOTE [one copy
    per storage])."""

    __slots__ = ("gid", "copies", "by_storage", "spans", "reached", "deferred", "origins", "reads", "now",
                 "__weakref__")

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
        self.now = False  # copies start at once, never kept (NOTE [keep last]): a decision said defer=False

    def register(self, key: int, copy: _Copy, version: int, t: torch.Tensor) -> None:
        """``copy`` is of the whole storage ``key`` that ``t`` (at ``version``) is saved from: later tensors of the
        call saved from it share it while it is unchanged (NOTE [one copy per storage])."""
        cref = weakref.ref(copy)
        self.copies.append(cref)
        base = t._base
        root = t if base is None else base
        self.by_storage[key] = (copy.origin, version, cref, weakref.ref(root))
        if self.spans:
            self.take_spans(key, copy, root)

    def take_spans(self, key: int, whole: _Copy, root: torch.Tensor) -> None:
        """NOTE [one copy per storage]: the handles of slices of this storage, copied as spans before its whole copy
        ``whole`` was made, read the whole copy instead, if no span was read and the slice's version counter (its
        ``_base``'s, or its own) has not moved since its span was copied; of a counter other than ``root``'s (the
        tensor copied whole, or its base), only if the whole copy has read its bytes (not kept: its write check
        watches ``root``'s counter)."""
        for ver, sref, oref, rref in self.spans.pop(key, ()):
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

    def shared_copy(self, storage: Any, key: int, root: torch.Tensor, t: torch.Tensor, version: int) -> _Copy | None:
        """The copy already made of this storage (data pointer ``key``) in this call, if the version counter of the
        tensor it was made of has not moved since (NOTE [one copy per storage]): not ``t``'s version, which may be
        another counter's (``y.add_(1)`` after ``d = y.data``: ``d`` still at the version ``y`` was copied at)."""
        ent = self.by_storage.get(key)
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
        if r is None:
            # the tensor copied died, its storage lives on in an alias (matmul's 2-D product, copied when a later op
            # read it, saved as its 3-D ``_unsafe_view``, which has a counter of its own): its counter, if it lives,
            # is its aliases' (vsrc, a .detach()), so share only with a tensor at the version it was copied at, as
            # below for another counter (a copy of its own doubled the host bytes)
            r = c.vsrc
            if r is None:
                return c if version == ver else None
        if r._version != ver:
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

    def storage_written(self, keys: set[int]) -> bool:
        """NOTE [one copy per storage]: an op of this call is about to write these storages (by data pointer): a
        tensor saved after it gets a copy of its own. Returns whether one of them had a copy to share."""
        shared = False
        for k in keys:
            shared = self.by_storage.pop(k, None) is not None or shared
            shared = self.spans.pop(k, None) is not None or shared
        return shared


# a copy no handle has read: one read-only empty table for all (a dict per copy costs on the forward pass's hot path)
_NOTHING_GIVEN: Any = types.MappingProxyType({})


class _Copy:
    """One storage's bytes on the host, and its device copy while the backward pass needs it: a :class:`_HostCopy`,
    which handles read, or a solo handle's own (NOTE [solo handles])."""

    __slots__ = ("engine", "cid", "group", "src", "nbytes", "host", "buf", "d2h_done", "dev", "dev_weak",
                 "h2d_done", "live", "pending", "round", "deferred", "vsrc", "saved_version", "given",
                 "origin", "origin_lo", "reads", "__weakref__")

    engine: _Owner
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

    def __init__(self, engine: _Owner, cid: int, group: _Group | None, src: torch.device, nbytes: int,
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

    def __init__(self, engine: _Owner, copy: _Copy, t: torch.Tensor, offset: int, version: int) -> None:
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


def _settle(c: _Copy | None) -> None:
    """NOTE [written while copied]: ``c``'s copy has read its bytes, or work queued from now on on the compute
    stream runs after it: whether the bytes were written since they were saved is known now, and final."""
    if c is not None and c.vsrc is not None:
        if c.vsrc._version == c.saved_version:
            c.saved_version = None  # unchanged since it was saved: the copy holds what was saved
        c.vsrc = None


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
