"""Shared test helpers: tolerances per dtype, call and op counters, a storage census, tiny models and functions,
offload engines that behave as on a GPU."""

from __future__ import annotations

import contextlib
import functools
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from remat import checkpoint_name, policies
from remat.offload import OffloadEngine

f64, f32 = torch.float64, torch.float32

MATMUL_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten.convolution.default,
    torch.ops.aten.mv.default,
    torch.ops.aten.dot.default,
}


def keeping_engine(keep_last: int = 1, **kw: Any) -> OffloadEngine:
    """An offload engine that keeps the newest calls' storages on the device on the CPU, as it does on CUDA by
    default (NOTE [keep last] in remat/_offload/schedule.py): the path a GPU takes, run where the tests run."""
    eng = OffloadEngine(keep_last=keep_last, **kw)
    eng._keep_devices = frozenset({"cpu"})
    return eng


def peak_bytes_of(forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Run ``forward()``; return its result and the most bytes its ops had allocated alive at once, weighed by
    ``remat.bench.measure.LiveCensus`` (a dispatch mode outside remat, as ``live_bytes_after`` weighs what is left)."""
    from remat.bench.measure import LiveCensus

    census = LiveCensus()
    try:
        with census:
            out = forward()
        return out, census.peak
    finally:
        census.close()


def tree_allclose(a: Any, b: Any, exact_float32: bool = True, rtol: float = 1e-12, atol: float = 1e-12) -> bool:
    """Same structure, and every tensor leaf equal: bitwise for float32, allclose for float64."""
    la, sa = optree.tree_flatten(a, none_is_leaf=True)
    lb, sb = optree.tree_flatten(b, none_is_leaf=True)
    if sa != sb:
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if not isinstance(x, torch.Tensor):
            if x != y:
                return False
            continue
        if x.shape != y.shape or x.dtype != y.dtype:
            return False
        if x.dtype == torch.float32 and exact_float32:
            if not torch.equal(x, y):
                return False
        elif not torch.allclose(x, y, rtol=rtol, atol=atol, equal_nan=False):
            return False
    return True


def assert_tree_close(a: Any, b: Any, **kw: Any) -> None:
    if not tree_allclose(a, b, **kw):
        la, lb = optree.tree_leaves(a), optree.tree_leaves(b)
        diffs = [
            (x - y).abs().max().item() if isinstance(x, torch.Tensor) and x.shape == y.shape else "shape/type"
            for x, y in zip(la, lb)
        ]
        raise AssertionError(f"trees differ: max abs differences per leaf {diffs}")


class Counted:
    """Wrap a function and count its calls (proves the recompute ran, or did not)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.calls = 0
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.fn(*args, **kwargs)


class OpLog(TorchDispatchMode):
    """Every ATen op seen from outside the library, in order (``ops``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


class OpCounter(TorchDispatchMode):
    """Count ATen ops from outside the library (e.g. matmuls run during a backward pass)."""

    def __init__(self, ops: set[Any] = MATMUL_OPS) -> None:
        super().__init__()
        self.ops = ops
        self.count = 0
        self.seen: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in self.ops:
            self.count += 1
            self.seen.append(func)
        return func(*args, **(kwargs or {}))


class CountCalls(torch.nn.Module):
    """An identity module that counts its calls: inside a remat'd block it runs again in the recompute."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x


def requires_grad_tree(tree: Any) -> Any:
    return optree.tree_map(lambda t: t.detach().clone().requires_grad_(), tree)


def leaves(tree: Any) -> list[torch.Tensor]:
    return [t for t in optree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def run_benchmark_in_process(name: str, argv: list[str]) -> Any:
    """Run ``benchmarks/<name>.py``'s ``main(argv)`` in this process (a subprocess spends seconds importing torch
    and its compiler); the thread count and Dynamo's caches are put back afterwards."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    threads = torch.get_num_threads()
    try:
        return mod.main(argv)
    finally:
        torch.set_num_threads(threads)
        torch._dynamo.reset()


# ---- seeded tensors, gradients -------------------------------------------------------------------------------------


def seeded_randn(*shape: int, dtype: torch.dtype = f64, seed: int = 0) -> torch.Tensor:
    """``torch.randn`` from a generator of its own: the same values whatever ran before."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


def leaf(*shape: int, dtype: torch.dtype = f64, seed: int = 0, grad: bool = True) -> torch.Tensor:
    """A seeded leaf tensor that requires grad (unless ``grad=False``)."""
    return seeded_randn(*shape, dtype=dtype, seed=seed).requires_grad_(grad)


def grads(fn: Callable[..., torch.Tensor], args: tuple[Any, ...], wrt: Any, create_graph: bool = False) -> Any:
    """The gradients of ``fn(*args).sum()`` with respect to ``wrt``."""
    out = fn(*args)
    return torch.autograd.grad(out.sum(), wrt, create_graph=create_graph)


# ---- which engine ran, the policies and functions they are tried on ------------------------------------------------


class Probe:
    """Inside the function: was a dispatch mode active (a recording engine), how often did it run."""

    def __init__(self) -> None:
        self.modes: list[bool] = []

    def __call__(self) -> None:
        mode = _get_current_dispatch_mode()
        self.modes.append(mode is not None)


def chain(probe: Probe) -> Callable[..., torch.Tensor]:
    """Three tanh-sin-matmul layers that call ``probe`` first."""

    def f(W: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        probe()
        h = x
        for _ in range(3):
            h = torch.tanh(torch.sin(h) @ W + b) * 0.5
        return h

    return f


PLAN_POLICIES = {
    "dots": policies.dots_saveable,
    "names": policies.save_only_these_names("mid"),
    "custom": lambda op, *a, **k: op is torch.ops.aten.mm.default,
    "offload": policies.offload_to_cpu(min_bytes=0),
    "dots+offload": policies.save_from_both_policies(policies.dots_saveable, policies.offload_to_cpu(min_bytes=0)),
}


def mlp(W1: torch.Tensor, W2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Three matmuls, the second one's output tagged "mid" (for the names policy)."""
    h = torch.tanh(x @ W1)
    h = checkpoint_name(torch.sin(h) @ W2, "mid")
    return torch.tanh(h @ W1.t()) * 0.5


def mlp_inplace(Ws: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``nn.ReLU(inplace=True)`` after each matmul: the matmul's output written in place."""
    h = x
    for W in Ws:
        h = torch.relu_(h @ W)  # the matmul's output, saved by dots_saveable, written by the ReLU
        h = torch.tanh(h)  # saves its output: dropped, recomputed from the matmul's output
    return h


class SquareWritingItsSaved(torch.autograd.Function):
    """a * a, whose backward computes 2a in place in the tensor it saved."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a)
        return a * a

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        (a,) = ctx.saved_tensors
        return g * a.mul_(2)


# ---- the offload engine: a call's group, copies that read their bytes late -----------------------------------------


class CallKey:
    """Stands for a remat call: what groups one call's copies in the offload engine."""


class LateCopies(OffloadEngine):
    """What CUDA's asynchronous copies to the host allow, on the CPU: each copy reads its bytes only when the test
    lets it (``finish``), so a write queued before that lands in the host copy."""

    def __init__(self) -> None:
        super().__init__()
        self.running: list[Any] = []

    def _asynchronous(self, src: torch.device, dst: torch.device) -> bool:
        return True

    def _copy_raw(self, c: Any, raw: torch.Tensor, dst: torch.device, asynchronous: bool = True) -> None:
        c.host = host = torch.empty(c.nbytes, dtype=torch.uint8, device=dst)
        done = [False]

        class Event:
            def query(self) -> bool:
                return done[0]

        def finish() -> None:
            host.copy_(raw)
            done[0] = True

        self.running.append(finish)
        self._running(c, raw, Event())
        self.stats["copies"] += 1

    def finish(self) -> None:
        while self.running:
            self.running.pop(0)()


# ---- memory, weighed from outside remat ----------------------------------------------------------------------------


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in optree.tree_leaves(tree, none_is_leaf=True) if isinstance(t, torch.Tensor)]


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return 0


class StorageCensus(TorchDispatchMode):
    """The storages that ops make while the mode is active, seen from outside remat; remat's bookkeeping is never
    read.

    * ``records``: the op's name and a weak reference to the storage of each of its outputs; ``alive`` names the
      ops whose output storages are still alive. Under torch.func the mode sees the ops below the functorch layers,
      on plain tensors, so the storages it records are the real ones the wrappers (and saved tensors) share.
    * ``live`` and ``peak``: the bytes of the storages ops allocated (a view or an in-place result allocates
      nothing) that are still alive, now and at most, each watched with a finalizer until ``close``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[str, weakref.ref[Any]]] = []
        self.live = 0
        self.peak = 0
        self._alive: dict[int, object] = {}
        self._finalizers: list[weakref.finalize] = []  # type: ignore[type-arg]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        ins = {_storage_ptr(t) for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue  # no storage to watch
            self.records.append((func.__name__, weakref.ref(storage)))
            ptr = _storage_ptr(t)
            if not ptr or ptr in ins or ptr in self._alive:
                continue  # a view or an in-place result allocates nothing
            n, token = int(storage.nbytes()), object()
            self._alive[ptr] = token
            self.live += n
            self.peak = max(self.peak, self.live)
            fin = weakref.finalize(storage, self._freed, ptr, token, n)
            fin.atexit = False
            self._finalizers.append(fin)
        return out

    def _freed(self, ptr: int, token: object, n: int) -> None:
        if self._alive.get(ptr) is token:
            del self._alive[ptr]
            self.live -= n

    def alive(self, exclude: set[int]) -> list[str]:
        """Sorted names of the ops whose output storages are still alive (a storage named by its first op)."""
        first: dict[int, str] = {}
        for name, ref in self.records:
            s = ref()
            if s is not None and id(s) not in exclude:
                first.setdefault(id(s), name)
        return sorted(first.values())

    def close(self) -> None:
        """Stop watching: detach every finalizer."""
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()
        self._alive.clear()


@contextlib.contextmanager
def census() -> Iterator[StorageCensus]:
    """A ``StorageCensus`` active in the block, closed after it."""
    c = StorageCensus()
    try:
        with c:
            yield c
    finally:
        c.close()


def heap_in_use() -> int | None:
    """glibc's heap bytes in use (``mallinfo2``: torch's CPU allocator goes through it), or None elsewhere."""
    import ctypes

    class _MI2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MI2
    except (OSError, AttributeError):
        return None
    gc.collect()
    m = libc.mallinfo2()
    return int(m.uordblks + m.hblkhd)
