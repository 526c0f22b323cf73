"""What the recompute hands the backward pass, on the first and later calls of a signature: bitwise plain
autograd's gradients, with the function's Python run once per call (the recompute replays its ATen ops) and more ops
in the backward pass than plain autograd's (the recompute's, seen from outside); a double backward, a function that
runs other ops without grad mode, hooks on intermediates; the tensor handed back is the one the node saved (written
values, factories, the data's choice, parameters).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat import RematError, checkpoint_name, policies, remat, remat_module

from .helpers import PLAN_POLICIES, OpLog, SquareWritingItsSaved, assert_tree_close, f32, f64, grads, leaf, mlp

# ---- exact, the Python run once, a recompute in the backward pass ---------------------------------------------------


class GradModes:
    """Inside the function: whether grad mode was on, per run of its Python (each forward pass; a recompute that ran
    the Python again would add one)."""

    def __init__(self, fn):
        self.fn, self.modes = fn, []

    def __call__(self, *args):
        self.modes.append(torch.is_grad_enabled())
        return self.fn(*args)


def block(params, x):
    from remat.bench.models import transformer_block

    return transformer_block(params, x, 2)


def block_inputs(dtype):
    from remat.bench.models import make_transformer

    params, x, _, _ = make_transformer(blocks=1, batch=2, seq=8, d=16, heads=2, ff=32, dtype=dtype)
    params = [{k: v.requires_grad_() for k, v in p.items()} for p in params] if isinstance(params, list) else params
    return params, x.requires_grad_()


VALUE_CASES = {  # (function, policy): each drops tensors and holds others for its recompute
    "block-dots": ("block", policies.dots_saveable),
    "block-names": ("block", policies.save_only_these_names("attn")),
    "mlp-dots": ("mlp", policies.dots_saveable),
    "mlp-names": ("mlp", policies.save_only_these_names("mid")),
    "mlp-custom": ("mlp", PLAN_POLICIES["custom"]),
    "mlp-offload-matmuls": ("mlp", policies.offload_dot_with_no_batch_dims("cpu", "cpu")),
}


@pytest.mark.parametrize("dtype", [f64, f32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", list(VALUE_CASES))
def test_a_recompute_is_exact_and_runs_no_python(case, dtype):
    """Each call's backward pass runs more ops than plain autograd's (a recompute ran) and the function's Python
    ran once per call, in its forward pass, with grad mode on; gradients bitwise equal to plain autograd's."""
    which, policy = VALUE_CASES[case]
    if which == "block":
        params, x = block_inputs(dtype)
        fn, args = block, (params[0] if isinstance(params, list) else params, x)
    else:
        fn, args = mlp, (leaf(8, 8, dtype=dtype), leaf(8, 8, dtype=dtype, seed=1), leaf(4, 8, dtype=dtype, seed=2))
    wrt = [t for t in torch.utils._pytree.tree_leaves(args) if t.requires_grad]
    plain_out = fn(*args).sum()
    with OpLog() as plain:
        ref = torch.autograd.grad(plain_out, wrt)
    probe = GradModes(fn)
    g = remat(probe, policy=policy)
    for _ in range(3):
        out = g(*args).sum()
        with OpLog() as log:
            got = torch.autograd.grad(out, wrt)
        assert all(torch.equal(a, b) for a, b in zip(got, ref))  # (the same kernels: bitwise)
        assert len(log.ops) > len(plain.ops)
    assert probe.modes == [True, True, True], probe.modes


def test_a_recompute_for_a_double_backward_is_exact():
    """create_graph=True: the backward pass differentiates what the recompute made; the double backward's gradients
    are plain autograd's, and the function's Python ran once per call."""
    W1, W2, x = leaf(8, 8), leaf(8, 8, seed=1), leaf(4, 8, seed=2)
    probe = GradModes(mlp)
    g = remat(probe, policy=policies.dots_saveable)
    g(W1, W2, x).sum().backward()
    gw = grads(g, (W1, W2, x), (W1,), create_graph=True)[0]
    want = grads(mlp, (W1, W2, x), (W1,), create_graph=True)[0]
    assert_tree_close(torch.autograd.grad(gw.pow(2).sum(), (W2, x)), torch.autograd.grad(want.pow(2).sum(), (W2, x)))
    assert probe.modes == [True, True], probe.modes


def test_a_function_that_runs_other_ops_without_grad_mode_is_exact():
    """torch's TransformerEncoderLayer in eval mode takes its fused path when grad mode is off (one op instead of
    ~40): the recompute must make what the forward pass (grad mode on) made; gradients exact on every call, the
    Python run once per call."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dtype=f64).eval()
    x = leaf(2, 5, 16)
    ref = grads(layer, (x,), (x, *layer.parameters()))
    probe = GradModes(layer)
    g = remat(probe, policy=policies.dots_saveable)
    for _ in range(3):
        assert_tree_close(grads(g, (x,), (x, *layer.parameters())), ref)
    assert probe.modes == [True, True, True], probe.modes


@pytest.mark.parametrize("what", ["register_hook", "retain_grad"])
def test_a_function_that_needs_grad_mode_is_exact(what):
    """Review: ``h.register_hook`` or ``h.retain_grad()`` on an intermediate raises without grad mode: a recompute
    that ran the Python without a graph would fail; the hook runs once per backward pass, exact on every call."""
    def f(W, x):
        h = torch.sin(x @ W)
        if what == "register_hook":
            h.register_hook(lambda g: g * 2)
        else:
            h.retain_grad()
        return torch.tanh(h @ W)

    W, x = leaf(8, 8), leaf(4, 8, seed=1)
    ref = grads(f, (W, x), (W, x))
    probe = GradModes(f)
    g = remat(probe, policy=policies.dots_saveable)
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(grads(g, (W, x), (W, x)), ref))
    assert probe.modes == [True, True, True], probe.modes



@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU])
@pytest.mark.parametrize("policy", ["save-nothing", "save-matmuls", "offload"])
def test_a_kernel_that_reads_grad_mode_is_replayed_with_it(cls, policy):
    """Review (twenty-eighth session): in float32 on the CPU ``nn.LSTM`` runs ``mkldnn_rnn_layer``, which makes the
    workspace its backward reads only with grad mode on; the backward pass runs with grad mode off, so a replay
    without it made no workspace ("internal error: the replay has no value for slot"). Bitwise plain autograd's
    gradients on every call, the Python run once per call."""
    torch.manual_seed(0)
    m = cls(4, 5, num_layers=2, batch_first=True, dtype=f32)
    x = leaf(2, 5, 4, dtype=f32)
    ref = grads(lambda x: m(x)[0], (x,), (x, *m.parameters()))
    probe = GradModes(lambda x: m(x)[0])
    p = policies.offload_to_cpu(min_bytes=0) if policy == "offload" else policy
    g = remat(probe, policy=p)
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(grads(g, (x,), (x, *m.parameters())), ref))
    assert probe.modes == [True, True, True], probe.modes

@pytest.mark.parametrize("policy", ["save-nothing", "save-matmuls", "offload", "budget", "debug"])
def test_a_backward_pass_under_inference_mode_is_exact(policy):
    """Review (twenty-eighth session): ``torch.autograd.grad`` called under ``torch.inference_mode()`` works in plain
    autograd; the recompute made inference tensors there, and remat's version checks raised torch's "Inference
    tensors do not track version counter." (a memory budget's re-run diverged: "aten.mm ... aten.matmul now").
    Bitwise plain autograd's gradients on three calls."""
    W = leaf(4, 4, dtype=f32)

    def f(x):
        return torch.tanh(x @ W).exp()

    p = {"offload": policies.offload_to_cpu(min_bytes=0), "budget": policies.memory_budget(0.5),
         "debug": "save-nothing"}.get(policy, policy)
    g = remat(f, policy=p, debug=policy == "debug")
    x = leaf(3, 4, dtype=f32, seed=1)
    for _ in range(3):
        outs = []
        for fn in (f, g):
            loss = fn(x).sum()
            with torch.inference_mode():
                outs.append(torch.autograd.grad(loss, (x, W)))
        assert all(torch.equal(a, b) for a, b in zip(*outs))


# ---- the tensor the recompute hands back is the one the node saved --------------------------------------------------


@pytest.mark.parametrize("name", ["dots", "custom"])
def test_a_dropped_tensor_written_before_it_was_saved_comes_back_written(name):
    """A tensor written in place between the op that made it and the op that saved it: the recompute hands back the
    written value with its version; exact, no false RematError, the Python run once per call. A write after the
    save raises, as in plain autograd (NOTE [written after saved])."""
    def f(W, x, after=False):
        h = torch.sin(x @ W)
        h.mul_(1.5)
        y = torch.sin(h) @ W  # sin saves h
        if after:
            h.add_(1)
        return torch.tanh(y)  # tanh saves its output, dropped: the recompute runs past the write

    W, x = leaf(8, 8), leaf(4, 8, seed=1)
    ref = grads(f, (W, x), (W, x))
    probe = GradModes(f)
    g = remat(probe, policy=PLAN_POLICIES[name])
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(grads(g, (W, x), (W, x)), ref))
    assert probe.modes == [True, True, True], probe.modes
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        grads(f, (W, x, True), (W, x))
    g2 = remat(lambda W, x: f(W, x, True), policy=PLAN_POLICIES[name])
    for _ in range(3):
        with pytest.raises(RematError, match="modified a tensor .* in place after an op saved it"):
            grads(g2, (W, x), (W, x))


@pytest.mark.parametrize("view", [False, True])
@pytest.mark.parametrize("name", ["dots", "custom"])
def test_a_backward_that_writes_a_recomputed_tensor_another_node_reads_raises(name, view):
    """Review: a node's backward writes the recomputed tensor it read, which another node saved too (or a view of
    it): plain autograd raises, and so must every call (versions noted in the recompute and compared when read; not
    noting them gave a wrong gradient without an error)."""
    def f(x, w):
        a = (x @ w).sin()
        other = (a.t() @ x).sum() if view else a.cos().sum()
        return other + SquareWritingItsSaved.apply(a).sum()

    x, w = leaf(4, 8), leaf(8, 8, seed=1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(f(x, w), (x, w))
    probe = GradModes(f)
    g = remat(probe, policy=PLAN_POLICIES[name])
    for _ in range(3):
        with pytest.raises(RematError, match="in place"):
            torch.autograd.grad(g(x, w), (x, w))
    assert probe.modes == [True, True, True], probe.modes


@pytest.mark.parametrize("factory", ["rand_like", "zeros_like", "randn"])
def test_a_factory_output_then_a_detach_of_your_own(factory):
    """Review: torch's binding detaches a factory's output that Python holds as it returns; an extra detach must not
    be taken for the function's own ``s.detach()`` (the dropped tensor would then come from the factory: a wrong
    gradient without an error). Bitwise exact on every call, under the same seed."""
    make = {"rand_like": torch.rand_like, "zeros_like": torch.zeros_like,
            "randn": lambda y: torch.randn(y.shape, dtype=y.dtype)}[factory]

    def f(W, x):
        y = x @ W
        s = torch.sin(y)
        r = make(y)
        d = s.detach()
        return (x * d).sum() + (r * y).sum()  # mul saves d, dropped

    W, x = leaf(8, 8), leaf(4, 8, seed=2)
    torch.manual_seed(0)
    ref = torch.autograd.grad(f(W, x), (W, x))
    probe = GradModes(f)
    g = remat(probe, policy=policies.dots_saveable)
    for _ in range(3):
        torch.manual_seed(0)
        got = torch.autograd.grad(g(W, x), (W, x))
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert probe.modes == [True, True, True], probe.modes


def test_a_named_parameter_updated_between_steps():
    """Review: a recompute that compared a dropped tensor's version with an earlier call's raised a false RematError
    on every later step: a ``checkpoint_name`` alias of a parameter shares its version counter, which an optimizer
    step moves. Bitwise plain autograd's gradients on every step."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.scale = nn.Parameter(torch.ones(8))

        def forward(self, x):
            s = checkpoint_name(self.scale, "scale")
            return torch.tanh(self.lin(x) * torch.sin(s) * s)  # sin and mul save s, dropped by dots_saveable

    def train(use_remat):
        torch.manual_seed(0)
        net = Block().double()
        if use_remat:
            remat_module(net, policy=policies.dots_saveable)
        opt = torch.optim.SGD(net.parameters(), lr=1e-2)
        x = leaf(4, 8, grad=False)
        out = []
        for _ in range(3):
            opt.zero_grad()
            net(x).pow(2).sum().backward()
            out.append([p.grad.clone() for p in net.parameters()])
            opt.step()
        return out

    for want, got in zip(train(False), train(True)):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("policy", ["dots", "custom"])
def test_a_dropped_tensor_chosen_by_the_data_is_recomputed_from_its_own_op(policy):
    """Which of two tensors of one shape a node saves depends on the data. A recompute that took each dropped tensor
    from the op an earlier call saw make it took the sine where this call had saved the cosine, a wrong gradient
    without an error. Exact on every call, whichever the data picks."""
    W = leaf(4, 4)

    def f(W, x):
        h = x @ W
        a, b = torch.sin(h), torch.cos(h)
        c = a if bool(x[0, 0] > 0) else b
        return (c * c).sum() + (a * b).sum()  # (a and b both saved: neither is dead)

    g = remat(f, policy=PLAN_POLICIES[policy])
    for sign in (1, -1, -1, 1, 1):
        x = leaf(3, 4, seed=1, grad=False).clone()
        x[0, 0] = sign * x[0, 0].abs()
        assert_tree_close(torch.autograd.grad(g(W, x), W), torch.autograd.grad(f(W, x), W))
