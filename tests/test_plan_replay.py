"""Later calls follow the plan their signature's first call left (NOTE [fast path] and NOTE [planned calls] in
``remat/_engine/plans.py``): exact, and recomputing what the first call recomputed.

A signature's first call runs the full engine and records; later calls run with saved-tensor hooks only
(save-nothing) or under the planned call's small dispatch mode (every other policy). Whether a call ran fast is
observed from inside the function, independently of remat's bookkeeping (``Probe``: the full engine's recorder is
a ``TorchDispatchMode`` of ``remat._dispatch`` on the stack, the fast path's are ``Tap``, ``Replay`` and ``ValueReplay`` of ``remat._engine``).
Gradients are compared with the plain function under the same inputs (float64 tight, float32 bitwise); what the
backward pass recomputes is counted from outside with ``OpCounter``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from remat import policies, remat
from remat.bench.measure import live_bytes_after

from .helpers import PLAN_POLICIES, OpCounter, Probe, assert_tree_close, chain, f32, f64, grads, leaf, mlp

# ---- save-nothing: later calls run with saved-tensor hooks only, exact ---------------------------------------------


@pytest.mark.parametrize("dtype", [f64, f32], ids=["f64", "f32"])
def test_later_calls_run_fast_and_exact(dtype):
    probe = Probe()
    f = chain(probe)
    W, b, x = leaf(8, 8, dtype=dtype), leaf(8, dtype=dtype, seed=1), leaf(4, 8, dtype=dtype, seed=2)
    ref = grads(f, (W, b, x), (W, b, x))
    g = remat(f)
    probe.modes.clear()
    for _ in range(3):
        assert_tree_close(grads(g, (W, b, x), (W, b, x)), ref)
    # per call: the forward, then the recompute; the first call (forward and recompute) records
    assert probe.fast_calls() == [False, False, True, True, True, True]


def test_recompute_stops_after_the_last_dropped_tensor():
    seen = []

    def f(W, x):
        h = torch.tanh(x @ W)
        seen.append("a")
        h = torch.sin(h)  # saves tanh's output again: the last tensor to drop
        seen.append("b")
        out = (h * 3).sum()  # saves nothing: the recompute need not get here
        seen.append("c")
        return out

    W, x = leaf(4, 4), leaf(2, 4, seed=1)
    g = remat(f)
    for _ in range(2):
        seen.clear()
        g(W, x).backward()
    assert seen == ["a", "b", "c", "a"]


def test_double_backward_and_second_backward():
    probe = Probe()
    f = chain(probe)
    W, b, x = leaf(6, 6), leaf(6, seed=1), leaf(3, 6, seed=2)
    g = remat(f)
    g(W, b, x).sum().backward()  # records
    W.grad = None
    (gW,) = grads(f, (W, b, x), (W,), create_graph=True)
    ref = torch.autograd.grad(gW.pow(2).sum(), (W, x))
    (gW2,) = grads(g, (W, b, x), (W,), create_graph=True)
    assert_tree_close(torch.autograd.grad(gW2.pow(2).sum(), (W, x)), ref)
    # retain_graph: a second backward pass recomputes again
    out = g(W, b, x).sum()
    first = torch.autograd.grad(out, (W,), retain_graph=True)
    assert_tree_close(torch.autograd.grad(out, (W,)), first)
    assert probe.fast_calls()[-3:] == [True, True, True]


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
    assert rematted._inner._plans and all(p is not None for p in rematted._inner._plans.values())


def test_hf_gpt2_blocks_take_the_fast_path():
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
        return torch.autograd.grad(loss, list(model.parameters()))

    refs = [step(s) for s in range(3)]
    remat_modules(model, type(model.transformer.h[0]))
    for s in range(3):
        assert_tree_close(step(s), refs[s])
    plans = [p for blk in model.transformer.h for p in blk.forward._plans.values()]
    assert plans and all(p is not None for p in plans)


# ---- every other policy: a planned call recomputes what the recorded call did, exact -------------------------------


@pytest.mark.parametrize("dtype", [f64, f32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", list(PLAN_POLICIES))
def test_planned_calls_exact(name, dtype):
    W1, W2, x = leaf(8, 8, dtype=dtype), leaf(8, 8, dtype=dtype, seed=1), leaf(4, 8, dtype=dtype, seed=2)
    ref = grads(mlp, (W1, W2, x), (W1, W2, x))
    g = remat(mlp, policy=PLAN_POLICIES[name])
    for _ in range(3):
        assert_tree_close(grads(g, (W1, W2, x), (W1, W2, x)), ref)
    assert g._plans and all(p is not None for p in g._plans.values())


@pytest.mark.parametrize("name,matmuls", [("dots", 0), ("custom", 0), ("names", 2)])
def test_planned_calls_replay_what_the_policy_saves(name, matmuls):
    """Matmuls counted in the backward pass from outside: a planned call recomputes what the recorded one did."""
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


def test_planned_call_with_dropout_replays_random_numbers():
    def f(W, x):
        h = F.dropout(x @ W, 0.5, training=True)
        return torch.tanh(h @ W)

    W, x = leaf(8, 8), leaf(4, 8, seed=1)
    g = remat(f, policy=policies.dots_saveable)
    for step in range(3):
        torch.manual_seed(step)
        ref = grads(f, (W, x), (W, x))
        torch.manual_seed(step)
        assert_tree_close(grads(g, (W, x), (W, x)), ref)
    assert list(g._plans.values())[0].random


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
    for _ in range(3):  # the recorded call, then planned ones
        loss, _ = live_bytes_after(lambda: f(W, X).pow(2).sum())
        assert_tree_close(torch.autograd.grad(loss, W)[0], ref, rtol=1e-10, atol=1e-10)
