"""Calls under offload policies, the first of a signature and the later ones: exact on every call with every
offload engine (prefetching or not, keeping the newest call on the device), letting go of the outputs they
offloaded (weighed from outside), watching them for writes; an in-place activation under an offload policy is
offloaded and exact; an offloaded product written in place is not run again (matmuls counted from outside); a write
no version counter shows is exact.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat import RematError, checkpoint_name, policies, remat
from remat.bench.measure import live_bytes_after

from .helpers import OpCounter, assert_tree_close, f32, f64, grads, keeping_engine, leaf, mlp_inplace

# ---- offloaded outputs: exact, let go of, watched for writes -------------------------------------------------------


def _offload_engine(kind):
    from remat.offload import OffloadEngine

    return keeping_engine() if kind == "kept" else OffloadEngine(prefetch=kind != "no-prefetch")


@pytest.mark.parametrize("engine", ["default", "no-prefetch", "kept"])
@pytest.mark.parametrize("policy", ["matmuls", "everything"])
def test_a_gru_cell_with_its_products_offloaded_is_exact_on_every_call(policy, engine):
    """Review: ``nn.GRUCell`` on the CPU splits its gate products with ``unsafe_chunk`` (pieces with version counters
    of their own) and writes them in place: a tensor saved after a write needs a copy of its own (NOTE [one copy
    per storage]), not the copy made before it (a wrong gradient without an error, once). Kept on the device (NOTE
    [keep last]), the product is written before its copy goes out, on every call. Bitwise plain autograd's
    gradients on every call."""
    from remat.offload import use_engine
    from remat.policies import Offloadable

    mm = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)

    def only_mm(op, *a, **k):
        return Offloadable(None, "cpu", 0) if op in mm else False

    pol = only_mm if policy == "matmuls" else policies.offload_to_cpu(min_bytes=0)
    cell = nn.GRUCell(8, 8).double()
    x, h = leaf(2, 8, seed=1), leaf(2, 8, seed=2)

    def f(x, h):
        return cell(x, h).sum()

    ref = torch.autograd.grad(f(x, h), (x, h, *cell.parameters()))
    g = remat(f, policy=pol)
    eng = _offload_engine(engine)
    with use_engine(eng):
        for _ in range(3):
            got = torch.autograd.grad(g(x, h), (x, h, *cell.parameters()))
            assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert eng.stats["offloaded"] >= 3


def test_calls_let_go_of_the_outputs_they_offloaded():
    """Review: a call that holds an alias of every output it offloaded for its recompute (to watch the output's
    version after the forward pass) keeps the device bytes the offload let go of: offloading the matrix products
    keeps them, as saving would. Counted from outside, on every call, by a dispatch mode that weighs the storages
    the ops allocate and watches them die."""
    from remat.offload import OffloadEngine, use_engine
    from remat.policies import Offloadable

    def only_mm(op, *a, **k):
        return Offloadable(None, "cpu", 0) if op is torch.ops.aten.mm.default else False

    def f(W, x):
        a = (x @ W).sin()  # sin saves the product
        return (a @ W).cos().sum()

    W, x = leaf(64, 64), leaf(16, 64, seed=1)
    g = remat(f, policy=only_mm)
    product = 16 * 64 * 8
    held = []
    with use_engine(OffloadEngine()):
        for _ in range(3):
            loss, n = live_bytes_after(lambda: g(W, x))  # noqa: B023
            held.append(n)
            assert_tree_close(torch.autograd.grad(loss, (W, x)), torch.autograd.grad(f(W, x), (W, x)))
    _, plain = live_bytes_after(lambda: f(W, x))
    assert plain >= 2 * product and held[0] <= plain - 2 * product, (plain, held)
    assert held == [held[0]] * 3, held


@pytest.mark.parametrize("engine", ["default", "no-prefetch", "kept"])
def test_a_detached_result_written_after_the_call_raises_or_gives_the_values_saved(engine):
    """Second review: a call that watches the output it offloaded through a weak reference, dead once the call
    returns only ``a.detach()``; kept on the device, the storage is read in place, written by the caller: a wrong
    gradient without an error (plain autograd raises). The engine watches the output's own version counter while
    its copy has not read the bytes; once it has, the copy holds the values saved."""
    from remat.offload import use_engine
    from remat.policies import Offloadable

    def only_mm(op, *a, **k):
        return Offloadable(None, "cpu", 0) if op is torch.ops.aten.mm.default else False

    def f(W, x):
        a = x @ W
        return a.sin().cos().sum(), a.detach()

    W, x = leaf(8, 8), leaf(4, 8, seed=1)
    clean = torch.autograd.grad(f(W, x)[0], (W, x))
    loss, r = f(W, x)
    with torch.no_grad():
        r.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss, (W, x))
    g = remat(f, policy=only_mm)
    eng = _offload_engine(engine)
    with use_engine(eng):
        loss, _ = g(W, x)  # (the first call, unwritten)
        assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(loss, (W, x)), clean))
        for _ in range(3):
            loss, r = g(W, x)
            with torch.no_grad():
                r.mul_(2)
            del r
            if engine == "kept":
                with pytest.raises(RematError, match="modified in place after it was saved"):
                    torch.autograd.grad(loss, (W, x))
            else:  # (copied before the write: the gradient of the values saved, where plain autograd raises)
                assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(loss, (W, x)), clean))


@pytest.mark.parametrize("engine", ["default", "no-prefetch", "kept"])
def test_an_offloaded_output_written_in_a_later_call_is_not_read_written(engine):
    """Third review: a later call's offloaded matrix product, written in place after ``sin`` saved it (the write's
    target depends on the data: the same op at the same index). Kept on the device, the written storage must not be
    read in place (a wrong gradient without an error; plain autograd raises): a RematError, with every engine."""
    from remat.offload import use_engine
    from remat.policies import Offloadable

    def only_mm(op, *a, **k):
        return Offloadable(None, "cpu", 0) if op is torch.ops.aten.mm.default else False

    def f(W, x):
        a = x @ W
        c = a.sin() * 3  # sin saves a
        with torch.no_grad():
            (a if x.sum() < 0 else c).mul_(2)
        return c.sum()

    W = leaf(8, 8)
    xp = torch.rand(4, 8, dtype=f64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    xn = (-xp).detach().requires_grad_()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(f(W, xn), (W, xn))
    saved = torch.autograd.grad((xn @ W).sin().mul(3).sum(), (W, xn))  # the values as saved
    g = remat(f, policy=only_mm)
    with use_engine(_offload_engine(engine)):
        torch.autograd.grad(g(W, xp), (W, xp))  # (writes c)
        for _ in range(3):
            # as plain autograd: the replay engine watches what it offloaded for writes, whichever engine copies it
            with pytest.raises(RematError, match="modified in place after it was saved"):
                torch.autograd.grad(g(W, xn), (W, xn))
    assert saved is not None


# ---- an in-place activation under an offload policy ---------------------------------------------------------------


@pytest.mark.parametrize("engine", ["default", "no-prefetch", "kept"])
@pytest.mark.parametrize("dtype", [f64, f32], ids=["f64", "f32"])
def test_an_in_place_activation_under_offload_is_offloaded_and_exact(dtype, engine):
    """``h = relu_(x @ W)`` under ``offload_to_cpu``: the product is offloaded as the matmul returns, and the ReLU
    writes it. The gradients are the plain function's, bit for bit, on every call; every call offloads as many
    tensors as the first; and what stays alive after its forward pass, weighed from outside, is the same on every
    call, far below plain autograd (but for an engine that keeps the newest call on the device: NOTE [keep
    last])."""
    from remat.offload import use_engine

    def f(Ws, x):
        return mlp_inplace(Ws, x).sum()

    Ws, x = [leaf(32, 32, dtype=dtype, seed=i) for i in range(3)], leaf(16, 32, dtype=dtype, seed=9, grad=False)
    g = remat(f, policy=policies.offload_to_cpu(min_bytes=0))
    eng = _offload_engine(engine)
    held, offloaded = [], []
    with use_engine(eng):
        for call in range(4):
            before = eng.stats["offloaded"]
            loss, n = live_bytes_after(lambda: g(Ws, x + call))  # noqa: B023
            held.append(n)
            offloaded.append(eng.stats["offloaded"] - before)
            assert_tree_close(torch.autograd.grad(loss, Ws), torch.autograd.grad(f(Ws, x + call), Ws), rtol=0, atol=0)
    _, plain = live_bytes_after(lambda: f(Ws, x))
    assert offloaded == [offloaded[0]] * 4 and offloaded[0] >= 6, offloaded  # (each layer: the ReLU's, the tanh's)
    assert held == [held[0]] * 4, held
    if engine != "kept":
        assert held[0] < plain // 4, (held, plain)


def test_offloaded_matmuls_written_in_place_are_not_run_again():
    """Found by review: under ``offload_dot_with_no_batch_dims`` the ReLU writes each offloaded product; with the rest
    dropped, recomputing the whole function runs its matmuls too (8 in the backward pass instead of 5). The
    offloaded products are handed back: the backward pass runs plain autograd's matmuls only, on every call."""
    Ws, x = [leaf(16, 16, seed=i) for i in range(3)], leaf(8, 16, seed=9, grad=False)
    g = remat(mlp_inplace, policy=policies.offload_dot_with_no_batch_dims(None, "cpu"))
    counts = []
    for call in range(3):
        out = g(Ws, x + call)
        with OpCounter({torch.ops.aten.mm.default}) as c:
            got = torch.autograd.grad(out.sum(), Ws)
        counts.append(c.count)
        assert_tree_close(got, torch.autograd.grad(mlp_inplace(Ws, x + call).sum(), Ws), rtol=0, atol=0)
    assert counts == [counts[0]] * 3 and counts[0] <= 6, counts  # (the plain backward's, nothing run again)


def _written_unseen(W0, W1, x):
    a = torch.relu_(x @ W0)
    if x.sum() > 0:  # (the signature's first call, with x < 0, does not write)
        a.data.mul_(2)  # a version counter of its own: no saved tensor's version moves
    return (a @ W1).sum()  # the matmul saves a again, after the write


@pytest.mark.parametrize("debug", [False, True], ids=["replay", "debug"])
def test_a_data_dependent_write_through_data_is_exact(debug):
    """Found by review: a later call writes, through ``.data``, a storage copied for a save, which its signature's
    first call did not; the matmul's save after the write must not share the copy made before it. Exact on every
    call, with ``debug=True`` (the old engine) and without."""
    from remat.offload import OffloadEngine, use_engine

    W0, W1 = leaf(16, 16), leaf(16, 16, seed=1)
    g = remat(_written_unseen, policy=policies.offload_to_cpu(min_bytes=0), debug=debug)
    with use_engine(OffloadEngine()):
        for call in range(3):
            x = torch.rand(8, 16, dtype=f64, generator=torch.Generator().manual_seed(call)) * (-1 if call == 0 else 1)
            want = torch.autograd.grad(_written_unseen(W0, W1, x), (W0, W1))
            assert_tree_close(torch.autograd.grad(g(W0, W1, x), (W0, W1)), want, rtol=0, atol=0)


def _offload_but_recompute_exp(op, *args, **kwargs):
    if op is torch.ops.aten.exp.default or op is torch.ops.aten.add.Tensor:
        return policies.Recompute
    return policies.Offloadable(None, "cpu", 0)


def test_a_write_into_another_storage_through_data_on_a_later_call_is_exact():
    """exp's and add's outputs are recomputed, the rest offloaded. The first call writes, through ``.data``, a
    storage it had not copied (``r``); a later call's same op writes ``q``'s, copied for ReLU's save, and the matmul
    saves ``q`` again after it: that save needs a copy of its own (sharing the copy made before the write gives a
    wrong gradient without an error). Bitwise plain autograd's gradients on every call."""
    from remat.offload import OffloadEngine, use_engine

    branch = {"q": False}

    def f(W0, W1, x):
        q = torch.relu(x @ W0)  # ReLU saves q: copied
        r = x + 1  # saved by nothing, recomputed
        (q if branch["q"] else r).data.mul_(2)  # (the signature's first call writes r)
        return (q @ W1).sum() + (x @ W0).exp().sum()  # the matmul saves q again; exp's output: a recompute

    W0, W1 = leaf(16, 16), leaf(16, 16, seed=1)
    x = torch.rand(8, 16, dtype=f64, generator=torch.Generator().manual_seed(2))
    g = remat(f, policy=_offload_but_recompute_exp)
    with use_engine(OffloadEngine()) as eng:
        for on in (0, 0, 1, 1, 0):
            branch["q"] = bool(on)
            want = torch.autograd.grad(f(W0, W1, x), (W0, W1))
            assert_tree_close(torch.autograd.grad(g(W0, W1, x), (W0, W1)), want, rtol=0, atol=0)
    assert eng.stats["offloaded"] > 0


def test_superpoint_s_conv_blocks_with_in_place_relus_under_offload():
    """Real model code: transformers' SuperPoint encoder (convolutions, ``nn.ReLU(inplace=True)``, max pooling), random
    weights from a config, each conv block under ``remat_modules`` with ``offload_to_cpu``. Every call is bit-exact
    against the plain encoder, and offloads: what stays alive after the forward pass, weighed from outside, is a
    fraction of what the plain encoder keeps."""
    import copy

    transformers = pytest.importorskip("transformers")
    from transformers.models.superpoint.modeling_superpoint import SuperPointConvBlock, SuperPointEncoder

    from remat import remat_modules

    torch.manual_seed(0)
    enc = SuperPointEncoder(transformers.SuperPointConfig(encoder_hidden_sizes=[8, 8, 16, 16])).double()
    ref = copy.deepcopy(enc)
    names = remat_modules(enc, SuperPointConvBlock, policy=policies.offload_to_cpu(min_bytes=0))
    assert len(names) == 4
    x = leaf(2, 1, 32, 32)
    for call in range(3):
        xi = (x + call).detach().requires_grad_()
        got = torch.autograd.grad(enc(xi)[0].sum(), (xi, *enc.parameters()))
        want = torch.autograd.grad(ref(xi)[0].sum(), (xi, *ref.parameters()))
        assert_tree_close(got, want, rtol=0, atol=0)
    # and the calls offload: what stays alive after the forward pass, weighed from outside, is a fraction of what
    # the plain encoder keeps
    _, held = live_bytes_after(lambda: enc(x)[0].sum())
    _, plain = live_bytes_after(lambda: ref(x)[0].sum())
    assert held < plain // 4, (held, plain)


def test_a_write_into_a_storage_offloaded_for_a_save_is_exact():
    """``unsafe_split`` pieces have version counters of their own; the second piece's write lands in a storage the
    first piece's save copied (the piece saved after it must not share the stale copy). Every call is bitwise
    exact."""
    W, x = leaf(4, 6), leaf(3, 4, seed=1)

    def f(W, x):
        a1, a2 = (x @ W).unsafe_split(3, 1)
        return a1.sigmoid_() * a2.sigmoid_()  # each sigmoid_ saves its written output

    g = remat(f, policy=policies.offload_to_cpu(min_bytes=0))
    want = grads(f, (W, x), (W, x))
    for _ in range(3):
        assert_tree_close(grads(g, (W, x), (W, x)), want, rtol=0, atol=0)


def _written_then_named(write):
    def f(x, W, g):
        h = x @ W
        if write == "slice":
            h[:, :2].mul_(3.0)
        elif write == "view":
            h.view(-1).add_(1.25)
        else:
            h.data.add_(1.25)
        h = checkpoint_name(h, "n0")
        return (h * g).sum(-1)

    return f


@pytest.mark.parametrize("double", [False, True], ids=["backward", "double backward"])
@pytest.mark.parametrize("write", ["slice", "view", "data"])
def test_an_offloaded_product_written_through_a_view_then_dropped_by_a_name_is_exact(write, double):
    """``offload_dot_with_no_batch_dims``: the product is handed to the offload engine when a view of it is read (the
    copy holds it as made, for the replayed steps that read it), written in place through that view, then a name the
    policy drops makes it a recomputed value, which a later op saves: the replay must make it again, the write with
    it, not serve the copy from before the write (off by the written amount in d/dg before the twenty-seventh
    session; found by review of the forward-mode transforms). Three calls."""
    f = _written_then_named(write)
    g = remat(f, policy=policies.offload_dot_with_no_batch_dims("cpu", "cpu"))

    def run(fn, x, W, v):
        y = (fn(x, W, v) ** 2).sum()
        if not double:
            return torch.autograd.grad(y, (x, W, v))
        gx, gW = torch.autograd.grad(y, (x, W), create_graph=True)
        return torch.autograd.grad(gx.sin().sum() + gW.pow(2).sum(), (x, W, v))

    for call in range(3):
        x, W, v = leaf(3, 4, seed=call), leaf(4, 4, seed=10 + call), leaf(4, seed=20 + call)
        assert_tree_close(run(g, x, W, v), run(f, x, W, v), rtol=1e-10, atol=1e-10)


def _offloaded_then_written_and_returned(x, v):
    h = x @ v  # (offloaded: the replay of gelu's input reads the copy)
    torch.nn.functional.gelu(h).sum()  # (saves h; its result is never used, so autograd never reads that save)
    return torch.nn.functional.silu(h, inplace=True)  # (written in place: its save is a copy of h, replayed)


@pytest.mark.parametrize("engine", ["default", "no-prefetch", "kept"])
@pytest.mark.parametrize("how", ["policy", "context_fn"])
def test_an_offloaded_output_written_in_place_and_kept_by_the_caller_is_exact(engine, how):
    """A drop-in review (thirty-sixth session): an offloaded product written in place afterwards and returned, the
    caller holding the result (``out = checkpoint(...); out.pow(2).sum().backward()``), raised "offloaded ... was
    modified in place after it was saved (version 0 -> 1)": the replay of ``silu_``'s saved input read the copy the
    engine took for it, whose value is the one it wants, written since or not; only a save autograd reads is
    checked for writes. Plain autograd and torch's checkpoint give the gradient."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from remat import checkpoint
    from remat.offload import use_engine

    mm = torch.ops.aten.mm.default
    kw: dict = {"policy": lambda op, *a, **k: policies.Offloadable("cpu", "cpu") if op is mm else policies.Recompute}
    if how == "context_fn":
        kw = {"context_fn": lambda: create_selective_checkpoint_contexts(
            lambda ctx, op, *a, **k: CheckpointPolicy.MUST_CPU_OFFLOAD if op is mm else CheckpointPolicy.PREFER_RECOMPUTE)}
    for call in range(3):
        ins = [leaf(4, 6, seed=call), leaf(6, 6, seed=10 + call)]
        ref = [a.detach().clone().requires_grad_() for a in ins]
        out = _offloaded_then_written_and_returned(*ref)
        out.pow(2).sum().backward()
        with use_engine(_offload_engine(engine)):
            got = checkpoint(_offloaded_then_written_and_returned, *ins, use_reentrant=False, **kw)
            got.pow(2).sum().backward()
        torch.testing.assert_close(got, out, rtol=0, atol=0)
        assert_tree_close([a.grad for a in ins], [a.grad for a in ref], rtol=1e-12, atol=1e-12)


def _returns_its_offloaded_product(x, v):
    h = x @ v
    return (h.tanh() * 2).sum(), h  # (tanh saves its output, not h: plain autograd minds no later write into h)


@pytest.mark.parametrize("engine", ["default", "kept"])
def test_a_returned_product_the_caller_writes_before_the_backward_pass_is_exact(engine):
    """The review of this session's fixes (thirty-sixth): with the engine keeping the newest call's storages on the
    device (NOTE [keep last], the CUDA default), the copy a replay reads of an offloaded product is not taken yet, so
    its bytes are the product's own; a caller writing the returned product (``h.mul_(2)``) before the backward pass
    changed what the replay read: off by 0.6-0.7, silently. The replay makes it again once its version moved."""
    from remat.offload import use_engine

    mm = torch.ops.aten.mm.default
    r = remat(_returns_its_offloaded_product,
              policy=lambda op, *a, **k: policies.Offloadable("cpu", "cpu") if op is mm else policies.Recompute)
    with use_engine(_offload_engine(engine)):
        for call in range(3):
            got = []
            for f in (_returns_its_offloaded_product, r):
                ins = [leaf(4, 6, seed=call), (leaf(6, 6, seed=10 + call, grad=False) * 0.3).requires_grad_()]
                loss, h = f(*ins)
                h.mul_(2)
                loss.backward()
                got.append([a.grad for a in ins])
            assert_tree_close(got[1], got[0], rtol=1e-12, atol=1e-12)
