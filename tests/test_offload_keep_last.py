"""The newest call's storages stay on the device (NOTE [keep last] in ``remat/_offload/schedule.py``; what CUDA
does, run on the CPU through ``keeping_engine``): read in place, exact for views, spans and a second backward pass,
copied out once a later call offloads, a write caught as autograd catches it, and nothing held once read or copied.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

from remat import DeviceModel, RematError, checkpoint_name, policies, remat
from remat.offload import OffloadEngine, use_engine

from .helpers import keeping_engine

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- the last call stays on the device, older calls are copied -----------------------------------------------------


def test_last_call_stays_on_the_device_older_calls_are_copied() -> None:
    """Item 5: the call the backward pass starts with is not copied out and straight back."""
    pol = policies.offload_to_cpu(min_bytes=0)
    calls = [remat(lambda v: v.sin().sin().sin(), policy=pol) for _ in range(3)]
    x = torch.randn(64, dtype=torch.float64, requires_grad=True)
    eng = keeping_engine(trace=True)
    with use_engine(eng):
        h = x
        for f in calls:
            h = f(h)
        loss = h.sum()
        groups = {what: sorted({g for w, g, _ in eng.trace if w == what}) for what in ("d2h", "keep")}
        loss.backward()
    assert groups == {"d2h": [0, 1], "keep": [0, 1, 2]}  # the first two calls copied once the next began
    assert {g for w, g, _ in eng.trace if w == "h2d"} == {0, 1}  # the last is read where it is
    y = x.detach().clone().requires_grad_()
    y.sin().sin().sin().sin().sin().sin().sin().sin().sin().sum().backward()
    assert torch.equal(x.grad, y.grad)  # type: ignore[arg-type]


def test_where_the_engine_keeps_is_read_afresh_after_it_changes() -> None:
    """The route of a copy (keep or copy, asynchronous or not) is looked up once per pair of devices; a change of
    where the engine keeps, or of pinning, after copies were made is seen by the next copy."""
    g = remat(lambda v: v.exp().sin(), policy=policies.offload_to_cpu(min_bytes=0))
    x = torch.randn(64, 64, dtype=torch.float64, requires_grad=True)
    eng = OffloadEngine(keep_last=1, pin_memory=False)
    with use_engine(eng):
        g(x).sum().backward()
        assert eng.stats["kept_on_device"] == 0 and eng.stats["copies"] == 1
        eng._keep_devices = frozenset({"cpu"})
        g(x).sum().backward()
        assert eng.stats["kept_on_device"] == 1 and eng.stats["copies"] == 1  # kept, never copied out
        eng._keep_devices = frozenset({"cuda"})
        eng.pin_memory = True  # (no effect on a CPU copy, but a setting that clears the routes too)
        g(x).sum().backward()
        assert eng.stats["kept_on_device"] == 1 and eng.stats["copies"] == 2
    y = x.detach().clone().requires_grad_()
    for _ in range(3):
        y.exp().sin().sum().backward()
    assert torch.equal(x.grad, y.grad)  # type: ignore[arg-type]


def test_kept_storages_exact_for_views_spans_and_a_second_backward() -> None:
    big = torch.randn(400, 50, dtype=torch.float64)

    def f(v: torch.Tensor) -> torch.Tensor:
        qkv = (v * 2).exp()
        q, k = qkv[:, :25], qkv[:, 25:]  # two views of one storage, one kept copy
        part = (big * v.sum()).sin()[3:5]  # a small span of a large storage
        return (q.tanh() * k.sin()).sum() + part.cos().sum()

    x = torch.randn(400, 50, dtype=torch.float64, requires_grad=True)
    eng = keeping_engine(trace=True)
    with use_engine(eng):
        loss = remat(f, policy=policies.offload_to_cpu(min_bytes=0))(x)
        loss.backward(retain_graph=True)
        first = x.grad.clone()  # type: ignore[union-attr]
        loss.backward()
    y = x.detach().clone().requires_grad_()
    f(y).backward()
    assert torch.equal(first, y.grad) and torch.equal(x.grad, 2 * y.grad)  # type: ignore[arg-type]
    assert eng.stats["kept_on_device"] > 0 and eng.stats["copies"] == 0


def test_kept_storage_written_in_place_raises_like_autograd() -> None:
    def f(v: torch.Tensor) -> torch.Tensor:
        a = v.exp()
        a.mul_(2)  # exp saved its output; plain autograd raises on backward
        return a.sin().sum()

    x = torch.randn(8, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        f(x).backward()
    eng = keeping_engine(trace=True)
    with use_engine(eng), pytest.raises(RematError, match="modified in place after it was saved"):
        remat(f, policy=policies.offload_to_cpu(min_bytes=0))(x).backward()
    eng = keeping_engine(trace=True)  # written before a later call copies it: the copy is known stale
    g = remat(lambda v: v.cos(), policy=policies.offload_to_cpu(min_bytes=0))
    with use_engine(eng):
        a = remat(lambda v: v.exp(), policy=policies.offload_to_cpu(min_bytes=0))(x)
        s = a + 1  # add saves nothing: only remat holds a
        with torch.no_grad():
            a.mul_(2)
        loss = g(s).sum()  # this call's offloading starts the (stale) copy of the first call's
        with pytest.raises(RematError, match="modified in place after it was saved"):
            loss.backward()


# ---- nothing held once read or copied out --------------------------------------------------------------------------


def test_a_finished_calls_group_is_let_go() -> None:
    """The engine's cache of the group looked up last holds it weakly: a finished call's group would otherwise stay
    among the groups it keeps on the device (keep_last) and prefetches next (found by review)."""
    eng = keeping_engine(keep_last=2, trace=True)
    f = remat(lambda v: v.sin().exp().sum(), policy=policies.offload_to_cpu(min_bytes=0))
    x = torch.randn(32, requires_grad=True)
    with use_engine(eng):
        for _ in range(3):
            f(x).backward()
    gc.collect()
    assert eng.stats["kept_on_device"] > 0 and [r() for r in eng._order if r() is not None] == []


def test_reads_of_a_kept_storage_are_held_once_per_handle_and_let_go_once_copied() -> None:
    """Review: many backward passes over one retained graph (a Jacobian row by row) held one more tensor per read
    of a kept storage, each read checking them all; and a kept storage copied out stayed alive through the tensors
    read from it. Now: one per handle, and copied out, held weakly."""
    f = remat(lambda v: v.sin().exp().sum(), policy=policies.offload_to_cpu(min_bytes=0))
    x = torch.randn(1 << 12, dtype=torch.float64, requires_grad=True)
    eng = keeping_engine(trace=True)
    with use_engine(eng):
        loss = f(x)
        kept = [c for c in gc.get_objects() if type(c).__name__ == "_HostCopy" and c.engine is eng]
        assert kept and all(c.deferred is not None for c in kept)
        for _ in range(20):
            (gx,) = torch.autograd.grad(loss, x, retain_graph=True)
        assert torch.equal(gx, x.detach().cos() * x.detach().sin().exp())
        assert max(len(c.given) for c in kept) <= max(c.live for c in kept)
        storages = [weakref.ref(c.dev.untyped_storage()) for c in kept]
        f(x)  # a later call offloads: the kept storages are copied out
        del kept
        gc.collect()
        assert all(r() is None for r in storages)
        (again,) = torch.autograd.grad(loss, x)
    assert torch.equal(again, gx)


def test_a_kept_storage_is_freed_once_its_readers_ran() -> None:
    """Review of the check: a table of reads shared by a kept storage's copies held the tensors read from it until
    the whole call's backward ended. Measured by a weak reference to the storage, in the backward of a node that
    runs after the storage's readers and before the call's other ones."""
    alive: list[bool] = []
    stores: list[weakref.ref[Any]] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
            return t.clone()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            gc.collect()
            alive.append(stores[-1]() is not None)
            return g

    def f(v: torch.Tensor) -> torch.Tensor:
        p = Probe.apply((v * 1).exp().sin())
        a2 = p.exp()  # exp saves a2, sin too: both read before the probe's backward
        stores.append(weakref.ref(a2.untyped_storage()))
        return a2.sin().sum()

    x = torch.randn(1 << 12, dtype=torch.float64, requires_grad=True)
    g = remat(f, policy=policies.offload_to_cpu(min_bytes=0))
    eng = keeping_engine(trace=True)
    with use_engine(eng):
        for _ in range(3):
            g(x).backward()
    assert alive == [False] * 3 and eng.stats["kept_on_device"] > 0


# ---- a returned offloaded product the caller writes (NOTE [kept values written after the call]) -------------------

def _offloading_block(W: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = checkpoint_name(torch.tanh(x) @ W, "h")  # offloaded for the replay, which makes tanh(h) again from it
    return h, torch.tanh(h)


_KEEP_LAST_POLICIES = {
    "names": lambda: policies.save_and_offload_only_these_names(names_which_can_be_offloaded=["h"], offload_src="cpu"),
    "offload": lambda: policies.offload_to_cpu(min_bytes=0),
    "budget": lambda: policies.memory_budget(0.3, offload=DeviceModel.h200()),
}


@pytest.mark.parametrize("write", ["iadd", "view", "no_grad"])
@pytest.mark.parametrize("rank", [2, 3], ids=["mm-result", "unsafe-view-result"])
@pytest.mark.parametrize("transform", ["autograd", "grad", "vmap(grad)"])
@pytest.mark.parametrize("policy", list(_KEEP_LAST_POLICIES))
def test_a_returned_offloaded_product_written_and_let_go_is_made_again(policy: str, transform: str, rank: int,
                                                                       write: str) -> None:
    """The keep-last engine (CUDA's default) has not copied the newest call's product when the caller writes it
    (the residual add) and lets it go; the replay read the written bytes: silent (off by 0.6-1.8) with names on
    plain autograd and under ``grad``, until the thirty-seventh session, whose watches hold no bytes and outlive the
    caller's tensor. Exact on every call."""
    W = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 0.5
    shape = (2, 3, 4) if rank == 3 else (3, 4)
    x = torch.randn(*((5,) if transform == "vmap(grad)" else ()), *shape, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(1))

    def loss(f: Any, W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h, aux = f(W, x)
        if write == "iadd":
            h += x
        elif write == "view":
            h[..., :2].mul_(3)
        else:
            with torch.no_grad():
                h.mul_(2)
        return (aux * 2).sum() + h.sum()  # (h let go once the loss is made)

    def run(f: Any) -> Any:
        if transform == "autograd":
            Wl, xl = W.clone().requires_grad_(), x.clone().requires_grad_()
            return torch.autograd.grad(loss(f, Wl, xl), (Wl, xl))
        g = torch.func.grad(lambda W, x: loss(f, W, x), argnums=(0, 1))
        return g(W, x) if transform == "grad" else torch.func.vmap(g, in_dims=(None, 0))(W, x)

    want = run(_offloading_block)
    with use_engine(keeping_engine()):
        f = remat(_offloading_block, policy=_KEEP_LAST_POLICIES[policy]())
        for _ in range(3):
            got = run(f)
            assert all(torch.allclose(a, b, rtol=1e-10, atol=1e-10) for a, b in zip(got, want))
