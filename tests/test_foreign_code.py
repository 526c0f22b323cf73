"""Code from torch's own library that a model pulls in, as a new user's would: quantization-aware training's
observers (empty buffers an ``out=`` op resizes on the first step), TorchScript submodules, a library that
disables saved-tensor hooks around its code. Each against the plain model, on the first call and later ones."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import remat
from remat import RematError, policies

POLICIES: dict[str, dict[str, Any]] = {
    "save-nothing": {"policy": "save-nothing"},
    "save-matmuls": {"policy": "save-matmuls"},
    "save-everything": {"policy": "save-everything"},
    "offload": {"policy": policies.offload_to_cpu(min_bytes=0)},
}


def _sorted_into(x: torch.Tensor, vals: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    torch.sort(x.detach(), dim=1, out=(vals, idx))  # (two outside tensors an out= op writes, and resizes if empty)
    return ((x * vals).sum(1) + x.sin().sum(1) * idx.to(x.dtype).sum(1)).sum()


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(0,), (3, 5)], ids=["empty", "sized"])
def test_outside_tensors_an_out_op_fills(policy: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """Two empty tensors have no storage address: they were one storage to the trace, and the replay made the
    values of one from the other's (a gradient off by 2e10 in float32)."""
    x0 = torch.randn(3, 5, dtype=dtype, generator=torch.Generator().manual_seed(0))

    def grads(f: Any) -> torch.Tensor:
        x = x0.clone().requires_grad_()
        f(x, torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=torch.long)).backward()
        assert x.grad is not None
        return x.grad

    ref = grads(_sorted_into)
    g = remat.remat(_sorted_into, **POLICIES[policy])
    for _ in range(3):
        torch.testing.assert_close(grads(g), ref, rtol=0, atol=0)


def _qat_model() -> nn.Module:
    import torch.ao.quantization as tq

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    m.train()
    m.qconfig = tq.get_default_qat_qconfig("fbgemm")  # (per-channel weight observers: empty buffers at first)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch.ao's deprecation notes)
        return tq.prepare_qat(m)


@pytest.mark.parametrize("policy", ["save-nothing", "save-matmuls", "save-everything"])
def test_quantization_aware_training_from_the_first_step(policy: str) -> None:
    """torch.ao's fake-quant modules start their observers' statistics as ``torch.tensor([])`` and resize them on
    the first step: that step's gradients were wrong (a weight's gradient 0 where plain gives 2.75)."""
    plain = _qat_model()
    model = copy.deepcopy(plain)
    assert remat.remat_modules(model, nn.Linear, policy=policy) == ["0", "2"]  # (torch.ao's qat.Linear)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(6, 4, generator=g)
        outs = []
        for m in (plain, model):
            xx = x.clone().requires_grad_()
            m(xx).pow(2).sum().backward()
            outs.append([xx.grad] + [p.grad for p in m.parameters()] + list(m.buffers()))
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"step {step}")
        for m in (plain, model):
            m.zero_grad()


class _WithScript(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.l = nn.Linear(16, 32, dtype=dtype)
        self.s = torch.jit.script(nn.Sequential(nn.Linear(32, 32, dtype=dtype), nn.Tanh()))
        self.register_buffer("scale", torch.full((32,), 0.5, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.s(self.l(x)) * self.scale).sin()


@pytest.mark.parametrize("wrap", [*POLICIES, "debug", "budget"])
def test_a_torchscript_submodule(wrap: str) -> None:
    """A ``torch.jit.script`` submodule: remat's walk of the module tree read its C++ parameter dict as a Python
    one (a TypeError on every call, every policy); its tensors are read as outside tensors now. (In float64:
    TorchScript's executor switches to its own differentiated graph after a few runs, whose float32 rounding
    differs from eager autograd's, with remat or without.)"""
    kw = {"debug": {"debug": True}, "budget": {"policy": policies.memory_budget(0.3)}}.get(wrap) or POLICIES[wrap]
    torch.manual_seed(0)
    plain = _WithScript(torch.float64)
    model = remat.remat_module(copy.deepcopy(plain), **kw)
    x0 = torch.randn(8, 16, dtype=torch.float64)
    for _ in range(3):
        # (TorchScript's executor, shared by every instance of the scripted type in the process, profiles its first
        # runs and then switches to a differentiated graph that saves other tensors: a re-run across that switch
        # (debug, a budget's measuring call) diverges, in whichever test runs first: how-it-works.md, "Also known")
        torch.autograd.grad(plain(x0.clone().requires_grad_()).sum(), list(plain.parameters()))
    for _ in range(3):
        got, ref = (torch.autograd.grad(m(x := x0.clone().requires_grad_()).pow(2).sum(), [x, *m.parameters()])
                    for m in (model, plain))
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    f = remat.remat(lambda mod, x: mod(x).sin(), policy="save-nothing")  # (as an argument)
    x = x0.clone().requires_grad_()
    (got,) = torch.autograd.grad(f(plain.s, plain.l(x)).sum(), x)
    (ref,) = torch.autograd.grad(plain.s(plain.l(x)).sin().sum(), x)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-14)


def test_a_torchscript_submodule_drops_its_activations() -> None:
    model = remat.remat_module(_WithScript(), policy="save-nothing")
    res = remat.saved_residuals(model, torch.randn(8, 16, requires_grad=True))
    acts = [r for r in res if r.shape[0] == 8 and r.argument is None]  # (the input is kept, as an input)
    assert acts and all(r.decision == "recomputed" for r in acts), [(r.shape, r.decision) for r in res]


def test_saved_tensor_hooks_disabled_by_a_library() -> None:
    """Under ``disable_saved_tensors_hooks`` remat cannot drop anything: a RematError that says so, not torch's
    RuntimeError carrying the library's own message; torch.func's own disabling (remat's hooks are safe there)
    still works, and nothing is left installed."""
    f = remat.remat(lambda x, W: torch.tanh(x @ W).sum())
    x, W = torch.randn(5, 4, requires_grad=True), torch.randn(4, 6, requires_grad=True)
    with torch.autograd.graph.disable_saved_tensors_hooks("this library disabled hooks"):
        with pytest.raises(RematError, match="saved-tensor hooks are disabled.*this library disabled hooks"):
            f(x, W)
    with torch.autograd.graph.disable_saved_tensors_hooks("this library disabled hooks"):
        torch.testing.assert_close(f(x.detach(), W.detach()), torch.tanh(x @ W).sum().detach())  # (nothing to save)
    assert torch._C._autograd._saved_tensors_hooks_is_enabled()
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
    f(x, W).backward()
    xd = x.detach()
    torch.testing.assert_close(torch.func.grad(f, argnums=1)(xd, W.detach()),
                               torch.func.grad(lambda x, W: torch.tanh(x @ W).sum(), argnums=1)(xd, W.detach()))


G: dict[str, torch.Tensor] = {}


def _fills_a_global(x: torch.Tensor) -> torch.Tensor:
    torch.sin(x.detach(), out=G["B"])  # (an empty global: the out= op resizes it)
    y = x.exp() + G["B"]
    torch.cos(x.detach(), out=G["B"])  # (overwritten later in the call: the recompute must not read this)
    return (y.tanh() * y).sum()


@pytest.mark.parametrize("route", ["debug", "budget", "grad", "save-nothing"])
def test_an_empty_global_an_out_op_fills_on_the_re_run_routes(route: str) -> None:
    """On the re-run routes (and under torch.func) an empty tensor has no storage address to copy apart by: the
    recompute read the global's last value (a wrong gradient, silently). Exact where the replay serves (a memory
    budget's first call too since the thirty-seventh session), a RematError that says what to do on the others,
    and exact once the global has its final shape."""
    x = torch.randn(4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))

    def run(f: Any, empty: bool) -> torch.Tensor:
        G["B"] = torch.empty(0 if empty else 4, dtype=torch.float64)
        if route == "grad":
            return torch.func.grad(f)(x)
        xx = x.clone().requires_grad_()
        f(xx).backward()
        assert xx.grad is not None
        return xx.grad

    kw = {"debug": {"debug": True}, "budget": {"policy": policies.memory_budget(0.3)},
          "grad": {}, "save-nothing": {"policy": "save-nothing"}}[route]
    g = remat.remat(_fills_a_global, **kw)
    for empty in (True, False):
        ref = run(_fills_a_global, empty)
        for _ in range(2):
            # (a budget measures on the replay engine under plain autograd: exact, as save-nothing)
            if empty and route not in ("save-nothing", "budget"):
                with pytest.raises(RematError, match="writes in place into an empty tensor it did not make"):
                    run(g, empty)
            else:
                torch.testing.assert_close(run(g, empty), ref, rtol=1e-12, atol=0)


@pytest.mark.parametrize("wrap", ["save-nothing", "save-matmuls", "debug", "budget"])
def test_lazy_modules_before_their_first_forward_pass(wrap: str) -> None:
    """``nn.LazyLinear`` makes its parameters in its first forward pass: remat's first call raised ("modified in
    place after it was saved", or on a memory budget on every call "Can't access the shape of an uninitialized
    parameter"). That call runs without remat now, saying so; the calls after it are remat'd and exact."""
    kw = {"debug": {"debug": True}, "budget": {"policy": policies.memory_budget(0.3)}}.get(wrap) or {"policy": wrap}

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.LazyLinear(16, dtype=torch.float64), nn.GELU(), nn.LazyLinear(3, dtype=torch.float64))

    plain, model = make(), remat.remat_module(make(), **kw)
    x0 = torch.randn(5, 4, dtype=torch.float64)
    for step in range(3):
        grads = []
        for m in (plain, model):
            x = x0.clone().requires_grad_()
            torch.manual_seed(1)  # (the lazy modules draw their initial values in the first forward pass)
            if m is model and step == 0:
                with pytest.warns(UserWarning, match="lazy module .* runs without remat"):
                    out = m(x)
            else:
                out = m(x)
            grads.append(torch.autograd.grad(out.pow(2).sum(), [x, *m.parameters()]))
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=0)
    if wrap == "save-nothing":
        res = remat.saved_residuals(model, x0.clone().requires_grad_())
        assert any(r.decision == "recomputed" for r in res), res
