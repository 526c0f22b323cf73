"""Offload under torch.compile (``remat.offload.compiled_offloading``): the compiled graphs move exactly what the
policy offloads to the host and back, gradients equal plain autograd's, torch's config is left as it was, and
where the pass cannot run remat recomputes with one warning (NOTE [compiled remat] in remat/_engine/compiled.py)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch._functorch.config as fc
from functorch.compile import min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd

import remat
from remat import _torch_internals as ti
from remat import checkpoint_name, policies
from remat.offload import compiled_offloading

pytestmark = pytest.mark.skipif(not ti.activation_offloading_available(),
                                reason="this torch has no compile-time activation offloading pass")


class Capture:
    """A torch.compile backend that keeps the forward and backward graphs AOTAutograd hands its compilers
    (inductor's partitioner, the one that runs torch's offloading pass) and runs them as they are."""

    def __init__(self) -> None:
        self.fw: list[Any] = []
        self.bw: list[Any] = []
        self.backend = aot_autograd(fw_compiler=self._fw, bw_compiler=self._bw,
                                    partition_fn=min_cut_rematerialization_partition)

    def _fw(self, gm: Any, inputs: Any) -> Any:
        self.fw.append(gm)
        return gm.forward

    def _bw(self, gm: Any, inputs: Any) -> Any:
        self.bw.append(gm)
        return gm.forward


def device_puts(gm: Any) -> list[str]:
    """The names of the values a graph moves between devices (torch's pass names them ``cpu_offload_<node>`` in the
    forward graph and ``gpu_reload_<node>`` in the backward graph)."""
    return sorted(str(n.args[0]) for n in gm.graph.nodes if n.target is torch.ops.prims.device_put.default)


def block(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    h = checkpoint_name(torch.tanh(x @ w), "h")
    g = torch.sigmoid(h @ w)
    return (torch.sin(g) * h).sum()


OFFLOAD_H = policies.save_and_offload_only_these_names(names_which_can_be_saved=[], names_which_can_be_offloaded=["h"],
                                                       offload_src="cpu", offload_dst="cpu")


def grads(fn: Any, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(fn(w, x), w)
    return g


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_compiled_graphs_offload_exactly_the_named_value(dtype: torch.dtype) -> None:
    torch._dynamo.reset()
    w = torch.randn(16, 16, dtype=dtype, requires_grad=True)
    x = torch.randn(8, 16, dtype=dtype)
    cap = Capture()
    fn = torch.compile(remat.remat(block, policy=OFFLOAD_H), backend=cap.backend)
    with compiled_offloading():
        got = grads(fn, w, x)
    assert len(cap.fw) == 1 and len(cap.bw) == 1
    moved = device_puts(cap.fw[0])
    assert len(moved) == 1, cap.fw[0].code  # the one value the policy offloads: the name h (a copy of tanh's output)
    assert any(n.name == moved[0] and n.meta.get("saved_for_offloading") for n in cap.fw[0].graph.nodes)
    assert [s.replace("cpu_offload_", "") for s in device_puts(cap.bw[0])] == [m for m in moved]
    ref = grads(block, w, x)
    if dtype is torch.float64:
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    else:
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    # later calls run the compiled graphs, outside the context, offloads included
    assert torch.equal(grads(fn, w, x), got) and len(cap.fw) == 1


def test_offload_to_cpu_moves_every_saved_intermediate_and_the_policy_decides_per_op() -> None:
    torch._dynamo.reset()
    w = torch.randn(16, 16, dtype=torch.float64, requires_grad=True)
    x = torch.randn(8, 16, dtype=torch.float64)

    def keep_mm_offload_tanh(op: Any, *args: Any, **kwargs: Any) -> Any:
        if op is torch.ops.aten.mm.default:
            return policies.Saveable
        if op is torch.ops.aten.tanh.default:
            return policies.Offloadable("cpu", "cpu")
        return policies.Recompute

    cap = Capture()
    fn = torch.compile(remat.remat(lambda w, x: torch.sin(torch.tanh(x @ w) @ w).sum(), policy=keep_mm_offload_tanh),
                       backend=cap.backend)
    with compiled_offloading():
        got = grads(fn, w, x)
    assert device_puts(cap.fw[0]) == ["tanh"], cap.fw[0].code
    outputs = [str(a) for a in cap.fw[0].graph.find_nodes(op="output")[0].args[0]]
    assert "cpu_offload_tanh" in outputs and "mm_1" in outputs  # offloaded; kept (the second matmul's output)
    torch.testing.assert_close(got, grads(lambda w, x: torch.sin(torch.tanh(x @ w) @ w).sum(), w, x),
                               rtol=1e-12, atol=1e-12)


def test_a_decision_for_another_source_device_keeps_the_value() -> None:
    """``Offloadable("cuda", "cpu")`` keeps CPU tensors where they are, compiled as in eager mode: nothing moves."""
    torch._dynamo.reset()
    w = torch.randn(16, 16, dtype=torch.float64, requires_grad=True)
    x = torch.randn(8, 16, dtype=torch.float64)
    cap = Capture()
    pol = policies.save_and_offload_only_these_names(names_which_can_be_saved=[], names_which_can_be_offloaded=["h"])
    fn = torch.compile(remat.remat(block, policy=pol), backend=cap.backend)
    with compiled_offloading():
        got = grads(fn, w, x)
    assert device_puts(cap.fw[0]) == []
    torch.testing.assert_close(got, grads(block, w, x), rtol=1e-12, atol=1e-12)


def test_torch_config_is_restored_and_a_users_joint_pass_still_runs() -> None:
    seen: list[int] = []

    def mine(gm: Any, inputs: Any) -> Any:
        seen.append(len(gm.graph.nodes))
        return gm

    before = (fc.enable_activation_offloading, fc.joint_custom_pass)
    torch._dynamo.reset()
    w = torch.randn(16, 16, dtype=torch.float64, requires_grad=True)
    x = torch.randn(8, 16, dtype=torch.float64)
    with fc.patch(joint_custom_pass=mine):
        cap = Capture()
        fn = torch.compile(remat.remat(block, policy=OFFLOAD_H), backend=cap.backend)
        with compiled_offloading():
            assert ti.activation_offloading_on()
            grads(fn, w, x)
        assert fc.joint_custom_pass is mine and not ti.activation_offloading_on()
    assert seen and len(device_puts(cap.fw[0])) == 1
    with pytest.raises(ValueError, match="inside"):
        with compiled_offloading():
            raise ValueError("inside")
    assert (fc.enable_activation_offloading, fc.joint_custom_pass) == before


def test_outside_the_context_remat_recomputes_and_warns_once() -> None:
    torch._dynamo.reset()
    w = torch.randn(16, 16, dtype=torch.float64, requires_grad=True)
    x = torch.randn(8, 16, dtype=torch.float64)
    cap = Capture()
    fn = torch.compile(remat.remat(block, policy=OFFLOAD_H), backend=cap.backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # (as users see them: once per message and place)
        got = grads(fn, w, x)
        grads(fn, w, x)
    msgs = [str(c.message) for c in caught if "offloads under torch.compile" in str(c.message)]
    # once per traced region at most; Python's registry hides repeats (torch's tracing resets it once: two)
    assert 1 <= len(msgs) <= 2 and all("compiled_offloading" in m for m in msgs), msgs
    assert device_puts(cap.fw[0]) == []
    torch.testing.assert_close(got, grads(block, w, x), rtol=1e-12, atol=1e-12)


def test_without_the_pass_a_clear_error_and_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ti, "activation_offloading_available", lambda: False)
    with pytest.warns(UserWarning, match="lacks"):
        with compiled_offloading():
            assert not ti.activation_offloading_on()
    torch._dynamo.reset()
    w = torch.randn(16, 16, dtype=torch.float64, requires_grad=True)
    x = torch.randn(8, 16, dtype=torch.float64)
    fn = torch.compile(remat.remat(block, policy=OFFLOAD_H), backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = grads(fn, w, x)
    assert any("no compile-time offloading pass" in str(c.message) for c in caught)
    torch.testing.assert_close(got, grads(block, w, x), rtol=1e-12, atol=1e-12)


def test_inductor_end_to_end() -> None:
    """The default backend: the pass runs inside inductor's partitioner; gradients as plain autograd's."""
    torch._dynamo.reset()
    w = torch.randn(16, 16, dtype=torch.float64, requires_grad=True)
    x = torch.randn(8, 16, dtype=torch.float64)
    fn = torch.compile(remat.remat(block, policy=OFFLOAD_H))
    with compiled_offloading():
        got = grads(fn, w, x)
    torch.testing.assert_close(got, grads(block, w, x), rtol=1e-10, atol=1e-10)


def test_dynamic_shapes() -> None:
    """Symbolic sizes (``dynamic=True``, or Dynamo's automatic dynamic shapes on a recompile): the size is
    unknown while tracing, so ``min_bytes`` cannot be weighed and the value is offloaded (CI saw the size raise
    "Cannot call numel() on tensor with symbolic sizes" once Dynamo had made a remat frame dynamic)."""
    torch._dynamo.reset()
    cap = Capture()
    pol = policies.save_and_offload_only_these_names(names_which_can_be_saved=[], names_which_can_be_offloaded=["h"],
                                                     offload_src="cpu", offload_dst="cpu")
    fn = torch.compile(remat.remat(block, policy=pol), backend=cap.backend, dynamic=True)
    w = torch.randn(16, 16, dtype=torch.float64, requires_grad=True)
    for rows in (8, 5):
        x = torch.randn(rows, 16, dtype=torch.float64)
        with compiled_offloading():
            got = grads(fn, w, x)
        torch.testing.assert_close(got, grads(block, w, x), rtol=1e-12, atol=1e-12)
    assert len(device_puts(cap.fw[0])) == 1
    torch._dynamo.reset()
    fn = torch.compile(remat.remat(block, policy=policies.offload_to_cpu(min_bytes=1 << 20, src="cpu")),
                       backend="aot_eager", dynamic=True)
    with compiled_offloading():
        torch.testing.assert_close(grads(fn, w, x), grads(block, w, x), rtol=1e-12, atol=1e-12)


def test_the_source_device_is_told_without_the_ops_output() -> None:
    """Before torch 2.13 a checkpoint policy is not handed the op's output: the device of its tensor arguments
    decides instead (found by CI on torch 2.11, where ``Offloadable("cuda", "cpu")`` moved a CPU value)."""
    from torch.utils.checkpoint import CheckpointPolicy

    from remat._engine.compiled import CompiledPolicy

    class Ctx:  # (torch 2.11's context: no op_output)
        is_recompute = False

    x = torch.ones(3)
    with compiled_offloading():
        cuda_only = CompiledPolicy(lambda op, *a, **k: policies.Offloadable("cuda", "cpu"))
        assert cuda_only(Ctx(), torch.ops.aten.sin.default, x) is CheckpointPolicy.MUST_SAVE
        cpu = CompiledPolicy(lambda op, *a, **k: policies.Offloadable("cpu", "cpu"))
        assert cpu(Ctx(), torch.ops.aten.sin.default, x) is CheckpointPolicy.MUST_CPU_OFFLOAD
        assert cpu(Ctx(), torch.ops.aten.cat.default, [x, x]) is CheckpointPolicy.MUST_CPU_OFFLOAD
        assert cuda_only(Ctx(), torch.ops.aten.cat.default, [x, x]) is CheckpointPolicy.MUST_SAVE
