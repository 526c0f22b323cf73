"""Module state is an input: parameters, buffers and closed-over tensors read inside a remat'd function.

Every case compares ``remat`` against the same model without remat under the same
transform (float64 at 1e-10, float32 bitwise), and proves that the recompute ran: under plain
autograd (the replay engine, which runs the block's Python once) by the ``tanh`` ops the backward
pass runs, seen from outside (plain autograd's backward runs none); under ``torch.func`` (where the
block's Python runs again) by counting calls. The cases that used to give silent wrong gradients: a remat'd
``forward`` under ``functional_call`` with parameters that differ from the
module's own (the recompute read the module's own), a closure over a tensor of a
``vjp``/``jacrev`` level, BatchNorm's statistics written twice.
"""

from __future__ import annotations

import copy
import functools
import io
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vjp, vmap

import remat
from remat import RematError, policies
from remat.bench.measure import live_bytes_after

from .helpers import CountCalls, OpCounter, assert_tree_close

DT = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}
POLICIES = {
    "nothing": policies.nothing_saveable,
    "dots": policies.dots_saveable,
    "everything": policies.everything_saveable,
    "offload": policies.offload_to_cpu(min_bytes=0),
}


class ConvNet(nn.Module):
    """A small CNN with BatchNorm; ``self.body`` is the block that gets rematerialized."""

    def __init__(self, bn: bool = True) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.body = nn.Sequential(
            nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4) if bn else nn.Identity(), nn.Tanh(),
            nn.Conv2d(4, 4, 3, padding=1), nn.Tanh(), CountCalls(),
        )
        self.head = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(torch.tanh(self.stem(x))).flatten(1))


def _net(dtype: torch.dtype = DT, bn: bool = True) -> ConvNet:
    torch.manual_seed(0)
    return ConvNet(bn).to(dtype)


def _x(dtype: torch.dtype = DT, n: int = 2) -> torch.Tensor:
    return torch.randn(n, 3, 6, 6, generator=torch.Generator().manual_seed(1), dtype=dtype)


def _tally(m: ConvNet) -> int:
    return m.body[-1].calls  # type: ignore[no-any-return]


TANH = {torch.ops.aten.tanh.default}


def _backward_tanhs(loss: torch.Tensor) -> int:
    """Run ``loss.backward()``; return how many ``tanh`` ops it ran, seen from outside remat. Plain autograd's
    backward runs none (tanh saves its output); each one is a recomputed ``tanh`` of the forward pass."""
    with OpCounter(TANH) as c:
        loss.backward()
    return c.count


def _swapped(m: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters that differ from the module's own: what functional_call is for."""
    return {k: v.detach() + 0.25 for k, v in m.named_parameters()}


def _bound_method(m: ConvNet, policy: Any) -> None:
    m.body.forward = remat.remat(m.body.forward, policy=policy)  # the pattern the docs show


def _remat_module(m: ConvNet, policy: Any) -> None:
    remat.remat_module(m.body, policy=policy)


WRAPS = {"bound_method": _bound_method, "remat_module": _remat_module}


def _loss(m: nn.Module, p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return functional_call(m, p, (x,)).square().sum()


TRANSFORMS: dict[str, Callable[[nn.Module, dict[str, torch.Tensor], torch.Tensor], Any]] = {
    "grad": lambda m, p, x: grad(lambda p: _loss(m, p, x))(p),
    "vjp": lambda m, p, x: vjp(lambda p: _loss(m, p, x), p)[1](torch.ones((), dtype=DT))[0],
    "jacrev": lambda m, p, x: jacrev(lambda p: functional_call(m, p, (x,)).sum(0))(p),
    "vmap_grad": lambda m, p, x: vmap(grad(lambda p, xi: _loss(m, p, xi[None])), in_dims=(None, 0))(p, x),
}


def _eager(m: nn.Module, p: dict[str, torch.Tensor], x: torch.Tensor,
           tanhs: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Plain autograd's gradients; the backward pass's ``tanh`` count appended to ``tanhs`` if given."""
    leaves = {k: v.clone().requires_grad_() for k, v in p.items()}
    n = _backward_tanhs(_loss(m, leaves, x))
    if tanhs is not None:
        tanhs.append(n)
    return {k: v.grad for k, v in leaves.items()}  # type: ignore[misc]


@pytest.mark.parametrize("wrap", list(WRAPS))
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("transform", ["eager", *TRANSFORMS])
def test_functional_call_with_other_parameters(transform: str, policy: str, wrap: str, clean_after: None) -> None:
    """The recompute uses the parameters functional_call swapped in, not the module's own."""
    plain, ours = _net(bn=False), _net(bn=False)
    WRAPS[wrap](ours, POLICIES[policy])
    p, x = _swapped(plain), _x()
    tanhs: list[int] = []
    run = functools.partial(_eager, tanhs=tanhs) if transform == "eager" else TRANSFORMS[transform]
    with OpCounter(TANH) as plain_tanhs:
        want = run(plain, p, x)
    before = _tally(ours)
    with OpCounter(TANH) as our_tanhs:
        got = run(ours, p, x)
    assert_tree_close(got, want, **TOL)
    calls = _tally(ours) - before
    base = _tally(plain)
    # save-nothing and dots recompute the block in the backward pass, save-everything does not; offload
    # recomputes under torch.func only, replaying the offloaded outputs (NOTE [offload under torch.func])
    rerun = policy in ("nothing", "dots") or (policy == "offload" and transform != "eager")
    if transform == "eager":
        # the replay engine runs the block's Python once and replays its ops: its two tanh ops, once each
        assert calls == base and tanhs == [0, 2 if rerun else 0], (calls, base, tanhs)
    else:
        # the block's Python runs once per call; its recompute replays its calls (NOTE [program replay]): the
        # block's two tanh ops once more per call
        # (under offload the recompute runs, but hands back the offloaded tanh outputs instead of running them)
        replayed = our_tanhs.count - plain_tanhs.count
        ran = policy in ("nothing", "dots")
        assert calls == base and replayed == (2 * base if ran else 0), (calls, base, replayed)


def test_float32_bitwise_under_functional_call(clean_after: None) -> None:
    plain, ours = _net(torch.float32, bn=False), _net(torch.float32, bn=False)
    remat.remat_module(ours.body)
    p, x = _swapped(plain), _x(torch.float32)
    assert_tree_close(_eager(ours, p, x), _eager(plain, p, x))
    assert_tree_close(grad(lambda p: _loss(ours, p, x))(p), grad(lambda p: _loss(plain, p, x))(p))


def test_seed_patterns_remat_of_a_submodule_call(clean_after: None) -> None:
    """``checkpoint(self.conv1, x)`` inside a forward, written ``remat(self.conv1)(x)``."""

    class Seed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 4, 3, padding=1))
            self.fc2 = nn.Sequential(nn.Linear(4 * 36, 8), nn.GELU(), nn.Linear(8, 2))
            self.use_remat = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = remat.remat if self.use_remat else (lambda f: f)
            h = torch.relu(w(self.conv1)(x)).flatten(1)
            return w(self.fc2)(h)

    torch.manual_seed(0)
    ours = Seed().to(DT)
    plain = copy.deepcopy(ours)
    plain.use_remat = False
    p, x = _swapped(plain), _x()
    assert_tree_close(_eager(ours, p, x), _eager(plain, p, x), **TOL)
    assert_tree_close(grad(lambda p: _loss(ours, p, x))(p), grad(lambda p: _loss(plain, p, x))(p), **TOL)
    # the module's own parameters, plain autograd
    for m in (ours, plain):
        _loss(m, {}, x).backward()
    for (name, a), b in zip(plain.named_parameters(), ours.parameters()):
        assert torch.allclose(a.grad, b.grad, **TOL), name  # type: ignore[arg-type]


@pytest.mark.parametrize("transform", ["vjp", "jacrev", "grad", "vmap_grad"])
def test_closure_over_a_tensor_of_the_level(transform: str, clean_after: None) -> None:
    """A remat'd closure reading a wrapper of the transform's level (dead when vjp's backward runs)."""
    x0 = torch.randn(3, 4, dtype=DT, generator=torch.Generator().manual_seed(2))
    calls = [0]

    def make(use: bool) -> Callable[[torch.Tensor], torch.Tensor]:
        def f(W: torch.Tensor) -> torch.Tensor:
            c = W * 2

            def inner(x: torch.Tensor) -> torch.Tensor:
                calls[0] += 1
                return torch.tanh(torch.tanh(x @ c) @ c).sum(-1)

            return (remat.remat(inner) if use else inner)(x0)
        return f

    W = torch.randn(4, 4, dtype=DT, generator=torch.Generator().manual_seed(3))
    runs: dict[str, Callable[[Callable[..., Any]], Any]] = {
        "vjp": lambda f: vjp(f, W)[1](torch.ones(3, dtype=DT))[0],
        "jacrev": lambda f: jacrev(f)(W),
        "grad": lambda f: grad(lambda W: f(W).sum())(W),
        "vmap_grad": lambda f: vmap(grad(lambda W: f(W).sum()))(torch.stack([W, W + 1])),
    }
    with OpCounter(TANH) as plain_tanhs:
        want = runs[transform](make(False))
    calls[0] = 0
    with OpCounter(TANH) as our_tanhs:
        got = runs[transform](make(True))
    assert_tree_close(got, want, **TOL)
    # the Python runs once; the recompute replays its two tanh ops (NOTE [program replay])
    assert (calls[0], our_tanhs.count - plain_tanhs.count) == (1, 2)


# ---- BatchNorm: buffers written once --------------------------------------------------------

def _stats(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.named_buffers()}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, DT], ids=["f32", "f64"])
def test_batchnorm_statistics_written_once_eager(steps: int, policy: str, dtype: torch.dtype,
                                                 clean_after: None) -> None:
    plain, ours = _net(dtype), _net(dtype)
    remat.remat_module(ours.body, policy=POLICIES[policy])
    opt_a = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(ours.parameters(), lr=0.1)
    for step in range(steps):
        x = _x(dtype) + step
        for m, opt in ((plain, opt_a), (ours, opt_b)):
            opt.zero_grad()
            m(x).square().sum().backward()
            opt.step()
    assert ours.body[1].num_batches_tracked.item() == steps
    assert_tree_close(_stats(ours), _stats(plain))  # bit for bit, float64 included
    for (name, a), b in zip(plain.named_parameters(), ours.parameters()):
        assert torch.equal(a, b), name


def test_batchnorm_called_twice_before_backward(clean_after: None) -> None:
    """The same BatchNorm block run on two batches before one backward pass (a GAN's D(real), D(fake))."""
    plain, ours = _net(), _net()
    plain.body[1].momentum = ours.body[1].momentum = None  # cumulative average: reads num_batches_tracked
    remat.remat_module(ours.body)
    for m in (plain, ours):
        (m(_x()).sum() + m(_x() * 2).square().sum()).backward()
    assert_tree_close(_stats(ours), _stats(plain))
    for (name, a), b in zip(plain.named_parameters(), ours.parameters()):
        assert torch.allclose(a.grad, b.grad, **TOL), name  # type: ignore[arg-type]


@pytest.mark.parametrize("transform", ["grad", "vjp"])
def test_batchnorm_under_torch_func_with_buffers_passed_in(transform: str, clean_after: None) -> None:
    """torch.func's recipe: buffers made inside the transformed function, passed with functional_call,
    returned as aux. remat writes them once, as plain torch.func does."""
    plain, ours = _net(), _net()
    remat.remat_module(ours.body)
    x = _x()

    def run(m: nn.Module) -> tuple[Any, dict[str, torch.Tensor]]:
        start = {k: v.clone() for k, v in m.named_buffers()}

        def f(p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            bufs = {k: v.clone() for k, v in start.items()}  # made inside: torch.func lets BatchNorm write them
            return functional_call(m, {**p, **bufs}, (x,)).square().sum(), bufs

        if transform == "grad":
            g, bufs = grad(f, has_aux=True)(_swapped(m))
        else:
            _, pull, bufs = vjp(f, _swapped(m), has_aux=True)
            g = pull(torch.ones((), dtype=DT))[0]
        return g, bufs

    with OpCounter(TANH) as plain_tanhs:
        g0, b0 = run(plain)
    with OpCounter(TANH) as our_tanhs:
        g1, b1 = run(ours)
    assert_tree_close(g1, g0, **TOL)
    assert_tree_close(b1, b0)
    assert b1["body.1.num_batches_tracked"].item() == 1
    # the block's Python ran once; the recompute replayed its two tanh ops (NOTE [program replay])
    assert (_tally(ours), our_tanhs.count - plain_tanhs.count) == (1, 2)
    assert_tree_close(_stats(ours), _stats(plain))  # the module's own buffers untouched by both


def test_buffer_read_then_written_in_place(clean_after: None) -> None:
    """An EMA-style buffer read before the call writes it: the recompute reads the value the forward read."""

    class EMA(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.ones(4, dtype=DT))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.tanh(torch.tanh(x + self.scale) * 2)  # add saves nothing: plain autograd allows the write
            self.scale.mul_(0.5)
            return y + self.scale

    plain, ours = EMA(), EMA()
    remat.remat_module(ours)
    for m in (plain, ours):
        x = torch.linspace(-1, 1, 8, dtype=DT).reshape(2, 4).requires_grad_()
        m(x).sum().backward()
        m.xgrad = x.grad  # type: ignore[assignment]
    assert torch.allclose(ours.xgrad, plain.xgrad, **TOL)
    assert torch.equal(ours.scale, plain.scale)


# ---- module API ----------------------------------------------------------------------------

def test_remat_module_keeps_class_names_and_hooks(clean_after: None) -> None:
    m = _net()
    names = [n for n, _ in m.named_parameters()]
    keys = list(m.state_dict())
    pre, post = [], []
    m.body.register_forward_pre_hook(lambda mod, args: pre.append(1))
    m.body.register_forward_hook(lambda mod, args, out: post.append(1))
    assert remat.remat_module(m.body, policy="save-nothing") is m.body
    assert isinstance(m.body, nn.Sequential)
    assert [n for n, _ in m.named_parameters()] == names and list(m.state_dict()) == keys
    tanhs = _backward_tanhs(m(_x()).sum())
    # the recompute replays the block's ops (its two tanh), its Python ran once, its hooks stay outside
    assert tanhs == 2 and _tally(m) == 1 and pre == [1] and post == [1]


def test_remat_modules_selectors_and_undo(clean_after: None) -> None:
    m = _net()
    assert remat.remat_modules(m, nn.Conv2d) == ["stem", "body.0", "body.3"]
    assert remat.remat_modules(m, (nn.Linear, nn.Sequential), policy="save-matmuls") == ["body", "head"]
    assert remat.remat_modules(m, lambda name, mod: name == "head") == ["head"]
    assert sorted(remat.unremat_modules(m)) == ["body", "body.0", "body.3", "head", "stem"]
    assert not any("forward" in vars(mod) for mod in m.modules())
    # undo restores a forward the module had of its own
    def own(x: torch.Tensor) -> torch.Tensor:
        return nn.Linear.forward(m.head, x)

    m.head.forward = own
    remat.remat_module(m.head)
    assert remat.unremat_module(m.head).forward is own
    with pytest.raises(TypeError, match="where must be an nn.Module subclass"):
        remat.remat_modules(m, "Linear")
    with pytest.raises(TypeError, match="expected an nn.Module"):
        remat.remat_module(lambda x: x)  # type: ignore[arg-type]


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_deepcopy_uses_the_copys_parameters(wrap: str, clean_after: None) -> None:
    m = _net(bn=False)
    WRAPS[wrap](m, policies.nothing_saveable)
    c = copy.deepcopy(m)
    with torch.no_grad():
        for t in c.parameters():
            t.add_(0.5)
    x = _x()
    tanhs = _backward_tanhs(c(x).square().sum())
    assert all(t.grad is None for t in m.parameters())  # the original module was not run
    ref = _net(bn=False)
    with torch.no_grad():
        for t in ref.parameters():
            t.add_(0.5)
    ref(x).square().sum().backward()
    for (name, a), b in zip(ref.named_parameters(), c.parameters()):
        assert torch.allclose(a.grad, b.grad, **TOL), name  # type: ignore[arg-type]
    assert tanhs == 2 and _tally(c) == 1  # the copy's forward is remat'd too: its ops replayed, its Python once


@pytest.mark.parametrize("wrap", list(WRAPS))
def test_torch_save_and_pickle_round_trip(wrap: str, clean_after: None) -> None:
    m = _net()
    WRAPS[wrap](m, policies.dots_saveable)
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    again = pickle.loads(pickle.dumps(m))
    x = _x()
    m(x).sum().backward()
    for other in (loaded, again):
        assert other.body.forward.policy is policies.dots_saveable
        assert other.body.forward.__remat_target__.__self__ is other.body
        # its ops replayed in the backward pass (dots_saveable keeps the convolutions, not the tanh outputs)
        assert _backward_tanhs(other(x).sum()) == 2
        assert _tally(other) == 1
        for (name, a), b in zip(m.named_parameters(), other.parameters()):
            assert torch.equal(a.grad, b.grad), name  # type: ignore[arg-type]


def test_decorated_function_pickles_by_reference() -> None:
    assert pickle.loads(pickle.dumps(_decorated)) is _decorated
    assert copy.deepcopy(_decorated) is _decorated


@remat.remat(policy="save-nothing")
def _decorated(x: torch.Tensor) -> torch.Tensor:
    return x.sin().sin()


def test_remat_as_a_method_decorator(clean_after: None) -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4).to(DT)

        @remat.remat
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(torch.tanh(self.lin(x)))

    b = Block()
    p = {k: v.detach() + 1 for k, v in b.named_parameters()}
    x = torch.randn(2, 4, dtype=DT)
    got = grad(lambda p: functional_call(b, p, (x,)).sum())(p)
    lin = nn.Linear(4, 4).to(DT)
    want = grad(lambda p: torch.tanh(torch.tanh(functional_call(lin, {k[4:]: v for k, v in p.items()}, (x,)))).sum())(p)
    assert_tree_close(got, want, **TOL)


# ---- what remat cannot put back raises, naming the tensor ------------------------------------

_GLOBAL_TABLE: dict[str, torch.Tensor] = {}


@pytest.mark.parametrize("engine", ["replay", "debug"])
@pytest.mark.parametrize("kind", ["requires_grad", "large"])
def test_replaced_global_tensor_is_the_forwards_or_raises_naming_it(kind: str, engine: str,
                                                                     clean_after: None) -> None:
    """A global tensor replaced between forward and backward: the replay engine replays the ops on the tensor
    the forward pass read (plain autograd's gradient); debug=True (the full engine, which re-runs the Python)
    checks what it reads, naming the tensor."""
    n = 4 if kind == "requires_grad" else 128  # 128 x 128 float64: 128 KiB, above the copy threshold
    _GLOBAL_TABLE["w"] = torch.randn(n, n, dtype=DT).requires_grad_(kind == "requires_grad")

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.tanh(x @ _GLOBAL_TABLE["w"])).sum()

    x = torch.randn(3, n, dtype=DT, requires_grad=True)
    (want,) = torch.autograd.grad(f(x), x)
    out = remat.remat(f, debug=engine == "debug")(x)
    _GLOBAL_TABLE["w"] = (_GLOBAL_TABLE["w"] + 1).detach().requires_grad_(kind == "requires_grad")
    if engine == "replay":
        (got,) = torch.autograd.grad(out, x)
        assert torch.allclose(got, want, **TOL)
    else:
        with pytest.raises(RematError, match=rf"read a different tensor of shape \[{n}, {n}\].*Pass it to the function"):
            out.backward()


def test_dict_in_a_closure_replaced_is_put_back(clean_after: None) -> None:
    table = {"w": torch.randn(4, 4, dtype=DT)}

    @remat.remat
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.tanh(x @ table["w"])).sum()

    x = torch.randn(3, 4, dtype=DT, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    w = table["w"]
    f(x).backward()
    out = f(y)
    table["w"] = w + 1  # the closure's dict now holds another tensor: the recompute reads the forward's
    out.backward()
    assert torch.allclose(x.grad, y.grad, **TOL)  # type: ignore[arg-type]


def test_parameter_modified_in_place_before_backward_raises(clean_after: None) -> None:
    m = _net(bn=False)
    remat.remat_module(m.body)
    loss = m(_x()).sum()
    with torch.no_grad():
        m.body[0].weight.add_(1)  # an optimizer step before the backward pass
    with pytest.raises(RematError, match=r"Sequential\.forward read from outside its arguments "
                                         r"\(Sequential\.0\.weight, shape \[4, 4, 3, 3\]\).*modified in place"):
        loss.backward()


def test_constant_made_on_every_call_is_fine(clean_after: None) -> None:
    @remat.remat
    def f(x: torch.Tensor) -> torch.Tensor:
        c = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=DT)
        return torch.tanh(torch.tanh(x @ c) * c).sum()

    x = torch.randn(2, 2, dtype=DT, requires_grad=True)
    f(x).backward()
    y = x.detach().clone().requires_grad_()
    c = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=DT)
    torch.tanh(torch.tanh(y @ c) * c).sum().backward()
    assert torch.allclose(x.grad, y.grad, **TOL)  # type: ignore[arg-type]


class _Flaky(nn.Module):
    """Runs other ops on its second call: what a re-run of its Python in the recompute would see."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.n = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n += 1
        h = torch.tanh(self.lin(x))
        return torch.tanh(h if self.n == 1 else h[:, :2]).sum()


def test_function_that_changes_on_its_next_call_is_exact(clean_after: None) -> None:
    """The replay engine runs the Python once and replays the ops: plain autograd's gradients, bit for bit."""
    plain, ours = _Flaky(), remat.remat_module(_Flaky())
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    for m in (plain, ours):
        m(x).backward()
    for (name, a), b in zip(plain.named_parameters(), ours.parameters()):
        assert torch.equal(a.grad, b.grad), name  # type: ignore[arg-type]


@pytest.mark.parametrize("engine", ["replay", "debug"])
def test_errors_name_the_function_briefly(engine: str, clean_after: None) -> None:
    """The error of each engine: a parameter written before the backward pass (replay), a recompute that ran
    other ops (debug=True, which re-runs the Python)."""
    m = remat.remat_module(_Flaky(), debug=engine == "debug")
    out = m(torch.randn(2, 4))
    if engine == "replay":
        with torch.no_grad():
            m.lin.weight.add_(1)
    with pytest.raises(RematError) as err:
        out.backward()
    msg = str(err.value)
    assert "_Flaky.forward" in msg and "\n" not in msg and "Linear(" not in msg
    assert repr(m.forward) == "remat(_Flaky.forward, policy='nothing_saveable')"


# ---- memory: it really drops what it claims ---------------------------------------------------

@pytest.mark.parametrize("policy,at_most", [("save-nothing", 0.2), ("save-matmuls", 0.7)])
def test_remat_module_retains_less(policy: str, at_most: float) -> None:
    """Bytes held between forward and backward, counted from outside remat (live storages)."""
    torch.manual_seed(0)
    block = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.LayerNorm(256)) for _ in range(4)])
    x = torch.randn(64, 256, requires_grad=True)
    _, plain = live_bytes_after(lambda: block(x).sum())
    remat.remat_module(block, policy=policy)
    out, ours = live_bytes_after(lambda: block(x).sum())
    assert ours <= at_most * plain, (ours, plain)
    out.backward()  # and it still runs


def test_remat_of_a_module_runs_its_hooks_once_outside(clean_after: None) -> None:
    """``remat(module)(x)``: hooks (FSDP2's, users' activation recorders) run once, the forward is remat'd."""
    plain, ours = _net(bn=False), _net(bn=False)
    seen = []
    ours.body.register_forward_hook(lambda mod, args, out: seen.append(out.detach().clone()))
    x = _x()
    tanhs = []
    for m, wrap in ((plain, lambda f: f), (ours, remat.remat)):
        h = torch.tanh(m.stem(x))
        tanhs.append(_backward_tanhs(m.head(wrap(m.body)(h).flatten(1)).square().sum()))
    # the hook ran once; the block's forward once, its ops (two tanh) replayed in the backward pass
    assert len(seen) == 1 and _tally(ours) == 1 and tanhs == [0, 2]
    assert "forward" not in vars(ours.body)  # nothing left on the module
    for (name, a), b in zip(plain.named_parameters(), ours.parameters()):
        assert torch.allclose(a.grad, b.grad, **TOL), name  # type: ignore[arg-type]


# ---- buffers read around batch norm's writes, Python state, containers --------------------------

class _ReadAroundBN(nn.Module):
    """Reads the running mean before BatchNorm writes it (batch norm's write does not bump its version)."""

    def __init__(self, twice: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).to(DT)
        self.bn = nn.BatchNorm1d(4).to(DT)
        self.twice = twice
        with torch.no_grad():
            self.bn.running_mean.fill_(0.7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        c = (h - self.bn.running_mean).sin()
        y = self.bn(h) * c
        if self.twice:  # read between two writes, then write again
            y = self.bn(y) * (h - self.bn.running_mean).cos()
        return y


@pytest.mark.parametrize("twice", [False, True], ids=["read-then-bn", "bn-read-bn"])
@pytest.mark.parametrize("policy", ["nothing", "dots", "everything"])
def test_buffer_read_around_batchnorm_writes(policy: str, twice: bool, clean_after: None) -> None:
    torch.manual_seed(0)
    plain = _ReadAroundBN(twice)
    ours = remat.remat_module(copy.deepcopy(plain), policy=POLICIES[policy])
    x = torch.randn(5, 4, dtype=DT)
    for m in (plain, ours):
        m(x).square().sum().backward()
    for (name, a), b in zip(plain.named_parameters(), ours.parameters()):
        assert torch.allclose(a.grad, b.grad, **TOL), name  # type: ignore[arg-type]
    assert_tree_close(_stats(ours), _stats(plain))


def test_buffer_updated_outside_the_call_before_backward(clean_after: None) -> None:
    """A remat'd function reads running statistics that a BatchNorm outside it updates before the backward."""
    bn = nn.BatchNorm1d(4).to(DT)
    x = torch.randn(5, 4, dtype=DT, requires_grad=True)
    y = x.detach().clone().requires_grad_()

    def f(v: torch.Tensor) -> torch.Tensor:
        return torch.tanh((v - bn.running_mean).sin() * 3)

    out = remat.remat(f)(x)
    want = f(y)
    bn(torch.randn(5, 4, dtype=DT))  # writes the statistics (without a version bump)
    out.sum().backward()
    want.sum().backward()
    assert torch.allclose(x.grad, y.grad, **TOL)  # type: ignore[arg-type]


def test_constant_from_changed_python_state_is_the_forwards(clean_after: None) -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3).to(DT)
            self.c = 2.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.lin(x) * torch.tensor(self.c, dtype=DT)).sin()

    torch.manual_seed(0)
    plain = Scaled()
    ours = remat.remat_module(copy.deepcopy(plain))
    x = torch.randn(4, 3, dtype=DT)
    for m in (plain, ours):
        out = m(x)
        m.c = 3.0  # changed before the backward pass: the recompute uses the forward's constant
        out.sum().backward()
    assert torch.allclose(ours.lin.weight.grad, plain.lin.weight.grad, **TOL)  # type: ignore[arg-type]


@pytest.mark.parametrize("engine", ["replay", "debug"])
def test_python_number_from_changed_state_is_the_forwards_or_raises(engine: str, clean_after: None) -> None:
    """A Python number computed from state the call changes: the replay engine replays the forward's value
    (plain autograd's gradients, bit for bit); debug=True re-runs the Python, which reads another, and raises."""

    class Warm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(4, 4)
            self.steps = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.steps += 1  # a re-run of the Python sees 2
            return torch.tanh(self.lin(x) * min(1.0, self.steps / 100)).sin()

    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    plain, ours = Warm(), remat.remat_module(Warm(), debug=engine == "debug")
    out = ours(x)
    if engine == "replay":
        plain(x).sum().backward()
        out.sum().backward()
        for (name, a), b in zip(plain.named_parameters(), ours.parameters()):
            assert torch.equal(a.grad, b.grad), name  # type: ignore[arg-type]
    else:
        with pytest.raises(RematError, match=r"argument #1 is 0\.02 in the recompute but 0\.01 in the forward pass"):
            out.sum().backward()


def test_buffer_written_in_forward_keeps_its_version_and_history(clean_after: None) -> None:
    class CopyBuf(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("buf", torch.zeros(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(self.lin(x))
            self.buf.copy_(h.mean(0))
            return torch.tanh(h * self.buf).sin()  # mul saves buf: its version is checked on unpack

    m = remat.remat_module(CopyBuf())
    out = m(torch.randn(3, 4))
    version, history = m.buf._version, m.buf.grad_fn
    out.sum().backward()  # the recompute writes a stand-in, not the buffer
    assert m.buf._version == version and m.buf.grad_fn is history


def test_closed_over_list_changed_after_forward(clean_after: None) -> None:
    ws = [torch.randn(3, 3, dtype=DT), torch.randn(3, 3, dtype=DT)]
    f = remat.remat(lambda x: ((x @ ws[0]).sin() @ ws[1]).cos())
    x = torch.randn(2, 3, dtype=DT, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    out = f(x)
    want = ((y @ ws[0]).sin() @ ws[1]).cos()
    ws.pop()  # the user's list changes; the recompute reads the forward's
    out.sum().backward()
    want.sum().backward()
    assert torch.allclose(x.grad, y.grad, **TOL) and len(ws) == 1  # type: ignore[arg-type]


def test_replaced_submodule_refreshes_the_cached_slots(clean_after: None) -> None:
    torch.manual_seed(0)
    m = remat.remat_module(nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3)).to(DT))
    x = torch.randn(4, 3, dtype=DT)
    m(x).sum().backward()
    m[0] = nn.Linear(3, 3).to(DT)  # same dict sizes, another module (LoRA injection, a new head)
    plain = copy.deepcopy(m)
    remat.unremat_module(plain)
    p = {k: v.detach() + 0.1 for k, v in m.named_parameters()}
    assert_tree_close(grad(lambda p: functional_call(m, p, (x,)).square().sum())(p),
                      grad(lambda p: functional_call(plain, p, (x,)).square().sum())(p), **TOL)


def test_partial_with_tensor_arguments_under_vjp(clean_after: None) -> None:
    def f(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return (x @ W).sin() * x.sum()

    W, x = torch.randn(4, 4, dtype=DT), torch.randn(3, 4, dtype=DT)

    def loss(wrap: Callable[[Any], Any]) -> Callable[..., torch.Tensor]:
        return lambda W, x: wrap(functools.partial(f, W))(x).square().sum()

    want = vjp(loss(lambda g: g), W, x)[1](torch.ones((), dtype=DT))
    got = vjp(loss(remat.remat), W, x)[1](torch.ones((), dtype=DT))
    assert_tree_close(got, want, **TOL)


@pytest.mark.parametrize("engine", ["replay", "debug"])
@pytest.mark.parametrize("n", [2, 20_000], ids=["small-copied", "large-checked"])
def test_outside_tensor_replaced_during_the_call(n: int, engine: str, clean_after: None) -> None:
    """An object (not a module: remat does not put it back) whose tensor the call reads, then replaces by a
    same-shaped slice of its own output (a sliding-window cache): the replay engine replays the ops on the
    tensor the forward pass read (exact); debug=True reads small gradient-free ones from a copy (exact) and
    checks larger ones (RematError). Never the new tensor silently."""

    class Cache:
        def __init__(self, keys: torch.Tensor) -> None:
            self.keys = keys

    def f(x: torch.Tensor, cache: Cache) -> torch.Tensor:
        full = torch.cat([cache.keys, x.sin()])
        cache.keys = full[-n:].detach()
        return torch.logsumexp(full, 0)

    prefix = torch.linspace(-5, 5, n, dtype=DT)
    x = torch.randn(4, dtype=DT, requires_grad=True)
    (want,) = torch.autograd.grad(f(x, Cache(prefix.clone())), x)
    out = remat.remat(f, debug=engine == "debug")(x, Cache(prefix.clone()))
    if n == 2 or engine == "replay":
        (got,) = torch.autograd.grad(out, x)
        assert torch.allclose(got, want, **TOL)
    else:
        with pytest.raises(RematError, match=r"read a different tensor of shape \[20000\].*use_cache=False"):
            torch.autograd.grad(out, x)


# ---- parameters held by partials and lists of blocks (NOTE [state is an input]) ----------------------------


def _block(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h @ p["W"] + p["b"])


def _params(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"W": torch.randn(4, 4, generator=g, dtype=DT).requires_grad_(),
             "b": torch.randn(4, generator=g, dtype=DT).requires_grad_()} for _ in range(n)]


class _Chain:
    """A callable object holding a list of partials (what remat.sequential's segments are)."""

    def __init__(self, blocks: list[Callable[[torch.Tensor], torch.Tensor]]) -> None:
        self.blocks = blocks

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            h = b(h)
        return h


@pytest.mark.parametrize("how", ["object", "closure", "partial-of-list"])
def test_params_in_partials_are_state_and_drop_what_they_claim(how: str, clean_after: None) -> None:
    """functools.partial(block, params) in a list (an object's attribute, a closure cell, a partial's argument):
    the params are found as state, every call is exact and drops what it claims."""
    params = _params(3)
    blocks = [functools.partial(_block, p) for p in params]
    if how == "object":
        fn: Any = _Chain(blocks)
    elif how == "closure":
        def fn(h: torch.Tensor) -> torch.Tensor:
            for b in blocks:
                h = b(h)
            return h
    else:
        fn = functools.partial(lambda bs, h: _Chain(bs)(h), blocks)
    wrt = [t for p in params for t in p.values()]
    x = torch.randn(5, 4, dtype=DT, requires_grad=True)
    want = torch.autograd.grad(_Chain(blocks)(x).sum(), [x, *wrt])
    g = remat.remat(fn)
    for _ in range(3):
        assert_tree_close(torch.autograd.grad(g(x).sum(), [x, *wrt]), want, **TOL)
    _, held = live_bytes_after(lambda: g(x).sum())
    _, plain = live_bytes_after(lambda: _Chain(blocks)(x).sum())
    assert held < plain


@pytest.mark.parametrize("transform", ["grad", "vjp"])
def test_params_in_partials_under_torch_func(transform: str, clean_after: None) -> None:
    """torch.func with respect to params held by partials: the recompute reads the transform's values (under
    vjp it runs after the level exited, with the partials' arguments put back as the forward pass saw them)."""
    params = _params(2)
    x = torch.randn(5, 4, dtype=DT)

    def loss(wrap: Callable[[Any], Any]) -> Callable[[list[dict[str, torch.Tensor]]], torch.Tensor]:
        return lambda ps: wrap(_Chain([functools.partial(_block, p) for p in ps]))(x).square().sum()

    ps = [{k: v.detach() for k, v in p.items()} for p in params]
    if transform == "grad":
        assert_tree_close(grad(loss(remat.remat))(ps), grad(loss(lambda f: f))(ps), **TOL)
    else:
        one = torch.ones((), dtype=DT)
        assert_tree_close(vjp(loss(remat.remat), ps)[1](one), vjp(loss(lambda f: f), ps)[1](one), **TOL)


POLICY_NAMES = {"save-nothing": None, "dots": policies.dots_saveable}


@pytest.mark.parametrize("policy", list(POLICY_NAMES))
@pytest.mark.parametrize("how", ["closure", "object", "partial-of-list"])
def test_block_replaced_before_backward_is_not_what_the_recompute_runs(how: str, policy: str,
                                                                         clean_after: None) -> None:
    """A list of partials the call reads, one replaced between the forward and the backward pass (after clean
    calls, on the fast path): the recompute runs the blocks the forward pass ran."""
    params, other = _params(2), _params(1, seed=1)[0]
    orig = [functools.partial(_block, p) for p in params]
    blocks = list(orig)
    if how == "closure":
        def fn(h: torch.Tensor) -> torch.Tensor:
            for b in blocks:
                h = b(h)
            return h
    elif how == "object":
        fn = _Chain(blocks)
    else:
        fn = functools.partial(lambda bs, h: _Chain(bs)(h), blocks)
    x = torch.randn(5, 4, dtype=DT, requires_grad=True)
    wrt = [x, *(t for p in params for t in p.values())]
    want = torch.autograd.grad(_Chain(orig)(x).sum(), wrt)
    g = remat.remat(fn, policy=POLICY_NAMES[policy])
    for call in range(4):
        blocks[:] = orig
        y = g(x).sum()
        if call:
            blocks[0] = functools.partial(_block, other)
        assert_tree_close(torch.autograd.grad(y, wrt), want, **TOL)


@pytest.mark.parametrize("policy", list(POLICY_NAMES))
def test_submodule_replaced_before_backward_is_not_what_the_recompute_runs(policy: str,
                                                                            clean_after: None) -> None:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).to(DT)
    first, alt = m[0], nn.Linear(4, 4).to(DT)
    x = torch.randn(5, 4, dtype=DT, requires_grad=True)
    wrt = [x, *m.parameters()]
    want = torch.autograd.grad(m(x).sum(), wrt)
    g = remat.remat(lambda h: m(h), policy=POLICY_NAMES[policy])
    for call in range(4):
        m[0] = first
        y = g(x).sum()
        if call:
            m[0] = alt
        assert_tree_close(torch.autograd.grad(y, wrt), want, **TOL)
    m[0] = first


def test_other_callables_in_a_walked_list_are_not_state(clean_after: None) -> None:
    """A callable object in the same list, which the call does not run, updating its own tensor between the
    forward and the backward pass: not state of the call, so no error."""

    class Counter:
        def __init__(self) -> None:
            self.n = torch.zeros(())

        def __call__(self) -> None:
            self.n += 1

    params = _params(2)
    ctr = Counter()
    things: list[Any] = [*(functools.partial(_block, p) for p in params), ctr]

    def fn(h: torch.Tensor) -> torch.Tensor:
        for b in things[:2]:
            h = b(h)
        return h

    x = torch.randn(5, 4, dtype=DT, requires_grad=True)
    want = torch.autograd.grad(fn(x).sum(), x)
    g = remat.remat(fn)
    for _ in range(3):
        y = g(x).sum()
        ctr()
        assert_tree_close(torch.autograd.grad(y, x), want, **TOL)


def test_sequential_levels_puts_replaced_params_back(clean_after: None) -> None:
    params, other = _params(4), _params(1, seed=1)[0]
    blocks = [functools.partial(_block, p) for p in params]
    x = torch.randn(5, 4, dtype=DT, requires_grad=True)
    wrt = [x, *(t for p in params for t in p.values())]
    want = torch.autograd.grad(_Chain(blocks)(x).sum(), wrt)
    seq = remat.sequential(blocks, segments=2, levels=2)
    for _ in range(3):
        saved = params[1]["W"]
        y = seq(x).sum()
        params[1]["W"] = other["W"]  # the dict entry replaced (not written) before the backward pass
        got = torch.autograd.grad(y, wrt)
        params[1]["W"] = saved
        assert_tree_close(got, want, **TOL)
