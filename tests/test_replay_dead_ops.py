"""Dead ops (an op whose outputs nothing the backward pass needs reads): the recompute does not run them; it hands
back the output a policy kept instead of running its op again; which op is read may change with Python state or the
data from one call to the next, exactly; a kept output written in place raises as plain autograd does.

What the backward pass runs is counted from outside (``OpCounter``), against plain autograd's backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from remat import checkpoint_name, policies, remat

from .helpers import OpCounter, assert_tree_close, grads, leaf

# ---- a dead op is not run; read on a later call, it is --------------------------------------------------------------


def test_a_dead_op_is_not_recomputed_and_read_on_a_later_call_is_exact():
    """Same ops, other wiring: an op no dropped tensor depends on (``cos``) is not run in the backward pass; when a
    later call reads it (Python state changed), its gradients are exact and the backward pass runs it again."""
    flip = {"on": False}
    cos = {torch.ops.aten.cos.default}

    def f(W, x):
        a = torch.sin(x @ W)
        b = torch.cos(x @ W)  # dead while flip is off: nothing the recompute needs reads it
        return torch.tanh(b if flip["on"] else a)

    W, x = leaf(6, 6), leaf(3, 6, seed=1)
    g = remat(f, policy=policies.dots_saveable)
    for on in (False, False, True, True):
        flip["on"] = on
        counts = []
        for fn in (f, g):
            out = fn(W, x)
            with OpCounter(cos) as c:
                counts.append((torch.autograd.grad(out.sum(), (W, x)), c.count))
        (ref, plain), (got, replayed) = counts
        assert_tree_close(got, ref)
        # tanh's output is dropped: made again from cos's output when it reads it (sin's own backward runs a cos)
        assert replayed == plain + (1 if on else 0), (on, plain, replayed)


@pytest.mark.parametrize("policy", ["save-matmuls", "save-everything"])
def test_dead_placeholder_read_as_a_number_falls_back(policy):
    def f(W, x):
        h = x @ W
        a, b = torch.sin(h).sum(), torch.cos(h).sum()
        v = (a if bool(x[0, 0] > 0) else b).item()  # which reduction is read depends on the data
        return torch.tanh(h * (2.0 if v > -100 else 3.0)).sum()

    W = leaf(4, 4)
    g = remat(f, policy=policy)
    for sign in (1, -1, -1):
        x = (leaf(4, 4, seed=1).detach().abs() * sign).requires_grad_()
        assert_tree_close(torch.autograd.grad(g(W, x), (W, x)), torch.autograd.grad(f(W, x), (W, x)))


# ---- a dead op whose outputs are kept is held, not a placeholder ---------------------------------------------------


def _attention_like(W, h):
    """Two tiny attention blocks. Each ``q`` is kept (the matmul after it saves it) and dead in the recompute,
    which hands back the held output of that matmul (dots_saveable)."""
    for _ in range(2):
        a = F.layer_norm(h, (h.shape[-1],))
        q = a @ W
        att = torch.softmax(q @ a.transpose(-1, -2), dim=-1)
        h = h + att @ a
    return h, q


@pytest.mark.parametrize("policy", ["save-matmuls", "custom"])
def test_a_dead_op_whose_output_is_kept_is_handed_back_without_a_placeholder(policy):
    pol = policies.dots_saveable if policy == "save-matmuls" else (
        lambda op, *a, **k: op in (torch.ops.aten.mm.default,))

    def f(W, h):
        return _attention_like(W, h)[0]

    W, h = leaf(4, 4), leaf(3, 4, seed=1)
    g = remat(f, policy=pol)
    for _ in range(3):
        out, ref_out = g(W, h), f(W, h)
        with OpCounter({torch.ops.aten.fill_.Scalar, torch.ops.aten.mm.default}) as c:
            got = torch.autograd.grad(out.sum(), (W, h))
        with OpCounter({torch.ops.aten.mm.default}) as plain:
            ref = torch.autograd.grad(ref_out.sum(), (W, h))
        assert_tree_close(got, ref, rtol=0, atol=0)
        # nothing filled as a placeholder, no matmul run again (the q matmuls are kept): the backward pass's own only
        assert c.count == plain.count


@pytest.mark.parametrize("write", ["inside, after its reader", "by the caller"])
def test_a_held_kept_output_written_raises_as_plain_autograd_does(write):
    def f(W, h):
        out, q = _attention_like(W, h)
        if write == "inside, after its reader":
            q.mul_(2)
            return out
        return out, q.detach()

    def run(fn):
        res = fn(W, h)
        if write == "by the caller":
            res, q = res
            q.add_(1)  # shares q's version counter: its saving node sees the write
        torch.autograd.grad(res.sum(), (W, h))

    W, h = leaf(4, 4), leaf(3, 4, seed=1)
    g = remat(f, policy=policies.dots_saveable)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(f)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="modified (by an inplace operation|in place)"):
            run(g)


def test_a_dead_op_s_kept_output_written_before_its_save_is_not_handed_back():
    """Found by the second review: which of two matmul outputs is written depends on the data; the recorded call
    wrote r, a later call wrote q before the next matmul saved it. Handing the written q back as its op's output
    let the recompute write it again, into the saved q (gradient of ``a`` 8.17 off, no error)."""
    W1, W2 = leaf(4, 4), leaf(4, 4, seed=1)

    def f(W1, W2, a):
        q = a @ W1
        r = a @ W2
        (q if bool(a[0, 0] > 0) else r).mul_(2)
        s = torch.softmax(q @ a.t(), -1)
        t = torch.softmax(r @ a.t(), -1)
        return (s + t) @ a

    g = remat(f, policy=policies.dots_saveable)
    for sign in (-1, 1, 1, 1):
        a = leaf(3, 4, seed=2).detach()
        a[0, 0] = sign * a[0, 0].abs()
        a1, a2 = a.clone().requires_grad_(), a.clone().requires_grad_()
        got = torch.autograd.grad(g(W1, W2, a1).sum(), (W1, W2, a1))
        assert_tree_close(got, torch.autograd.grad(f(W1, W2, a2).sum(), (W1, W2, a2)))


@pytest.mark.parametrize("policy", ["dots", "names"])
def test_a_write_the_data_aims_at_a_dead_ops_kept_output_is_not_handed_back_written_twice(policy):
    """A dead op's output kept for a save is handed back to the recompute; a later call that writes it through
    ``.data`` (no version moves; the first call wrote another tensor) must not replay the write into the tensor
    the node reads (written twice: a wrong gradient without an error)."""
    name = (lambda t: checkpoint_name(t, "mm")) if policy == "names" else (lambda t: t)

    def f(W, x):
        q = x @ W  # dead in the recompute: only the held matmul below reads it
        s = name(name(q) @ W)
        scratch = torch.zeros_like(s)
        target = q.data if bool(x.sum() > 0) else scratch.data  # which tensor is written is data
        target.mul_(2)
        return torch.tanh(s * 2).sum() + scratch.sum()

    g = remat(f, policy=policies.dots_saveable if policy == "dots" else policies.save_only_these_names("mm"))
    W = leaf(6, 6)
    below, above = -leaf(4, 6, seed=1, grad=False).abs(), leaf(4, 6, seed=2, grad=False).abs()
    x0, x1 = below.requires_grad_(), above.requires_grad_()
    assert_tree_close(grads(g, (W, x0), (W, x0)), grads(f, (W, x0), (W, x0)))  # the write is scratch's
    for _ in range(3):
        assert_tree_close(grads(g, (W, x1), (W, x1)), grads(f, (W, x1), (W, x1)), rtol=0, atol=0)


_KEEP_TANH_AND_BN = ("aten.tanh.default", "aten.native_batch_norm.default")


def _keep_tanh_and_bn(op, *args, **kwargs):
    return str(op) in _KEEP_TANH_AND_BN


def _all_but_factories(op, *args, **kwargs):
    return not any(s in str(op) for s in ("zeros", "ones", "empty"))


@pytest.mark.parametrize("policy", [_keep_tanh_and_bn, _all_but_factories, "save-nothing"],
                         ids=["keep tanh and bn", "all but factories", "save-nothing"])
@pytest.mark.parametrize("transform", ["grad", "vjp", "jacrev", "debug"])
def test_a_write_its_schema_hides_keeps_its_op_live(policy, transform):
    """Batch norm statistics the function makes itself (``torch.zeros``/``ones``), written by a training-mode batch norm
    (a write its schema hides) and read and saved by an eval-mode one, with a policy that keeps the batch norms'
    outputs but not the factories': the full engine's liveness walk took the writing batch norm for dead (nothing
    reads its outputs) and the value it reads for a placeholder, so the statistics the backward pass read were NaN:
    every gradient NaN under ``torch.func.grad``, ``vjp`` and ``jacrev``, without an error (NOTE [dead ops])."""

    def f(w, x):
        h = torch.tanh(x @ w)
        rm = torch.zeros(4, dtype=h.dtype)
        rv = torch.ones(4, dtype=h.dtype)
        F.batch_norm(h, rm, rv, training=True, momentum=0.5)
        b = F.batch_norm(h, rm, rv, training=False)
        return (b * b).sum()

    g = remat(f, policy=policy, debug=transform == "debug")
    func = torch.func
    run = {
        "grad": lambda fn, w, x: func.grad(fn)(w, x),
        "debug": lambda fn, w, x: func.grad(fn)(w, x),
        "vjp": lambda fn, w, x: func.vjp(fn, w, x)[1](torch.tensor(1.0, dtype=torch.float64))[0],
        "jacrev": lambda fn, w, x: func.jacrev(fn)(w, x),
    }[transform]
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4, 4, dtype=torch.float64, generator=gen)
    for _ in range(3):
        x = torch.randn(3, 4, dtype=torch.float64, generator=gen)
        torch.testing.assert_close(run(g, w, x), run(f, w, x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("policy", ["budget", "save-nothing"])
def test_a_write_is_never_run_on_a_placeholder_of_an_unused_op(policy) -> None:
    """A double backward reaches the forward's nodes through the first backward's graph, not through the outputs: a
    memory budget's first call skipped the ops that made ``nn.Embedding(max_norm=1.0)``'s indices as unused (NOTE
    [unused outputs]) and ran ``embedding_renorm_`` of the weight at their placeholders' uninitialised values
    (``IndexError: index 22986233510``; in range, it would have renormalised rows of the weight the forward did not
    touch). A write of a real tensor that reads a placeholder makes the recompute run in full."""

    class Emb(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.e = torch.nn.Embedding(10, 4, max_norm=1.0)

        def forward(self, x):
            idx = (x.abs() * 3).long().clamp(max=9)[..., 0]
            return self.e(idx).sin() * x[..., :1]

    results = []
    for wrap in ("plain", policy):
        torch.manual_seed(0)
        m = Emb().double()
        with torch.no_grad():
            m.e.weight.mul_(3)  # (rows with norms above max_norm: a renorm of a row the forward did not read shows)
        pol = policies.memory_budget(0.5) if wrap == "budget" else wrap
        fn = m.forward if wrap == "plain" else remat(m.forward, policy=pol)
        x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
        out = fn(x)
        loss = (out * torch.cos(torch.arange(12, dtype=torch.float64) * 0.7 + 0.3).reshape(3, 4)).sum()
        g = torch.autograd.grad(loss, [x, m.e.weight], create_graph=True)
        sum((gi * gi).sum() for gi in g).backward()
        results.append((x.grad, m.e.weight.grad, m.e.weight.detach().clone()))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_write_into_a_placeholder_at_a_placeholders_indices_is_skipped() -> None:
    """The same under a double backward, with the write into a tensor the call made (``index_put_`` into a
    ``zeros``, accumulating) at indices from an unused op: it ran at the placeholder's uninitialised indices
    (``IndexError: index 9.4e13 out of bounds``). A write whose every written tensor is a placeholder is skipped."""
    w = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)

    def f(x):
        acc = torch.zeros(6, 4)  # (of the default dtype, float64 here: the review's case)
        acc.index_put_((x.argmax(-1),), x.sin(), accumulate=True)
        return (acc @ w.t()).cos().sum() * x

    results = []
    dtype0 = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        _double_backwards(f, w, results)
    finally:
        torch.set_default_dtype(dtype0)
    for got, want in zip(results[2:], results[:2]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def _double_backwards(f, w, results) -> None:
    for fn in (f, remat(f, policy=policies.memory_budget(0.5))):
        for _ in range(2):
            x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0), requires_grad=True)
            out = fn(x)  # (held: its node, which the double backward does not run, makes its ops unused)
            loss = (out * torch.cos(torch.arange(12.0, dtype=torch.float64).reshape(3, 4) * 0.7 + 0.3)).sum()
            g = torch.autograd.grad(loss, [x, w], create_graph=True)
            sum((gi * gi).sum() for gi in g).backward()
            results.append((x.grad.clone(), w.grad.clone()))
            del out
            w.grad = None
