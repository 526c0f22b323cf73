"""Private PyTorch APIs are used in one module only (remat/_torch_internals.py), each with a reason."""

from __future__ import annotations

import pathlib
import re
from typing import Any

import torch

import remat._torch_internals as ti

from .helpers import OpLog

ROOT = pathlib.Path(__file__).resolve().parents[1] / "remat"
PRIVATE = re.compile(r"torch\._C\b|torch\._functorch\b|torch\.utils\._\w+|torch\._dynamo\b|torch\._subclasses\b")


def test_private_torch_apis_only_in_the_internals_module():
    offenders = []
    for path in ROOT.rglob("*.py"):
        if path.name == "_torch_internals.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if PRIVATE.search(line) and not line.lstrip().startswith("#"):
                offenders.append(f"{path.relative_to(ROOT.parent)}:{n}: {line.strip()}")
    assert offenders == [], "private torch APIs outside remat/_torch_internals.py:\n" + "\n".join(offenders)


def test_internals_module_explains_its_uses():
    text = (ROOT / "_torch_internals.py").read_text()
    # every block that reaches into a private API is introduced by a comment or docstring saying why
    assert text.lower().count("no public") >= 4


def test_internals_work_on_this_torch():
    assert ti.interpreter_stack() == []
    assert ti.peek_interpreter() is None
    t = torch.ones(2)
    assert not ti.is_wrapped(t) and ti.unwrap_all(t) is t

    def f(x):
        (interp,) = ti.interpreter_stack()
        assert interp.key() == ti.TransformType.Grad
        assert ti.is_wrapped(x) and ti.unwrap_all(x).shape == x.shape
        return (x * x).sum()

    torch.func.grad(f)(torch.ones(3))
    assert ti.saved_tensors_hooks_disabled_message() is None
    assert not ti.is_compiling()


def test_dispatch_mode_handlers_are_not_wrapped_for_dynamo() -> None:
    class Seen(ti.TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[Any] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    raw = Seen.__dict__["__torch_dispatch__"]
    assert getattr(raw, "__wrapped__", None) is None  # torch's _disable_dynamo wrapper sets __wrapped__
    x = torch.ones(2)
    with Seen() as m:
        torch.sin(x)
    assert m.ops == [torch.ops.aten.sin.default]


def test_detach_below_modes_skips_the_modes() -> None:
    seen: list[Any] = []

    class Seen(ti.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x = torch.ones(3, requires_grad=True) * 2
    with Seen():
        d = ti.detach_below_modes(x)
        x.detach()
    assert seen == [torch.ops.aten.detach.default]  # only the public detach went through the mode
    assert not d.requires_grad and d.grad_fn is None
    assert d.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def test_detach_below_modes_without_a_mode_is_a_plain_detach() -> None:
    """With no mode pushed (inside a mode's handler, or under none) the detach runs as it is, above autograd: an alias
    that shares the version counter, so a later write shows."""
    x = torch.ones(3, requires_grad=True) * 2
    d = ti.detach_below_modes(x)
    assert not d.requires_grad and d.grad_fn is None and d._version == x._version
    with torch.no_grad():
        x.add_(1)
    assert d._version == x._version and torch.equal(d, x)
    seen: list[Any] = []

    class InHandler(ti.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            seen.append(ti.no_modes_pushed())
            return out

    with OpLog() as outer, InHandler():
        torch.sin(x)
    assert seen == [False]  # a mode below the handler's own: the guard keeps the detach from it
    with InHandler():
        torch.sin(x)
    assert seen == [False, True]
    assert outer.ops == [torch.ops.aten.sin.default]


def test_is_zero_tensor_tells_forward_ads_zero_tensor() -> None:
    """is_zero_tensor: the offload engine keeps a ZeroTensor (it has no storage to copy)."""
    assert ti.is_zero_tensor(torch._efficientzerotensor(3)) is True
    assert ti.is_zero_tensor(torch.zeros(3)) is False


def test_the_mode_stack_probes_count_modes_on_both_stacks() -> None:
    """dispatch_modes_pushed and pre_dispatch_modes_pushed: the two facts no_modes_pushed asks (the offload engine
    asks them itself, per saved tensor)."""
    from torch._ops import _set_mode_pre_dispatch, unset_mode_pre_dispatch  # (a pre-dispatch mode, as make_fx's)
    from torch._subclasses.schema_check_mode import SchemaCheckMode

    assert ti.dispatch_modes_pushed() == 0 and not ti.pre_dispatch_modes_pushed() and ti.no_modes_pushed()
    with OpLog():
        assert ti.dispatch_modes_pushed() == 1 and not ti.no_modes_pushed()
    _set_mode_pre_dispatch(SchemaCheckMode())
    try:
        assert ti.pre_dispatch_modes_pushed() and ti.dispatch_modes_pushed() == 0 and not ti.no_modes_pushed()
    finally:
        unset_mode_pre_dispatch(None, schema_check=True)
    assert not ti.pre_dispatch_modes_pushed() and ti.no_modes_pushed()


def test_op_call_runs_the_op() -> None:
    """op_call: the callable behind an OpOverload, called by remat's planned modes (NOTE [planned calls])."""
    x = torch.randn(5)
    op = torch.ops.aten.sin.default
    call = ti.op_call(op)
    assert call is not op and torch.equal(call(x), torch.sin(x))
    assert torch.equal(ti.op_call(torch.ops.aten.add.Tensor)(x, x, alpha=2), x + 2 * x)
    with OpLog() as log:
        call(x)
    assert log.ops == [op]  # dispatched as the op is, modes included
    assert ti.op_call(torch.sin) is torch.sin  # no _op: the callable itself


def test_no_dispatch_modes_pops_every_mode_and_is_free_without_one() -> None:
    x = torch.ones(3)
    with OpLog() as outer, OpLog() as inner:
        with ti.no_dispatch_modes():
            assert torch._C._len_torch_dispatch_stack() == 0
            x.clone()
        assert torch._C._len_torch_dispatch_stack() == 2
        x.sin()
    assert outer.ops == inner.ops == [torch.ops.aten.sin.default]  # the clone went below both modes
    # nothing pushed: the shared no-op context (popping an empty stack costs microseconds a tensor)
    assert ti.no_dispatch_modes() is ti.no_dispatch_modes()
    with ti.no_dispatch_modes():
        x.clone()
    assert torch._C._len_torch_dispatch_stack() == 0


def test_no_dispatch_modes_pops_a_pre_dispatch_mode() -> None:
    """A mode on torch's pre-dispatch stack (export's tracer) is popped too: the cheap test for one is the
    PreDispatch key, which torch includes while that stack holds a mode."""
    from torch._ops import _len_torch_dispatch_stack_pre_dispatch, _pop_mode_from_pre_dispatch, _set_mode_pre_dispatch
    from torch._subclasses.schema_check_mode import SchemaCheckMode

    key = torch._C.DispatchKey.PreDispatch
    assert not torch._C._dispatch_tls_is_dispatch_key_included(key)
    mode = SchemaCheckMode()
    mode._dispatch_key = key  # (so that torch pushes it back on the pre-dispatch stack, not the other)
    _set_mode_pre_dispatch(mode)
    try:
        assert torch._C._dispatch_tls_is_dispatch_key_included(key)
        ctx = ti.no_dispatch_modes()
        assert ctx is not ti.no_dispatch_modes()  # not the shared no-op: this one pops
        with ctx:
            assert _len_torch_dispatch_stack_pre_dispatch() == 0
        assert _len_torch_dispatch_stack_pre_dispatch() == 1
    finally:
        _pop_mode_from_pre_dispatch()
    assert not torch._C._dispatch_tls_is_dispatch_key_included(key)
    assert ti.no_dispatch_modes() is ti.no_dispatch_modes()


def test_a_process_that_compiles_nothing_never_imports_dynamo() -> None:
    """is_compiled_callable asks torch._dynamo only once something imported it: importing it to ask made the first
    remat(...) of every process take about 1.5 s. In a fresh process, a remat'd call's forward and backward (full
    engine, then planned) import none of it, and a function compiled afterwards is still recognised."""
    import subprocess
    import sys

    code = (
        "import sys, torch, remat\n"
        "f = remat.remat(lambda x: torch.sin(x @ x).sum(), policy='save-matmuls')\n"
        "x = torch.randn(3, 3, requires_grad=True)\n"
        "for _ in range(2):\n"
        "    f(x).backward()\n"
        "assert 'torch._dynamo' not in sys.modules, 'imported'\n"
        "from remat import _torch_internals as ti\n"
        "assert ti.is_compiled_callable(torch.compile(lambda x: x, backend='eager'))\n"
        "assert not ti.is_compiled_callable(torch.compiler.disable(lambda x: x))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_compile_helpers_work_on_this_torch() -> None:
    """The name annotation reaches the node AOTAutograd traces; compiled callables are recognised."""
    import torch.fx.traceback as fxt

    with fxt.preserve_node_meta():
        assert ti.annotated_name() is None
    compiled = torch.compile(lambda x: x, backend="eager")
    assert ti.is_compiled_callable(compiled) and ti.is_compiled_callable(torch.compile(torch.nn.Linear(1, 1)))
    assert not ti.is_compiled_callable(lambda x: x) and not ti.is_compiled_callable(torch.nn.Linear(1, 1))
    seen = []

    def backend(gm: Any, example_inputs: Any) -> Any:
        seen.extend(n.meta.get("custom") for n in gm.graph.nodes if n.op == "call_function")
        return gm

    def f(x: torch.Tensor) -> torch.Tensor:
        with ti.annotate_name("h"):
            return x * 1

    torch._dynamo.reset()
    torch.compile(f, backend=backend, fullgraph=True)(torch.ones(2))
    assert {"remat_checkpoint_name": "h"} in seen


def test_compiled_parts_give_the_original_and_its_compile_context() -> None:
    """What remat(torch.compile(f)) takes apart: the original callable, and a context that compiles another callable
    with the same backend (counted); None for a callable torch.compile did not return."""
    seen = []

    def backend(gm: Any, example_inputs: Any) -> Any:
        seen.append(gm)
        return gm

    def f(x: torch.Tensor) -> torch.Tensor:
        return x.sin()

    torch._dynamo.reset()
    parts = ti.compiled_parts(torch.compile(f, backend=backend))
    assert parts is not None and parts[0] is f
    assert torch.equal(parts[1](lambda x: x.cos())(torch.ones(2)), torch.ones(2).cos()) and len(seen) == 1
    lin = torch.nn.Linear(1, 1)
    parts = ti.compiled_parts(torch.compile(lin, backend=backend))
    assert parts is not None and parts[0] is lin
    assert ti.compiled_parts(f) is None and ti.compiled_parts(lin) is None


def test_wrapper_subclass_helpers_work_on_this_torch() -> None:
    """NOTE [wrapper subclasses] in _engine/dispatch.py: a wrapper's inner tensors, its storage, and one of its class and
    layout rebuilt around other inner tensors (torch's own two-tensor test subclass)."""
    from torch.testing._internal.two_tensor import TwoTensor

    from remat._engine.ops import dead_value, storage_key
    from remat._engine.ops import op_meta as meta

    a, b = torch.randn(3, 2), torch.randn(3, 2)
    t = TwoTensor(a, b)
    assert ti.inner_tensors(t) == [a, b] and ti.inner_tensors(a) == []
    assert storage_key(t) == a.untyped_storage().data_ptr() and ti.storage_of(t).data_ptr() == storage_key(t)
    assert ti.wrapper_layout(a) is None
    placeholder = dead_value(meta(t))
    assert type(placeholder) is TwoTensor and placeholder.shape == t.shape
    assert all(x.isnan().all() for x in ti.inner_tensors(placeholder))
    again = ti.rewrap(ti.wrapper_layout(t), {"a": b, "b": a}, t.shape, t.stride())
    assert type(again) is TwoTensor and again.a is b and again.b is a


def test_made_hands_each_recomputed_tensor_back_once_and_refuses_one_it_did_not_make() -> None:
    import pytest

    from remat import RematError
    from remat._engine.packed import Made

    t = torch.zeros(2)
    made = Made({0: t}, {0: t._version})
    assert made.take_if_made("f", 1) is None  # never made
    assert made.take("f", 0) is t
    assert made.take_if_made("f", 0) is None  # taken already
    with pytest.raises(RematError, match="did not make saved tensor #0"):
        made.take("f", 0)
    written = torch.zeros(2)
    made = Made({3: written}, {3: written._version})
    written.add_(1)
    with pytest.raises(RematError, match="modified|written"):
        made.take_if_made("f", 3)


def test_below_autograd_runs_in_place_ops_without_a_graph_or_a_version_bump() -> None:
    """The replay engine's recompute runs below autograd and ADInplaceOrView (NOTE [replay])."""
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    v = y._version
    with ti.below_autograd():
        z = torch.ops.aten.mul.Tensor(y, y)
        torch.ops.aten.mul_.Tensor(z, 2)
        torch.ops.aten.squeeze_.default(y.detach())
    assert z.grad_fn is None and not z.requires_grad
    assert y._version == v
    assert torch.equal(z, torch.full((3,), 8.0))


def test_set_grad_mode_sets_grad_mode_now_and_builds_no_graph_below_autograd() -> None:
    """The replay turns grad mode on around an op that ran with it (a kernel may read it), below autograd."""
    x = torch.ones(3, requires_grad=True)
    with torch.no_grad():
        ti.set_grad_mode(True)
        try:
            assert torch.is_grad_enabled()
            with ti.below_autograd():
                z = torch.ops.aten.mul.Tensor(x, x)
        finally:
            ti.set_grad_mode(False)
        assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()
    assert z.grad_fn is None and not z.requires_grad


def test_python_dispatch_off_hides_ops_from_every_mode() -> None:
    seen: list[Any] = []

    class Seen(ti.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x = torch.ones(2)
    with Seen():
        with ti.python_dispatch_off():
            y = x.clone()
        z = x.clone()
    assert torch.equal(y, z) and seen == [torch.ops.aten.clone.default]


def test_set_version_puts_a_counter_back_on_this_torch() -> None:
    """``ti.set_version`` (the full engine puts back the version counter its recompute's writes moved on a kept view
    of an outside tensor: NOTE [written outside storages]) sets the counter the tensor shares with its views."""
    t = torch.zeros(4)
    v = t[1:]
    t.add_(1.0)
    t.add_(1.0)
    assert t._version == v._version == 2
    ti.set_version(v, 0)
    assert t._version == v._version == 0


def test_has_history_looks_through_every_functorch_level() -> None:
    """A tensor with a graph at some level (the differentiated input of ``grad``, under ``vmap`` too) has history;
    a plain one, or one passed through a level without being differentiated, has none."""
    plain = torch.randn(3)
    assert not ti.has_history(plain)
    assert ti.has_history(torch.randn(3, requires_grad=True))
    seen: list[tuple[bool, bool]] = []

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen.append((ti.has_history(x), ti.has_history(y)))
        return (x * y).sum()

    torch.func.grad(f)(torch.randn(3), plain)
    torch.func.vmap(torch.func.grad(f), in_dims=(0, None))(torch.randn(2, 3), plain)
    assert seen == [(True, False), (True, False)]


def test_top_saved_tensors_hooks_is_the_innermost_pair() -> None:
    def pack(t: torch.Tensor) -> torch.Tensor:
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    assert ti.top_saved_tensors_hooks() is None
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        assert ti.top_saved_tensors_hooks() == (pack, unpack)
        with torch.autograd.graph.save_on_cpu():
            top = ti.top_saved_tensors_hooks()
            assert top is not None and top[0] is not pack
        assert ti.top_saved_tensors_hooks() == (pack, unpack)
    assert ti.top_saved_tensors_hooks() is None


def test_outside_legacy_vmap_leaves_and_restores_every_depth() -> None:
    from torch._vmap_internals import _vmap

    def depth() -> int:
        d = torch._C._vmapmode_increment_nesting() - 1
        torch._C._vmapmode_decrement_nesting()
        return d

    seen = []

    def f(x: torch.Tensor) -> torch.Tensor:
        with ti.outside_legacy_vmap():
            seen.append(depth())
            r = torch.rand(3)  # (refused inside the legacy vmap's mode)
        seen.append(depth())
        return x + r

    assert depth() == 0
    _vmap(lambda y: _vmap(f)(y))(torch.ones(2, 2, 3))
    assert seen == [0, 2]
    with ti.outside_legacy_vmap():
        assert depth() == 0
    assert depth() == 0


def test_version_alias_shares_the_counter_and_holds_no_bytes() -> None:
    """NOTE [kept values written after the call]: the watch moves with every write through the tensor or its views,
    leaves the tensor's version as it was (autograd's saved-tensor checks), and holds none of its storage."""
    import gc
    import weakref

    leaf = torch.randn(64, 64, dtype=torch.float64, requires_grad=True)
    base = leaf * 1
    y = base.sin()  # saves base: a version the watch moved would make this backward raise
    v0 = base._version
    a = ti.version_alias(base)
    assert (a.numel(), a._version, base._version) == (0, v0, v0)
    y.sum().backward()
    s = weakref.ref(base.untyped_storage())
    with torch.no_grad():
        base[1:].mul_(2)  # through a view
    assert a._version == base._version == v0 + 1
    del base, y
    gc.collect()
    assert s() is None  # the watch held none of the bytes
    assert a._version == v0 + 1
    p = torch.nn.Parameter(torch.randn(3))
    w = ti.version_alias(p)
    with torch.no_grad():
        p.add_(1)
    assert w._version == p._version == 1 and p.numel() == 3
    nested = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])  # (no set_: a whole alias, no error)
    assert ti.version_alias(nested)._version == nested._version
