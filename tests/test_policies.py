"""Unit tests of the policies: decisions on representative ops, repr, validation, composition, shortcuts.

A policy is called as ``policy(op, *args, **kwargs)``; these tests call them the way
the engine does (ATen OpOverloads, and ``checkpoint_name`` with ``kwargs["name"]``),
and check through ``remat`` that the policy really sees the ops of the function.
"""

from __future__ import annotations

import pytest
import torch

from remat import checkpoint_name, policies, remat, saved_residuals
from remat.policies import Offloadable, Recompute, Saveable

from .helpers import OpCounter

aten = torch.ops.aten

NO_BATCH_DOTS = [aten.mm.default, aten.addmm.default, aten.mv.default, aten.dot.default]
BATCH_DOTS = [aten.bmm.default, aten.baddbmm.default]
CONVS = [aten.convolution.default]
ELEMENTWISE = [aten.sin.default, aten.gelu.default, aten.add.Tensor, aten.mul.Tensor, aten._softmax.default,
               aten.native_layer_norm.default, aten.relu.default, aten.view.default, aten.t.default]


def named(name: str) -> tuple[object, dict[str, str]]:
    """How the engine asks a policy about ``checkpoint_name(x, name)``."""
    return checkpoint_name, {"name": name}


def ask(policy, op, **kwargs):
    return policy(op, torch.ones(2, 2), **kwargs)


# ---- fixed policies --------------------------------------------------------------


@pytest.mark.parametrize("op", NO_BATCH_DOTS + BATCH_DOTS + CONVS + ELEMENTWISE, ids=str)
def test_nothing_and_everything_saveable(op):
    assert ask(policies.nothing_saveable, op) is False
    assert ask(policies.everything_saveable, op) is True
    name_op, kw = named("x")
    assert policies.nothing_saveable(name_op, torch.ones(1), **kw) is False
    assert policies.everything_saveable(name_op, torch.ones(1), **kw) is True


@pytest.mark.parametrize("op", NO_BATCH_DOTS + BATCH_DOTS + CONVS, ids=str)
def test_dots_saveable_saves_products_and_convolutions(op):
    assert ask(policies.dots_saveable, op) is True
    assert policies.checkpoint_dots is policies.dots_saveable


@pytest.mark.parametrize("op", ELEMENTWISE, ids=str)
def test_dots_policies_recompute_elementwise(op):
    assert ask(policies.dots_saveable, op) is False
    assert ask(policies.dots_with_no_batch_dims_saveable, op) is False


def test_dots_saveable_recomputes_names():
    op, kw = named("h")
    assert policies.dots_saveable(op, torch.ones(1), **kw) is False


@pytest.mark.parametrize("op", NO_BATCH_DOTS, ids=str)
def test_dots_with_no_batch_dims_saves_unbatched_products(op):
    assert ask(policies.dots_with_no_batch_dims_saveable, op) is True
    assert policies.checkpoint_dots_with_no_batch_dims is policies.dots_with_no_batch_dims_saveable


@pytest.mark.parametrize("op", BATCH_DOTS + CONVS, ids=str)
def test_dots_with_no_batch_dims_recomputes_batched_products(op):
    assert ask(policies.dots_with_no_batch_dims_saveable, op) is False


# ---- name policies ---------------------------------------------------------------


def test_save_only_these_names():
    p = policies.save_only_these_names("a", "b")
    for n in ("a", "b"):
        op, kw = named(n)
        assert p(op, torch.ones(1), **kw) is True
    op, kw = named("c")
    assert p(op, torch.ones(1), **kw) is False
    for op in NO_BATCH_DOTS + ELEMENTWISE:
        assert ask(p, op) is False
    assert p.names == frozenset({"a", "b"})


def test_save_anything_except_these_names():
    p = policies.save_anything_except_these_names("a")
    op, kw = named("a")
    # the explicit Recompute (not False): the name drops the value even though the op that
    # computed it is saved (NOTE [names decide for the value] in _policies/core.py)
    assert p(op, torch.ones(1), **kw) is Recompute
    op, kw = named("b")
    assert p(op, torch.ones(1), **kw) is True
    for op in NO_BATCH_DOTS + ELEMENTWISE:
        assert ask(p, op) is True  # untagged values are saved


def test_save_any_names_but_these():
    p = policies.save_any_names_but_these("a")
    op, kw = named("a")
    assert p(op, torch.ones(1), **kw) is False
    op, kw = named("b")
    assert p(op, torch.ones(1), **kw) is True
    for op in NO_BATCH_DOTS + ELEMENTWISE:
        assert ask(p, op) is False  # untagged values are recomputed


def test_a_name_that_looks_like_an_op_is_still_a_name():
    # an op is never mistaken for a name, even when its kwargs carry a "name"
    p = policies.save_only_these_names("mm")
    assert p(aten.mm.default, torch.ones(1), name="mm") is False


@pytest.mark.parametrize("factory", [policies.save_only_these_names, policies.save_anything_except_these_names,
                                     policies.save_any_names_but_these])
def test_name_policies_reject_non_strings(factory):
    with pytest.raises(TypeError, match=rf"{factory.__name__}: names must be strings .* got 3 \(int\)"):
        factory("ok", 3)
    with pytest.raises(TypeError, match="names must be strings"):
        factory(["a", "b"])  # a list instead of *names


@pytest.mark.parametrize("factory", [policies.save_only_these_names, policies.save_anything_except_these_names,
                                     policies.save_any_names_but_these])
def test_name_policies_repr_and_equality(factory):
    p = factory("b", "a")
    assert repr(p) == f"{factory.__name__}('a', 'b')"
    assert p == factory("a", "b")
    assert hash(p) == hash(factory("a", "b", "a"))
    assert repr(factory()) == f"{factory.__name__}()"


def test_save_and_offload_only_these_names():
    p = policies.save_and_offload_only_these_names(
        names_which_can_be_saved=["s"], names_which_can_be_offloaded=("o",), offload_src="cuda", offload_dst="cpu")
    op, kw = named("s")
    assert p(op, torch.ones(1), **kw) is Saveable
    op, kw = named("o")
    assert p(op, torch.ones(1), **kw) == Offloadable("cuda", "cpu")
    op, kw = named("other")
    assert p(op, torch.ones(1), **kw) is Recompute
    assert ask(p, aten.mm.default) is Recompute
    assert repr(p) == "save_and_offload_only_these_names(saved=['s'], offloaded=['o'], 'cuda' -> 'cpu')"


def test_save_and_offload_only_these_names_validation():
    with pytest.raises(ValueError, match=r"names \['a'\] are both saved and offloaded; pick one"):
        policies.save_and_offload_only_these_names(names_which_can_be_saved=["a", "b"],
                                                   names_which_can_be_offloaded=["a"])
    with pytest.raises(TypeError, match="names must be strings"):
        policies.save_and_offload_only_these_names(names_which_can_be_saved=[1])
    with pytest.raises(ValueError, match="is not a device"):
        policies.save_and_offload_only_these_names(names_which_can_be_offloaded=["a"], offload_dst="nowhere")
    with pytest.raises(TypeError):
        policies.save_and_offload_only_these_names(["a"])  # keyword-only, like JAX


def test_offload_dot_with_no_batch_dims():
    p = policies.offload_dot_with_no_batch_dims("cuda", "cpu")
    for op in NO_BATCH_DOTS:
        assert ask(p, op) == Offloadable("cuda", "cpu")
    for op in BATCH_DOTS + ELEMENTWISE:
        assert ask(p, op) is Recompute
    with pytest.raises(ValueError, match="is not a device"):
        policies.offload_dot_with_no_batch_dims("cuda", "somewhere")


def test_offload_to_cpu():
    p = policies.offload_to_cpu()
    assert p.min_bytes == policies.DEFAULT_MIN_OFFLOAD_BYTES == 1 << 20
    assert ask(p, aten.sin.default) == Offloadable(None, "cpu", 1 << 20)
    assert ask(policies.offload_to_cpu(min_bytes=0, src="cuda"), aten.mm.default) == Offloadable("cuda", "cpu", 0)
    with pytest.raises(ValueError, match="min_bytes must be a non-negative int, got -1"):
        policies.offload_to_cpu(min_bytes=-1)


# ---- decisions ---------------------------------------------------------------------


def test_decision_reprs():
    assert repr(Saveable) == "Saveable"
    assert repr(Recompute) == "Recompute"
    assert repr(Offloadable("cuda", "cpu")) == "Offloadable(src='cuda', dst='cpu', min_bytes=0)"
    assert isinstance(Saveable, policies.Decision) and isinstance(Offloadable(), policies.Decision)


def test_offloadable_validation():
    assert Offloadable(None, "cpu").src is None
    assert Offloadable("cuda:1", "cpu", 10).min_bytes == 10
    with pytest.raises(ValueError, match="min_bytes must be a non-negative int, got -1"):
        Offloadable("cuda", "cpu", -1)
    with pytest.raises(ValueError, match="min_bytes must be a non-negative int, got 1.5"):
        Offloadable("cuda", "cpu", 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="src must be a device string such as 'cpu', got 3"):
        Offloadable(3, "cpu")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dst must be a device string"):
        Offloadable("cuda", None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dst='nowhere' is not a device"):
        Offloadable("cuda", "nowhere")
    with pytest.raises(AttributeError):  # frozen: decisions are values
        Offloadable().dst = "cuda"  # type: ignore[misc]


# ---- composition -------------------------------------------------------------------


def test_save_from_both_policies_saves_what_either_saves():
    names = policies.save_only_these_names("h")
    p = policies.save_from_both_policies(policies.dots_with_no_batch_dims_saveable, names)
    assert ask(p, aten.mm.default) is Saveable  # left saves
    op, kw = named("h")
    assert p(op, torch.ones(1), **kw) is Saveable  # right saves
    op, kw = named("g")
    assert p(op, torch.ones(1), **kw) is False  # neither saves: no reason to save (not an explicit drop)
    assert ask(p, aten.bmm.default) is False
    assert ask(p, aten.sin.default) is False
    assert repr(p) == "save_from_both_policies(dots_with_no_batch_dims_saveable, save_only_these_names('h'))"


def test_save_from_both_policies_keeps_an_explicit_recompute():
    p = policies.save_from_both_policies(policies.save_anything_except_these_names("a"), policies.nothing_saveable)
    op, kw = named("a")
    assert p(op, torch.ones(1), **kw) is Recompute  # the named value is dropped
    op, kw = named("b")
    assert p(op, torch.ones(1), **kw) is Saveable


def test_save_from_both_policies_offload_and_save_precedence():
    off = policies.offload_dot_with_no_batch_dims("cuda", "cpu")
    p = policies.save_from_both_policies(off, policies.everything_saveable)
    assert ask(p, aten.mm.default) is Saveable  # saving wins over offloading
    p = policies.save_from_both_policies(policies.nothing_saveable, off)
    assert ask(p, aten.mm.default) == Offloadable("cuda", "cpu")  # offloading wins over recomputing
    p = policies.save_from_both_policies(off, policies.nothing_saveable)
    assert ask(p, aten.mm.default) == Offloadable("cuda", "cpu")
    assert ask(p, aten.sin.default) is Recompute


def test_save_from_both_policies_nests_and_normalises_bools():
    p = policies.save_from_both_policies(
        policies.save_from_both_policies(policies.save_only_these_names("a"), policies.save_only_these_names("b")),
        lambda op, *a, **k: op is aten.sin.default,
    )
    for n, want in (("a", Saveable), ("b", Saveable), ("c", False)):
        op, kw = named(n)
        assert p(op, torch.ones(1), **kw) is want
    assert ask(p, aten.sin.default) is Saveable
    assert ask(p, aten.cos.default) is False


def test_save_from_both_policies_validation():
    # (a string is a shortcut's name, as at remat(policy=...): a misspelt one says which there are)
    with pytest.raises(ValueError, match=r"unknown policy 'dots'; use one of 'save-nothing'"):
        policies.save_from_both_policies("dots", policies.dots_saveable)
    with pytest.raises(TypeError, match=r"save_from_both_policies: 3 is not a policy; pass callables"):
        policies.save_from_both_policies(3, policies.dots_saveable)
    with pytest.raises(TypeError, match="is not a policy"):
        policies.save_from_both_policies(policies.dots_saveable, None)


def test_save_from_both_policies_reports_a_bad_inner_answer():
    from remat import RematError

    p = policies.save_from_both_policies(policies.nothing_saveable, lambda op, *a, **k: "yes")
    with pytest.raises(RematError, match=r"returned 'yes' for aten.mm.default; return True, False"):
        ask(p, aten.mm.default)


# ---- shortcuts and what the engine passes --------------------------------------------


@pytest.mark.parametrize("string,policy", [
    ("save-nothing", policies.nothing_saveable),
    ("save-everything", policies.everything_saveable),
    ("save-matmuls", policies.dots_saveable),
    ("offload-to-cpu", policies.offload_to_cpu()),
    (None, policies.nothing_saveable),
])
def test_string_shortcuts(string, policy):
    assert remat(torch.sin, policy=string).policy == policy


def test_unknown_shortcut_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown policy 'save_matmuls'; use one of 'save-nothing', "
                                         r"'save-everything', 'save-matmuls', 'offload-to-cpu'"):
        remat(torch.sin, policy="save_matmuls")


def test_a_policy_sees_every_aten_op_and_every_name():
    seen: list[tuple[object, dict]] = []

    def spy(op, *args, **kwargs):
        seen.append((op, kwargs))
        return False

    def f(W, x):
        h = checkpoint_name(torch.mm(x, W), "pre")
        return torch.sin(h).sum()

    W = torch.randn(3, 3, requires_grad=True)
    remat(f, policy=spy)(W, torch.randn(2, 3)).backward()
    ops = [op for op, _ in seen]
    assert ops == [aten.mm.default, checkpoint_name, aten.sin.default, aten.sum.default]
    assert seen[1][1] == {"name": "pre"}
    assert all(isinstance(op, torch._ops.OpOverload) for op in ops if op is not checkpoint_name)
    # asked in the forward pass only: the backward's recompute does not ask again
    assert len(seen) == 4


def test_a_users_policy_is_asked_on_every_call_and_op_only_policies_answer_as_asked():
    """The tracer asks a policy whose answer depends on the op alone (the fixed and name policies) once per op and
    reuses the answer; a user's callable, which may read the arguments or its own state, is asked every time."""
    from remat._policies.core import op_only

    assert op_only(policies.dots_saveable) and op_only(policies.everything_saveable)
    assert op_only(policies.save_only_these_names("h"))
    assert op_only(policies.save_from_both_policies(policies.dots_saveable, policies.save_any_names_but_these("h")))
    assert not op_only(policies.dots_with_no_batch_dims_saveable)  # (reads the arguments' shapes)
    assert not op_only(policies.offload_to_cpu())
    assert not op_only(policies.save_from_both_policies(policies.dots_saveable, policies.offload_to_cpu()))
    assert not op_only(lambda op, *a, **k: True)

    class Mine(policies.save_only_these_names):  # (a subclass may answer otherwise: asked every time)
        def __call__(self, op, *args, **kwargs):
            return flips(op, *args, **kwargs)

    assert not op_only(Mine("h"))
    state = {"save": True}
    asked = []

    def flips(op, *args, **kwargs):
        asked.append(op)
        return state["save"] if op is aten.mm.default else False

    def f(W, x):
        return torch.mm(x, W).sin().sum()

    def recomputed_mm(g, W, x):
        """The matmuls the backward pass ran beyond plain autograd's (counted from outside remat), and the gradient."""
        loss = g(W, x)
        with OpCounter({aten.mm.default}) as c:
            (gW,) = torch.autograd.grad(loss, W)
        plain_loss = f(W, x)
        with OpCounter({aten.mm.default}) as plain:
            (want,) = torch.autograd.grad(plain_loss, W)
        assert torch.equal(gW, want)
        return c.count - plain.count

    W, x = torch.randn(3, 3, dtype=torch.float64, requires_grad=True), torch.randn(2, 3, dtype=torch.float64)
    for policy in (flips, Mine("h")):
        g = remat(f, policy=policy)
        for save in (True, False, True, False):
            state["save"] = save
            asked.clear()
            assert recomputed_mm(g, W, x) == (0 if save else 1), (policy, save)
            assert len(asked) == 3  # (mm, sin, sum: every op of every call)
    for policy in (policies.dots_saveable, policies.save_from_both_policies(policies.dots_saveable,
                                                                           policies.save_only_these_names("h")),
                   policies.save_only_these_names("h"), policies.everything_saveable):
        g = remat(f, policy=policy)
        for _ in range(3):
            assert recomputed_mm(g, W, x) == (1 if type(policy) is policies.save_only_these_names else 0), policy


def test_a_policy_gets_the_op_arguments():
    shapes = []

    def spy(op, *args, **kwargs):
        if op is aten.mm.default:
            shapes.append([tuple(a.shape) for a in args])
        return True

    remat(lambda a, b: a @ b, policy=spy)(torch.ones(2, 3, requires_grad=True), torch.ones(3, 4))
    assert shapes == [[(2, 3), (3, 4)]]


EINSUMS = [  # (equation, operand shapes, has batch dimensions in JAX's dot_general terms)
    ("ij,jk->ik", [(5, 4), (4, 3)], False),
    ("ij,kj->ik", [(5, 4), (3, 4)], False),
    ("ij,j->i", [(5, 4), (4,)], False),
    ("i,i->", [(4,), (4,)], False),
    ("bij,bjk->bik", [(2, 5, 4), (2, 4, 3)], True),
    ("bij,bjk->bik", [(1, 5, 4), (1, 4, 3)], True),  # a batch of one is still a batch
    ("ij,ij->i", [(5, 4), (5, 4)], True),
]


@pytest.mark.parametrize("eq,shapes,batched", EINSUMS, ids=[f"{e}-{s[0][0]}" for e, s, _ in EINSUMS])
def test_einsum_contractions_are_classified_by_their_batch_dims(eq, shapes, batched):
    """einsum lowers every contraction to bmm; the policy decides on the contraction (JAX's dimension numbers)."""
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]

    def f(*a):
        return torch.einsum(eq, *a).sin().sum()

    want = torch.autograd.grad(f(*args), args)
    for pol, kept_as in ((policies.dots_with_no_batch_dims_saveable, "kept"),
                         (policies.offload_dot_with_no_batch_dims(None, "cpu"), "offloaded")):
        dots = [r for r in saved_residuals(remat(f, policy=pol), *args) if r.op and "bmm" in r.op]
        assert len(dots) == 1, dots
        assert dots[0].decision == ("recomputed" if batched else kept_as), dots
        got = torch.autograd.grad(remat(f, policy=pol)(*args), args)
        for a, b in zip(got, want):
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("transform", ["jvp", "jacfwd", "hessian", "vmap(grad)"])
def test_a_policy_that_reads_its_arguments_values_is_exact_under_forward_ad(transform):
    """A policy may read what it is handed (keep an op's output when its input is large). Under forward AD
    (``jvp``, ``jacfwd``, ``hessian``) torch runs internal checks on "efficient zero tensors", which have no storage;
    handed one, such a policy crashed the process (a segmentation fault). Those ops, whose outputs are meta tensors,
    are not the policy's: the policy's answers on the function's ops, and the gradients, are plain's."""
    asked = []

    def reads_values(op, *args, **kwargs):
        for t in args:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0:
                asked.append(op)
                return bool(t.abs().sum() > 10)
        return False

    def f(x):
        return (x * x.detach()).sin().sum(-1)

    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    F = torch.func
    run = {
        "jvp": lambda g: F.jvp(g, (x,), (x,))[1],
        "jacfwd": lambda g: F.jacfwd(g)(x),
        "hessian": lambda g: F.hessian(lambda y: g(y).sum())(x),
        "vmap(grad)": lambda g: F.vmap(F.grad(lambda y: g(y).sum()))(x),
    }[transform]
    for _ in range(2):
        assert torch.allclose(run(remat(f, policy=reads_values)), run(f), rtol=1e-10, atol=1e-10)
    assert asked and torch.ops.aten.sin.default in asked


@pytest.mark.parametrize("duals", ["x", "W", "both"])
def test_a_policy_that_reads_its_arguments_values_is_exact_under_forward_ad_duals(duals):
    """The same under ``torch.autograd.forward_ad`` dual tensors, which take the replay engine's route (plain
    autograd's) rather than the full engine's: the policy was handed forward AD's meta-tensor checks there too, and
    the process crashed (a segmentation fault; a policy that skipped meta tensors raised on ``prims.mul``). The
    primal and the tangent are plain's, on three calls."""
    import torch.autograd.forward_ad as fwAD

    def reads_values(op, *args, **kwargs):
        for t in args:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0 and t.dim() >= 1:
                return bool(t.detach().abs().sum() > 3.0)
        return False

    def f(W, x):
        return torch.tanh((x * 1.5) @ W)

    g = remat(f, policy=reads_values)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        W = torch.randn(4, 4, dtype=torch.float64, generator=gen)
        x = torch.randn(3, 4, dtype=torch.float64, generator=gen)
        res = []
        for fn in (f, g):
            with fwAD.dual_level():
                a = fwAD.make_dual(W, torch.full_like(W, 0.2)) if duals in ("W", "both") else W
                b = fwAD.make_dual(x, torch.full_like(x, 0.3)) if duals in ("x", "both") else x
                p, t = fwAD.unpack_dual(fn(a, b))
                res.append((p.clone(), t.clone()))
        assert torch.allclose(res[0][0], res[1][0], rtol=1e-10, atol=1e-12)
        assert torch.allclose(res[0][1], res[1][1], rtol=1e-10, atol=1e-12)
