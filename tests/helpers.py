"""Shared test helpers: tolerances per dtype, call and op counters, tiny models."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from remat.offload import OffloadEngine

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
    default (NOTE [keep last] in remat/_offload.py): the path a GPU takes, run where the tests run."""
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
