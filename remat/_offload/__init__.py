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

The engine in files, from the bottom up (each imports only those above it in
this list):

* ``pool.py``: the pinned-memory pool (:class:`_PinnedPool`).
* ``geometry.py``: where a tensor's bytes lie in its storage.
* ``routes.py``: which tensors a decision moves; a copy's route per pair of
  devices (kept, asynchronous, where to).
* ``copies.py``: the host copies, the handles autograd holds (:class:`Offloaded`),
  one call's copies and which of them a tensor shares (NOTE [one copy per
  storage], NOTE [written while copied], NOTE [reads of one device copy], NOTE
  [solo handles]).
* ``streams.py``: the copies in both directions: routes, streams, events, the
  bound on copies in flight (NOTE [stream-ordered reuse]).
* ``schedule.py``: what to move and when: the calls in order, keeping the newest
  (NOTE [keep last]), prefetching (NOTE [prefetch]), reads in the backward pass.
* ``engine.py``: :class:`OffloadEngine`, its entry points in the forward pass
  (which copy a tensor gets), and the engine of a context (NOTE [default
  engine]).

``OffloadEngine`` builds on ``schedule.py``'s and ``streams.py``'s classes rather
than holding them: their steps are methods a subclass overrides (the tests
make copies finish late or fail, ``benchmarks/gpu_check.py`` delays the copy
streams), and each calls the next through ``self``.
"""

# (and four private names, which the tests import from here)
from .copies import Offloaded as Offloaded
from .copies import _HostCopy as _HostCopy
from .engine import OffloadEngine as OffloadEngine
from .engine import default_engine as default_engine
from .engine import use_engine as use_engine
from .geometry import _geometry as _geometry
from .geometry import _overlap as _overlap
from .pool import _PinnedPool as _PinnedPool

__all__ = ["OffloadEngine", "Offloaded", "default_engine", "use_engine"]
