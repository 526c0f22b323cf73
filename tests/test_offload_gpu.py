"""The CUDA path of the offload engine: the warm pinned pool allocates nothing and frees device memory,
the forward pass never synchronizes, the pinned cap and CUDA graph capture are clear errors. The CUDA tests skip
without CUDA; benchmarks/gpu_check.sh runs every test of this file on a GPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from remat import RematError, policies, remat
from remat.bench.models import make_model
from remat.offload import OffloadEngine, use_engine

from .helpers import assert_tree_close, leaves, requires_grad_tree

pytestmark = pytest.mark.usefixtures("one_thread")

# benchmarks/offload_gpu.py --tiny runs in tests/test_gpu_check.py (through gpu_check.sh --tiny), which checks its
# rows, that gradients equal no remat's and the leak check: one run of it is enough.


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _gpu_step(params: Any, x: torch.Tensor, apply: Any, policy: Any) -> tuple[Any, int]:
    """Gradients, and the device memory held between forward and backward."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loss = apply(params, x, (lambda f: f) if policy is None else (lambda f: remat(f, policy=policy)))
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    grads = torch.autograd.grad(loss, leaves(params))
    return grads, held


@cuda
def test_gpu_pinned_pool_warm_no_allocation_exact_grads_less_memory() -> None:
    params, x, _, apply = make_model("mlp", "medium", torch.float32, "cuda")  # 1 MiB activations per layer
    params = requires_grad_tree(params)
    eng = OffloadEngine()
    ref, held_plain = _gpu_step(params, x, apply, None)
    with use_engine(eng):
        _gpu_step(params, x, apply, "offload-to-cpu")
        warm = eng.pinned_allocations()
        for _ in range(3):
            grads, held = _gpu_step(params, x, apply, "offload-to-cpu")
    assert warm > 0 and eng.pinned_allocations() == warm  # no pinned allocation per step once warm
    assert_tree_close(grads, ref)
    assert held_plain - held >= eng.stats["offloaded_bytes"] // 4 // 2  # of a step's offloaded bytes, half freed at least
    assert eng.stats["prefetched"] > 0


@cuda
def test_gpu_forward_does_not_synchronize() -> None:
    params, x, _, apply = make_model("mlp", "medium", torch.float32, "cuda")
    params = requires_grad_tree(params)
    eng = OffloadEngine()
    with use_engine(eng):
        _gpu_step(params, x, apply, "offload-to-cpu")  # warm the pool and the streams
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = apply(params, x, lambda f: remat(f, policy="offload-to-cpu", preserve_rng_state=False))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        loss.backward()


@cuda
def test_gpu_pinned_cap_is_a_clear_error() -> None:
    x = torch.randn(1 << 20, device="cuda", requires_grad=True)
    with use_engine(OffloadEngine(max_pinned_bytes=1 << 20)):
        with pytest.raises(RematError, match="max_pinned_bytes"):
            remat(lambda x: x.exp().exp(), policy=policies.offload_to_cpu(min_bytes=0))(x)


def test_offload_under_cuda_graph_capture_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import remat._torch_internals as ti

    monkeypatch.setattr(ti, "cuda_graph_capturing", lambda t: True)  # remat's own probe, not torch
    f = remat(lambda x: x.sin().exp().sum(), policy=policies.offload_to_cpu(min_bytes=0))
    eng = OffloadEngine()
    # (the probe asks only of CUDA tensors, whose copies run on the engine's general path; a CPU tensor takes it where
    # the engine keeps CPU storages: NOTE [keep last])
    eng._keep_devices = frozenset({"cpu"})
    with use_engine(eng), pytest.raises(RematError, match="under CUDA graph capture"):
        f(torch.randn(8, requires_grad=True))
