"""The offload engine's common case (``offload_saved``): a whole storage, copied synchronously, first in
its call, runs inline, with the same copies, sharing and values as the general path; what its decision does not
move is kept; a call's whole tensors take it; its handle is its own copy (NOTE [solo handles]).
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

from remat import RematError, policies, remat
from remat.offload import OffloadEngine, use_engine
from remat.policies import Offloadable

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_offload_saved_matches_the_general_path_tensor_for_tensor(grad: bool) -> None:
    """offload_saved runs its common case (a whole storage, synchronous, first in the call) inline and every other
    case through the general path: the same copies, sharing, copies back, values and strides as
    offload_below_modes, case by case (a whole tensor, a view of it, a bool, a small slice, a transpose, its storage
    again, a small slice saved before its whole storage, a write between saves), with and without grad mode (a
    pack hook runs without it; a caller outside a pack hook may run with it)."""

    class Key:
        pass

    class Spy(OffloadEngine):
        general = 0

        def _offload(self, t: torch.Tensor, dst: str, group: Any) -> Any:
            self.general += 1
            return super()._offload(t, dst, group)

    def saves() -> list[torch.Tensor]:
        torch.manual_seed(0)
        a = torch.randn(6, 8)
        b = torch.randn(4, 4)
        c = torch.randn(32)
        m = torch.randn(5, 3) > 0
        big = torch.randn(64)
        return [a, a[1:], m, big[:4], b.t(), b, c[2:5], c, a.view(8, 6), torch.randn(3, dtype=torch.float64)]

    got = {}
    for how in ("saved", "general"):
        eng = Spy()
        key = Key()
        grp = eng.group(key)
        ts = saves()
        dec = Offloadable(None, "cpu", 0)
        handles = []
        with torch.set_grad_enabled(grad):
            for i, t in enumerate(ts):
                if i == 8:
                    ts[0].add_(1)  # a write between saves: the later view of the same storage gets a copy of its own
                h = eng.offload_saved(t, dec, grp) if how == "saved" else eng.offload_below_modes(t, "cpu", grp)
                assert h is not None
                handles.append(h)
        for h in handles[:2]:  # (saved before the write)
            with pytest.raises(RematError, match="modified in place after it was saved"):
                eng.fetch(h)
        back = [eng.fetch(h) for h in handles[2:]]
        got[how] = ([(v.stride(), v.clone()) for v in back], dict(eng.stats), eng.general)
        assert all(torch.equal(v, t) and v.stride() == t.stride() for v, t in zip(back, ts[2:]))
    assert got["saved"][1] == got["general"][1] and got["saved"][1]["shared"] > 0
    assert all(x[0] == y[0] and torch.equal(x[1], y[1]) for x, y in zip(got["saved"][0], got["general"][0]))
    # the whole storages copied first (a, c, the float64 tensor) took offload_saved's own copy; c's slice, saved
    # before it as a span, reads c's whole copy (the same copies back as on the general path, above)
    assert (got["saved"][2], got["general"][2]) == (len(saves()) - 3, len(saves()))


@pytest.mark.parametrize("grouped", [False, True], ids=["no-group", "a-calls-group"])
def test_offload_saved_keeps_what_the_decision_does_not_move(grouped: bool) -> None:
    """offload_saved returns None (the caller keeps the tensor) where applies says no: too small, another device,
    a conjugate or negative view, a quantized tensor, forward AD's zero tensor, a nested tensor, a sparse or mkldnn
    one. With a call's group, the CPU's common case asks its own questions first (it tells a zero tensor and a
    layout other than strided by their storage): this runs them all through it."""
    eng = OffloadEngine()

    class Call:
        pass

    call = Call()
    grp = eng.group(call) if grouped else None

    def moved(t: torch.Tensor, decision: Offloadable) -> bool:
        return eng.offload_saved(t, decision, grp) is not None

    every = Offloadable(None, "cpu", 0)
    kept = {
        "too small": (torch.randn(4), Offloadable(None, "cpu", 1 << 20)),
        "another device": (torch.randn(4), Offloadable("cuda", "cpu", 0)),
        "conjugate": (torch.randn(4, dtype=torch.complex64).conj(), every),
        "negative": (torch._neg_view(torch.randn(4)), every),
        "quantized": (torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8), every),
        "zero tensor": (torch._efficientzerotensor(4), every),
        "nested": (torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)]), every),
        "sparse coo": (torch.randn(3, 3).to_sparse(), every),
        "sparse csr": (torch.randn(3, 3).to_sparse_csr(), every),
        "sparse csc": (torch.randn(3, 3).to_sparse_csc(), every),
    }
    if torch.backends.mkldnn.is_available():
        kept["mkldnn"] = (torch.randn(3, 3).to_mkldnn(), every)
    for what, (t, decision) in kept.items():
        assert not moved(t, decision), what
    assert eng.stats["offloaded"] == 0
    assert moved(torch.randn(4, dtype=torch.complex64), every)  # (no bit: moved)
    assert moved(torch.randn(4), every) and moved(torch.arange(4), every)
    assert eng.stats["offloaded"] == 3


def test_a_calls_whole_tensors_take_offload_saveds_common_case() -> None:
    """The forward pass's hot path: on every call (the replay engine's pack hook), every offloaded tensor that is all
    of its storage goes through offload_saved's own copy, not the general path, but the call's first (its group is
    looked up then); gradients equal plain autograd's."""

    class Spy(OffloadEngine):
        general = 0

        def _offload(self, t: torch.Tensor, dst: str, group: Any) -> Any:
            Spy.general += 1
            return super()._offload(t, dst, group)

    def f(x: torch.Tensor) -> torch.Tensor:
        return x.sin().exp().exp().exp().tanh().sum()

    g = remat(f, policy=policies.offload_to_cpu(min_bytes=0))
    x = torch.randn(64, dtype=torch.float64, requires_grad=True)
    (want,) = torch.autograd.grad(f(x), (x,))
    eng = Spy()
    with use_engine(eng):
        for call in range(3):
            Spy.general = 0
            copies = eng.stats["copies"]
            (got,) = torch.autograd.grad(g(x), (x,))
            assert torch.equal(got, want)
            assert eng.stats["copies"] - copies == 4  # the three exps' and tanh's outputs (sin saves x, held)
            assert Spy.general <= 1, (call, Spy.general)


def test_a_solo_handle_is_its_own_copy_shared_by_later_views_and_freed_with_them() -> None:
    """NOTE [solo handles]: the common case's handle is its own host copy; a view of the same storage saved later
    reads that copy through a handle of its own, before and after autograd lets the solo go unread; once both die,
    nothing holds the copy; the counters count the solo once each, whenever stats is read."""
    eng = OffloadEngine()

    class Call:
        pass

    call = Call()
    grp = eng.group(call)
    every = Offloadable(None, "cpu", 0)
    x = torch.randn(6, 8, dtype=torch.float64)
    solo = eng.offload_saved(x, every, grp)
    assert solo is not None and solo.copy is solo and solo.host is not None  # (one object: the handle is the copy)
    assert eng.stats["copies"] == 1 and eng.stats["offloaded"] == 1 and eng.stats["offloaded_bytes"] == x.nbytes
    view = eng.offload_saved(x.t(), every, grp)
    assert view is not None and view.copy is solo and solo.live == 2  # (shares the solo's bytes, not a new copy)
    assert eng.stats["copies"] == 1 and eng.stats["offloaded"] == 2 and eng.stats["shared"] == 1
    expected = x.clone()
    del x
    assert torch.equal(eng.fetch(solo), expected)
    solo_ref = weakref.ref(solo)
    del solo  # (read, then let go: the view's handle holds the copy)
    assert solo_ref() is not None
    got = eng.fetch(view)
    assert torch.equal(got, expected.t()) and got.stride() == expected.t().stride()
    del view, got
    gc.collect()
    assert solo_ref() is None  # (nothing else held the copy: not the group, not the engine)
