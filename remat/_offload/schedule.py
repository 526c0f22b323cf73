"""When the offload engine moves what: the calls in order, keeping the newest, prefetching, reading back, letting go.

:class:`_Schedule` builds on the copies of ``streams.py`` (:class:`_Transfers`)
and is built on by :class:`~remat._offload.engine.OffloadEngine`. It numbers the
remat calls in the order they first offload (a group each, ``copies.py``),
starts a copy at once or, while its call is among the newest, defers it (NOTE
[keep last]), starts the deferred ones when a later call offloads or a write
comes, and makes a write wait for a copy still reading its bytes. In the
backward pass it hands a read its tensor (``fetch``), first starting the copies
back of the call the backward pass reached and of the next (NOTE [prefetch]).
Which copy a tensor gets is ``engine.py``'s.

NOTE [keep last]
    The backward pass begins with the call the forward pass ended with: copying
    that call's tensors to the host and straight back is a round trip the
    backward pass would wait for. So on CUDA a call's copies are deferred: its
    storages stay on the device, held by their handles, and their copies start
    when a call ``keep_last`` calls later starts offloading (or just before an
    in-place write into one of them). Whatever is still kept when the backward
    pass arrives is read where it is, like plain autograd's saved tensors A
    call with a decision ``Offloadable(..., defer=False)`` (a memory budget's,
    whose device bytes must go) is never kept: its copies start at once.

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

import itertools
import weakref
from typing import Any

import torch

from .._context import internal
from .._errors import RematError
from .copies import Offloaded, _Copy, _Group, _HostCopy, _note_written, _settle, _view, _written
from .streams import _Transfers

__all__ = ["_Schedule"]


class _Schedule(_Transfers):
    """When to move what (NOTE [keep last], NOTE [prefetch]), over the copies of :class:`_Transfers`, and the reads
    of the backward pass. A base class of the engine, as :class:`_Transfers` is: it calls the steps a subclass
    overrides (:meth:`_copy_raw`, :meth:`_asynchronous`, :meth:`_start_h2d`, :meth:`_stream_wait`) through
    ``self``."""

    def __init__(self, pin_memory: bool, max_inflight_bytes: int, max_pinned_bytes: int | None, prefetch: bool,
                 trace: bool, keep_last: int) -> None:
        super().__init__(pin_memory, max_inflight_bytes, max_pinned_bytes, trace)
        self.keep_last = keep_last
        self.prefetch = prefetch
        self._groups: weakref.WeakKeyDictionary[Any, _Group] = weakref.WeakKeyDictionary()
        self._order: list[weakref.ref[_Group]] = []  # groups in the order they first offloaded
        self._next_gid = 0
        self._next_cid = 0
        self._handle_keys = itertools.count()  # (Offloaded.key)

    @property
    def _keep_devices(self) -> frozenset[str]:
        """The device types where keeping a call's storages saves a round trip (NOTE [keep last])."""
        return self._routes.keep_types

    @_keep_devices.setter
    def _keep_devices(self, value: frozenset[str]) -> None:
        self._routes.keep_types = value
        self._routes.clear()

    # ---- the calls, in order; a copy started or kept ---------------------------
    def group(self, key: Any) -> _Group:
        """The group of the remat call ``key`` (made now if it has none), to pass as ``group`` to
        :meth:`offload_below_modes`."""
        with self._lock:
            grp = self._group(key)
        assert grp is not None
        return grp

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

    def _copy_out(self, t: torch.Tensor, storage: Any, dst: str, grp: _Group | None,
                  lo: int, hi: int, whole: bool = False) -> _Copy:
        """Copy bytes ``[lo, hi)`` of ``storage``, ``t``'s (``whole``: they are ``t``'s own, all of them, in order)."""
        nbytes = hi - lo
        device = t.device
        origin = weakref.ref(storage)
        c = _HostCopy(self, self._next_cid, grp, device, nbytes, origin, lo)
        self._next_cid += 1
        route = self._route_table.get((device, dst)) or self._route(device, dst)
        asynchronous = route[1]
        to = route[2]
        if grp is None:
            keep = False
        else:
            # (weakref.ref gives the storage's one weak reference while it lives: a token shared by its copies)
            grp.origins[id(origin)] = grp.origins.get(id(origin), 0) + 1
            keep = route[0] and self.keep_last > 0 and not grp.now
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

    def _flush(self, c: _Copy) -> None:
        """Start the copy of a kept storage (NOTE [keep last]) and let go of the device bytes."""
        assert c.deferred is not None
        raw, dst = c.deferred
        c.deferred = None
        _note_written(c, weakly=True)  # NOTE [reads of one device copy]: what a reader wrote is copied as it is
        self._copy_raw(c, raw, dst, self._asynchronous(c.src, dst))
        c.dev = None

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

    # ---- writes into an offloaded storage --------------------------------------
    def storage_written(self, group: Any, keys: set[int]) -> bool:
        """NOTE [one copy per storage]: an op of the call ``group`` is about to write these storages (by data
        pointer): a tensor saved after it gets a copy of its own. Returns whether one of them had a copy to share."""
        grp = self._groups.get(group)
        if grp is None:
            return False
        with self._lock:
            return grp.storage_written(keys)

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

    def rewatch(self, o: Offloaded) -> None:
        """The forward pass itself wrote ``o``'s source after the copy (which holds the value its op made): a write
        is one after saving only from the source's version now on."""
        c = o._copy or o
        src = c.vsrc if c.vsrc is not None else o.orig()
        if src is not None:
            o.version = src._version

    def before_write(self, o: Offloaded) -> None:
        """An op is about to write into ``o``'s source tensor: it must wait until the copy has read it."""
        c = o._copy or o
        if c.deferred is not None:
            with self._lock:
                if c.deferred is not None:
                    self._flush(c)  # a kept storage: copy what was saved before the write
        if c.d2h_done is not None:
            self._stream_wait(c.src, c.d2h_done)
            _settle(c)  # the write is queued after the copy

    # ---- backward --------------------------------------------------------------
    def fetch(self, o: Offloaded, check: bool = True) -> torch.Tensor:
        """The tensor back on its source device; the current stream waits for its copy if still running. ``check``:
        raise if the tensor it copied was written in place since (a save's; a replay reads the copy's value, which
        is the one it wants whatever came after)."""
        if torch.is_inference_mode_enabled():  # (a backward pass under inference_mode: the tensor tracks versions)
            with torch.inference_mode(False):
                return self.fetch(o, check)
        with self._lock, internal():  # (no torch.no_grad(): fresh tensors over remat's own bytes)
            c = o._copy or o
            orig = c.vsrc if c.vsrc is not None else o.orig()
            now = orig._version if orig is not None else (-1 if c.saved_version is not None else o.version)
            if check and now != o.version:
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
            out = _view(c, o, dev)
            if _written(c, out, dev):
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

