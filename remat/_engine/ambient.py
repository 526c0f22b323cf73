"""Ambient state the recompute must replay (random-number generators, autocast, kernel flags), and what it must not
do again (accumulate gradients a backward pass inside the function accumulated: :func:`no_accumulation`).

The recompute must draw exactly the random numbers the forward pass drew
(dropout masks, ``torch.rand``), on the CPU and on every CUDA device the call
touched, and run under the same autocast settings. remat records the CPU
generator and the generator of every CUDA device that is initialised or holds one
of the call's inputs, then restores them inside a fork so the caller's generators
are left exactly as they were.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from .. import _errors as errors
from .. import _torch_internals as ti
from .._context import internal
from .._errors import RematError

__all__ = ["AmbientFlags", "AmbientState", "no_accumulation", "put_settings", "settings"]

_AUTOCAST_DEVICES = ("cpu", "cuda")


# NOTE [flush denormal]
#     torch.set_flush_denormal sets the thread's floating-point control flags (SSE's DAZ/FTZ, ARM's FZ), which torch
#     has no getter for. Python's own float arithmetic runs under the same flags: a denormal times one is zero exactly
#     when they are set (40 ns; the operands are module globals so that nothing folds the product).
_TINY, _ONE = 5e-324, 1.0


def _set_flush_denormal(on: bool) -> None:
    torch.set_flush_denormal(on)


def settings() -> tuple[torch.dtype, int]:
    """The default dtype and the thread count, now: what a recorded step or call notes when the function set them
    inside (they are also among the call's flags, ``AmbientFlags``, for the replay's start)."""
    return torch.get_default_dtype(), torch.get_num_threads()


def put_settings(s: tuple[torch.dtype, int]) -> None:
    """Set the default dtype and the thread count of :func:`settings`, where they differ from now."""
    if s[0] is not torch.get_default_dtype():
        torch.set_default_dtype(s[0])
    if s[1] != torch.get_num_threads():
        torch.set_num_threads(s[1])


class AmbientFlags:
    """Global switches that change what a kernel computes, noted once per call and set for its replay."""

    __slots__ = ("values",)

    _FLAGS: tuple[tuple[Callable[[], Any], Callable[[Any], None]], ...] = (
        (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
        (lambda: (torch.are_deterministic_algorithms_enabled(),
                  torch.is_deterministic_algorithms_warn_only_enabled()),
         lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1])),
        (lambda: torch.backends.mkldnn.enabled, lambda v: setattr(torch.backends.mkldnn, "enabled", v)),
        (lambda: _TINY * _ONE == 0.0, _set_flush_denormal),  # (NOTE [flush denormal])
        # the dtype a kernel gives a float result of integers or of a Python float (``i / 7``, ``i * 0.1``): the
        # default one (steps that run under another, set inside the function, note theirs: ``Trace.settings``)
        (torch.get_default_dtype, torch.set_default_dtype),
        # a CPU kernel may pick its backend by the thread count (a 1x1 convolution takes oneDNN only with several)
        (torch.get_num_threads, torch.set_num_threads),
        (lambda: torch.backends.cudnn.enabled, lambda v: setattr(torch.backends.cudnn, "enabled", v)),
        (lambda: torch.backends.cudnn.deterministic, lambda v: setattr(torch.backends.cudnn, "deterministic", v)),
        (lambda: torch.backends.cudnn.allow_tf32, lambda v: setattr(torch.backends.cudnn, "allow_tf32", v)),
        (lambda: torch.backends.cuda.matmul.allow_tf32, lambda v: setattr(torch.backends.cuda.matmul, "allow_tf32", v)),
    )

    _CPU = 6  # (the first six: the rest change CUDA kernels only)

    def __init__(self) -> None:
        # (reading a flag costs up to 0.7 us; without CUDA initialised the call ran no CUDA kernel, and its replay runs
        # none: the CUDA flags are not noted, nor set)
        flags = self._FLAGS if torch.cuda.is_initialized() else self._FLAGS[:self._CPU]
        self.values = tuple(get() for get, _ in flags)

    def set(self) -> list[tuple[Callable[[Any], None], Any]]:
        """Set the call's flags; return what to restore."""
        undo = []
        for (get, put), v in zip(self._FLAGS, self.values):
            now = get()
            if now != v:
                put(v)
                undo.append((put, now))
        return undo


@dataclasses.dataclass
class AmbientState:
    cpu_rng: torch.Tensor | None
    cuda_rng: dict[int, torch.Tensor]
    autocast: dict[str, tuple[bool, torch.dtype]]
    # NOTE [generators of your own]: id -> (generator, its state before the call's first draw from it)
    generators: dict[int, tuple[torch.Generator, torch.Tensor]] = dataclasses.field(default_factory=dict)
    flags: AmbientFlags = dataclasses.field(default_factory=AmbientFlags)  # (noted when the forward pass starts)

    @classmethod
    def capture(cls, tensors: Iterable[torch.Tensor], preserve_rng: bool) -> AmbientState:
        autocast = {
            d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES
        }
        if not preserve_rng:
            return cls(None, {}, autocast)
        devices: set[int] = set()
        if torch.cuda.is_available():
            for t in tensors:
                if t.device.type == "cuda":
                    devices.add(t.device.index if t.device.index is not None else 0)
            if torch.cuda.is_initialized():
                devices.update(range(torch.cuda.device_count()))
        cuda = {d: torch.cuda.get_rng_state(d) for d in sorted(devices)}
        return cls(torch.get_rng_state(), cuda, autocast)

    def rewind(self) -> None:
        """Set every generator back to the call's start, in place (a forward pass run again)."""
        if self.cpu_rng is None:
            return
        for g, state in self.generators.values():
            g.set_state(state)
        torch.set_rng_state(self.cpu_rng)
        for d, rng in self.cuda_rng.items():
            torch.cuda.set_rng_state(rng, d)

    def restored(self) -> _Restored:
        """Run the body under the captured state; the caller's state is kept outside."""
        return _Restored(self)


class _Restored:
    """The context manager of :meth:`AmbientState.restored`: a class rather than a generator, as it runs once per
    recompute (torch.random.fork_rng, which it does the work of, costs several times more)."""

    __slots__ = ("state", "autocast", "cpu", "cuda", "gens", "undo")

    def __init__(self, state: AmbientState) -> None:
        self.state = state
        self.autocast: list[Any] = []
        self.cpu: torch.Tensor | None = None
        self.cuda: dict[int, torch.Tensor] = {}
        self.gens: list[tuple[torch.Generator, torch.Tensor]] = []
        self.undo: list[tuple[Callable[[Any], None], Any]] = []

    def __enter__(self) -> None:
        st = self.state
        self.undo = st.flags.set()
        for dev, (enabled, dtype) in st.autocast.items():
            # entering torch.autocast costs ~4 us a device: only where the state differs from now
            if (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) != (enabled, dtype):
                ctx = torch.autocast(dev, dtype=dtype, enabled=enabled)
                ctx.__enter__()
                self.autocast.append(ctx)
        if st.cpu_rng is not None:
            self.cpu = torch.get_rng_state()
            self.cuda = {d: torch.cuda.get_rng_state(d) for d in st.cuda_rng}
            self.gens = [(g, g.get_state()) for g, _ in st.generators.values()]
            # the user's generators first: a default generator passed as generator= ends at the call's start
            st.rewind()

    def __exit__(self, *exc: object) -> None:
        if self.cpu is not None:
            for g, state in self.gens:
                g.set_state(state)
            torch.set_rng_state(self.cpu)
            for d, rng in self.cuda.items():
                torch.cuda.set_rng_state(rng, d)
        while self.autocast:
            self.autocast.pop().__exit__(*exc)
        for put, v in self.undo:
            put(v)
        self.undo = []


@contextlib.contextmanager
def no_accumulation(fn_name: str, tensors: Iterable[Any]) -> Iterator[None]:
    """Raise if the body (a recompute) accumulated into the ``.grad`` of one of ``tensors``'s leaves that require
    grad, on this thread: a function that runs a backward pass inside (``loss.backward()``) accumulates into
    ``.grad``, and its recompute would run it again (``torch.utils.checkpoint`` adds the gradient twice, silently).

    Seen by a post-accumulate-grad hook on each leaf for the recompute's duration, which notes the thread it runs
    on: another thread's backward pass accumulating into a shared parameter meanwhile (autograd allows it on the
    CPU) runs its hooks on its own thread, and is not this call's (issue 38: 2 to 9 of 40 calls of two threads
    raised, when this compared ``.grad`` before and after). A backward pass the body runs is run by the thread
    that runs the body (the engine runs a backward pass called from inside a backward pass on the caller's
    thread). Only the full engine's recompute asks."""
    me = threading.get_ident()
    hit: list[torch.Tensor] = []

    def seen(t: torch.Tensor) -> None:
        if threading.get_ident() == me:
            hit.append(t)

    handles = [t.register_post_accumulate_grad_hook(seen) for t in tensors
               if type(t) in (torch.Tensor, torch.nn.Parameter) and t.is_leaf and t.requires_grad]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
    if hit:
        raise RematError(
            f"remat: {fn_name} runs a backward pass that accumulates into .grad (loss.backward()) inside its "
            f"forward pass, and its recompute ran it again: a leaf of shape {list(hit[0].shape)} got its gradient "
            "twice. Inside a remat'd function use torch.autograd.grad (it returns the gradients, "
            "accumulating nothing), or run .backward() outside it."
        )


# NOTE [draws in threads]
#     Torch's generators are shared by every thread. Another thread that draws from one between the moment a call notes
#     a random op's generator state and the op's own draw (the forward pass), or between the replay's putting that state
#     back and its draw (the backward pass), moves the numbers the op draws: the replay would make another dropout mask
#     than the forward pass's, and the gradient would be wrong without an error (torch checkpoint's is, in 268 of 400
#     calls of the review's threads). So a random op that can be handed a generator (``bernoulli_``, ``normal``,
#     dropout on the CPU; ``rand`` through ``rand.generator``) draws, when another Python thread is alive and no other
#     dispatch mode would see the generator handed to it (another remat call's, recording the same op), from a
#     generator of the call's own put at the state it noted, and the shared one is then moved to where that one ended:
#     the op drew the numbers of the noted state, whatever another thread drew meanwhile (which may then draw the same
#     numbers, as with torch checkpoint's replays). Its replay always draws from a generator of its own: another thread
#     neither moves its draws nor sees the shared generator put back. A draw whose generator another dispatch mode would see handed
#     to it (a nested call's: the enclosing call's mode records the op) draws from the shared generator and notes the
#     state after it; its replay, from a generator of its own, raises if it does not end there (the forward's draw
#     raced another thread: an error, never a wrong gradient; rarely also where the other thread drew just after). An
#     op no generator can be handed (CUDA's ``native_dropout``) is held when another thread is alive: its replay
#     draws from the shared generator, where a check of the state its draw ends at can be fooled (another thread's
#     draw of the same size during the forward's draw and again during the replay's: a wrong gradient in the review's
#     threads); with no other thread alive it notes the state after its draw, and its replay draws again while it does
#     not end there (a thread started since), and raises if it never does.
_ATTEMPTS = 8


@functools.cache
def with_generator(func: Any) -> Any:
    """A random op itself if it takes its generator as an argument, else the overload of its name that takes the same
    arguments and a generator (``rand.generator`` for ``rand.default``), else None (NOTE [draws in threads])."""
    names = [a.name for a in func._schema.arguments]
    if "generator" in names:
        return func
    packet = func.overloadpacket
    for name in packet.overloads():
        o = getattr(packet, name)
        theirs = [a.name for a in o._schema.arguments]
        if "generator" in theirs and [n for n in theirs if n != "generator"] == names:
            return o
    return None


def draw_own(gen: torch.Generator, state: torch.Tensor, op: Any, args: Any, kwargs: Any) -> tuple[Any, torch.Generator]:
    """Random op ``op`` (one ``with_generator`` finds an overload for) on ``args`` and ``kwargs``, drawing from a
    generator of its own put at ``gen``'s ``state`` (NOTE [draws in threads]); and that generator."""
    with internal():
        own = torch.Generator(device=gen.device)
        own.set_state(state)
    o = with_generator(op)
    i = _generator_at(o)
    if i is not None and i < len(args):  # (poisson, binomial: a positional generator)
        return o(*args[:i], own, *args[i + 1:], **kwargs), own
    return o(*args, **{**kwargs, "generator": own}), own


@functools.cache
def _generator_at(o: Any) -> int | None:
    """Where overload ``o`` takes its generator among its positional arguments, or None."""
    pos = [a.name for a in o._schema.arguments if not a.kwarg_only]
    return pos.index("generator") if "generator" in pos else None


def draw_as_recorded(gen: torch.Generator, state: torch.Tensor, drew: torch.Tensor | None, op: Any, call: Any,
                     args: Any, kwargs: Any, fn_name: str) -> Any:
    """The replay's draw of random op ``op`` (``call(*args, **kwargs)``) as the forward pass drew from ``gen`` at
    ``state``; ``drew``: the state after the forward's draw, where it was not drawn from a generator of the call's
    own (NOTE [draws in threads])."""
    if with_generator(op) is not None:
        out, own = draw_own(gen, state, op, args, kwargs)
        with internal():
            if drew is None or torch.equal(own.get_state(), drew):
                return out
        raise errors.draw_raced(fn_name, op)
    again = getattr(op, "_overloadpacket", None) is not torch.ops.aten.rrelu_with_noise_  # (reads what it writes)
    for _ in range(_ATTEMPTS if again else 1):
        with internal():
            gen.set_state(state)
        out = call(*args, **kwargs)
        with internal():
            if drew is None or torch.equal(gen.get_state(), drew):
                return out
    raise errors.draw_raced(fn_name, op)


def draw_first(gen: torch.Generator, op: Any, call: Any, args: Any, kwargs: Any) -> tuple[Any, torch.Tensor,
                                                                                          torch.Tensor | None, bool]:
    """The forward pass's draw of random op ``op`` (``call(*args, **kwargs)``) from ``gen`` (NOTE [draws in threads]):
    its output, the state it drew from, the state after it where it drew alone from the shared generator, and
    whether its outputs must be held (drawn from the shared generator with another thread alive)."""
    alone = threading.active_count() == 1
    handed = with_generator(op) is not None
    with internal():
        state = gen.get_state()
    if handed and not alone and ti.no_modes_pushed():
        out, own = draw_own(gen, state, op, args, kwargs)
        with internal():
            gen.set_state(own.get_state())
        return out, state, None, False
    out = call(*args, **kwargs)
    if alone and handed:
        return out, state, None, False
    if not alone and not handed:
        return out, state, None, True
    with internal():
        return out, state, gen.get_state(), False
