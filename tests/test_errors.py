"""Bad input and failures: each raises a teaching error, and leaves nothing of remat installed.

After every exception (bad arguments, a policy answering nonsense, a diverging or
failing recompute, an exception inside the function mid-forward, an input modified
in place) no saved-tensor hook, dispatch mode, functorch level or RNG state of
remat's is left behind: the ``clean_after`` fixture reads torch's own stacks, and
:func:`plain_autograd_still_works` runs an ordinary computation afterwards.

A recompute that diverges runs the function's Python again: the full engine
(``debug=True`` here; torch.func transforms too). Under plain autograd the replay
engine replays the forward pass's ATen ops instead and never runs the Python
again, so the same functions are exact there (:func:`replayed_exactly`).
"""

from __future__ import annotations

import pytest
import torch

import remat as api
from remat import RematError, checkpoint_name, policies, remat, saved_residuals

from .conftest import CLEAN, ambient_state
from .helpers import Counted, OpCounter, leaf

pytestmark = pytest.mark.usefixtures("clean_after")


def plain_autograd_still_works():
    """An ordinary computation afterwards: saved tensors are saved by autograd itself, not by remat."""
    assert ambient_state() == CLEAN
    x = leaf(4)
    y = x.sin()  # saves x
    assert y.grad_fn._saved_self is x  # no pack hook in between: autograd holds x itself
    (g,) = torch.autograd.grad(y.exp().sum(), x)
    torch.testing.assert_close(g, x.cos() * x.sin().exp(), rtol=1e-12, atol=1e-12)


def two_sins(x):
    return x.sin().sin()


def replayed_exactly(f, calls):
    """The replay engine (plain autograd, not debug): ``f``'s Python runs once per call, and the gradient is plain
    autograd's of what its forward pass computed (``calls``: ``f``'s call counter, set back to 0 before each)."""

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    x = leaf(3)
    calls[0] = 0
    (got,) = torch.autograd.grad(first(remat(f)(x)).sum(), x)
    assert calls[0] == 1
    calls[0] = 0
    (want,) = torch.autograd.grad(first(f(x)).sum(), x)
    assert torch.equal(got, want)
    plain_autograd_still_works()


# ---- bad arguments ------------------------------------------------------------------


@pytest.mark.parametrize("fn", [3, "f", torch.ones(2)])
def test_not_callable(fn):
    with pytest.raises(TypeError, match=r"remat: expected a function to wrap, got .* \(\w+\); write remat\(f, "):
        remat(fn)


def test_decorator_forms_still_check():
    with pytest.raises(TypeError, match="expected a function to wrap"):
        remat(policy="save-nothing")(42)
    assert remat(policy="save-matmuls")(two_sins).policy is policies.dots_saveable


def test_unknown_policy_string():
    with pytest.raises(ValueError, match=r"remat: unknown policy 'save-all'; use one of 'save-nothing', "
                                         r"'save-everything', 'save-matmuls', 'offload-to-cpu' or a callable"):
        remat(two_sins, policy="save-all")


@pytest.mark.parametrize("policy", [3, [policies.dots_saveable], policies.Saveable])
def test_policy_not_callable(policy):
    with pytest.raises(TypeError, match=r"remat: policy must be a callable policy\(op, \*args, \*\*kwargs\) or a "
                                        r"string, got .*; for example policy=remat.policies.dots_saveable"):
        remat(two_sins, policy=policy)


@pytest.mark.parametrize("bad", [1.5, "0", (0, "x"), True, [None]])
def test_static_argnums_type(bad):
    with pytest.raises(TypeError, match=r"remat: static_argnums must be an int or a sequence of ints, got "):
        remat(two_sins, static_argnums=bad)


@pytest.mark.parametrize("nums", [2, (0, 5), -3])
def test_static_argnums_out_of_range(nums):
    f = remat(lambda x, flag: x.sin() if flag else x.cos(), static_argnums=nums)
    with pytest.raises(ValueError, match=r"remat: static_argnums=\(.*\) names argument -?\d, but \S*<lambda> was "
                                         r"called with 2 positional arguments"):
        f(leaf(3), True)
    plain_autograd_still_works()


def test_static_argnums_work():
    f = Counted(lambda x, flag: x.sin().sin() if flag == "sin" else x.cos().cos())
    x = leaf(3)
    out = remat(f, static_argnums=1)(x, "sin")
    with OpCounter({torch.ops.aten.sin.default}) as replayed:
        (g,) = torch.autograd.grad(out.sum(), x)
    (g0,) = torch.autograd.grad(x.sin().sin().sum(), x)
    torch.testing.assert_close(g, g0, rtol=1e-12, atol=1e-12)
    assert f.calls == 1
    assert replayed.count == 1  # the recompute made x.sin() again (plain autograd's backward pass runs no sin)


def test_preserve_rng_state_type():
    with pytest.raises(TypeError, match="remat: preserve_rng_state must be True or False, got 'yes'"):
        remat(two_sins, preserve_rng_state="yes")


# ---- a policy answering nonsense -----------------------------------------------------


class _OwnDecision(policies.Decision):  # (a subclass of the user's: says nothing remat can act on)
    pass


@pytest.mark.parametrize("answer", [None, "save", 1, policies.dots_saveable, policies.Decision(), _OwnDecision()],
                         ids=["None", "str", "int", "policy", "Decision()", "subclass"])
def test_policy_returns_no_decision(answer):
    """(``Decision()`` and a user's subclass of it were taken for Saveable until the thirty-sixth session's review.)"""
    x = leaf(3)
    state = torch.get_rng_state()
    with pytest.raises(RematError, match=r"remat: policy <lambda> returned .* for aten.sin.default; return True, "
                                         r"False, remat.policies.Saveable, remat.policies.Recompute or "
                                         r"remat.policies.Offloadable\(src, dst\)"):
        remat(two_sins, policy=lambda op, *a, **k: answer)(x)
    assert torch.equal(state, torch.get_rng_state())
    plain_autograd_still_works()


def test_policy_returns_no_decision_for_a_name():
    def policy(op, *args, **kwargs):
        return "keep" if op is checkpoint_name else False

    with pytest.raises(RematError, match=r"policy policy returned 'keep' for checkpoint_name\('h'\); return True"):
        remat(lambda x: checkpoint_name(x.sin(), "h").sin(), policy=policy)(leaf(3))
    plain_autograd_still_works()


def test_policy_that_raises():
    """A bug in a policy is the policy's error, naming it and the op it was asked about, never an error of the user's
    op; the policy's own exception is its cause (with its traceback)."""
    def policy(op, *args, **kwargs):
        raise KeyError("policy bug")

    with pytest.raises(RematError, match=r"policy policy raised KeyError: 'policy bug' when asked about "
                                         r"aten\.sin\.default") as e:
        remat(two_sins, policy=policy)(leaf(3))
    assert isinstance(e.value.__cause__, KeyError)
    with pytest.raises(RematError, match="policy policy raised KeyError") as e:  # the re-run engine's call too
        remat(two_sins, policy=policy, debug=True)(leaf(3))
    with pytest.raises(RematError, match="policy policy raised KeyError"):  # and under torch.func
        torch.func.grad(lambda x: remat(two_sins, policy=policy)(x).sum())(leaf(3).detach())
    plain_autograd_still_works()


def test_an_uncalled_policy_factory_is_named_when_given():
    for factory in (policies.offload_to_cpu, policies.save_only_these_names):
        with pytest.raises(TypeError, match=rf"policy=remat\.policies\.{factory.__name__} is a policy factory, "
                                            rf"not a policy: call it, policy=remat\.policies\.{factory.__name__}\(\.\.\.\)"):
            remat(two_sins, policy=factory)
    plain_autograd_still_works()


def test_a_policy_of_the_wrong_signature_is_refused_when_given():
    with pytest.raises(TypeError, match=r"cannot be called as policy\(op, \*args, \*\*kwargs\).*def policy\(op, "):
        remat(two_sins, policy=lambda op: True)

    def sac_style(ctx, op, *args, **kwargs):
        return True

    with pytest.raises(TypeError, match=r"torch selective-checkpointing policy.*context_fn"):
        remat(two_sins, policy=sac_style)
    # what the signature check lets through: *args/**kwargs, defaults, policy objects
    remat(two_sins, policy=lambda op, *a, **k: False)(leaf(3)).sum().backward()
    remat(two_sins, policy=lambda op, *a, scale=1, **k: False)(leaf(3)).sum().backward()
    remat(two_sins, policy=policies.save_only_these_names("h"))(leaf(3)).sum().backward()


def test_an_iterator_argument_is_refused_at_the_call():
    def f(xs):
        return sum(x.sin() for x in xs)

    gen = (leaf(3) for _ in range(2))
    with pytest.raises(TypeError, match=r"called with a generator \(an iterator\).*Pass a list or a tuple"):
        remat(f)(gen)
    with pytest.raises(TypeError, match=r"list_iterator \(an iterator\)"):
        remat(f)(iter([leaf(3)]))
    remat(f)([leaf(3), leaf(3)]).sum().backward()  # a list is fine
    plain_autograd_still_works()


# ---- the recompute diverges ---------------------------------------------------------


def test_recompute_runs_another_op():
    calls = [0]

    def f(x):
        calls[0] += 1  # global state: the recompute takes the other branch
        return x.sin().sin() if calls[0] == 1 else x.cos().sin()

    out = remat(f, debug=True)(leaf(3))
    with pytest.raises(RematError, match=r"the recompute of f diverged from its forward pass: op #0 was "
                                         r"aten.sin.default -> \[3\] float64 in the forward pass but "
                                         r"aten.cos.default now. The wrapped function must run the same ops"):
        out.sum().backward()
    plain_autograd_still_works()
    replayed_exactly(f, calls)


def test_recompute_computes_another_shape():
    calls = [0]

    def f(x):
        calls[0] += 1
        return torch.cat([x] * calls[0]).sin().sin().sum()

    out = remat(f, debug=True)(leaf(3))
    # (NOTE [same reads]: the op's arguments differ before its output does: two tensors to concatenate, not one)
    with pytest.raises(RematError, match=r"the recompute of f diverged .*: op #0 aten.cat.default read other values "
                                         r"than in the forward pass: argument #0 is \[argument #0 of the call .*, "
                                         r"argument #0 of the call .*\] in the recompute but \[argument #0 of the "
                                         r"call .*\] in the forward pass"):
        out.backward()
    plain_autograd_still_works()
    replayed_exactly(f, calls)


def test_recompute_runs_more_ops():
    calls = [0]

    def f(x):
        calls[0] += 1
        y = x.sin().sin()
        return y.exp().exp() if calls[0] > 1 else y

    out = remat(f, debug=True)(leaf(3))
    with pytest.raises(RematError, match=r"diverged from its forward pass: it ran aten.exp.default after the 2 ops "
                                         r"of the forward pass"):
        out.sum().backward()
    plain_autograd_still_works()
    replayed_exactly(f, calls)


def test_recompute_runs_fewer_ops():
    calls = [0]

    def f(x):
        calls[0] += 1
        y = x.sin().sin()
        return (y.exp() if calls[0] == 1 else y), y  # the dropped tensors are all read by then

    y, _ = remat(f, debug=True)(leaf(3))
    with pytest.raises(RematError, match=r"diverged from its forward pass: it stopped after 2 ops; the forward "
                                         r"pass went on with aten.exp.default"):
        y.sum().backward()
    plain_autograd_still_works()
    replayed_exactly(f, calls)


def test_exception_raised_in_the_recompute():
    calls = [0]

    def f(x):
        calls[0] += 1
        if calls[0] > 1:
            raise KeyError("only in the recompute")
        return x.sin().sin()

    x = leaf(3)
    out = remat(f, debug=True)(x)
    state = torch.get_rng_state()
    torch.rand(3)
    state = torch.get_rng_state()
    with pytest.raises(KeyError, match="only in the recompute"):
        out.sum().backward()
    assert torch.equal(state, torch.get_rng_state())  # the forward's RNG state was restored only inside
    plain_autograd_still_works()
    replayed_exactly(f, calls)


def test_exception_raised_mid_forward():
    def f(x):
        x.sin().exp()  # saves, records ops, then fails
        torch.rand(2)
        raise ValueError("boom in f")

    x = leaf(3)
    with pytest.raises(ValueError, match="boom in f"):
        remat(f)(x)
    plain_autograd_still_works()
    # the same remat'd function works afterwards
    g = remat(f, policy="save-nothing").__wrapped__
    assert g is f
    h = remat(two_sins)
    (gx,) = torch.autograd.grad(h(x).sum(), x)
    torch.testing.assert_close(gx, x.cos() * x.sin().cos(), rtol=1e-12, atol=1e-12)


def test_exception_mid_forward_of_a_nested_call():
    def inner(x):
        raise RuntimeError("inner failed")

    ri = remat(inner)
    with pytest.raises(RuntimeError, match="inner failed"):
        remat(lambda x: ri(x.sin()).sin())(leaf(3))
    plain_autograd_still_works()


# ---- in-place modification ------------------------------------------------------------


def test_input_modified_in_place_before_the_backward():
    x = leaf(3)
    inp = x * 1
    out = remat(two_sins)(inp)
    inp.add_(1)
    with pytest.raises(RematError, match=r"remat: input #0 \(shape \[3\], float64\) of two_sins was modified in "
                                         r"place after its forward pass and before its backward pass; the recompute "
                                         r"would read the new value. Clone it"):
        out.sum().backward()
    plain_autograd_still_works()


def test_a_saved_output_written_in_the_forward_pass_names_the_version_it_moved_to():
    """``tanh_`` saves its output, which ``add_`` then writes: the message gives the versions as plain autograd
    would see them (it said "1 -> -1" once the tensor was gone, -1 being remat's own placeholder)."""
    W = leaf(4, 4)

    def f(x):
        h = x @ W
        h.tanh_()
        h.add_(1)
        return h.sin()

    out = remat(f)(leaf(2, 4))
    with pytest.raises(RematError, match=r"modified a tensor \(shape \[2, 4\].*\(version 1 -> 2\)"):
        out.sum().backward()
    plain_autograd_still_works()


def test_kept_input_modified_in_place_before_the_backward():
    x = leaf(3)
    inp = x * 1
    out = remat(lambda t: t.sin(), policy="save-everything")(inp)
    inp.mul_(2)
    with pytest.raises(RematError, match=r"a tensor of shape \[3\] that \S*<lambda> saved for the backward pass was "
                                         r"modified in place after it was saved \(version 0 -> 1\)"):
        out.sum().backward()
    plain_autograd_still_works()


def test_input_modified_in_place_inside_the_function():
    """The full engine (``debug=True``), whose recompute would read the modified input, raises; the replay engine
    writes the input once, as plain autograd does, and gives plain autograd's gradient."""

    def f(x):
        x.mul_(2)
        return x.sin().sin()

    with pytest.raises(RematError, match=r"f modified its input #0 \(shape \[3\], float64\) in place during its "
                                         r"forward pass; .* Clone the input inside the function"):
        remat(f, debug=True)(leaf(3) * 1)
    plain_autograd_still_works()
    x = leaf(3)
    inp = x * 1
    (got,) = torch.autograd.grad(remat(f)(inp).sum(), x)
    assert torch.equal(inp, x.detach() * 2)  # written once
    inp = x * 1
    (want,) = torch.autograd.grad(f(inp).sum(), x)
    assert torch.equal(got, want)
    plain_autograd_still_works()


def test_checkpoint_name_needs_a_string():
    with pytest.raises(TypeError, match=r"checkpoint_name: name must be a string, got 3 \(int\)"):
        checkpoint_name(torch.ones(1), 3)  # type: ignore[arg-type]


# ---- misuse that raised from inside remat or from torch, or did nothing without a word --------------------------


def test_unremat_module_of_something_else_names_the_mistake():
    with pytest.raises(TypeError, match=r"unremat_module: expected the torch.nn.Module.*got 'hello' \(str\)"):
        api.unremat_module("hello")


def test_device_model_probe_without_cuda_says_what_to_do():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: probe measures it")
    with pytest.raises(ValueError, match=r"no CUDA device here.*DeviceModel\(flops=\.\.\., d2h=\.\.\., h2d=\.\.\.\)"):
        api.DeviceModel.probe()


def test_memory_budget_above_one_suggests_what_is_accepted():
    with pytest.raises(ValueError, match=r"must lie in \[0, 1\], got 1.5: memory_budget\(1.0\) keeps everything"):
        policies.memory_budget(1.5)
    policies.memory_budget(1.0)  # what it suggests is accepted
    policies.memory_budget(512 * 2**20)


def test_a_selector_that_matches_nothing_says_so():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    with pytest.warns(UserWarning, match=r"Conv2d'> selects no submodule of Sequential, so nothing is remat'd"):
        assert api.remat_modules(model, torch.nn.Conv2d) == []
    with pytest.warns(UserWarning, match="selects no submodule"):
        api.remat_modules(model, lambda name, m: False)


def test_an_offload_to_the_device_the_tensors_are_on_says_so_once():
    from remat.offload import OffloadEngine, use_engine

    f = remat(lambda x: x.sin().exp().sum(), policy=policies.offload_to_cpu(min_bytes=0))
    x = leaf(64)
    with use_engine(OffloadEngine()), pytest.warns(UserWarning, match=r"moves tensors from cpu to cpu.*frees no "
                                                                       r"memory.*save-nothing"):
        f(x).backward()
    import warnings

    with use_engine(OffloadEngine()), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        eng_calls = [f(x).backward() for _ in range(3)]
    assert len(eng_calls) == 3
    assert sum("frees no memory" in str(w.message) for w in seen) == 1  # once per engine


def test_more_segments_than_blocks_says_so():
    blocks = [torch.nn.Linear(4, 4) for _ in range(4)]
    with pytest.warns(UserWarning, match=r"segments=10 over 4 blocks.*runs as segments=4"):
        api.sequential(blocks, segments=10)


@pytest.mark.parametrize("policy", [
    "save-nothing", "save-everything", "save-matmuls", policies.save_only_these_names("h"),
    policies.save_from_both_policies(policies.dots_saveable, policies.save_only_these_names("h")),
    policies.offload_to_cpu(min_bytes=0), policies.offload_dot_with_no_batch_dims("cpu", "cpu"),
    policies.memory_budget(0.3), policies.memory_budget(0.3, offload=api.DeviceModel.h200()),
], ids=lambda p: getattr(p, "__name__", str(p)))
def test_every_policy_pickles_after_it_ran(policy):
    import io
    import pickle
    import warnings

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    api.remat_module(model, policy=policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (an offload to the CPU says once that it frees nothing there)
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
        copy = pickle.loads(pickle.dumps(model))
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        x = torch.randn(2, 4)
        for m in (copy, loaded):
            torch.testing.assert_close(m(x), model(x))
            m(x).sum().backward()


class _InferenceBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        with torch.inference_mode():
            self.register_buffer("b", torch.randn(4))

    def forward(self, x):
        return (self.lin(x) + self.b).tanh().sum()


@pytest.mark.parametrize("route", ["backward", "debug", "budget", "grad"])
@pytest.mark.parametrize("where", ["input", "global", "buffer"])
def test_an_inference_tensor_says_how_to_fix_it(where, route):
    """A tensor made under ``torch.inference_mode()`` has no version counter, which every route reads (it was torch's
    "Inference tensors do not track version counter." from remat's internals before the twenty-seventh session)."""
    with torch.inference_mode():
        inf = torch.randn(4, 4)
    w = leaf(4, 4)
    kw = {"debug": True} if route == "debug" else {"policy": policies.memory_budget(0.5)} if route == "budget" else {}
    if where == "buffer":
        m = api.remat_module(_InferenceBuffer(), **kw)  # (float32: .double() would copy the buffer out of inference)
        w = torch.randn(4, 4, requires_grad=True)
        params = dict(m.named_parameters())
        run = (lambda: torch.func.grad(lambda p: torch.func.functional_call(m, p, (w.detach(),)))(params)) \
            if route == "grad" else (lambda: m(w).backward())
    else:
        f = remat((lambda w, x: (w + x).tanh().sum()) if where == "input" else (lambda w, x: (w + inf).tanh().sum()),
                  **kw)
        x = inf if where == "input" else torch.randn(4, 4)
        run = (lambda: torch.func.grad(f)(w.detach(), x)) if route == "grad" else (lambda: f(w, x).backward())
    with pytest.raises(RematError, match=r"torch\.inference_mode\(\).*torch\.no_grad\(\) instead"):
        run()
    plain_autograd_still_works()


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)

    def forward(self, x):
        return x + self.a(x)


@pytest.mark.parametrize("call, error, message", [
    (lambda: api.remat_modules(lambda x: x, _Block), TypeError, r"root must be an nn\.Module .* remat\(f, policy"),
    (lambda: api.remat_modules(torch.nn.Sequential(_Block()), _Block()), TypeError,
     r"where=_Block\(\.\.\.\) is a module instance; pass its class, where=_Block"),
    (lambda: api.sequential(_Block()), TypeError, r"blocks must be a sequence of blocks .* got one _Block"),
    (lambda: api.checkpoint_sequential(_Block(), 1, torch.randn(2, 4)), TypeError,
     r"functions must be an nn\.Sequential or a list of functions, got one _Block"),
    (lambda: remat(lambda x: x.sin().sum(), policy=policies.memory_budget), TypeError,
     r"policy=remat\.policies\.memory_budget is a policy factory, not a policy: call it"),
    (lambda: api.route_torch_checkpoint(policy="save_matmuls"), ValueError, r"unknown policy 'save_matmuls'"),
    (lambda: api.route_torch_checkpoint(policy=torch.nn.Linear(2, 2)), TypeError,
     r"policy=Linear\(\.\.\.\) is a module, not a policy"),
    (lambda: api.checkpoint(lambda x: x.sin(), leaf(2), use_reentrant="no"), TypeError,
     r"use_reentrant must be False \(or left out\), got 'no'"),
    (lambda: policies.save_and_offload_only_these_names(names_which_can_be_saved="attn"), TypeError,
     r"names_which_can_be_saved='attn' is one string; pass a list of names: names_which_can_be_saved=\['attn'\]"),
    (lambda: policies.save_from_both_policies(policies.save_only_these_names, policies.dots_saveable), TypeError,
     r"policy=remat\.policies\.save_only_these_names is a policy factory, not a policy: call it"),
    (lambda: policies.Offloadable("cpu", "meta"), ValueError, r"dst='meta' holds no data.*offload to 'cpu'"),
], ids=["remat_modules-function", "remat_modules-instance", "sequential-module", "checkpoint_sequential-module",
        "memory_budget-uncalled", "route-unknown-policy", "route-module-policy", "checkpoint-use_reentrant",
        "names-one-string", "both-uncalled-factory", "offload-to-meta"])
def test_a_misused_helper_says_what_to_pass(call, error, message):
    """Each was a raw error from deep inside (AttributeError, the block's own forward signature, "object is not
    iterable"), or came at the first training step (routing), or gave a wrong hint (memory_budget), before the
    twenty-seventh session."""
    with pytest.raises(error, match=message):
        call()
    plain_autograd_still_works()


def test_a_generator_function_is_refused_at_once():
    """Its ops would run when the caller iterates, outside remat: nothing would be rematerialized."""

    def gen(w, x):
        for _ in range(3):
            x = (x @ w).tanh()
            yield x

    with pytest.raises(TypeError, match="gen is a generator .* nothing would be rematerialized"):
        remat(gen)


def test_a_measuring_call_that_writes_its_input_after_reading_it_is_exact_or_names_its_route():
    """Under plain autograd a memory budget's first call runs on the replay engine (since the thirty-seventh session;
    its full engine refused this): plain autograd's gradient. With ``debug=True`` the full engine's refusal names the
    route the call took, not torch.func or the budget."""
    w = leaf(4, 4)

    def f(w, x):
        y = (x + w).tanh()
        x.add_(1)
        return y.sum()

    x0 = leaf(4, 4).detach()
    (want,) = torch.autograd.grad(f(w, x0.clone()), w)
    (got,) = torch.autograd.grad(remat(f, policy=policies.memory_budget(0.3))(w, x0.clone()), w)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(RematError, match="with debug=True, .* without debug=True"):
        remat(f, policy=policies.memory_budget(0.3), debug=True)(w, x0.clone())
    plain_autograd_still_works()


@pytest.mark.parametrize("how", ["budget", "debug"])
@pytest.mark.parametrize("case", ["relu", "sigmoid", "as_strided"])
def test_a_saved_result_written_between_the_passes_raises_on_the_re_run_too(how: str, case: str) -> None:
    """A memory budget's first call and ``debug=True`` re-run the function; a result an op saved (``relu``'s,
    ``sigmoid``'s, or ``relu_``'s through an ``as_strided`` view of the returned tensor), written by the caller
    between the passes, gave a gradient from the values before the write there, where plain autograd refuses (and
    the replay of later calls raised). Now every call raises, as plain autograd does."""
    W = leaf(4, 6)

    def f(x):
        if case == "relu":
            return torch.relu(x @ W)
        if case == "sigmoid":
            return (x @ W).sigmoid()
        v = (x @ W).clone()
        v.as_strided((2, 3), (6, 2), 1).relu_()
        return v.view(-1)

    g = remat(f, policy=policies.memory_budget(0.5)) if how == "budget" else remat(f, policy="save-nothing", debug=True)
    for call in range(3):
        x = leaf(4, 4, seed=call)
        for fn in (f, g):
            out = fn(x)
            with torch.no_grad():
                out.add_(1)
            with pytest.raises(RuntimeError, match="modified (by an inplace operation|in place after)"):
                torch.autograd.grad(out.sum(), x)
    plain_autograd_still_works()


@pytest.mark.parametrize("wrap", [{"policy": "save-nothing"}, {"policy": "save-everything"}, {"debug": True},
                                  {"policy": "save-matmuls"}])
def test_a_write_allowed_by_allow_mutation_on_saved_tensors_is_named(wrap: dict) -> None:
    """Under ``torch.autograd.graph.allow_mutation_on_saved_tensors()`` a write into a saved tensor is legal (the
    context clones it first, through saved-tensor hooks that remat's replace): remat refuses it, saying so, not
    "plain autograd raises here too"; without the context the message is the usual one."""
    def f(x: torch.Tensor, W1: torch.Tensor, W2: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ W1)
        y = h @ W2
        h.mul_(3)
        return y.sin() + h.sum()

    args = [torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in [(5, 4), (4, 6), (6, 3)]]
    with torch.autograd.graph.allow_mutation_on_saved_tensors():
        f(*args).pow(2).sum().backward()  # (plain autograd: legal)
        with pytest.raises(RematError, match="allow_mutation_on_saved_tensors.*Clone it before writing it"):
            remat(f, **wrap)(*args).pow(2).sum().backward()
    with pytest.raises((RematError, RuntimeError)) as e:
        remat(f, **wrap)(*args).pow(2).sum().backward()
    assert "allow_mutation_on_saved_tensors" not in str(e.value)


def test_a_policy_combination_takes_shortcuts_by_name():
    """``save_from_both_policies`` resolves its sides as ``remat(policy=...)`` does: a shortcut is its policy."""
    both = policies.save_from_both_policies("save-matmuls", policies.save_only_these_names("h"))
    assert both.left is policies.dots_saveable
    assert both(torch.ops.aten.mm.default) is policies.Saveable


@pytest.mark.parametrize("how", ["callable object", "function"])
def test_a_call_that_returns_a_generator_is_refused(how):
    """A callable object whose ``__call__`` is a generator function, or a function that returns a generator, is not
    known for one before the call: its ops would run when the caller iterates, outside remat."""

    class Stream:
        def __call__(self, w, x):
            for _ in range(3):
                x = (x @ w).tanh()
                yield x

    def returns_gen(w, x):
        return Stream()(w, x)

    f = remat(Stream() if how == "callable object" else returns_gen)
    with pytest.raises(TypeError, match="returned a generator: its body runs when it is iterated"):
        f(leaf(4, 4), leaf(2, 4).detach())
    plain_autograd_still_works()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a process that sees no CUDA device")
def test_an_offload_to_cuda_without_cuda_says_so():
    """A policy written for a GPU machine, offloading to it, on a CPU-only process: a bare "Torch not compiled with
    CUDA enabled" before."""
    f = remat(lambda w, x: torch.sin(x @ w).sum(), policy=policies.offload_dot_with_no_batch_dims("cpu", "cuda"))
    with pytest.raises(RematError, match=r"to 'cuda', but this process sees no CUDA device.*offload to 'cpu'"):
        f(leaf(4, 4), leaf(3, 4).detach()).backward()
    plain_autograd_still_works()


def test_meta_inputs_with_debug():
    """Meta tensors under ``debug=True``: the re-run's fingerprint of a tensor built from data copied a meta tensor's
    bytes ("Cannot copy out of meta tensor"); plain autograd runs, and so does every route now."""
    m = torch.randn(3, 3, device="meta", requires_grad=True)
    for kw in ({}, {"debug": True}):
        out = remat(lambda x: (x @ x.T).tanh().sum(), policy="save-matmuls", **kw)(m)
        out.backward()
        assert out.device.type == "meta" and m.grad.shape == (3, 3)
        m.grad = None


@pytest.mark.parametrize("line", [0, 1, 2, 3])
def test_an_interrupt_entering_a_call_leaves_no_active_call(line):
    """A KeyboardInterrupt may land between a context variable's set and its ``try`` (CPython checks for signals after
    a C call returns): simulated at each line of ``activated`` up to its body, the next remat calls of any function
    work (before: every later call took the dead call for its enclosing one, "saved a tensor of shape ...")."""
    import sys

    import remat._context as rc

    code = rc.activated.__wrapped__.__code__
    seen = [0]

    def inject(frame, event, arg):
        if frame.f_code is not code:
            return None

        def local(frame, event, arg):
            if event == "line":
                if seen[0] == line:
                    sys.settrace(None)
                    raise KeyboardInterrupt("simulated")
                seen[0] += 1
            return local

        return local

    w = leaf(4, 4)
    sys.settrace(inject)
    try:
        with pytest.raises(KeyboardInterrupt):
            remat(lambda w: torch.sin(torch.tanh(w) @ w).sum())(w).backward()
    finally:
        sys.settrace(None)
    assert rc.ACTIVE.get() is None
    x = torch.randn(3, 4, dtype=torch.float64)
    w64 = leaf(4, 4).double()
    want = torch.autograd.grad((torch.tanh(x @ w64) @ w64).sum(), w64)[0]
    for policy in ("save-nothing", "save-matmuls"):
        got = torch.autograd.grad(remat(lambda w, x: (torch.tanh(x @ w) @ w).sum(), policy=policy)(w64, x), w64)[0]
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    plain_autograd_still_works()


@pytest.mark.parametrize("pol", [policies.dots_saveable, policies.nothing_saveable,
                                 policies.save_only_these_names("h"), policies.offload_to_cpu(),
                                 policies.memory_budget(0.5)], ids=lambda p: type(p).__name__)
def test_a_policy_passed_where_the_function_goes_is_refused(pol) -> None:
    """``remat(policies.dots_saveable)`` (meaning ``remat(policy=...)``) wrapped the policy as the function: calling it
    returned False, and ``@remat(policies.dots_saveable)`` turned the decorated function into False."""
    with pytest.raises(TypeError, match="is a policy, passed where the function to wrap goes"):
        remat(pol)


def test_the_policy_set_on_a_remat_function_is_resolved_as_remat_resolves_it() -> None:
    """``f.policy = "save-matmuls"`` is what ``remat(f, policy="save-matmuls")`` is; a bad one says so when set."""
    W = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 4, dtype=torch.float64)

    def body(W, x):
        return torch.tanh(x @ W).sum()

    f = remat(body)
    f.policy = "save-matmuls"
    assert f.policy is policies.dots_saveable
    kept = [r.op for r in saved_residuals(f, W, x) if r.decision == "kept" and r.op]
    assert kept == ["aten.mm.default"]
    torch.testing.assert_close(torch.autograd.grad(f(W, x), W)[0], torch.autograd.grad(body(W, x), W)[0])
    with pytest.raises(ValueError, match="unknown policy 'bogus'"):
        f.policy = "bogus"
    with pytest.raises(TypeError, match="got 3 \\(int\\)"):
        f.policy = 3


def test_errors_show_a_tensor_by_its_shape_not_its_values() -> None:
    with pytest.raises(TypeError, match=r"got a torch.float32 tensor of shape \[1000, 1000\] \(Tensor\)") as e:
        remat(policy="save-matmuls")(torch.zeros(1000, 1000))
    assert len(str(e.value)) < 300


def test_a_policy_answering_torchs_checkpoint_policy_is_told_what_remat_expects() -> None:
    from torch.utils.checkpoint import CheckpointPolicy

    def sac_style(op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE

    W = torch.randn(4, 4, requires_grad=True)
    with pytest.raises(RematError, match="That is torch's CheckpointPolicy.*create_selective_checkpoint_contexts"):
        remat(lambda W: torch.tanh(W @ W).sum(), policy=sac_style)(W)


def test_the_policy_set_on_remat_of_a_module_after_a_call_is_the_one_used() -> None:
    """``remat(module)`` keeps the call it makes of the module's forward: setting ``.policy`` after a call left that
    call's policy in force, silently."""
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    r = remat(m)
    x = torch.randn(4, 8)
    r(x).sum().backward()
    assert [row.decision for row in saved_residuals(r, x) if row.op] == ["recomputed"]
    r.policy = "save-everything"
    assert [row.decision for row in saved_residuals(r, x) if row.op] == ["kept"]


def test_debug_set_on_remat_of_a_module_after_a_call_is_the_one_used() -> None:
    runs = []

    class M(torch.nn.Module):
        def forward(self, x):
            runs.append(1)
            return torch.tanh(x).sum()

    r = remat(M())
    x = torch.randn(4, requires_grad=True)
    r(x).backward()
    r.debug = True  # (the re-run engine: the Python runs again in the backward pass)
    runs.clear()
    r(x).backward()
    assert len(runs) == 2


class _Box:  # (an object of a class no pytree knows: a leaf of the arguments, its tensors unseen)
    def __init__(self, t, w):
        self.t, self.w = t, w


def test_an_argument_object_holding_tensors_under_vjp_is_named_in_the_error() -> None:
    """A drop-in review (thirty-sixth session): ``remat.checkpoint(body, Box(x, w))`` under ``torch.func.vjp`` raised
    "saved 0 tensors ... pass them as arguments", which they are, inside an object remat does not look into. The
    error names its class and says how to pass them (a dataclass, a dict, or ``optree.register_pytree_node``);
    with a dict the call is exact."""
    W, X = leaf(6, 6, seed=1, grad=False), leaf(4, 6, seed=2, grad=False)

    def body(b):
        return (b.t @ b.w).sin() if isinstance(b, _Box) else (b["t"] @ b["w"]).sin()

    with pytest.raises(RematError, match=r"type _Box holds tensors.*optree\.register_pytree_node"):
        torch.func.vjp(lambda w: remat(body)(_Box(X, w)).sum(), W)[1](torch.tensor(1.0))
    want = torch.func.vjp(lambda w: body({"t": X, "w": w}).sum(), W)[1](torch.tensor(1.0))[0]
    got = torch.func.vjp(lambda w: remat(body)({"t": X, "w": w}).sum(), W)[1](torch.tensor(1.0))[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    plain_autograd_still_works()


_SCALE: dict = {}


@pytest.mark.parametrize("transform", ["vjp(jvp)", "jacrev(jacfwd)"])
def test_a_constant_of_an_ended_transform_read_from_a_dict_is_exact(transform) -> None:
    """A torch.func review (thirty-sixth session): a constant made inside the transformed function and read from a
    dict (a mask, a rotary cache handed over as an attribute) under reverse-over-forward: the inner transform has
    ended when the outer one's backward pass recomputes, and torch's "INTERNAL ASSERT FAILED ... level <=
    current_level" came out; a ``RematError`` said to pass it as an argument. Since the thirty-eighth session the
    replay reads it without the ended layers, as functorch reads such a wrapper: exact (one with history at the ended
    level raises: ``tests/test_program_replay.py``)."""
    def body(w, x, c=None):
        return torch.sin(x * (_SCALE["c"] if c is None else c)) @ w

    def run(blk, as_arg):
        w, x = leaf(4, 4, seed=5, grad=False), leaf(3, 4, seed=6, grad=False)

        def fwd(w):
            c = torch.linspace(-1, 1, 4, dtype=w.dtype) + 0.25
            _SCALE["c"] = c  # (a global dict: in a closure's, the call finds it)
            return blk(w, x, c) if as_arg else blk(w, x)

        if transform == "vjp(jvp)":
            out, fn = torch.func.vjp(lambda w: torch.func.jvp(fwd, (w,), (torch.ones_like(w),))[1], w)
            return fn(torch.ones_like(out))[0]
        return torch.func.jacrev(torch.func.jacfwd(lambda w: fwd(w).sum()))(w)

    torch.testing.assert_close(run(remat(body), as_arg=False), run(body, as_arg=False), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(run(remat(body), as_arg=True), run(body, as_arg=True), rtol=1e-12, atol=1e-12)
    plain_autograd_still_works()


def test_a_module_handed_to_checkpoint_is_named_by_its_class_in_errors() -> None:
    """A drop-in review (thirty-sixth session): ``remat.checkpoint(module, x)`` named the module
    ``Module._wrapped_call_impl`` in every message."""
    seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()).double()
    x = leaf(3, 4) * 1
    y = api.checkpoint(seq, x, use_reentrant=False)
    x.mul_(2)
    with pytest.raises(RematError, match=r"of Sequential was modified in place") as e:
        y.sum().backward()
    assert "_wrapped_call_impl" not in str(e.value)


class _KeepProducts:  # (a policy object holding its answers: module level, so that it pickles)
    def __init__(self):
        self.keep, self.drop = policies.Saveable, policies.Recompute

    def __call__(self, op, *args, **kwargs):
        return self.keep if op is torch.ops.aten.mm.default else self.drop


def test_a_copied_or_unpickled_decision_is_the_decision() -> None:
    """The review of this session's fixes (thirty-sixth): answers are told apart by identity, so a policy object
    holding ``Saveable`` / ``Recompute``, deep-copied with its model or saved and loaded, answered copies, which the
    new check of answers refused (and a copy of ``Recompute`` would have kept what it drops). They come back as the
    one object; the gradient is plain autograd's and the product is not run again."""
    import copy
    import pickle

    assert copy.deepcopy(policies.Saveable) is policies.Saveable
    assert pickle.loads(pickle.dumps(policies.Recompute)) is policies.Recompute

    pol = pickle.loads(pickle.dumps(copy.deepcopy(_KeepProducts())))
    W = leaf(4, 4)
    f = remat(lambda W: torch.tanh(W @ W).sum(), policy=pol)
    out = f(W)
    counter = OpCounter()
    with counter:
        (got,) = torch.autograd.grad(out, W)
    (want,) = torch.autograd.grad(torch.tanh(W @ W).sum(), W)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert counter.count == 2, counter.seen  # (the backward's two products; the forward's is kept)
