"""remat under ``torch.compile`` (NOTE [compiled remat] in ``remat/_engine/compiled.py``).

Every gradient test compares the compiled model whose blocks are remat'd with the
same model compiled without remat, same backend: ``aot_eager`` in float64 to 1e-10,
``inductor`` in float32 at the tolerance of torch's own compile tests. A counting
backend proves that the remat'd code was compiled (how many graphs), and the bytes
the compiled forward keeps for the backward pass are weighed from torch's autograd
graph (``remat.bench.measure.saved_bytes``, not remat's bookkeeping), against the
same model compiled with ``torch.utils.checkpoint`` and selective checkpointing.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.backends.registry import lookup_backend
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import remat
from remat import checkpoint_name, policies
from remat._engine.compiled import CompiledPolicy
from remat.bench.configs import TORCH_MATMULS
from remat.bench.measure import live_bytes_after, saved_bytes

from .helpers import assert_tree_close

F64 = {"rtol": 1e-10, "atol": 1e-10}
# torch's compile tests (torch._dynamo.testing / utils.same) compare float32 at 1e-4
F32_INDUCTOR = {"rtol": 1e-4, "atol": 1e-5, "exact_float32": False}
needs_outputs = pytest.mark.skipif(not torch.__version__ >= "2.13", reason="the policy hook sees op outputs on 2.13+")
POLICIES: dict[str, Any] = {
    "save-nothing": "save-nothing",
    "save-matmuls": "save-matmuls",
    "names": policies.save_only_these_names("attn", "act"),
}


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Counting:
    """A backend that counts the graphs Dynamo hands it, then compiles them with ``backend``."""

    def __init__(self, backend: str) -> None:
        self.backend = lookup_backend(backend)
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.graphs += 1
        return self.backend(gm, example_inputs)


def tiny(model: str, dtype: torch.dtype) -> tuple[Any, torch.Tensor, Callable[..., torch.Tensor]]:
    cfg = {"transformer": {"blocks": 2, "batch": 2, "seq": 8, "d": 16, "heads": 2, "ff": 32},
           "cnn": {"blocks": 2, "batch": 2, "channels": 4, "hw": 8}}[model]
    from remat.bench import models

    params, x, _, apply = getattr(models, f"make_{model}")(**cfg, dtype=dtype)
    for p in params:
        for t in p.values():
            t.requires_grad_(True)
    return params, x, apply


def grads_of(fn: Callable[..., torch.Tensor], params: Any, x: torch.Tensor) -> list[torch.Tensor]:
    wrt = [t for p in params for t in p.values()]
    return list(torch.autograd.grad(fn(params, x), wrt))


def wrapped(apply: Callable[..., torch.Tensor], wrap: Callable[[Any], Any]) -> Callable[..., torch.Tensor]:
    return lambda params, x: apply(params, x, wrap)


def remat_wrap(policy: Any) -> Callable[[Any], Any]:
    return lambda f: remat.remat(f, policy=policy)


def torch_wrap(selective: bool) -> Callable[[Any], Any]:
    kw: dict[str, Any] = {"use_reentrant": False}
    if selective:
        kw["context_fn"] = functools.partial(create_selective_checkpoint_contexts, TORCH_MATMULS)
    return lambda f: (lambda *a: torch.utils.checkpoint.checkpoint(f, *a, **kw))


# ---- gradients ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("model", ["transformer", "cnn"])
def test_aot_eager_float64_equals_compiled_without_remat(model: str, policy: str) -> None:
    params, x, apply = tiny(model, torch.float64)
    ref = grads_of(torch.compile(apply, backend="aot_eager", fullgraph=True), params, x)
    be = Counting("aot_eager")
    got = grads_of(torch.compile(wrapped(apply, remat_wrap(POLICIES[policy])), backend=be, fullgraph=True), params, x)
    assert be.graphs == 1  # compiled, in one graph: remat is not run eagerly
    assert_tree_close(got, ref, **F64)
    eager = grads_of(apply, params, x)
    assert_tree_close(got, eager, **F64)


def mlp(W1: torch.Tensor, W2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    h = checkpoint_name(torch.tanh(x @ W1), "h")
    return torch.sin(h @ W2) @ W2


def test_inductor_float32_gradients_and_what_is_kept() -> None:
    """inductor (C++ kernels on this CPU): gradients equal the compiled function without remat, and the compiled
    forward keeps what the policy says."""
    g = torch.Generator().manual_seed(0)
    W1, W2 = (torch.randn(32, 32, generator=g, requires_grad=True) for _ in range(2))
    x = torch.randn(16, 32, generator=g)
    ins = (W1, W2, x)

    def run(fn: Callable[..., torch.Tensor]) -> tuple[list[torch.Tensor], int]:
        torch._dynamo.reset()
        be = Counting("inductor")
        loss = torch.compile(lambda *a: fn(*a).pow(2).sum(), backend=be, fullgraph=True)(*ins)
        assert be.graphs == 1
        return list(torch.autograd.grad(loss, [W1, W2], retain_graph=True)), saved_bytes(loss, inputs=ins)

    ref, plain = run(mlp)
    got, matmuls = run(remat.remat(mlp, policy="save-matmuls"))
    assert_tree_close(got, ref, **F32_INDUCTOR)
    got, names = run(remat.remat(mlp, policy=policies.save_only_these_names("h")))
    assert_tree_close(got, ref, **F32_INDUCTOR)
    _, nothing = run(remat.remat(mlp, policy="save-nothing"))
    # (equal to torch's selective checkpointing of the matmuls: under aot_eager below, one inductor compile less)
    assert nothing < matmuls < plain
    assert names - nothing == 16 * 32 * 4  # h, and nothing else


def test_remat_called_inside_forward_with_a_policy_built_there() -> None:
    """``remat(block, policy=policies.save_only_these_names(...))`` written inside the compiled function."""
    params, x, apply = tiny("transformer", torch.float64)

    def fn(params: Any, x: torch.Tensor) -> torch.Tensor:
        return apply(params, x, lambda f: remat.remat(f, policy=policies.save_only_these_names("attn")))

    be = Counting("aot_eager")
    got = grads_of(torch.compile(fn, backend=be, fullgraph=True), params, x)
    assert be.graphs == 1
    assert_tree_close(got, grads_of(apply, params, x), **F64)


# ---- what the compiled forward keeps --------------------------------------------------------------------------


def kept(fn: Callable[..., torch.Tensor], params: Any, x: torch.Tensor) -> int:
    loss = fn(params, x)
    return saved_bytes(loss, inputs=(params, x))


def test_the_compiled_program_keeps_what_the_policy_says() -> None:
    """remat save-nothing keeps what torch.utils.checkpoint keeps, save-matmuls what torch's selective
    checkpointing of the matmuls keeps, names in between; all less than no remat, measured on torch's graph."""
    params, x, apply = tiny("transformer", torch.float32)

    def compiled(wrap: Callable[[Any], Any]) -> int:
        torch._dynamo.reset()
        return kept(torch.compile(wrapped(apply, wrap), backend="aot_eager", fullgraph=True), params, x)

    plain = compiled(lambda f: f)
    nothing, matmuls = compiled(remat_wrap("save-nothing")), compiled(remat_wrap("save-matmuls"))
    names = compiled(remat_wrap(policies.save_only_these_names("attn")))
    torch_ckpt, torch_sac = compiled(torch_wrap(False)), compiled(torch_wrap(True))
    assert nothing == torch_ckpt
    assert matmuls == torch_sac
    assert nothing < names < plain and nothing < matmuls < plain
    # the attention probabilities, saved under names: batch * heads * seq * seq floats per block
    assert names - nothing == 2 * (2 * 2 * 8 * 8) * 4


def test_saved_bytes_agrees_with_the_live_storage_census() -> None:
    """The two measures of retained memory, on eager autograd where both apply."""
    params, x, apply = tiny("transformer", torch.float32)
    _, live = live_bytes_after(lambda: apply(params, x))
    assert abs(kept(apply, params, x) - live) < 64  # a scalar made outside any op is seen only by the graph walk


def test_a_custom_callable_policy_is_honoured() -> None:
    sin = torch.ops.aten.sin.default

    def keep_sin(op: Any, *args: Any, **kwargs: Any) -> bool:
        return op is sin

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x).exp().sum()

    x = torch.randn(1000, dtype=torch.float64, requires_grad=True)
    held = {}
    for pol in ["save-nothing", keep_sin]:
        torch._dynamo.reset()
        fn = torch.compile(remat.remat(f, policy=pol), backend="aot_eager", fullgraph=True)
        loss = fn(x)
        held[pol if isinstance(pol, str) else "sin"] = saved_bytes(loss, inputs=x)
        assert_tree_close(torch.autograd.grad(loss, x), torch.autograd.grad(f(x), x), **F64)
    assert held["sin"] - held["save-nothing"] == 1000 * 8


# ---- models ----------------------------------------------------------------------------------------------------


def test_batchnorm_cnn_module_updates_running_stats_once() -> None:
    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3)).double()

    x = torch.randn(2, 3, 10, 10, dtype=torch.float64)
    ref, r = net(), net()
    remat.remat_modules(r, nn.Sequential, policy="save-matmuls")
    if not torch.__version__ >= "2.13":  # the policy hook cannot tell BatchNorm's writes from unsafe ones
        with pytest.raises(Exception, match="RematError"):
            torch.compile(r, backend="aot_eager")(x)
        return
    be = Counting("aot_eager")
    torch.compile(r, backend=be)(x).sum().backward()
    torch.compile(ref, backend="aot_eager")(x).sum().backward()
    assert be.graphs >= 1
    assert_tree_close([p.grad for p in r.parameters()], [p.grad for p in ref.parameters()], **F64)
    assert_tree_close(list(r.buffers()), list(ref.buffers()), **F64)
    assert int(r[1].num_batches_tracked) == 1


def test_gpt2_stack_compiled() -> None:
    policy = "save-matmuls"
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=4, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).double()
    r = copy.deepcopy(model)
    assert remat.remat_modules(r, transformers.models.gpt2.modeling_gpt2.GPT2Block, policy=policy) == ["transformer.h.0"]
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    be = Counting("aot_eager")
    loss = torch.compile(r, backend=be)(input_ids=ids, labels=ids).loss
    loss.backward()
    model(input_ids=ids, labels=ids).loss.backward()  # (compiled-vs-compiled: the reference models above)
    assert be.graphs >= 1
    assert_tree_close({k: p.grad for k, p in r.named_parameters()}, {k: p.grad for k, p in model.named_parameters()},
                      **F64)


# ---- graph breaks, randomness, arguments -----------------------------------------------------------------------


def test_graph_breaks_inside_the_remat_function_are_exact(capsys: pytest.CaptureFixture[str]) -> None:
    def block(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ W)
        print("inside")
        if h.sum() > 0:  # data-dependent
            h = h * 2
        return h @ W

    W = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    for x in (torch.randn(4, 8, dtype=torch.float64), -torch.ones(4, 8, dtype=torch.float64)):
        fn = torch.compile(lambda W, x: remat.remat(block, policy="save-matmuls")(W, x).sum(), backend="aot_eager")
        got = torch.autograd.grad(fn(W, x), W)
        assert_tree_close(got, torch.autograd.grad(block(W, x).sum(), W), **F64)
    assert "inside" in capsys.readouterr().out


@pytest.mark.parametrize("policy", ["save-nothing", "save-matmuls"])
def test_dropout_recompute_sees_the_same_mask(policy: str) -> None:
    def block(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(torch.tanh(x @ W), 0.5, training=True) @ W

    W = torch.randn(16, 16, dtype=torch.float64, requires_grad=True)
    x = torch.randn(8, 16, dtype=torch.float64)
    fn = torch.compile(lambda W, x: remat.remat(block, policy=policy)(W, x).sum(), backend="aot_eager", fullgraph=True)
    ref = torch.compile(lambda W, x: block(W, x).sum(), backend="aot_eager", fullgraph=True)
    torch.manual_seed(3)
    got = torch.autograd.grad(fn(W, x), W)
    torch.manual_seed(3)
    assert_tree_close(got, torch.autograd.grad(ref(W, x), W), **F64)


@needs_outputs
@pytest.mark.parametrize("policy", ["save-nothing", "save-matmuls", "save-everything"])
def test_in_place_ops_inside_the_region(policy: str) -> None:
    """torch warns that selective checkpointing under compile wants no in-place ops; functionalization makes
    them out-of-place copies before the policy sees them, and the gradients stay exact."""
    def block(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = x @ W
        h.add_(1)  # a saved matmul output written in place (the saved value is the one before the write)
        h = torch.relu(h)
        g = h @ W
        g.view(-1)[::2].mul_(3)  # through a view
        return torch.sin(g).add_(1)

    W = torch.randn(16, 16, dtype=torch.float64, requires_grad=True)
    x = torch.randn(8, 16, dtype=torch.float64)
    fn = torch.compile(lambda W, x: remat.remat(block, policy=policy)(W, x).pow(2).sum(), backend="aot_eager",
                       fullgraph=True)
    assert_tree_close(torch.autograd.grad(fn(W, x), W), torch.autograd.grad(block(W, x).pow(2).sum(), W), **F64)


def write_input(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    x.mul_(2)  # an input written in place, then read: the compiled recompute would read the written value
    return torch.tanh(x @ W) @ W


def write_through_a_view(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ W)
    x[0].mul_(2)
    return h @ W


def write_a_name(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    h = x @ W
    checkpoint_name(h, "h").add_(1)  # an alias in eager mode, a copy under compile
    return torch.sin(h) @ W


@pytest.mark.parametrize("block", [write_input, write_through_a_view, write_a_name])
def test_writes_that_compiled_recompute_would_get_wrong_raise(block: Callable[..., torch.Tensor]) -> None:
    W = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    f = remat.remat(block, policy=policies.save_only_these_names("h"))
    fn = torch.compile(lambda W, x: f(W, x).sum(), backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match=r"RematError: remat: aten\.\w+\.\w+ inside a remat'd function "
                       "under torch.compile (writes|reads)"):
        fn(W, torch.randn(3, 4, dtype=torch.float64))


def test_a_buffer_written_then_read_raises() -> None:
    class EMA(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4).double()
            self.register_buffer("avg", torch.zeros(4, dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.avg.mul_(0.5).add_(x.mean(0).detach())
            return torch.tanh(self.lin(x)) * self.avg

    m = remat.remat_module(EMA())
    with pytest.raises(Exception, match="RematError"):
        torch.compile(m, backend="aot_eager")(torch.randn(3, 4, dtype=torch.float64)).sum().backward()


def test_static_arguments_and_keywords() -> None:
    def block(W: torch.Tensor, x: torch.Tensor, scale: float, *, debug: bool = False) -> torch.Tensor:
        return torch.tanh(x @ W) * scale + (1.0 if debug else 0.0)  # 'debug' is also torch checkpoint's keyword

    W = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 8, dtype=torch.float64)
    f = remat.remat(block, static_argnums=2)
    fn = torch.compile(lambda W, x: f(W, x, 3.0, debug=True).sum(), backend="aot_eager", fullgraph=True)
    assert_tree_close(torch.autograd.grad(fn(W, x), W), torch.autograd.grad(block(W, x, 3.0, debug=True).sum(), W),
                      **F64)


def test_offload_under_compile_recomputes_and_warns_once_not_per_op_or_step() -> None:
    def f(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ W) @ W

    W = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 8, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("default")  # (Python's default for UserWarning: once per message and location)
        for _ in range(3):  # three compiled functions, two steps each, three ops the policy offloads in each
            fn = torch.compile(lambda W, x: remat.remat(f, policy=policies.offload_to_cpu(min_bytes=0))(W, x).sum(),
                               backend="aot_eager", fullgraph=True)
            got = torch.autograd.grad(fn(W, x), W)
            torch.autograd.grad(fn(W, x), W)
    shown = [str(w.message) for w in rec if "recomputes what it offloads" in str(w.message)]
    # once per traced region at most, and Python's registry hides repeats (torch's tracing resets it once: two)
    assert 1 <= len(shown) <= 2, shown
    assert_tree_close(got, torch.autograd.grad(f(W, x).sum(), W), **F64)


# ---- remat(torch.compile(f)) ---------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", list(POLICIES))
def test_remat_of_a_compiled_function_is_the_compiled_remat(policy: str) -> None:
    """remat(torch.compile(f)) means torch.compile(remat(f)), same backend and options (issue 39; before: a
    TypeError saying to swap them): compiled once per signature (counted by the backend), the gradients of eager
    autograd, and the compiled program keeps what torch.compile(remat(f)) keeps (measured on torch's graph)."""
    params, x, apply = tiny("transformer", torch.float64)
    be = Counting("aot_eager")
    compiled_then_remat = wrapped(apply, lambda f: remat.remat(torch.compile(f, backend=be, fullgraph=True),
                                                               policy=POLICIES[policy]))
    eager = grads_of(apply, params, x)
    assert_tree_close(grads_of(compiled_then_remat, params, x), eager, **F64)
    graphs = be.graphs
    assert graphs >= 1
    for _ in range(2):
        assert_tree_close(grads_of(compiled_then_remat, params, x), eager, **F64)
    assert be.graphs == graphs  # compiled once for this signature
    params32, x32, apply32 = tiny("transformer", torch.float32)
    swapped = kept(wrapped(apply32, lambda f: remat.remat(torch.compile(f, backend="aot_eager", fullgraph=True),
                                                          policy=POLICIES[policy])), params32, x32)
    torch._dynamo.reset()
    ordered = kept(wrapped(apply32, lambda f: torch.compile(remat.remat(f, policy=POLICIES[policy]),
                                                            backend="aot_eager", fullgraph=True)), params32, x32)
    torch._dynamo.reset()
    plain = kept(wrapped(apply32, lambda f: torch.compile(f, backend="aot_eager", fullgraph=True)), params32, x32)
    assert swapped == ordered < plain


def test_remat_of_a_compiled_module_and_remat_module_of_one() -> None:
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)).double()
    ref = copy.deepcopy(block)
    x = torch.randn(4, 8, dtype=torch.float64)
    be = Counting("aot_eager")
    compiled = torch.compile(block, backend=be)
    fn = remat.remat(compiled, policy="save-nothing")
    fn(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    assert be.graphs >= 1
    assert_tree_close([p.grad for p in block.parameters()], [p.grad for p in ref.parameters()], **F64)
    assert remat.remat_module(compiled, policy="save-matmuls") is compiled
    assert "forward" in vars(block)  # the original module rematerialized in place, compiled with it
    block.zero_grad()
    ref.zero_grad()
    compiled(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    assert_tree_close([p.grad for p in block.parameters()], [p.grad for p in ref.parameters()], **F64)


def test_remat_of_an_unknown_compiled_wrapper_raises_with_the_fix() -> None:
    """A compiled function behind a wrapper of the user's (a partial): remat cannot take its options apart."""
    compiled = torch.compile(lambda x, y: x.sin() + y, backend="aot_eager")
    with pytest.raises(TypeError, match=r"torch\.compile\(remat\(f, policy=\.\.\.\)\)"):
        remat.remat(functools.partial(compiled, y=1.0))


def test_remat_modules_on_a_compiled_model_rematerializes_its_blocks() -> None:
    """remat_modules(torch.compile(model), Block): the blocks are the original model's, compiled with it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)), nn.Tanh()).double()
    ref = copy.deepcopy(model)
    be = Counting("aot_eager")
    compiled = torch.compile(model, backend=be)
    assert remat.remat_modules(compiled, lambda name, m: name == "_orig_mod.0") == ["_orig_mod.0"]
    x = torch.randn(4, 8, dtype=torch.float64)
    loss = compiled(x).pow(2).sum()
    assert be.graphs == 1
    assert saved_bytes(loss, inputs=(list(model.parameters()), x)) < saved_bytes(ref(x).pow(2).sum(),
                                                                                  inputs=(list(ref.parameters()), x))
    loss.backward()
    ref(x).pow(2).sum().backward()
    assert_tree_close([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()], **F64)


# ---- the translated policy -----------------------------------------------------------------------------------


def test_compiled_policy_translates_decisions() -> None:
    mm, sin = torch.ops.aten.mm.default, torch.ops.aten.sin.default
    a = torch.ones(2, 2)
    assert CompiledPolicy(policies.dots_saveable)(None, mm, a, a) is CheckpointPolicy.MUST_SAVE
    assert CompiledPolicy(policies.dots_saveable)(None, sin, a) is CheckpointPolicy.PREFER_RECOMPUTE
    assert CompiledPolicy(policies.everything_saveable)(None, sin, a) is CheckpointPolicy.MUST_SAVE
    with pytest.raises(remat.RematError, match="returned 'yes'"):
        CompiledPolicy(lambda op, *a, **k: "yes")(None, sin, a)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert CompiledPolicy(policies.nothing_saveable)(None, mm, a, a) is CheckpointPolicy.PREFER_RECOMPUTE


def test_checkpoint_name_outside_compile_and_remat_is_the_value() -> None:
    x = torch.randn(3)
    assert checkpoint_name(x, "a") is x


# ---- torch.compile(g) called inside an eager remat'd function ------------------------------------------------


@pytest.mark.parametrize("policy", [*POLICIES, "offload"])
def test_a_compiled_function_inside_remat_leaves_remat_s_own_code_uncompiled(policy: str) -> None:
    """Dynamo compiled remat's handlers and the engine code its hooks call (40 frames, some ``lru_cache``-wrapped,
    which Dynamo warns may be silently wrong) when a compiled function ran inside a remat'd function: a mode's
    handler runs with its mode popped, and a hook with no mode at all. Dynamo's own frame count shows none now."""
    from torch._dynamo.utils import counters

    counting = Counting("eager")
    g = torch.compile(lambda h: torch.sin(h) @ h.T @ h * 2 + 1, backend=counting)

    def f(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return (g(x @ W) @ W).tanh()

    pol = policies.offload_to_cpu(min_bytes=0) if policy == "offload" else POLICIES[policy]
    rf = remat.remat(f, policy=pol)
    torch.manual_seed(0)
    W = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 4, dtype=torch.float64)
    counters.clear()
    got = [torch.autograd.grad(rf(W, x + i).sum(), W) for i in range(3)]  # the full engine, then planned calls
    assert dict(counters["frames"]) == {} and counting.graphs == 0
    want = [torch.autograd.grad(f(W, x + i).sum(), W) for i in range(3)]
    assert_tree_close(got, want, **F64)


@pytest.mark.parametrize("policy", [None, "save-matmuls"])
def test_torch_checkpoint_routed_to_remat_compiles(policy) -> None:
    """Inside ``route_torch_checkpoint``, torch.compile's checkpoint region ran its body through the routed
    function (torch imports its checkpoint by name at the call): ``BackendCompilerFailed`` in torch's partitioner.
    torch's own runs it now; the gradients are plain autograd's, and torch's function is back after the block."""
    import torch.utils.checkpoint as tuc

    torch.manual_seed(0)
    blk = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)).double()
    ref = copy.deepcopy(blk)
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    before = tuc.checkpoint
    with remat.route_torch_checkpoint(policy=policy):
        cf = torch.compile(lambda x: tuc.checkpoint(blk, x, use_reentrant=False).sin(), backend="aot_eager")
        cf(x).sum().backward()
    assert tuc.checkpoint is before
    x2 = x.detach().clone().requires_grad_()
    ref(x2).sin().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-10, atol=1e-12)
    for a, b in zip(blk.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
