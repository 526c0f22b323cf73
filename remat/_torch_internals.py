"""Every private PyTorch API that remat uses, and why no public one does the job.

When PyTorch changes, this is the only file to touch. Nothing outside this module
imports ``torch._C`` or ``torch._functorch``.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks as _saved_tensors_hooks
from torch.fx.experimental.proxy_tensor import get_proxy_mode as _get_proxy_mode  # (tracing_with_make_fx)

# torch.func's interpreter stack has no public API: remat must know which
# functorch level saved a tensor and rebuild that level for the recompute
# (see NOTE [per-level replay] in _engine/functorch.py).
_F: Any = torch._C._functorch
TransformType: Any = _F.TransformType
RandomnessType: Any = _F.RandomnessType


def interpreter_stack() -> list[Any]:
    """The live functorch interpreters, bottom first (empty outside transforms)."""
    stack = _F.get_interpreter_stack()
    return list(stack) if stack else []


def peek_interpreter() -> Any:
    return _F.peek_interpreter_stack()


def stack_depth() -> int:
    return int(_F.get_dynamic_layer_stack_depth())


def pop_layer() -> Any:
    return _F.pop_dynamic_layer_stack()


def push_layer(layer: Any) -> None:
    _F.push_dynamic_layer_stack(layer)


def vmap_info(interpreter: Any) -> tuple[int, str]:
    """(batch size, randomness) of a vmap interpreter."""
    from torch._functorch.pyfunctorch import VmapInterpreter

    vi = VmapInterpreter(interpreter)
    return int(vi.batch_size()), str(vi.randomness())


def grad_prev_mode(interpreter: Any) -> bool:
    return bool(_F.CGradInterpreterPtr(interpreter).prevGradMode())


def jvp_prev_mode(interpreter: Any) -> bool:
    return bool(_F.CJvpInterpreterPtr(interpreter).prevFwdGradMode())


def maybe_level(t: torch.Tensor) -> int | None:
    lvl = _F.maybe_get_level(t)
    return None if lvl == -1 else int(lvl)


def is_wrapped(t: torch.Tensor) -> bool:
    return bool(_F.is_functorch_wrapped_tensor(t))


def is_batched(t: torch.Tensor) -> bool:
    return bool(_F.is_batchedtensor(t))


def is_grad_wrapper(t: torch.Tensor) -> bool:
    return bool(_F.is_gradtrackingtensor(t))


# Whether a tensor is forward AD's ZeroTensor (an efficient "no tangent"): no public predicate exists. The method
# itself, not a function around it: the offload engine asks once per saved tensor, where a Python frame costs ~0.15 us.
is_zero_tensor: Callable[[torch.Tensor], bool] = torch.Tensor._is_zerotensor


# A tensor subclass that wraps other tensors (DTensor, the AsyncCollectiveTensor a collective returns) names them
# through ``__tensor_flatten__``, the protocol by which torch.compile traces subclasses; torch has no public function
# that lists a wrapper's inner tensors. remat needs them because such wrappers are made and taken apart in Python
# (``DTensor.from_local``, ``to_local``), where no dispatch mode sees it: NOTE [wrapper subclasses] in _engine/dispatch.py.
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors a wrapper subclass holds (its local shard, for a DTensor); [] for any other tensor."""
    if type(t) in _PLAIN_TYPES or not hasattr(type(t), "__tensor_flatten__"):
        return []
    try:
        names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    except Exception:  # (a subclass whose flatten needs a tracing context): no inner tensors known
        return []
    return [x for x in (getattr(t, n, None) for n in names) if isinstance(x, torch.Tensor)]


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage of ``t``'s bytes here: its own, or a wrapper subclass's first inner tensor's; None if none."""
    try:
        s = t.untyped_storage()
        s.data_ptr()
        return s
    except (RuntimeError, NotImplementedError):
        inner = inner_tensors(t)
        return storage_of(inner[0]) if inner else None


def wrapper_layout(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What :func:`rewrap` needs to make a tensor of ``t``'s subclass and layout (a DTensor's mesh and placements)
    around other inner tensors: (class, inner names, flatten context); None for a tensor that wraps none."""
    if type(t) in _PLAIN_TYPES or not hasattr(type(t), "__tensor_flatten__"):
        return None
    try:
        names, ctx = t.__tensor_flatten__()  # type: ignore[attr-defined]
    except Exception:
        return None
    return type(t), tuple(names), ctx


def rewrap(layout: tuple[Any, ...], inner: dict[str, torch.Tensor], size: Any, stride: Any) -> torch.Tensor:
    """A tensor of ``layout``'s subclass around ``inner`` (``__tensor_unflatten__``, the protocol's other half)."""
    cls, _, ctx = layout
    return cls.__tensor_unflatten__(inner, ctx, torch.Size(size), tuple(stride))


def is_dead_wrapper(t: torch.Tensor) -> bool:
    return bool(_F.is_dead_tensor_wrapper(t))


def bdim(t: torch.Tensor) -> int:
    return int(_F.maybe_get_bdim(t))


def unwrap_one(t: torch.Tensor) -> torch.Tensor:
    return _F.get_unwrapped(t)


def unwrap_all(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor below every functorch wrapper (dead ones included)."""
    while _F.is_functorch_wrapped_tensor(t):
        t = _F.get_unwrapped(t)
    return t


def has_history(t: torch.Tensor) -> bool:
    """Whether ``t`` or a tensor below one of its functorch wrappers requires grad (a graph at some level)."""
    while True:
        if t.requires_grad:
            return True
        if not _F.is_functorch_wrapped_tensor(t):
            return False
        t = _F.get_unwrapped(t)


def unwrap_for_grad(t: torch.Tensor, level: int) -> torch.Tensor:
    return _F._unwrap_for_grad(t, level)


def wrap_for_grad(t: torch.Tensor, level: int) -> torch.Tensor:
    return _F._wrap_for_grad(t, level)


def dead_grad_wrapper(t: torch.Tensor) -> torch.Tensor:
    """``t`` wrapped at a grad level that is exited at once (functorch unwraps dead wrappers)."""
    level = _F._grad_increment_nesting()
    try:
        return _F._wrap_for_grad(t, level)
    finally:
        _F._grad_decrement_nesting()


def add_batch_dim(t: torch.Tensor, dim: int, level: int) -> torch.Tensor:
    return _F._add_batch_dim(t, dim, level)


@contextlib.contextmanager
def vmap_level(batch_size: int, randomness: str) -> Iterator[int]:
    level = int(_F._vmap_increment_nesting(batch_size, randomness))
    try:
        yield level
    finally:
        _F._vmap_decrement_nesting()


@contextlib.contextmanager
def grad_level(prev_grad_mode: bool) -> Iterator[int]:
    with torch.set_grad_enabled(prev_grad_mode):
        level = int(_F._grad_increment_nesting())
    try:
        with torch.enable_grad():
            yield level
    finally:
        _F._grad_decrement_nesting()


@contextlib.contextmanager
def jvp_level(prev_fwd_grad_mode: bool) -> Iterator[int]:
    import torch.autograd.forward_ad as fwAD
    from torch._functorch import eager_transforms as et

    with fwAD._set_fwd_grad_enabled(prev_fwd_grad_mode):
        level = int(et.enter_jvp_nesting())
    try:
        with fwAD._set_fwd_grad_enabled(True):
            # torch.func.jvp enters the forward-AD dual level only for the outermost jvp.
            ctx = fwAD.dual_level if et.JVP_NESTING == 1 else contextlib.nullcontext
            with ctx():
                yield level
    finally:
        et.exit_jvp_nesting()


@contextlib.contextmanager
def inplace_requires_grad_allowed() -> Iterator[None]:
    """torch.func forbids requires_grad_() on wrappers; the replay must set it."""
    from torch._functorch import eager_transforms as et

    with et.enable_inplace_requires_grad(True):
        yield


# torch.func.grad/vjp/jacrev disable saved-tensor hooks with an error message
# (pytorch issue 141845). remat's hooks are safe under them, so remat enables
# hooks in its own scope only and restores the previous state on exit. There is
# no public API for reading or setting that state.
class saved_tensors_hooks_enabled:
    """(A class, not a generator: it is entered on every remat call and recompute.)"""

    __slots__ = ("msg",)

    def __enter__(self) -> None:
        self.msg = torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()
        if self.msg is not None:
            torch._C._autograd._saved_tensors_hooks_enable()

    def __exit__(self, *exc: object) -> None:
        if self.msg is not None:
            torch._C._autograd._saved_tensors_hooks_disable(self.msg)


# torch.func.grad, vjp, jacrev and hessian refuse to start while any saved-tensor hooks are
# installed ("don't yet support saved tensor hooks"). remat's reentrant region (_engine/region.py)
# runs a function that enters them with grad mode off (nothing is saved) and recomputes it in its
# own backward, where the enclosing calls' hooks have nothing to do with its ops: it sets the
# hook stack aside for that span. No public API reads or pops the stack (saved_tensors_hooks only
# pushes and pops its own pair).
@contextlib.contextmanager
def saved_tensors_hooks_set_aside() -> Iterator[None]:
    popped = []
    while (top := torch._C._autograd._top_saved_tensors_default_hooks(True)) is not None:
        popped.append(top)
        torch._C._autograd._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(popped):
            torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)


# torch.autograd.grad(..., is_grads_batched=True) and autograd.functional's vectorize=True run the backward pass under
# the legacy vmap (torch._vmap_internals), whose mode refuses every random op whatever its inputs. remat's recompute
# makes the forward pass's values again (no batch dimension: the forward ran outside that vmap), so it runs outside
# the mode. No public API leaves it; its depth is read by one increment (which returns the new depth).
@contextlib.contextmanager
def outside_legacy_vmap() -> Iterator[None]:
    depth = torch._C._vmapmode_increment_nesting() - 1
    torch._C._vmapmode_decrement_nesting()
    for _ in range(depth):
        torch._C._vmapmode_decrement_nesting()
    try:
        yield
    finally:
        for _ in range(depth):
            torch._C._vmapmode_increment_nesting()


def tracing_with_make_fx() -> bool:
    """Whether ``make_fx`` is tracing (``torch.func.linearize`` traces its jvp so): remat keeps everything then
    (``_engine/select.py``). No public API asks; ``get_proxy_mode`` is the proxy-tensor module's own question (the
    module is imported by torch itself)."""
    return _get_proxy_mode() is not None


# torch's selective checkpointing keeps a context_fn's policy inside the forward context that
# create_selective_checkpoint_contexts returns (``_CachingTorchDispatchMode.policy_fn``); a context_fn that makes the
# contexts itself (torchtitan's ``selective_checkpointing_context_fn``) hands over nothing else to read it from, and no
# public API reads it.
def selective_policy_of(contexts: Any) -> Callable[..., Any] | None:
    """The policy of the contexts a torch ``context_fn`` returned, when torch's selective checkpointing made them."""
    caching = getattr(torch.utils.checkpoint, "_CachingTorchDispatchMode", None)
    if isinstance(contexts, tuple) and len(contexts) == 2 and caching is not None and type(contexts[0]) is caching:
        fn = getattr(contexts[0], "policy_fn", None)
        return fn if callable(fn) else None
    return None


def top_saved_tensors_hooks() -> tuple[Any, Any] | None:
    """The (pack, unpack) pair on top of the stack: a full-engine call's program notes whether the function pushed
    hooks of its own (``torch.utils.checkpoint``, ``save_on_cpu`` inside it: ``_engine/program.py``)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True)  # type: ignore[no-any-return]


# torch.autograd.graph.allow_mutation_on_saved_tensors() has no public "is it on": its flag is the module's global.
# remat's messages read it (a write into a saved tensor is legal there, and remat's hooks replace the context's).
def mutation_on_saved_allowed() -> bool:
    return bool(getattr(torch.autograd.graph, "_allow_mutation_on_saved_tensors_enabled", False))


def saved_tensors_hooks_disabled_message() -> str | None:
    return torch._C._autograd._saved_tensors_hooks_get_disabled_error_message()


# The autograd engine has no public "run this when the current backward pass
# ends" hook; DDP and FSDP use the same call. remat frees a call's recomputed
# tensors there when the backward pass did not read all of them.
def queue_backward_callback(fn: Callable[[], None]) -> bool:
    try:
        torch.autograd.Variable._execution_engine.queue_callback(fn)  # type: ignore[attr-defined]
    except RuntimeError:  # not inside a backward pass
        return False
    return True


# No public API sets a tensor's version counter. The full engine's recompute writes an outside tensor's values
# into a copy of its own (NOTE [written outside storages] in _engine/outside_writes.py), but the write's view of
# the outside tensor was made above the dispatch level, where the in-place op moves the real tensor's counter: put
# back, the counter says what is true (its values did not change), and a kept view of it is not refused.
def set_version(t: torch.Tensor, version: int) -> None:
    torch._C._autograd._unsafe_set_version_counter((t,), (version,))  # (torch 2.11 to 2.13: sequences)


# NOTE [kept values written after the call] in _engine/replaying.py: a watch on ``t``'s version counter, none of its
# bytes (public APIs share one only with the storage): a ``detach`` emptied by ``set_()``, its counter put back.
def version_alias(t: torch.Tensor) -> torch.Tensor:
    if t.layout is not torch.strided or t.is_nested or t.is_quantized or type(t) not in _PLAIN_TYPES:
        return t.detach()  # (no set_ for sparse, nested or quantized tensors, nor one a subclass sees: the whole alias)
    v = t._version
    with torch.no_grad(), torch._C._DisableTorchDispatch():  # (remat's bookkeeping: no user's dispatch mode sees it)
        a = t.detach()
        a.set_()  # type: ignore[call-overload]  # (torch's stubs lack the overload without arguments)
    set_version(a, v)
    return a


def will_engine_execute(node: Any) -> bool:
    """Whether the running backward pass will execute autograd node ``node`` (True outside a backward pass).

    NOTE [unused outputs] in ``_engine/full.py``: no public API tells which outputs of a call the backward pass
    differentiates; torch's own ``register_multi_grad_hook`` asks the engine this way."""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return True


# No public API says whether a tensor's history was made before a point (NOTE [program replay]: a tensor with history
# a call reads from outside, the enclosing function's, is read as it is): ``autograd_order()`` then, and a node's.
def autograd_order(node: Any = None) -> int:
    """The sequence number of autograd node ``node``, or the one this thread's next node will get."""
    return int(torch.autograd._get_sequence_nr() if node is None else node._sequence_nr())  # type: ignore[attr-defined]


# TorchDispatchMode is the documented way to see ATen ops below autograd and every functorch
# layer (the only place a policy can see matmuls under torch.func), but it lives in a private
# module: remat imports it from here only.
from torch.utils._python_dispatch import TorchDispatchMode as _TorchDispatchMode  # noqa: E402

# What torch's wrapper does, at no cost per op: Dynamo never compiles a handler's frame nor any frame it
# calls (a frame strategy kept on the code object, read by Dynamo's C frame evaluator only while a compiled
# function runs). Without it, a torch.compile'd function called inside a remat'd function has Dynamo compile
# remat's handler frames and the engine code they call (the handler runs with its own mode popped, and Dynamo
# compiles inside a handler once no mode is left on the stack: torch._dynamo.config
# .inline_torch_dispatch_torch_compile). No public API sets a frame strategy: torch.compiler.disable is the
# wrapper itself.
try:
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy
    from torch._C._dynamo.eval_frame import set_code_exec_strategy as _set_code_exec_strategy

    _NEVER_COMPILED: Any = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
except (ImportError, AttributeError, TypeError):  # pragma: no cover - a torch without frame strategies
    _NEVER_COMPILED = None


def never_compiled(fn: Any) -> Any:
    """Mark ``fn`` (a function or bound method) so that Dynamo never compiles its frame nor any frame it calls,
    as for a mode's handler below. remat's saved-tensor hooks run inside the user's code, a compiled function's
    too, with no mode on the stack: Dynamo would compile the engine's code they call. Returns ``fn``."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if _NEVER_COMPILED is not None and code is not None:
        # (on every call that installs hooks: idempotent, ~0.1 us, and no registry of marked code to keep)
        _set_code_exec_strategy(code, _NEVER_COMPILED)
    return fn


def saved_tensors_hooks(pack: Any, unpack: Any) -> Any:
    """torch's ``saved_tensors_hooks(pack, unpack)``, both hooks :func:`never_compiled`."""
    return _saved_tensors_hooks(never_compiled(pack), never_compiled(unpack))


class TorchDispatchMode(_TorchDispatchMode):
    """torch's ``TorchDispatchMode``, its handler kept from Dynamo by a frame strategy instead of a wrapper.

    torch wraps every subclass's ``__torch_dispatch__`` in ``torch._disable_dynamo`` unless the class
    opts out through the private classmethod ``_should_skip_dynamo`` (no public switch). The wrapper
    costs ~3.5 us per op, ~30% of a mode's whole cost per op (measured on this project's CPU: 13.5
    against 17.0 us per op for tiny transformer blocks under an empty mode and ``no_grad``, 4.6 without
    a mode). Marking the handler :func:`never_compiled` does what the wrapper does at no cost per op.
    On a torch without frame strategies, the wrapper stays."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return _NEVER_COMPILED is None  # (torch's wrapper, where its code cannot be marked below)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__torch_dispatch__" in cls.__dict__:
            never_compiled(cls.__dict__["__torch_dispatch__"])


def op_call(func: Any) -> Any:
    """What calling the ATen op ``func`` (an ``OpOverload``) runs: its C++ callable, ``func._op``.

    ``OpOverload.__call__`` is a Python frame that only forwards to ``_op``; a dispatch mode's handler
    calls its op once per op, and that frame is ~0.5 us of a mode's ~6 us per op here (measured on this
    project's CPU, 8 tiny transformer blocks under an empty mode and ``no_grad``: 882 against 831 us). No
    public API names the callable; without the attribute, the op itself is called."""
    return getattr(func, "_op", func)


_NO_MODES = contextlib.nullcontext()
_PRE_DISPATCH = torch._C.DispatchKey.PreDispatch


# The two facts no_modes_pushed asks, as C callables: the offload engine's hot path asks them once per saved tensor,
# and a Python frame around them costs ~0.15 us there. How many modes the dispatch-mode stack holds, and whether
# the pre-dispatch stack holds one (see no_dispatch_modes).
dispatch_modes_pushed: Callable[[], int] = torch._C._len_torch_dispatch_stack
pre_dispatch_modes_pushed: Callable[[], bool] = functools.partial(torch._C._dispatch_tls_is_dispatch_key_included,
                                                                  _PRE_DISPATCH)


def no_modes_pushed() -> bool:
    """Whether neither dispatch-mode stack holds a mode (inside a mode's handler, its own mode is popped)."""
    return dispatch_modes_pushed() == 0 and not pre_dispatch_modes_pushed()


def no_dispatch_modes() -> contextlib.AbstractContextManager[Any]:
    """Run remat's own copies below every dispatch mode: the user's modes and tracers (make_fx
    inside torch.func.linearize) must not see them. No public API pops the mode stack.

    With no mode on either stack (the common case: an offload from a pack hook of a traced call), nothing
    to pop: popping and pushing back an empty stack costs about 15 us a tensor. torch includes the
    PreDispatch key in the thread's dispatch set while its pre-dispatch stack holds a mode (torch/_ops.py,
    _set_mode_pre_dispatch), which is cheaper to ask than the stack's length (a Python count); with the
    key included and no mode, the modes are popped as before."""
    if no_modes_pushed():
        return _NO_MODES
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


# torch 2.11 (fixed by 2.13): an op run in a saved-tensor pack hook under a torch.func level, with the
# functorch layers popped, while a Python dispatch mode is active trips an internal assert in the
# Python fallback kernel ("tls_on_entry.has_value()"). remat's own detach/copy there need no mode:
# run them with the modes popped. No public API pops the mode stack (see no_dispatch_modes).
def plain_ops_in_pack_hook() -> contextlib.AbstractContextManager[Any]:
    return no_dispatch_modes()


def cuda_graph_capturing(t: torch.Tensor) -> bool:
    """Whether ``t`` is on CUDA and the current CUDA stream is capturing a graph (public API; here so tests
    can stand it in). A CPU tensor asks nothing of CUDA (``torch.cuda.is_available()`` costs microseconds)."""
    return bool(t.is_cuda and torch.cuda.is_current_stream_capturing())


def is_compiling() -> bool:
    return bool(torch.compiler.is_compiling())


# Grad mode on or off, now, as ``torch.set_grad_enabled(mode)`` called as a function does, without its Python object:
# the replay engine's recompute runs its ops with grad mode on (below autograd, where it builds no graph, a kernel may
# still read it: ``_engine/replaying.py``) and turns it off around each value it fetches (remat's own unpack hooks
# read it), ~0.1 against ~1 us a time.
set_grad_mode = torch._C._set_grad_enabled


def below_autograd() -> contextlib.AbstractContextManager[Any]:
    """Run ops below autograd and below ``ADInplaceOrView``: no graph, no view bookkeeping, no version bumps.

    The replay engine's recompute (NOTE [replay] in ``_engine/replaying.py``) calls the recorded ATen overloads
    again and needs none of that: a version bump made by a replayed in-place op (``squeeze_`` on an alias of a
    kept value, a write into a replayed value) would move the counter of a tensor autograd holds and make its
    unpack fail; and skipping both layers is faster than ``torch.no_grad()``. No public API dispatches below
    ``ADInplaceOrView`` (``torch.no_grad`` stays above it); torch's own functionalization and custom ops use this
    guard."""
    return torch._C._AutoDispatchBelowADInplaceOrView()  # type: ignore[no-any-return]


def python_dispatch_off() -> contextlib.AbstractContextManager[Any]:
    """Ops inside skip every Python dispatch mode (and subclass), at the cost of a guard: the offload engine's copy of
    a plain tensor taken in a pack hook while remat's own tracers are on the stack, which would each see it (a Python
    round trip of several us per copy). Popping the modes (``no_dispatch_modes``) costs more; no public API skips
    them."""
    return torch._C._DisableTorchDispatch()  # type: ignore[no-any-return]


# A saved tensor held by remat must be detached (an output held with its graph would make a reference cycle
# through its own node), and a pack hook runs while remat's own dispatch mode is on the stack: a public
# detach takes a trip through that Python mode (~3x its cost; per saved tensor, on the pack hook's hot loop).
# torch.utils._python_dispatch._disable_current_modes pops the stack in Python and costs more than the trip.
# The C guard skips Python dispatch for the one call; only for plain tensors, whose detach no subclass defines.
# With no mode pushed (in a mode's handler, where its own is popped, or under none) there is nothing to skip, and
# the guard would cost more than the detach (1.0 against 0.4 us).
def detach_below_modes(t: torch.Tensor) -> torch.Tensor:
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        if no_modes_pushed():
            return t.detach()
        with torch._C._DisableTorchDispatch():
            return t.detach()
    return t.detach()


# --- torch.compile (NOTE [compiled remat] in _engine/compiled.py) ---------------------------------------------------
# Under torch.compile, a policy sees the ATen ops of a traced region through torch's selective-checkpoint
# policy hook, called while AOTAutograd traces the region with fake tensors. A checkpoint_name there is an
# aten.alias like any other: the only way to hand the name from Dynamo's trace to that hook is node metadata.
# torch.fx.traceback.annotate puts a dict on the nodes traced inside it (Dynamo traces the context manager and
# AOTAutograd carries the dict to the nodes it derives), and get_current_meta returns the metadata of the node
# being interpreted. Both are in torch.fx.traceback without an underscore but undocumented (torch >= 2.9).
_NAME_KEY = "remat_checkpoint_name"


def annotate_name(name: str) -> contextlib.AbstractContextManager[Any]:
    """Tag the nodes Dynamo traces inside with ``name`` (read back by :func:`annotated_name`)."""
    import torch.fx.traceback as fxt

    return fxt.annotate({_NAME_KEY: name})  # type: ignore[no-any-return]


def annotated_name() -> str | None:
    """The ``annotate_name`` of the node AOTAutograd is tracing now, if any."""
    import torch.fx.traceback as fxt

    meta = fxt.get_current_meta() or {}
    name = (meta.get("custom") or {}).get(_NAME_KEY)
    return name if isinstance(name, str) else None


def is_compiled_callable(fn: Any) -> bool:
    """Whether ``fn`` is what ``torch.compile`` returned (a compiled function or an ``OptimizedModule``).

    torch has no public predicate; both forms carry the original as ``_torchdynamo_orig_callable`` or
    ``_orig_mod``, set by torch._dynamo.eval_frame.

    A process that has not imported that module compiled nothing (``torch.compile`` and
    ``torch.compiler.disable`` import it): importing it only to ask costs about 1.5 s, on the first
    ``remat(...)`` of every process."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:
        return False
    if isinstance(fn, eval_frame.OptimizedModule):
        return True
    seen = 0
    while fn is not None and seen < 8:  # through bound methods and partials of a compiled function
        if getattr(fn, "_torchdynamo_disable", False):  # torch.compiler.disable sets the attribute too
            return False
        if getattr(fn, "_torchdynamo_orig_callable", None) is not None:
            return True
        fn = getattr(fn, "__func__", None) or getattr(fn, "func", None)
        seen += 1
    return False


# FSDP2 swaps a module's parameters between sharded DTensors and gathered tensors in its hooks, which run inside a
# remat'd call that calls the sharded module (NOTE [FSDP's hooks] in _engine/dispatch.py). Which parameters it manages has no
# public API: its parameter groups' FSDPParams hold them (one group on torch 2.11, a list of groups since).
def fsdp_sharded_params(module: Any) -> list[torch.Tensor]:
    """The sharded parameters FSDP2 registers on the modules of ``module`` (a ``fully_shard``'ed module) between its
    calls; [] for any other module."""
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return []
    try:
        state = get_state()
    except Exception:
        return []
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    out = []
    for group in groups:
        for fp in getattr(group, "fsdp_params", ()):
            for name in ("sharded_param", "_sharded_post_forward_param"):
                t = getattr(fp, name, None)
                if isinstance(t, torch.Tensor):
                    out.append(t)
    return out


def compiled_parts(fn: Any) -> tuple[Any, Callable[[Any], Any]] | None:
    """For what ``torch.compile`` returned: the original callable, and a function that compiles another callable
    with the same backend, mode and options (the context ``torch.compile`` made); None if either cannot be found.

    No public API returns them: a compiled module keeps both (``_orig_mod``, ``dynamo_ctx``), a compiled function
    keeps the original as ``_torchdynamo_orig_callable`` and the context in its closure, set by
    torch._dynamo.eval_frame. ``remat(torch.compile(f))`` uses them to mean ``torch.compile(remat(f))``."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None:
        return None
    context_type = getattr(eval_frame, "_TorchDynamoContext", None)
    if isinstance(fn, eval_frame.OptimizedModule):
        ctx = getattr(fn, "dynamo_ctx", None)
        orig = getattr(fn, "_orig_mod", None)
    else:
        orig = getattr(fn, "_torchdynamo_orig_callable", None)
        ctx = None
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # (an empty cell)
                continue
            if context_type is not None and isinstance(value, context_type):
                ctx = value
                break
    if orig is None or not callable(orig) or ctx is None or not callable(ctx):
        return None
    return orig, ctx


def activation_memory_budget(fraction: float) -> contextlib.AbstractContextManager[Any]:
    """``torch.compile``'s own activation budget for the partitioner while the body compiles (the peer that
    ``python -m remat.bench --budgets ... --compile`` measures ``policies.memory_budget`` against). torch sets it
    only in ``torch._functorch.config``, which has no public setter."""
    import torch._functorch.config as fc

    return fc.patch(activation_memory_budget=fraction)  # type: ignore[no-any-return]


# ---- torch.compile's activation offloading (NOTE [compiled remat] in _engine/compiled.py) --------------------------
# torch (2.13) has a compile-time pass that moves saved values to host memory and back
# (torch._functorch._activation_offloading), run by the partitioner when torch._functorch.config's
# enable_activation_offloading is on, for the forward nodes whose meta says "should_offload". Nothing in torch sets
# that flag from a checkpoint policy (CheckpointPolicy.MUST_CPU_OFFLOAD is an enum value the partitioner does not
# read), and the config has no public setter: remat sets both while the body compiles, through the config's own
# scoped patch and its joint-graph hook (joint_custom_pass, chained after one the user set).

_OFFLOAD_MARK = "_remat_marks_offloads"


def activation_offloading_available() -> bool:
    """Whether this torch has the compile-time offloading pass and the joint-graph hook remat drives it with."""
    import torch._functorch.config as fc
    from torch.utils.checkpoint import CheckpointPolicy

    if not hasattr(fc, "enable_activation_offloading") or not hasattr(fc, "joint_custom_pass") \
            or not hasattr(CheckpointPolicy, "MUST_CPU_OFFLOAD"):
        return False
    try:
        import torch._functorch._activation_offloading.activation_offloading  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def activation_offloading() -> Iterator[None]:
    """torch's compile-time offloading on, for the nodes remat's compiled policy marks, while the body compiles."""
    import torch._functorch.config as fc
    from torch.utils.checkpoint import CheckpointPolicy

    previous = fc.joint_custom_pass
    offload = (CheckpointPolicy.MUST_CPU_OFFLOAD, CheckpointPolicy.PREFER_CPU_OFFLOAD)

    def joint(gm: Any, inputs: Any) -> Any:
        gm = previous(gm, inputs) if previous is not None else gm
        for node in gm.graph.nodes:  # (the nodes a checkpoint policy answered MUST_CPU_OFFLOAD for: saved, marked)
            if node.meta.get("recompute") in offload:
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
                node.meta["should_offload"] = True
        return gm

    setattr(joint, _OFFLOAD_MARK, True)
    with fc.patch(enable_activation_offloading=True, joint_custom_pass=joint):
        yield


def activation_offloading_on() -> bool:
    """Whether the body of :func:`activation_offloading` is running (the pass will see remat's marks)."""
    import torch._functorch.config as fc

    return bool(getattr(fc, "enable_activation_offloading", False)) and \
        getattr(getattr(fc, "joint_custom_pass", None), _OFFLOAD_MARK, False)


# The classes of ATen ops (``torch.ops.aten.mm.default`` is an OpOverload, ``torch.ops.aten.mm`` its packet): torch
# names them only in the private ``torch._ops``; ``remat.checkpoint`` checks a selective-checkpointing list against
# them as torch's ``create_selective_checkpoint_contexts`` does.
from torch._ops import HigherOrderOperator as HigherOrderOperator  # noqa: E402
from torch._ops import OpOverload as OpOverload  # noqa: E402
from torch._ops import OpOverloadPacket as OpOverloadPacket  # noqa: E402
