"""PyTorch's own checkpoint tests, translated to ``remat``.

Sources: pytorch/pytorch ``test/test_utils.py`` (class ``TestCheckpoint``) and
``test/test_autograd.py`` (the checkpoint cases of ``TestAutograd``, and the classes
``TestNestedCheckpoint`` and ``TestSelectiveActivationCheckpoint``), read at pytorch/pytorch
commits 0025348e03d0 (test_utils.py) and 5c322af10e52 (test_autograd.py). Translated, not
copied: the same intent and, where sensible, the same shapes, with ``remat`` (non-reentrant
semantics) in place of ``torch.utils.checkpoint.checkpoint`` and remat policies in place of
selective-checkpoint contexts. Every case compares against the function without remat
(float64 to 1e-10, float32 bitwise where the recompute runs the same kernels); where
upstream counts recomputes or memory, these count ATen ops (``OpCounter``, ``OpLog``,
``FlopCounterMode``) and Python calls and measure memory from outside remat (``StorageCensus`` of
``tests/helpers.py`` on the CPU, the CUDA allocator's statistics on CUDA). Under plain autograd
remat's replay engine runs each call (remat/_engine/traced.py): its recompute replays the ATen
ops the forward pass recorded and runs the Python once per call; ``debug=True`` runs the full
engine, whose recompute runs the Python again (the cases about a recompute that diverges or
raises run there). Cases that fail
because of remat are ``xfail(strict=True)`` with the reason (none today); CUDA-only cases
skip without a GPU.

test/test_utils.py, TestCheckpoint (18 cases)
    test_checkpoint_trigger: ported as test_trigger_recomputes_each_rematted_module_once
        (the first five of ten counting modules remat'd as one segment; checkpoint_sequential
        itself not: remat has no checkpoint_sequential).
    test_checkpoint_valid: ported as test_grad_with_create_graph_through_rematted_segments
        (the use_reentrant=True error not: remat has no reentrant mode).
    test_checkpoint: ported as test_segments_match_plain[*-sequential].
    test_checkpoint_module_list: ported as test_segments_match_plain[*-module_list].
    test_checkpoint_sequential_deprecated_multiple_args: not ported: tests
        checkpoint_sequential's argument checking; remat has no checkpoint_sequential.
    test_checkpoint_sequential_deprecated_no_args: not ported: same reason.
    test_checkpoint_rng_cpu: ported as test_dropout_sees_the_same_random_numbers_in_the_recompute[cpu].
    test_checkpoint_rng_gpu: ported as test_dropout_sees_the_same_random_numbers_in_the_recompute[cuda].
    test_checkpoint_not_preserve_rng_state_and_without_reentrant: ported as
        test_dropout_without_preserving_rng_state (CPU and CUDA).
    test_checkpoint_non_tensor: ported as test_none_argument.
    test_checkpoint_non_tensor_inputs_outputs: ported as test_non_tensor_inputs_and_outputs
        (upstream's "backward through the graph a second time" error belongs to the reentrant
        engine; here the extra backward must behave as it does without remat).
    test_checkpoint_no_tensors: ported as test_only_python_numbers.
    test_checkpoint_partial_grad: ported as test_gradient_of_one_output_and_outputs_without_grad
        (the reentrant-only "none of output has requires_grad=True" error becomes: the same
        error as without remat).
    test_checkpointing_without_reentrant_early_free: ported as test_backward_frees_buffers_as_it_goes
        (CPU with the census, CUDA with the allocator as upstream).
    test_get_device_states_recursive: ported as test_random_state_of_every_device_in_nested_inputs
        (the private helper get_device_states is not remat's; what it serves, the RNG state of
        every device found in nested inputs, is; needs two GPUs).
    test_infer_device_state_recursive_meta: ported as test_meta_tensors_in_nested_inputs.
    test_infer_device_state_recursive_multi_gpu: ported as test_inputs_on_two_gpus_warn_nothing
        (needs two GPUs; the wording of torch's mixed cuda/meta warning is torch's own).
    test_checkpoint_preserves_device_context: ported as
        test_recompute_keeps_the_default_device_of_the_forward (CUDA, backward inside and after
        the torch.device context).

test/test_autograd.py, TestAutograd (22 cases with "checkpoint" in the name, 3 more that use it)
    test_checkpointing: ported as test_many_small_rematted_calls_match_plain[*-positional]
        (40 inputs instead of 2000; use_reentrant=True not).
    test_checkpointing_non_reentrant_autocast_cpu: ported as
        test_autocast_state_is_replayed_in_the_recompute[*-cpu].
    test_checkpointing_non_reentrant_autocast_gpu: ported as
        test_autocast_state_is_replayed_in_the_recompute[*-cuda].
    test_checkpointing_without_reentrant_memory_savings: ported as
        test_rematted_layers_hold_less_memory (CPU census and CUDA allocator; 64 wide, not 256).
    test_checkpointing_without_reentrant_custom_function_works: ported as
        test_custom_function_reading_saved_tensors_twice (a second read of saved tensors in the
        same backward must give what it gives without remat, not upstream's error).
    test_checkpointing_without_reentrant_with_context_fn: not ported: the context_fn kwarg.
    test_checkpoint_warns_if_use_reentrant_not_passed_explcitly: ported as
        test_calling_a_rematted_function_warns_nothing (the use_reentrant kwarg itself not).
    test_checkpoint_sequential_warns_if_use_reentrant_not_passed_explcitly: not ported:
        checkpoint_sequential and use_reentrant.
    test_checkpoint_graph_execution_group: ported as test_each_backward_pass_recomputes_once and
        test_backward_twice_through_a_retained_graph[save_nothing] (torch's GraphExecGroup
        context, which merges recomputes across backward calls, not: remat has no such API).
    test_checkpoint_detects_non_determinism: ported as
        test_recompute_that_differs_from_the_forward_raises and
        test_recompute_with_extra_ops_is_refused_or_correct (the debug=True report and
        set_checkpoint_debug_enabled/early-stop switches not).
    test_checkpointing_without_reentrant: ported as
        test_many_small_rematted_calls_match_plain[*-keyword] (input_requires_grad True/False).
    test_checkpoint_valid_reset_on_error: ported as test_errors_leave_remat_usable (upstream's
        error is the reentrant engine's; here errors in the forward and in the recompute).
    test_checkpointing_without_reentrant_detached_tensor: ported as
        test_output_computed_under_no_grad (the use_reentrant=True parametrization not).
    test_checkpointing_without_reentrant_saved_object_identity: ported as
        test_saved_input_is_the_callers_object.
    test_checkpointing_without_reentrant_correct_grad: ported as
        test_correct_grad_with_backward_and_autograd_grad.
    test_checkpointing_without_reentrant_dataparallel: ported as test_dataparallel_module.
    test_checkpointing_without_reentrant_parameter_used_in_an_out: ported as
        test_gradient_hook_of_a_tensor_used_inside_and_outside_runs_once.
    test_checkpointing_without_reentrant_arbitrary_input_output: ported as test_dict_input_and_output.
    test_save_on_cpu_and_checkpoint: ported as test_save_on_cpu_around_and_inside_remat.
    test_checkpoint_compile_no_recompile: not ported: torch.compile-specific (Dynamo recompile
        guards on the default device, CUDA-only); remat does not run inside torch.compile.
    test_checkpoint_device_context_fn: not ported: the context_fn kwarg (the default device of
        the forward reaching the recompute is test_recompute_keeps_the_default_device_of_the_forward).
    test_forward_traceback_preserves_exception_with_checkpoint: ported as
        test_custom_op_with_registered_autograd (CPU; CUDA with memory-history recording, as upstream).
    test_access_saved_tensor_twice_without_recomputation_works (uses checkpoint): ported as
        test_saved_tensor_read_outside_backward (upstream's saved output, and a saved intermediate).
    test_custom_autograd_ac_early_stop (uses checkpoint): ported as
        test_custom_function_saved_tensors_die_after_backward.
    test_cross_device_reentrant_autograd (uses checkpoint): not ported: use_reentrant=True (CUDA).

test/test_autograd.py, TestNestedCheckpoint (8 cases; the early_stop parametrization is
torch's flag and not ported anywhere)
    test_nested_checkpoint: ported as test_nested_remat_matches_plain (f and g, every upstream
        nesting, each also with torch.func.grad in place of the autograd.grad wrapper; values and
        the graph dying without the garbage collector).
    test_nested_checkpoint_two_children: ported as test_nested_two_children and
        test_nested_two_children_graph_dies.
    test_nested_checkpoint_non_tensor_inputs_and_outputs: ported as
        test_nested_non_tensor_inputs_and_outputs.
    test_nested_checkpoint_kwargs: ported as test_keyword_tensor_argument.
    test_nested_checkpoint_same_graph: ported as test_hook_on_the_forward_graph_runs_once.
    test_nested_checkpoint_reentrant_backwards: ported as test_backward_started_from_a_hook_during_backward.
    test_nested_checkpoint_set_early_stop: not ported: early-stop flags (set_checkpoint_early_stop,
        early_stop=).
    test_nested_checkpoint_set_early_stop_no_recompution_needed: ported as
        test_no_recompute_when_nothing_but_inputs_is_saved (sin runs once; nothing re-runs when
        nothing is saved; the early-stop switch not).

test/test_autograd.py, TestSelectiveActivationCheckpoint (10 cases; torch's policy functions
and op lists become remat policies)
    test_flops_and_mem: ported as test_policy_memory_and_backward_flops (64x64 instead of 512x512;
        plain, save-nothing, dots_saveable, a bool policy and a Saveable/Recompute policy; CPU
        census and CUDA allocator).
    test_output_already_has_autograd_meta: ported as test_integer_view_output_with_a_view_saving_policy.
    test_subclass_dispatching_sizes: ported as test_policy_saving_size_queries_of_a_subclass.
    test_bad_inputs: ported as test_bad_policy_is_refused_when_built, test_bad_policy_names_are_refused
        and test_policy_answer_that_is_not_a_decision_raises.
    test_policy_with_state: ported as test_stateful_policy_is_asked_once_per_forward_op.
    test_storage_lifetime: ported as test_intermediate_storage_dies_with_the_graph (the SAC cache
        object itself is torch's; the storage it held must die with the graph, or at backward).
    test_version_counter: ported as test_kept_value_mutated_in_place_is_refused_or_correct (the
        allow_cache_entry_mutation kwarg not).
    test_function_with_more_than_one_output: ported as test_policy_keeps_both_outputs_of_var_mean.
    test_function_with_non_tensor_output: ported as test_kept_op_with_a_non_tensor_output_is_not_run_again.
    test_can_only_trigger_recompute_once: ported as test_backward_twice_through_a_retained_graph[save_sin]
        (upstream pins an error for a second backward; remat supports it and must match plain).

Totals: 61 upstream cases (58 with "checkpoint" in the name or class, plus 3 that call
checkpoint without the word in their name): 53 ported, 8 not ported (use_reentrant=True,
checkpoint_sequential, context_fn, early-stop flags, torch.compile internals).
"""

import collections
import contextlib
import copy
import gc
import re
import warnings
import weakref

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from remat import RematError, policies, remat

from ..helpers import Counted, OpCounter, OpLog, StorageCensus, assert_tree_close, census

F64 = torch.float64
SIN = torch.ops.aten.sin.default
MM = torch.ops.aten.mm.default
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]


def close64(a, b):
    """float64 results: equal to 1e-10 (float32 leaves are compared bitwise by assert_tree_close)."""
    assert_tree_close(a, b, rtol=1e-10, atol=1e-10)


def leaf(*shape, dtype=F64, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device, requires_grad=True)


def fresh(t):
    """The same values as a new leaf, for the run without remat."""
    return t.detach().clone().requires_grad_(t.requires_grad)


def outcome(thunk):
    """'ok', or the type and first line of the RuntimeError raised (to compare remat with plain)."""
    try:
        thunk()
    except RuntimeError as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return "ok"


@contextlib.contextmanager
def no_gc():
    """Objects must die by reference counting alone (a reference cycle would keep them)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def watch_storage(t):
    """A dict whose "alive" flips to False when ``t``'s storage is freed."""
    state = {"alive": True}
    fin = weakref.finalize(t.untyped_storage(), state.__setitem__, "alive", False)
    fin.atexit = False
    return state


# Custom ops (torch.library) used by the custom-op cases; registered once per process.
@torch.library.custom_op("remat_peer_tests::sin_op", mutates_args=())
def _sin_op(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


def _save_input(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _sin_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * x.cos()


torch.library.register_autograd("remat_peer_tests::sin_op", _sin_backward, setup_context=_save_input)

SIN_WITH_EXTRA_CALLS = [0]


@torch.library.custom_op("remat_peer_tests::sin_with_extra", mutates_args=())
def _sin_with_extra(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    SIN_WITH_EXTRA_CALLS[0] += 1
    return x.sin(), 2


def _sin_with_extra_backward(ctx, grad, _unused):
    (x,) = ctx.saved_tensors
    return grad * x.cos()


torch.library.register_autograd(
    "remat_peer_tests::sin_with_extra", _sin_with_extra_backward, setup_context=_save_input
)


# ------------------------------------------------------------------------------------------------
# test/test_utils.py, TestCheckpoint
# ------------------------------------------------------------------------------------------------


class CountingDouble(nn.Module):
    def __init__(self):
        super().__init__()
        self.counter = 0

    def forward(self, x):
        self.counter += 1
        return x * torch.full_like(x, 2.0)  # mul saves the intermediate: the block has something to recompute


def test_trigger_recomputes_each_rematted_module_once():
    modules = [CountingDouble() for _ in range(10)]

    def run(mods, h):
        for m in mods:
            h = m(h)
        return h

    x = torch.randn(3, 4, requires_grad=True)
    out = run(modules[5:], remat(lambda h: run(modules[:5], h))(x))
    assert [m.counter for m in modules] == [1] * 10
    fills = OpCounter({torch.ops.aten.full_like.default})
    with fills:
        out.sum().backward()
    # torch re-runs each checkpointed module once; remat replays each module's ops once and runs no Python again
    assert fills.count == 5
    assert [m.counter for m in modules] == [1] * 10
    assert torch.equal(x.grad, torch.full_like(x, 2.0**10))


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 20), nn.ReLU(), nn.Linear(20, 5), nn.ReLU()
    ).double()


class ModuleListNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.module_list = nn.ModuleList(
            [nn.Linear(100, 50), nn.ReLU(), nn.Linear(50, 20), nn.ReLU(), nn.Linear(20, 5), nn.ReLU()]
        )
        self.double()

    def forward(self, x):
        for layer in self.module_list:
            x = layer(x)
        return x


def run_in_segments(mods, x, chunks, as_module):
    """Like checkpoint_sequential: every segment but the last is remat'd."""
    mods = list(mods)
    size = -(-len(mods) // chunks)
    segments = [mods[i : i + size] for i in range(0, len(mods), size)]
    for i, seg in enumerate(segments):
        if as_module:
            block = nn.Sequential(*seg)
        else:
            def block(h, seg=seg):
                for m in seg:
                    h = m(h)
                return h
        x = remat(block)(x) if i < len(segments) - 1 else block(x)
    return x


def test_grad_with_create_graph_through_rematted_segments():
    model = mlp()
    x = leaf(1, 100)
    go = torch.ones(1, 5, dtype=F64)
    plain_out = model(x)
    (g_plain,) = torch.autograd.grad(plain_out, x, go, create_graph=True)
    out = run_in_segments(model, x, 2, as_module=False)
    (g,) = torch.autograd.grad(out, x, go, create_graph=True)
    close64((out, g), (plain_out, g_plain))
    assert g.requires_grad
    (h_plain,) = torch.autograd.grad(g_plain.pow(2).sum(), model[0].weight)
    (h,) = torch.autograd.grad(g.pow(2).sum(), model[0].weight)
    close64(h, h_plain)


@pytest.mark.parametrize("net", ["sequential", "module_list"])
@pytest.mark.parametrize("segments_as", ["functions", "modules"])
def test_segments_match_plain(net, segments_as):
    model = mlp() if net == "sequential" else ModuleListNet()
    container = model if net == "sequential" else model.module_list
    x = leaf(1, 100)
    out_plain = model(x)
    out_plain.sum().backward()
    expected = (out_plain.detach(), x.grad.clone(), [p.grad.clone() for p in model.parameters()])
    model.zero_grad()
    x2 = fresh(x)
    out = run_in_segments(container.children(), x2, 2, as_module=segments_as == "modules")
    out.sum().backward()
    close64((out.detach(), x2.grad, [p.grad for p in model.parameters()]), expected)


def rng_state(device):
    return torch.get_rng_state() if device == "cpu" else torch.cuda.get_rng_state()


def set_rng_state(device, state):
    if device == "cpu":
        torch.set_rng_state(state)
    else:
        torch.cuda.set_rng_state(state)


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_sees_the_same_random_numbers_in_the_recompute(device):
    for _ in range(3):
        inp = torch.randn(2000, device=device).requires_grad_()
        phase1, phase2 = nn.Dropout(), nn.Dropout()
        state = rng_state(device)
        remat(phase2)(phase1(inp)).sum().backward()
        with_remat = inp.grad
        set_rng_state(device, state)
        inp.grad = None
        phase2(phase1(inp)).sum().backward()
        assert torch.equal(with_remat, inp.grad)
        assert 0 < int((with_remat == 0).sum()) < inp.numel()  # dropout dropped something


@pytest.mark.parametrize("device", DEVICES)
def test_dropout_without_preserving_rng_state(device, clean_after):
    inp = torch.randn(64, device=device).requires_grad_()
    layer = nn.Dropout()
    remat(lambda t: layer(t), preserve_rng_state=False)(inp).sum().backward()
    assert set(inp.grad.unique().tolist()) <= {0.0, 2.0}


def test_none_argument():
    def run_fn(t1, t2):
        return t1 if t2 is None else t1 + t2

    x = torch.randn(1, 100, requires_grad=True)
    out = remat(run_fn)(x, None)
    assert torch.equal(out, x)
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def mixed_outputs(t1, t2, scale, t3):
    t4 = t1 + t2 * t3
    t5 = t1 * t2 + t3
    t4 *= scale
    t5 *= scale
    return scale, t4, None, True, t5, "bar", t1


def test_non_tensor_inputs_and_outputs():
    t1, t2, t3, scale = leaf(10), leaf(10), torch.rand(10, dtype=F64), 7

    def run(wrap, a, b):
        res = wrap(mixed_outputs)(a, b, scale, t3)
        res[1].sum().backward(retain_graph=True)
        res[4].sum().backward(retain_graph=True)
        res[6].sum().backward()
        grads = (a.grad.clone(), b.grad.clone())
        return res, grads, outcome(lambda: res[6].sum().backward())  # once more through the pass-through

    res, grads, again = run(remat, t1, t2)
    ref, ref_grads, ref_again = run(lambda f: f, fresh(t1), fresh(t2))
    assert (res[0], res[2], res[3], res[5]) == (scale, None, True, "bar")
    close64([res[1], res[4], res[6]], [ref[1], ref[4], ref[6]])
    close64(grads, ref_grads)
    assert again == ref_again


def test_only_python_numbers():
    args = (0.25, 0.5, 3, 0.75)
    assert remat(mixed_outputs)(*args) == mixed_outputs(*args)


def test_gradient_of_one_output_and_outputs_without_grad():
    a, b = torch.randn(1, 4, requires_grad=True), torch.randn(1, 4)
    out = remat(lambda t1, t2: (t1, t2))(a, b)
    out[0].sum().backward()
    assert torch.equal(a.grad, torch.ones_like(a))

    def run_fn2(t1, t2):
        return t1

    a, b = torch.randn(1, 4), torch.randn(1, 4, requires_grad=True)
    with_remat = outcome(lambda: remat(run_fn2)(a, b).sum().backward())
    assert with_remat == outcome(lambda: run_fn2(a, b).sum().backward()) != "ok"


def memory_now(device, c):
    """Bytes allocated: the census on the CPU, the caching allocator's statistics on CUDA (as upstream)."""
    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.memory_stats()["requested_bytes.all.current"]
    return c.live


def memory_at_each_backward_step(run, device):
    """Memory when the gradient of each of three saved intermediates is computed."""
    stats = []
    c = StorageCensus()

    def track(t, idx):
        def hook(_):
            assert len(stats) == idx
            stats.append(memory_now(device, c))

        t.register_hook(hook)

    def chain(x):
        x = x**2
        track(x, 2)
        x = x**2
        track(x, 1)
        x = x**2
        track(x, 0)
        x = x**2
        return x.sum()

    x = torch.full((4096,), 0.5, dtype=F64, device=device, requires_grad=True)
    x.grad = torch.zeros_like(x)
    try:
        with c:
            run(chain, x)
    finally:
        c.close()
    return stats, x.grad


@pytest.mark.parametrize("device", DEVICES)
def test_backward_frees_buffers_as_it_goes(device):
    plain, g_plain = memory_at_each_backward_step(lambda f, x: f(x).backward(), device)
    kept, _ = memory_at_each_backward_step(lambda f, x: f(x).backward(retain_graph=True), device)
    assert len(plain) == 3 and plain[0] > plain[1] > plain[2]  # the measure sees frees
    assert kept[0] == kept[1] == kept[2]  # and sees nothing freed under retain_graph
    rematted, g = memory_at_each_backward_step(lambda f, x: remat(f)(x).backward(), device)
    rematted_kept, _ = memory_at_each_backward_step(
        lambda f, x: remat(f)(x).backward(retain_graph=True), device)
    close64(g, g_plain)
    assert rematted == plain
    assert rematted_kept == plain  # recomputed buffers are freed even when the graph is retained


@needs_two_gpus
def test_random_state_of_every_device_in_nested_inputs():
    def f(d):
        return nn.functional.dropout(d["foo"], 0.5).sum() + nn.functional.dropout(d["bar"][0], 0.5).sum()

    inp = {"foo": torch.rand(1000, device="cuda:0", requires_grad=True),
           "bar": [torch.rand(1000, device="cuda:1", requires_grad=True)]}
    states = [torch.cuda.get_rng_state(i) for i in (0, 1)]
    remat(f)(inp).backward()
    grads = [inp["foo"].grad, inp["bar"][0].grad]
    for i, s in enumerate(states):
        torch.cuda.set_rng_state(s, i)
    ref = {"foo": fresh(inp["foo"]), "bar": [fresh(inp["bar"][0])]}
    f(ref).backward()
    assert_tree_close(grads, [ref["foo"].grad, ref["bar"][0].grad])


def test_meta_tensors_in_nested_inputs():
    def f(d):
        return d["foo"].sin().exp().sum()

    x = torch.rand(10, device="meta", requires_grad=True)
    remat(f)({"foo": x}).backward()
    y = torch.rand(10, device="meta", requires_grad=True)
    f({"foo": y}).backward()
    assert (x.grad.shape, x.grad.device, x.grad.dtype) == (y.grad.shape, y.grad.device, y.grad.dtype)


@needs_two_gpus
def test_inputs_on_two_gpus_warn_nothing():
    inp = {"foo": torch.rand(10, device="cuda:0", requires_grad=True),
           "bar": [torch.rand(10, device="cuda:1", requires_grad=True)]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        remat(lambda d: d["foo"].sin().sum() + d["bar"][0].sin().sum().to("cuda:0"))(inp).backward()
    assert torch.equal(inp["foo"].grad, inp["foo"].cos())


# CUDA only, as upstream: on the CPU the default device is the CPU anyway, and remat keeps
# (never recomputes) meta tensors, so a meta-device variant would recompute nothing.
@needs_cuda
@pytest.mark.parametrize("backward", ["inside_the_context", "after_it"])
def test_recompute_keeps_the_default_device_of_the_forward(backward):
    device = "cuda"
    seen = []

    def fn(x):
        intermediate = torch.empty(4)
        seen.append(intermediate.device.type)
        return x * intermediate.sum()

    x = torch.randn(4, device=device, requires_grad=True)
    with torch.device(device):
        y = remat(fn)(x)
        assert seen == [device]
        if backward == "inside_the_context":
            y.sum().backward()
    if backward == "after_it":
        y.sum().backward()
    assert seen == [device, device]  # forward + recompute


# ------------------------------------------------------------------------------------------------
# test/test_autograd.py, TestAutograd (checkpoint cases)
# ------------------------------------------------------------------------------------------------


class Holder(nn.Module):
    def __init__(self, mod):
        super().__init__()
        self.module = mod

    def forward(self, data):
        return self.module(data)


@pytest.mark.parametrize("call", ["positional", "keyword"])
@pytest.mark.parametrize("input_requires_grad", [True, False])
def test_many_small_rematted_calls_match_plain(call, input_requires_grad):
    torch.manual_seed(0)
    module = Holder(nn.Sequential(nn.Linear(10, 100), nn.ReLU(), nn.Linear(100, 10)).double())
    module_copy = copy.deepcopy(module)
    rematted = remat(module)
    feats, feats_plain, inputs, inputs_plain = [], [], [], []
    for _ in range(40):
        data = torch.empty(1, 10, dtype=F64).uniform_().requires_grad_(input_requires_grad)
        inputs.append(data)
        inputs_plain.append(fresh(data))
        feats.append(rematted(data=data) if call == "keyword" else rematted(data))
        feats_plain.append(module_copy(inputs_plain[-1]))
    torch.stack(feats).mean().backward()
    torch.stack(feats_plain).mean().backward()
    close64([p.grad for p in module.parameters()], [p.grad for p in module_copy.parameters()])
    if input_requires_grad:
        close64([d.grad for d in inputs], [d.grad for d in inputs_plain])


BF16_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.is_bf16_supported()), reason="needs CUDA with bfloat16"))]


@pytest.mark.parametrize("device", BF16_DEVICES)
@pytest.mark.parametrize("enabled", [True, False])
def test_autocast_state_is_replayed_in_the_recompute(device, enabled):
    seen = []

    def foo(x, y, z):
        x = torch.mm(x, y)
        y = torch.mm(x, z)
        z = torch.mm(z, z)
        seen.append(z.dtype)
        return z

    def run(wrap):
        args = [torch.randn(3, 3, generator=torch.Generator().manual_seed(i)).to(device).requires_grad_()
                for i in range(3)]
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=enabled):
            loss = wrap(foo)(*args).sum()
        made = []  # (op, dtype of its tensor output) for each op of the backward pass

        class Dtypes(OpLog):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if isinstance(out, torch.Tensor) and func is not torch.ops.aten.detach.default:
                    made.append((func, out.dtype))
                return out

        with Dtypes():
            loss.backward()  # the recompute must run in bfloat16 again
        return [a.grad for a in args], made

    grads, made = run(remat)
    ref, plain_made = run(lambda f: f)
    expected = torch.bfloat16 if enabled else torch.float32
    assert seen == [expected] * 2  # the forward pass, once with remat and once without: no Python runs again
    replayed = list(made)  # the backward pass's ops beyond plain autograd's: the recompute's
    for op in plain_made:
        replayed.remove(op)
    # without autocast only inputs are saved and nothing needs recomputing; with it, the casts and matmuls the
    # recompute replays make bfloat16 values, as the forward pass did
    assert {dtype for _, dtype in replayed} == ({torch.bfloat16} if enabled else set()), replayed
    assert_tree_close(grads, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_rematted_layers_hold_less_memory(device):
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)).to(device)
              for _ in range(8)]
    params = [p for layer in layers for p in layer.parameters()]
    x = torch.randn(32, 64, device=device, requires_grad=True)

    def step(wrap):
        for t in [x, *params]:  # pre-allocated gradients, as upstream: the peak is the activations'
            t.grad = torch.ones_like(t)
        gc.collect()
        with census() as c:
            base = memory_now(device, c)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
                base_allocated = torch.cuda.memory_allocated()
            h = x
            for layer in layers:
                h = wrap(layer)(h)
            loss = h.sum()
            del h
            held = memory_now(device, c) - base - loss.untyped_storage().nbytes()
            loss.backward()
            peak = c.peak if device == "cpu" else torch.cuda.max_memory_allocated() - base_allocated
        return held, peak, [t.grad.clone() for t in [x, *params]]

    held_plain, peak_plain, g_plain = step(lambda m: m)
    held, peak, g = step(remat)
    activation = 32 * 64 * 4
    assert held_plain >= 3 * 7 * activation  # the census is not vacuous
    assert held <= 7 * activation  # one input per remat'd block (the first is x, allocated before)
    assert peak < peak_plain
    assert_tree_close(g, g_plain)


class SaveFiveTensors(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, z):
        w = x * y * z
        out = w + w
        ctx.save_for_backward(x, y, z, w, out)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        first = ctx.saved_tensors
        second = ctx.saved_tensors  # a second read in the same backward
        ctx.reads_agree = all(torch.equal(a, b) for a, b in zip(first, second))
        SaveFiveTensors.reads.append(ctx.reads_agree)
        x, y, z, w, out = second
        return grad_out * y * z * 2, grad_out * x * z * 2, grad_out * x * y * 2


def test_custom_function_reading_saved_tensors_twice():
    SaveFiveTensors.reads = []

    def foo(x, y, z):
        x = x * y * z
        y = y * y * z
        z = z * z
        return SaveFiveTensors.apply(x, y, z)

    args = [torch.tensor(v, dtype=F64, requires_grad=True) for v in (1.0, 2.0, 3.0)]
    (remat(foo)(*args)).sum().backward()
    args_plain = [fresh(a) for a in args]
    foo(*args_plain).sum().backward()
    assert SaveFiveTensors.reads == [True, True]
    close64([a.grad for a in args], [a.grad for a in args_plain])


def test_calling_a_rematted_function_warns_nothing():
    a = torch.randn(1, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        remat(lambda x: x.sin())(a).backward()


def two_outputs(x):
    y = x.sin().cos()
    return y, y.sin().cos()


def test_each_backward_pass_recomputes_once():
    def ops(run):
        """The ATen ops of ``run()`` (``aten.detach``, autograd's unpacking, left out) and its result."""
        with OpLog() as log:
            out = run()
        return [op for op in log.ops if op is not torch.ops.aten.detach.default], out

    fn = Counted(two_outputs)
    x = leaf(3, 3)
    forward, (y, z) = ops(lambda: remat(fn)(x))
    first, (gy,) = ops(lambda: torch.autograd.grad(z, (y,), (torch.ones(3, 3, dtype=F64),)))
    second, (gx,) = ops(lambda: torch.autograd.grad(y, (x,), (gy,)))
    assert fn.calls == 1  # the recompute replays the recorded ops
    x2 = fresh(x)
    y2, z2 = two_outputs(x2)
    plain_first, (gy2,) = ops(lambda: torch.autograd.grad(z2, (y2,), (torch.ones(3, 3, dtype=F64),)))
    plain_second, (gx2,) = ops(lambda: torch.autograd.grad(y2, (x2,), (gy2,)))
    close64((gy, gx), (gy2, gx2))
    # one recompute per backward pass: each runs ops beyond plain autograd's, none more often than the forward did
    for got, plain in ((first, plain_first), (second, plain_second)):
        extra = collections.Counter(got) - collections.Counter(plain)
        assert extra and not extra - collections.Counter(forward), extra


def save_the_sin(op, *args, **kwargs):
    return op is SIN


@pytest.mark.parametrize("policy", ["save-nothing", save_the_sin], ids=["save_nothing", "save_sin"])
def test_backward_twice_through_a_retained_graph(policy):
    def fn(x):
        return x.sin().cos().exp()

    x = leaf(3)
    out = remat(fn, policy=policy)(x)
    out.sum().backward(retain_graph=True)
    out.sum().backward()
    x2 = fresh(x)
    out2 = fn(x2)
    out2.sum().backward(retain_graph=True)
    out2.sum().backward()
    close64(x.grad, x2.grad)


def sin_exp_sin(x):
    return x.sin().exp().sin()


def sin_exp(x):
    return x.sin().exp()


def sin_times_vector(x):
    return x.sin() * torch.tensor([1.0, 2.0], dtype=x.dtype)


def first_call_then(orig, recompute):
    calls = [0]

    def fn(x):
        calls[0] += 1
        return orig(x) if calls[0] == 1 else recompute(x)

    return fn


@pytest.mark.parametrize("debug", [False, True], ids=["replay", "full-engine"])
@pytest.mark.parametrize("orig, recompute", [(sin_exp_sin, sin_exp), (sin_exp, sin_times_vector)],
                         ids=["fewer_ops", "other_shapes"])
def test_recompute_that_differs_from_the_forward_raises(orig, recompute, debug, clean_after):
    """The full engine (``debug=True``) runs the function again and refuses a run that differs; the replay engine
    (plain autograd) replays the forward pass's ops and gives the gradient of what the forward pass computed."""
    a = leaf(1)
    if debug:
        with pytest.raises(RematError, match="diverged"):
            remat(first_call_then(orig, recompute), debug=True)(a).backward()
        return
    remat(first_call_then(orig, recompute))(a).backward()
    b = fresh(a)
    orig(b).backward()
    close64(a.grad, b.grad)


def test_recompute_with_extra_ops_is_refused_or_correct():
    a = leaf(1)
    try:
        remat(first_call_then(sin_exp, sin_exp_sin))(a).backward()
    except RematError as e:
        assert "diverged" in str(e)
        return
    b = fresh(a)
    sin_exp(b).backward()
    close64(a.grad, b.grad)


def exp_with_dead_ops(a):
    b = a * a
    _ = a * b
    return torch.exp(a)


def sin_of_exp(a):
    return torch.exp(a).sin()


@pytest.mark.parametrize("fn, attr", [(exp_with_dead_ops, "_saved_result"), (sin_of_exp, "_saved_self")],
                         ids=["saved_output", "saved_intermediate"])
def test_saved_tensor_read_outside_backward(fn, attr):
    counted = Counted(fn)
    a = leaf(5)
    d = remat(counted)(a)
    assert counted.calls == 1
    expected = getattr(fn(fresh(a)).grad_fn, attr)
    reads, exps = [], []  # each read, and the exps it ran: the recompute replays the saved tensor's exp
    for _ in range(2):
        with OpCounter({torch.ops.aten.exp.default}) as c:
            reads.append(getattr(d.grad_fn, attr))
        exps.append(c.count)
    assert exps == [1, 1]  # a read outside backward recomputes, and keeps nothing for the next read
    close64(reads, [expected, expected])
    with OpCounter({torch.ops.aten.exp.default}) as c:
        d.sum().backward()
    assert c.count == 1
    assert counted.calls == 1  # the Python ran once
    a2 = fresh(a)
    fn(a2).sum().backward()
    close64(a.grad, a2.grad)
    with pytest.raises(RuntimeError, match="already been freed"):
        getattr(d.grad_fn, attr)


def test_errors_leave_remat_usable(clean_after):
    a = torch.randn(2, 2, requires_grad=True)

    def boom(x):
        x.exp()
        raise ValueError("boom in forward")

    with pytest.raises(ValueError, match="boom in forward"):
        remat(boom)(a)

    calls = [0]

    def fails_in_recompute(x):
        calls[0] += 1
        if calls[0] > 1:
            raise ValueError("boom in recompute")
        return x.exp().sin()

    # the replay engine (plain autograd) runs the Python once: no recompute to fail, plain autograd's gradient
    remat(fails_in_recompute)(a).sum().backward()
    assert calls[0] == 1 and torch.allclose(a.grad, a.exp() * a.exp().cos(), rtol=1e-12, atol=1e-12)
    a.grad = None
    # the full engine (debug=True) runs it again in the recompute, which raises
    calls[0] = 0
    out = remat(fails_in_recompute, debug=True)(a).sum()
    with pytest.raises((ValueError, RuntimeError), match="boom in recompute"):
        out.backward()
    a.grad = None
    remat(torch.exp)(a).sum().backward()
    assert torch.equal(a.grad, a.exp())


class NoGradModule(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(2, 2, bias=False).double()
        self.lin2 = nn.Linear(2, 2, bias=False).double()

    def forward(self, x):
        with torch.no_grad():
            return self.lin2(self.linear(x))


def test_output_computed_under_no_grad():
    module = NoGradModule()
    a = leaf(2, 2)
    b = fresh(a)
    for _ in range(3):
        out = remat(module)(a)
        assert not out.requires_grad
        out += a
        out.sum().backward()
        ref = module(b)
        ref += b
        ref.sum().backward()
    close64(a.grad, b.grad)


class SaveSecondInput(torch.autograd.Function):
    seen = []

    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(y)
        return x

    @staticmethod
    def backward(ctx, grad):
        SaveSecondInput.seen.append(ctx.saved_tensors[0])
        return grad, None


def test_saved_input_is_the_callers_object():
    a, b = torch.tensor(1.0, requires_grad=True), torch.tensor(1.0)
    SaveSecondInput.apply(a, b).backward()
    assert SaveSecondInput.seen[-1] is b
    remat(SaveSecondInput.apply)(a, b).backward()
    assert SaveSecondInput.seen[-1] is b


def test_correct_grad_with_backward_and_autograd_grad():
    a = torch.randn(2, 2, requires_grad=True)
    torch.exp(a).sum().backward()
    expected = a.grad
    a.grad = None
    remat(torch.exp)(a).sum().backward()
    (d_grad,) = torch.autograd.grad(remat(torch.exp)(a).sum(), (a,))
    assert torch.equal(a.grad, expected)
    assert torch.equal(d_grad, expected)


def test_dataparallel_module():
    torch.manual_seed(0)
    model = nn.Linear(2, 2, bias=False).double()
    a = leaf(2, 2)
    copy.deepcopy(model)(a).sum().backward()
    expected = a.grad
    a.grad = None
    remat(nn.DataParallel(copy.deepcopy(model)))(a).sum().backward()
    close64(a.grad, expected)


def test_gradient_hook_of_a_tensor_used_inside_and_outside_runs_once():
    def run(wrap):
        torch.manual_seed(0)
        w, x = leaf(10, 10), torch.rand(10, 10, dtype=F64, requires_grad=True)
        count = [0]
        w.register_hook(lambda g: count.__setitem__(0, count[0] + 1))
        h = w * x  # w outside the remat'd function
        out = wrap(lambda t: w * t)(h)  # and inside it
        out.sum().backward()
        return count[0], (w.grad, x.grad)

    count, grads = run(remat)
    plain_count, plain_grads = run(lambda f: f)
    assert count == plain_count == 1
    close64(grads, plain_grads)


class DictModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(5, 5, bias=False).double()

    def forward(self, dict_input):
        return {"result": self.layer(dict_input["tensor"])}


def test_dict_input_and_output():
    torch.manual_seed(0)
    model = DictModel()
    model_copy = copy.deepcopy(model)
    inp = {"tensor": torch.randn(5, 5, dtype=F64)}
    out_plain = model(inp)["result"].sum()
    out = remat(model_copy)(inp)["result"].sum()
    close64(out, out_plain)
    out_plain.backward()
    out.backward()
    close64([p.grad for p in model_copy.parameters()], [p.grad for p in model.parameters()])


def test_save_on_cpu_around_and_inside_remat():
    a = leaf(2, 2)
    a.pow(2).pow(2).pow(2).pow(2).sum().backward()
    expected = a.grad.clone()
    a.grad = None
    with torch.autograd.graph.save_on_cpu():
        h = a.pow(2)
        h = remat(lambda x: x.pow(2).pow(2))(h)
        c = h.pow(2)
    c.sum().backward()
    close64(a.grad, expected)
    a.grad = None

    def f(t):
        h = t.pow(2)
        with torch.autograd.graph.save_on_cpu():
            h = h.pow(2).pow(2)
        return h.pow(2)

    remat(f)(a).sum().backward()
    close64(a.grad, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_custom_op_with_registered_autograd(device):
    def fn(x):
        return torch.ops.remat_peer_tests.sin_op(x)

    x = torch.randn(4, dtype=F64, device=device, requires_grad=True)
    recording = device == "cuda"
    if recording:  # upstream: allocator callbacks with Python stacks fire while the recompute runs
        torch.cuda.memory._record_memory_history("all", stacks="python")
    try:
        remat(fn)(x).sum().backward()
    finally:
        if recording:
            torch.cuda.memory._record_memory_history(None)
    close64(x.grad, x.detach().cos())


class KeepClone(torch.autograd.Function):
    refs = []

    @staticmethod
    def forward(ctx, x):
        y = x.clone()
        ctx.save_for_backward(y)
        KeepClone.refs.append(weakref.ref(y))
        return y

    @staticmethod
    def backward(ctx, *grads):
        _ = ctx.saved_tensors
        return None


def test_custom_function_saved_tensors_die_after_backward():
    KeepClone.refs = []
    inp = torch.randn(5, 5, requires_grad=True)

    def scope():
        remat(KeepClone.apply)(inp).sum().backward()

    with no_gc():
        scope()
        assert KeepClone.refs and all(r() is None for r in KeepClone.refs)


# ------------------------------------------------------------------------------------------------
# test/test_autograd.py, TestNestedCheckpoint
# ------------------------------------------------------------------------------------------------


def grad_autograd(fn):
    def wrapper(x):
        with torch.enable_grad():
            out = fn(x)
            (grad_input,) = torch.autograd.grad(out, inputs=(x,), create_graph=True)
        return grad_input

    return wrapper


def grad_func(fn):
    return torch.func.grad(fn)


def summed(fn):
    return lambda x: fn(x).sum()


def nested_f(x):
    return x.sin().exp().sin()


def nested_g(grad):
    def g(x):
        a = x.sin().exp().sin()
        b = x.sin().exp().sin()
        if grad is grad_autograd:
            torch.autograd.grad(a, x)
            torch.autograd.grad(b, x)
        else:
            torch.func.grad(lambda t: t.sin().exp().sin())(x)
            torch.func.grad(lambda t: t.sin().exp().sin())(x)
        return x.sin()

    return g


NESTED_PAIRS = [
    ("fn", ["c(fn)", "c(c(fn))"]),
    ("grad(fn)", ["grad(c(fn))", "grad(c(c(fn)))"]),
    ("grad(grad(fn))", ["grad(c(grad(fn)))", "c(grad(grad(c(fn))))", "grad(c(grad(c(fn))))"]),
    ("grad(grad(grad(fn)))", ["grad(c(grad(grad(c(fn)))))", "grad(c(grad(c(grad(c(fn))))))"]),
]
NESTED_CASES = [
    pytest.param(name, impl, expected, actual, id=f"{name}-{impl}-{actual}")
    for name in ("f", "g")
    for impl in ("autograd", "func")
    for expected, actuals in NESTED_PAIRS
    for actual in actuals
    # the func flavour of f only differs where a gradient is taken; g's inner gradients change with it
    if impl == "autograd" or "grad" in expected or name == "g"
]


class CaseError(Exception):
    """An error from inside torch or remat, re-raised with its message but without its deep traceback."""


def shallow(thunk):
    """Run ``thunk``; an error comes back as CaseError("Type: message") with a two-frame traceback.

    pytest renders the full traceback of every xfailed case, parsing each torch and remat source
    file on it: about half a second per nested case, the bulk of this file's runtime otherwise.
    """
    try:
        return thunk()
    except Exception as e:
        raise CaseError(f"{type(e).__name__}: {e}") from None


def iter_graph(root):
    if root is None:
        return
    seen, queue = {root}, [root]
    while queue:
        node = queue.pop(0)
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in seen:
                seen.add(nxt)
                queue.append(nxt)
        yield node


class Handle:
    def __init__(self, name):
        self.name = name


def graph_survivors(fn):
    """Names of the autograd nodes of ``fn(a)``'s graph still alive once its result is dropped."""

    def scope():
        a = torch.randn((), dtype=F64, requires_grad=True)
        out = fn(a)
        refs = []
        for node in iter_graph(out.grad_fn):
            handle = Handle(node.name())
            refs.append(weakref.ref(handle))
            node.metadata["handle"] = handle
        return refs

    with no_gc():
        refs = scope()
        return [r().name for r in refs if r() is not None]


@pytest.mark.parametrize("name, impl, expected, actual", NESTED_CASES)
def test_nested_remat_matches_plain(name, impl, expected, actual):
    grad = grad_autograd if impl == "autograd" else grad_func
    fn = nested_f if name == "f" else nested_g(grad)
    scope = {"grad": grad, "c": remat, "fn": fn}
    x = torch.randn((), dtype=F64, requires_grad=True)
    close64(shallow(lambda: eval(actual, scope)(x)), eval(expected, scope)(x))
    assert shallow(lambda: graph_survivors(eval(actual, scope))) == []


def two_children_scope():
    def f(x):
        return x.sin().exp().sin()

    def g(x):
        return x.cos().sin().exp()

    def hc(x):
        return remat(g)(remat(f)(x))

    def h(x):
        return g(f(x))

    return {"grad": grad_autograd, "sum": summed, "c": remat, "hc": hc, "h": h}


TWO_CHILDREN_GRAD_INSIDE = "grad(sum(c(grad(sum(c(hc))))))"  # torch.autograd.grad inside a remat'd call


@pytest.mark.parametrize("actual", ["grad(sum(grad(sum(c(hc)))))", TWO_CHILDREN_GRAD_INSIDE])
def test_nested_two_children(actual):
    scope = two_children_scope()
    a = leaf(3, 3)
    close64(shallow(lambda: eval(actual, scope)(a)), eval("grad(sum(grad(sum(h))))", scope)(a))


@pytest.mark.parametrize("fn", ["grad(c(hc))", "grad(sum(grad(sum(c(hc)))))", TWO_CHILDREN_GRAD_INSIDE])
def test_nested_two_children_graph_dies(fn):
    assert shallow(lambda: graph_survivors(eval(fn, two_children_scope()))) == []


def test_nested_non_tensor_inputs_and_outputs():
    def fn(k, a, b, f):
        return f(k * a * b.exp()), 1, "abcd"

    a, b = torch.tensor(2.0, dtype=F64, requires_grad=True), torch.tensor(3.0, dtype=F64, requires_grad=True)
    out, one, text = remat(fn)(3, a, b, torch.sin)
    assert (one, text) == (1, "abcd")
    expected_out, _, _ = fn(3, a, b, torch.sin)
    close64(torch.autograd.grad(out, (a, b)), torch.autograd.grad(expected_out, (a, b)))


def test_keyword_tensor_argument():
    def fn(a, blah=None):
        out = a.sin().exp()
        if blah is not None:
            out = out * blah
        return out.sin().exp()

    a, b = torch.tensor(2.0, dtype=F64, requires_grad=True), torch.tensor(3.0, dtype=F64, requires_grad=True)
    out = remat(fn)(a, blah=b)
    close64(torch.autograd.grad(out, (a, b)), torch.autograd.grad(fn(a, blah=b), (a, b)))
    close64(torch.autograd.grad(remat(fn)(a), (a,)), torch.autograd.grad(fn(a), (a,)))


def test_hook_on_the_forward_graph_runs_once():
    counter = [0]
    a = torch.tensor(1.0, dtype=F64, requires_grad=True)
    out = remat(lambda t: t.sin().cos().sin())(a)
    out.grad_fn.next_functions[0][0].register_hook(lambda *_: counter.__setitem__(0, counter[0] + 1))
    out.backward()
    assert counter[0] == 1
    close64(a.grad, -torch.cos(torch.cos(a.detach().sin())) * torch.sin(a.detach().sin()) * a.detach().cos())


def test_backward_started_from_a_hook_during_backward():
    def fn(a):
        x = a.sin().cos()
        return x, x.sin()

    def run(wrap):
        a = torch.tensor(1.0, dtype=F64, requires_grad=True)
        x, out = wrap(fn)(a)
        out.grad_fn.register_hook(lambda *_: x.backward(retain_graph=True))
        out.backward(retain_graph=True)
        return a.grad

    close64(run(remat), run(lambda f: f))


def test_no_recompute_when_nothing_but_inputs_is_saved():
    fn = Counted(lambda x: x.sin())
    a = torch.tensor(1.0, requires_grad=True)
    with OpCounter({SIN}) as sins:
        remat(fn)(a).backward()
    assert sins.count == 1  # sin ran once: its only saved tensor is the input
    assert fn.calls <= 2
    assert torch.equal(a.grad, a.detach().cos())

    fn2 = Counted(lambda x: x.clone())  # saves nothing at all
    remat(fn2)(a).backward()
    assert fn2.calls == 1


# ------------------------------------------------------------------------------------------------
# test/test_autograd.py, TestSelectiveActivationCheckpoint (torch's policies -> remat policies)
# ------------------------------------------------------------------------------------------------


def cos_mm_sin(x, y):
    return torch.mm(x.cos(), y).sin().sum()


def save_mm(op, *args, **kwargs):
    return op is MM


def save_mm_decisions(op, *args, **kwargs):
    return policies.Saveable if op is MM else policies.Recompute


N = 64


@pytest.mark.parametrize("policy, held_units, backward_mms", [
    (None, 2, 2),
    ("save-nothing", 0, 3),
    (policies.dots_saveable, 1, 2),
    (save_mm, 1, 2),
    (save_mm_decisions, 1, 2),
], ids=["plain", "save_nothing", "dots_saveable", "bool_policy", "decision_policy"])
@pytest.mark.parametrize("device", DEVICES)
def test_policy_memory_and_backward_flops(device, policy, held_units, backward_mms):
    x = torch.randn(N, N, device=device, requires_grad=True)
    y = torch.randn(N, N, device=device, requires_grad=True)
    f = cos_mm_sin if policy is None else remat(cos_mm_sin, policy=policy)
    f(x, y).backward()  # warm up, as upstream
    gc.collect()
    with census() as c:
        base = memory_now(device, c)
        out = f(x, y)
        held = memory_now(device, c) - base - out.untyped_storage().nbytes()
    with FlopCounterMode(display=False) as flops:
        out.backward()
    assert held == held_units * N * N * 4
    assert flops.get_total_flops() == backward_mms * 2 * N**3


def test_integer_view_output_with_a_view_saving_policy():
    def fn(x, y):
        return x.view(-1), y.sin().cos()

    x, y = torch.tensor([1, 2, 3]), leaf(3)
    out = remat(fn, policy=lambda op, *a, **k: op is torch.ops.aten.view.default)(x, y)
    assert torch.equal(out[0], x)
    out[1].sum().backward()
    y2 = fresh(y)
    fn(x, y2)[1].sum().backward()
    close64(y.grad, y2.grad)


class SizesDispatchingTensor(torch.Tensor):
    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.size(), inner.stride(), None, None, inner.dtype, inner.layout, inner.device,
            False, inner.requires_grad, "sizes",
        )

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs):
        args_inner = torch.utils._pytree.tree_map_only(cls, lambda t: t.inner, args)
        out = func(*args_inner, **(kwargs or {}))
        return torch.utils._pytree.tree_map_only(torch.Tensor, cls, out)


def test_policy_saving_size_queries_of_a_subclass():
    """A policy that keeps only ``sym_size`` answers, on a wrapper subclass: the intermediates (``x.sum()`` among
    them) are recomputed, counted from outside in the backward pass (remat replays the call's program rather than
    running ``fn`` again), and the gradient is plain autograd's."""

    def fn(x):
        view_out = (x * x.sum()).view(-1).view(4, 3)
        assert tuple(view_out.grad_fn._saved_self_sym_sizes) == (12,)
        return view_out.exp()

    policy = lambda op, *a, **k: op is torch.ops.aten.sym_size.default  # noqa: E731
    base = torch.randn(4, 3, dtype=torch.float64)
    x = SizesDispatchingTensor(base.clone().requires_grad_())
    out = remat(fn, policy=policy)(x).sum()
    with OpCounter({torch.ops.aten.sum.default}) as sums:
        (got,) = torch.autograd.grad(out, x)
    assert sums.count >= 1, "remat kept the intermediates (x.sum() among them) instead of recomputing them"
    x2 = SizesDispatchingTensor(base.clone().requires_grad_())
    (want,) = torch.autograd.grad(fn(x2).sum(), x2)
    close64(got.inner, want.inner)


@pytest.mark.parametrize("bad, error, match", [
    (2, TypeError, "policy must be a callable"),
    ([SIN], TypeError, "policy must be a callable"),
    ("save-some", ValueError, "unknown policy"),
], ids=["int", "op_list", "unknown_string"])
def test_bad_policy_is_refused_when_built(bad, error, match):
    with pytest.raises(error, match=match):
        remat(torch.sin, policy=bad)


def test_bad_policy_names_are_refused():
    with pytest.raises(TypeError, match="names must be strings"):
        policies.save_only_these_names(2)


def test_policy_answer_that_is_not_a_decision_raises(clean_after):
    with pytest.raises(RematError, match=r"returned 'yes' for aten\.sin\.default"):
        remat(lambda x: x.sin(), policy=lambda op, *a, **k: "yes")(leaf(3))


class SaveFirstSin:
    def __init__(self):
        self.sin_calls = 0

    def __call__(self, op, *args, **kwargs):
        if op is SIN:
            self.sin_calls += 1
            return self.sin_calls == 1
        return False


def test_stateful_policy_is_asked_once_per_forward_op():
    policy = SaveFirstSin()

    def fn(x):
        return x.sin().sin().sin()

    x = leaf(3)
    out = remat(fn, policy=policy)(x)
    assert policy.sin_calls == 3
    with OpCounter({SIN}) as sins:
        out.sum().backward()
    assert policy.sin_calls == 3  # not asked again in the recompute
    assert sins.count == 1  # the first sin was kept, the last one is needed by nothing
    x2 = fresh(x)
    fn(x2).sum().backward()
    close64(x.grad, x2.grad)


@pytest.mark.parametrize("policy", ["save-everything", "save-nothing"])
def test_intermediate_storage_dies_with_the_graph(policy):
    def make():
        states = []

        def fn(x):
            e = x.cos().exp()
            if not states:
                states.append(watch_storage(e))
            return e.sin()

        return fn, states

    with no_gc():
        fn, states = make()
        out = remat(fn, policy=policy)(torch.randn(3, requires_grad=True))
        assert states[0]["alive"] is (policy == "save-everything")
        del out  # graph dropped without a backward
        assert not states[0]["alive"]

        fn, states = make()
        out = remat(fn, policy=policy)(torch.randn(3, requires_grad=True))
        out.sum().backward()
        assert not states[0]["alive"]

        fn, states = make()
        out = remat(fn, policy=policy)(torch.randn(3, requires_grad=True))
        out.sum().backward(retain_graph=True)
        del out
        assert not states[0]["alive"]


def test_kept_value_mutated_in_place_is_refused_or_correct():
    def fn(x):
        return x.sin().mul_(2).cos().exp()

    x = leaf(3)
    try:
        remat(fn, policy=save_the_sin)(x).sum().backward()
    except RuntimeError as e:
        assert re.search("modified|mutated|in[- ]place", str(e)), e
        return
    x2 = fresh(x)
    fn(x2).sum().backward()
    close64(x.grad, x2.grad)


def test_policy_keeps_both_outputs_of_var_mean():
    asked = [0]

    def policy(op, *args, **kwargs):
        if op is torch.ops.aten.var_mean.correction:
            asked[0] += 1
            return True
        return False

    def fn(x):
        a, b = torch.var_mean(x)
        return a * b

    x = leaf(3)
    out = remat(fn, policy=policy)(x)
    with OpCounter({torch.ops.aten.var_mean.correction}) as var_means:
        (g,) = torch.autograd.grad(out.sum(), (x,))
    assert asked[0] >= 1
    assert var_means.count == 0  # not run again in the backward pass
    close64(g, torch.autograd.grad(fn(x).sum(), (x,))[0])


def test_kept_op_with_a_non_tensor_output_is_not_run_again():
    def fn(x):
        return (torch.ops.remat_peer_tests.sin_with_extra(x)[0] * x.sin().exp()).sin()

    policy = lambda op, *a, **k: op is torch.ops.remat_peer_tests.sin_with_extra.default  # noqa: E731
    x = leaf(3)
    SIN_WITH_EXTRA_CALLS[0] = 0
    out = remat(fn, policy=policy)(x)
    (g,) = torch.autograd.grad(out.sum(), (x,))
    assert SIN_WITH_EXTRA_CALLS[0] == 1
    close64(g, torch.autograd.grad(fn(x).sum(), (x,))[0])
