"""Every call of a signature, the first and the later ones, on plain autograd (the replay engine): exact (float64
tight, float32 bitwise), the function's Python run once per call, and the backward pass recomputing what the policy
drops and nothing past the last dropped tensor.

What the backward pass runs is seen from outside (``OpLog``, ``OpCounter``): the ops it runs beyond plain
autograd's backward on the same function are the recompute's (``aten.detach`` is autograd's own unpacking, not a
recompute).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from remat import policies, remat
from remat.bench.measure import live_bytes_after

from .helpers import PLAN_POLICIES, OpCounter, OpLog, Probe, assert_tree_close, chain, f32, f64, grads, leaf, mlp

aten = torch.ops.aten


def recomputed(plain_out, out, wrt, **kw):
    """Run the backward passes of ``plain_out`` (plain autograd) and ``out`` (a remat call of the same function);
    return ``out``'s gradients and the ops its backward pass ran beyond plain autograd's, by overload."""
    with OpLog() as plain:
        torch.autograd.grad(plain_out, wrt, **kw)
    with OpLog() as log:
        got = torch.autograd.grad(out, wrt, **kw)
    extra = Counter(log.ops) - Counter(plain.ops)
    del extra[aten.detach.default]
    return got, extra


# ---- save-nothing: exact on every call, the recompute replays ops ---------------------------------------------------


@pytest.mark.parametrize("dtype", [f64, f32], ids=["f64", "f32"])
def test_every_call_is_exact_and_runs_the_python_once(dtype):
    probe = Probe()
    f = chain(probe)
    W, b, x = leaf(8, 8, dtype=dtype), leaf(8, dtype=dtype, seed=1), leaf(4, 8, dtype=dtype, seed=2)
    ref = grads(f, (W, b, x), (W, b, x))
    g = remat(f)
    for call in range(1, 4):
        probe.modes.clear()
        got, extra = recomputed(f(W, b, x).sum(), g(W, b, x).sum(), (W, b, x))
        assert_tree_close(got, ref)
        assert len(probe.modes) == 2  # the plain call's and remat's forward pass: no Python in the backward pass
        # save-nothing recomputes each layer (the last scaling's output is saved by nothing: not run again)
        assert extra == {aten.mm.default: 3, aten.sin.default: 3, aten.add.Tensor: 3, aten.tanh.default: 3,
                         aten.mul.Tensor: 2}, (call, extra)


def test_recompute_stops_after_the_last_dropped_tensor():
    seen = []

    def f(W, x):
        h = torch.tanh(x @ W)
        seen.append("a")
        h = torch.sin(h)  # saves tanh's output: the last tensor to drop
        seen.append("b")
        out = (h * 3).sum()  # saves nothing: the recompute need not get here
        seen.append("c")
        return out

    W, x = leaf(4, 4), leaf(2, 4, seed=1)
    g = remat(f)
    for _ in range(2):
        seen.clear()
        got, extra = recomputed(f(W, x), g(W, x), (W, x))
        assert seen == ["a", "b", "c"] * 2  # plain f's forward pass and remat's: the backward pass runs no Python
        assert extra == {aten.mm.default: 1, aten.tanh.default: 1}, extra  # no sin, no mul, no sum
        assert_tree_close(got, grads(f, (W, x), (W, x)))


def test_double_backward_and_second_backward():
    probe = Probe()
    f = chain(probe)
    W, b, x = leaf(6, 6), leaf(6, seed=1), leaf(3, 6, seed=2)
    g = remat(f)
    g(W, b, x).sum().backward()
    W.grad = None
    (gW,) = grads(f, (W, b, x), (W,), create_graph=True)
    ref = torch.autograd.grad(gW.pow(2).sum(), (W, x))
    (gW2,) = grads(g, (W, b, x), (W,), create_graph=True)
    assert_tree_close(torch.autograd.grad(gW2.pow(2).sum(), (W, x)), ref)
    # retain_graph: a second backward pass recomputes again (more tanhs than plain autograd's, each time), exact
    probe.modes.clear()
    out, plain = g(W, b, x).sum(), f(W, b, x).sum()
    first, extra = recomputed(plain, out, (W,), retain_graph=True)
    assert extra[aten.tanh.default] == 3
    second, extra = recomputed(plain, out, (W,))
    assert extra[aten.tanh.default] == 3
    assert_tree_close(second, first)
    assert len(probe.modes) == 2  # (the forward passes: no Python in either backward pass)


def test_module_with_dropout_replays_random_numbers():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.3), nn.Linear(16, 8), nn.LayerNorm(8)).double()
    x = leaf(4, 8)
    rematted = remat(block)
    for step in range(3):
        torch.manual_seed(step)
        ref = torch.autograd.grad(block(x).sum(), (x, *block.parameters()))
        torch.manual_seed(step)
        assert_tree_close(torch.autograd.grad(rematted(x).sum(), (x, *block.parameters())), ref)


def test_hf_gpt2_blocks_are_exact_and_recompute():
    transformers = pytest.importorskip("transformers")
    from remat import remat_modules

    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=101,
                                  resid_pdrop=0.1, attn_pdrop=0.1, embd_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).double()
    ids = torch.randint(0, 101, (2, 16))

    def step(seed):
        torch.manual_seed(seed)
        loss = model(ids, labels=ids).loss
        with OpCounter() as c:  # the matmuls of the backward pass
            got = torch.autograd.grad(loss, list(model.parameters()))
        return got, c.count

    refs = [step(s) for s in range(3)]
    remat_modules(model, type(model.transformer.h[0]))
    for s in range(3):
        got, matmuls = step(s)
        assert_tree_close(got, refs[s][0])
        assert matmuls > refs[s][1]  # save-nothing: the blocks' matmuls run again in the backward pass


# ---- every policy: each call recomputes what the policy drops, exact ----------------------------------------------


@pytest.mark.parametrize("dtype", [f64, f32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", list(PLAN_POLICIES))
def test_every_call_exact(name, dtype):
    W1, W2, x = leaf(8, 8, dtype=dtype), leaf(8, 8, dtype=dtype, seed=1), leaf(4, 8, dtype=dtype, seed=2)
    ref = grads(mlp, (W1, W2, x), (W1, W2, x))
    g = remat(mlp, policy=PLAN_POLICIES[name])
    for _ in range(3):
        assert_tree_close(grads(g, (W1, W2, x), (W1, W2, x)), ref)


@pytest.mark.parametrize("name,matmuls", [("dots", 0), ("custom", 0), ("names", 2)])
def test_calls_recompute_what_the_policy_drops(name, matmuls):
    """Matmuls counted in the backward pass from outside: no kept product is recomputed, on every call; under the
    names policy the two untagged products are."""
    W1, W2, x = leaf(8, 8), leaf(8, 8, seed=1), leaf(4, 8, seed=2)
    g = remat(mlp, policy=PLAN_POLICIES[name])
    counts = []
    for _ in range(3):
        out = g(W1, W2, x).sum()
        with OpCounter() as c:
            out.backward()
        counts.append(c.count)
    # plain autograd runs 6 matmuls in this backward pass (2 per mm); the recompute adds its own
    assert counts[0] == counts[1] == counts[2] == 6 + matmuls, counts


def test_a_call_with_dropout_replays_random_numbers():
    """The recompute replays the dropout's mask (save-matmuls drops it), and the call draws from the generator what
    plain autograd draws: the next random numbers are the same too."""

    def f(W, x):
        h = F.dropout(x @ W, 0.5, training=True)
        return torch.tanh(h @ W)

    W, x = leaf(8, 8), leaf(4, 8, seed=1)
    g = remat(f, policy=policies.dots_saveable)
    for step in range(3):
        torch.manual_seed(step)
        ref = (*grads(f, (W, x), (W, x)), torch.rand(3))
        torch.manual_seed(step)
        assert_tree_close((*grads(g, (W, x), (W, x)), torch.rand(3)), ref)


@pytest.mark.parametrize("policy", ["save-nothing", "save-matmuls"])
def test_forward_under_a_users_dispatch_mode_and_backward_outside(policy: str) -> None:
    """A memory census (a Python dispatch mode) around the forward pass only: torch decomposes the reshape into
    ``_reshape_alias`` there and into ``view`` in the recompute, which runs outside it. The same view: not a
    divergence (a false RematError before, found by review), and the gradients are exact."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(64, 64, generator=g, dtype=torch.float64, requires_grad=True)
    X = torch.randn(32, 64, generator=g, dtype=torch.float64)

    def attn(W: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
        q = (X @ W).view(32, 4, 16).transpose(0, 1)
        o = F.scaled_dot_product_attention(q, q, q)
        return F.softmax(o.transpose(0, 1).reshape(32, 64) @ W, -1)

    ref = torch.autograd.grad(attn(W, X).pow(2).sum(), W)[0]
    f = remat(attn, policy=policy)
    for _ in range(3):
        loss, _ = live_bytes_after(lambda: f(W, X).pow(2).sum())
        assert_tree_close(torch.autograd.grad(loss, W)[0], ref, rtol=1e-10, atol=1e-10)
