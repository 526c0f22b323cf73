"""remat.saved_residuals / print_saved_residuals / memory_report, checked against known saved tensors.

Each function here has a saved-tensor set we can write down from autograd's
derivative formulas (mm saves the other operand, sin saves its input, exp saves
its result), and the inspection must find exactly that, with each policy's
decision. Memory figures are cross-checked between two independent methods: the
inspector's list and a census of live tensor storages.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import remat
from remat import checkpoint_name, policies
from remat.bench.measure import LiveCensus

F64 = torch.float64
HERE = __file__


def _line(marker: str) -> str:
    with open(HERE) as f:
        for i, text in enumerate(f, 1):
            if marker in text and "_line(" not in text:
                return f"{HERE}:{i}"
    raise AssertionError(marker)


def block(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    h = x @ W  # MARK-mm
    return torch.sin(h)


def named_block(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    h = checkpoint_name(x @ W, "h")  # MARK-named
    return torch.sin(h)


def _args() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    W = torch.randn(16, 16, dtype=F64, generator=g).requires_grad_()
    x = torch.randn(8, 16, dtype=F64, generator=g)
    return W, x


def _outer(inner):  # exp outside any remat call: plain autograd keeps its result
    return lambda W, x: inner(W, x).exp().sum()  # MARK-exp


def _by_op(rs):
    return {r.op: r for r in rs}


@pytest.mark.parametrize(
    "policy, h_decision",
    [("save-nothing", "recomputed"), ("save-matmuls", "kept"), ("save-everything", "kept"),
     (policies.offload_to_cpu(min_bytes=0), "offloaded")],
    ids=["save-nothing", "save-matmuls", "save-everything", "offload"],
)
def test_records_match_known_saves(policy, h_decision):
    W, x = _args()
    rs = remat.saved_residuals(_outer(remat.remat(block, policy=policy)), W, x)
    # saved: x by mm (for dW), h = x @ W by sin, exp's result by plain autograd; nothing else
    assert len(rs) == 3, rs
    xr = rs[0]
    assert (xr.decision, xr.argument, xr.op, xr.scope) == ("kept", "args[1]", None, "block")
    assert xr.shape == (8, 16) and xr.dtype == F64 and xr.nbytes == 8 * 16 * 8
    ops = _by_op(rs)
    h = ops["aten.mm.default"]
    assert h.decision == h_decision and h.shape == (8, 16) and h.nbytes == 8 * 16 * 8 and h.scope == "block"
    assert h.source == _line("MARK-mm")
    e = ops["aten.exp.default"]
    assert (e.decision, e.scope, e.count, e.source) == ("kept", None, 1, _line("MARK-exp"))
    # nothing here needs mm's output in a recompute, so nothing is held for a replay
    assert not h.replayed


def test_replayed_matmul_output_is_listed():
    """save-matmuls holds mm's output to replay it when sin(h) is recomputed, though autograd never saves it."""
    W, x = _args()
    f = remat.remat(lambda W, x: torch.sin(torch.sin(x @ W)), policy="save-matmuls")  # MARK-replay
    rs = remat.saved_residuals(_outer(f), W, x)
    h = _by_op(rs)["aten.mm.default"]
    assert (h.decision, h.replayed, h.source) == ("kept", True, _line("MARK-replay"))
    assert _by_op(rs)["aten.sin.default"].decision == "recomputed"
    rs = remat.saved_residuals(_outer(remat.remat(f.__wrapped__, policy="save-nothing")), W, x)
    assert _by_op(rs)["aten.mm.default"].decision == "recomputed" and not any(r.replayed for r in rs)


def test_plain_function_matches_autograd_hooks():
    """Without remat every save is plain autograd's: compare with our own count of pack-hook calls."""
    W, x = _args()
    f = _outer(block)
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        f(W, x)
    rs = remat.saved_residuals(f, W, x)
    assert sum(r.count for r in rs) == len(seen) == 3
    assert len({t.untyped_storage().data_ptr() for t in seen}) == len(rs)
    assert all(r.decision == "kept" and r.scope is None for r in rs)


@pytest.mark.parametrize("policy, decision", [
    (policies.save_only_these_names("h"), "kept"),
    (policies.save_only_these_names("other"), "recomputed"),
    (policies.save_anything_except_these_names("h"), "recomputed"),
])
def test_saved_residuals_name_the_tagged_residual_and_its_decision(policy, decision):
    W, x = _args()
    rs = remat.saved_residuals(_outer(remat.remat(named_block, policy=policy)), W, x)
    h = _by_op(rs)["aten.mm.default"]
    assert (h.name, h.decision, h.source) == ("h", decision, _line("MARK-named"))


def test_dedupes_one_storage_saved_several_times():
    x = torch.randn(32, dtype=F64, requires_grad=True)

    def f(x):
        h = torch.sin(x)
        return (h * h).sum() + (h.t() * 2).sum()  # mul saves h twice; h.t() is a view of h

    rs = remat.saved_residuals(f, x)
    h = _by_op(rs)["aten.sin.default"]
    assert h.count == 2 and h.nbytes == 32 * 8
    assert len([r for r in rs if r.op == "aten.sin.default"]) == 1


def test_nested_remat_and_totals(capsys):
    W, x = _args()
    inner = remat.remat(block, policy="save-matmuls")
    outer = remat.remat(lambda W, x: inner(W, torch.cos(x)), policy="save-nothing")
    rs = remat.saved_residuals(_outer(outer), W, x)
    assert {r.scope for r in rs} >= {"block", None}
    remat.print_saved_residuals(_outer(outer), W, x)
    out = capsys.readouterr().out
    totals = out.strip().splitlines()[-1]
    for d in ("kept", "input", "offloaded", "recomputed"):
        sel = [r for r in rs if r.decision == d]
        if sel:
            size = remat._inspection.inspect._size(sum(r.nbytes for r in sel))
            assert f"{d} {size} ({len(sel)})" in totals, totals
    held = sum(r.nbytes for r in rs if r.argument is None and r.decision in ("kept", "input"))
    assert totals.endswith(f"held besides the arguments: {remat._inspection.inspect._size(held)}")
    assert len(out.splitlines()) == len(rs) + 3  # title, header, rows, totals


def test_inside_torch_func_grad():
    W, x = _args()
    g = remat.remat(block, policy="save-nothing")
    got = {}

    def loss(W):
        got["rs"] = remat.saved_residuals(_outer(g), W, x)
        return _outer(g)(W, x)

    grad = torch.func.grad(loss)(W)
    ref = torch.func.grad(_outer(block))(W, x)
    assert torch.allclose(grad, ref, rtol=1e-12, atol=1e-12)
    ops = _by_op(got["rs"])
    assert ops["aten.mm.default"].decision == "recomputed"
    assert ops["aten.exp.default"].decision == "kept" and ops["aten.exp.default"].scope is None
    assert ops["aten.mm.default"].source == _line("MARK-mm")


def test_of_torch_func_grad_and_vmap():
    W, x = _args()
    g = remat.remat(block, policy="save-matmuls")
    with pytest.warns(UserWarning, match="refuse saved-tensor hooks"):
        rs = remat.saved_residuals(torch.func.grad(_outer(g)), W, x)
    h = _by_op(rs)["aten.mm.default"]
    assert h.decision == "kept" and h.count >= 1
    assert "aten.exp.default" not in _by_op(rs)  # plain saves inside grad cannot be seen (the warning says so)
    xs = torch.randn(3, 8, 16, dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # vmap accepts outer hooks: no second run, no warning
        rs = remat.saved_residuals(torch.func.vmap(_outer(g), in_dims=(None, 0)), W, xs)
    h = _by_op(rs)["aten.mm.default"]
    assert h.shape == (3, 8, 16) and h.decision == "kept"  # as stored: with the batch dimension
    assert _by_op(rs)["aten.exp.default"].decision == "kept"


def test_census_agrees_with_inspector():
    """Two independent measures of what the forward pass leaves alive for the backward pass."""
    W, x = _args()
    for policy in ("save-nothing", "save-matmuls", "save-everything"):
        f = _outer(remat.remat(block, policy=policy))
        rs = remat.saved_residuals(f, W, x)
        held = sum(r.nbytes for r in rs if r.argument is None and r.decision in ("kept", "input"))
        census = LiveCensus()
        with census:
            loss = f(W, x)
        census.close()
        assert census.live == held + loss.numel() * loss.element_size(), policy
        del loss


def test_memory_report_weighs_each_policy_against_no_remat():
    W, x = _args()

    def make_loss(wrap):
        blk = wrap(block)
        return lambda W, x: blk(W, blk(W, x)).exp().sum()

    torch_ckpt = ("torch-checkpoint", lambda f: lambda *a: torch.utils.checkpoint.checkpoint(f, *a, use_reentrant=False))
    rep = remat.memory_report(make_loss, W, x, policies=["save-nothing", "save-matmuls", torch_ckpt], steps=1)
    assert [r.label for r in rep.rows] == ["no remat", "save-nothing", "save-matmuls", "torch-checkpoint"]
    plain, nothing, dots, tc = rep.rows
    n = 8 * 16 * 8  # bytes of one activation
    # plain keeps mm output and sin input of both blocks + exp result; save-nothing the block inputs
    assert plain.retained_bytes == 5 * n + 8 - n  # the first mm's x is an argument
    assert nothing.retained_bytes == tc.retained_bytes < plain.retained_bytes
    assert nothing.recomputed_flops == tc.recomputed_flops == 2 * (2 * 8 * 16 * 16)  # both mms run again
    assert dots.recomputed_flops == 0 and plain.recomputed_flops == 0
    assert plain.time_ratio == 1.0 and all(r.peak_bytes >= r.retained_bytes > 0 for r in rep.rows)
    assert "save-matmuls" in str(rep) and rep.to_dict()["rows"][0]["label"] == "no remat"


def test_memory_report_on_blocks_that_call_modules():
    """nn.Modules inside the remat'd block: the FLOP count must not run module hooks inside the recompute."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)).double()

    def make_loss(wrap):
        blk = wrap(lambda x: mlp(x))
        return lambda x: blk(blk(x)).pow(2).sum()

    x = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
    torch_ckpt = ("torch-checkpoint", lambda f: lambda *a: torch.utils.checkpoint.checkpoint(f, *a, use_reentrant=False))
    rep = remat.memory_report(make_loss, x, policies=["save-nothing", "save-matmuls", torch_ckpt], steps=1)
    plain, nothing, dots, tc = rep.rows
    # save-nothing recomputes the first linear of each call (the second's output is read by nothing: torch's
    # checkpoint stops early, remat skips it as a dead op); save-matmuls none
    assert nothing.recomputed_flops == tc.recomputed_flops == 2 * (2 * 8 * 16 * 32), rep
    assert dots.recomputed_flops == 0 and plain.recomputed_flops == 0
    assert nothing.retained_bytes < plain.retained_bytes


def test_saved_residuals_and_memory_report_reject_bad_arguments():
    with pytest.raises(TypeError, match="expected a function"):
        remat.saved_residuals(3)
    W, x = _args()
    with pytest.raises(ValueError, match="no argument requires grad"):
        remat.memory_report(lambda wrap: _outer(wrap(block)), W.detach(), x, steps=1)
    with pytest.raises(ValueError, match="unknown policy"):
        remat.memory_report(lambda wrap: _outer(wrap(block)), W, x, policies=["save-some"], steps=1)
    # the loss function itself where make_loss goes (a user's first try): what make_loss is, not the loss's TypeError
    with pytest.raises(TypeError, match=r"make_loss\(wrap\) raised TypeError.*make_loss is a function of one argument"):
        remat.memory_report(lambda W, x: block(W, x).sum(), W, x, steps=1)
    with pytest.raises(TypeError, match=r"make_loss\(wrap\) returned Tensor, not a function"):
        remat.memory_report(lambda wrap: W.sum(), W, x, steps=1)
    with pytest.raises(TypeError, match=r"make_loss\(wrap\) raised AttributeError.*make_loss is a function of one"):
        remat.memory_report(lambda x: x.pow(2).sum(), x, steps=1)


def test_a_modules_parameters_are_not_held_besides_the_arguments() -> None:
    """A module's parameters are held by the module anyway: ``saved_residuals(module, x)`` named them and counted
    them as "held besides the arguments" (1 MiB for a 512 x 512 weight a save-nothing block keeps by reference),
    where the same function with its parameters as arguments counted 0 B."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.GELU(), torch.nn.Linear(512, 512))
    remat.remat_module(mlp)
    x = torch.randn(8, 512)
    for f in (mlp, mlp.forward, remat.remat(torch.nn.Sequential(*mlp))):
        rows = remat.saved_residuals(f, x)
        weights = [r for r in rows if r.shape == (512, 512)]
        assert weights and all(r.argument in ("Sequential.0.weight", "Sequential.2.weight") for r in weights)
        assert remat.format_saved_residuals(rows).endswith("held besides the arguments: 0 B")


def test_print_saved_residuals_names_a_module_by_its_class(capsys) -> None:
    """Not by its repr, which runs over many lines."""
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    remat.remat_module(mlp)
    remat.print_saved_residuals(mlp, torch.randn(2, 8))
    first = capsys.readouterr().out.splitlines()[0]
    assert "Sequential" in first and "Linear" not in first
