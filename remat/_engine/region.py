"""The reentrant region: remat for functions that enter a torch.func reverse transform, without saved-tensor hooks.

NOTE [reentrant region]
    torch refuses to enter ``torch.func.grad``, ``vjp``, ``jacrev`` or ``hessian``
    while saved-tensor hooks are installed, and remat's frames work through them
    (``full.py``). A remat'd function that enters one therefore runs as a single
    ``torch.autograd.Function`` (the functorch-compatible kind: ``setup_context``,
    a generated vmap rule), as ``torch.utils.checkpoint(use_reentrant=True)`` does:
    autograd saves only the region's inputs. Its forward pass runs the function
    under ``torch.func.vjp`` (the ops a torch.func transform inside runs depend on
    the grad mode, so forward and recompute run it the same way; that graph dies
    with the call) and under the :class:`~remat._engine.dispatch.Recorder`, which asks the
    policy about every op and holds the outputs it saves at once (``region``: no
    saved tensor will say what the backward pass reads). Its backward pass runs the
    function again under ``torch.func.vjp`` and the :class:`~remat._engine.dispatch.Replayer`
    (saved outputs handed back, random numbers and autocast as in the forward pass)
    and applies the vjp. That graph's backward formulas read what the re-run passed, so
    every op, one whose output is handed back included, is checked against the forward
    pass's: its numbers and which input or value of the call each tensor is (NOTE [same
    reads]; module state is an input of a region, so a parameter too), and a tensor from
    outside is the very one at its version, however small. So it works under plain
    autograd (double backward too) and under torch.func transforms. Module state the function reads (NOTE [state is an
    input]) are inputs of the region, so their gradients flow; a tensor read from
    somewhere remat does not look that requires grad (plain autograd: seen at the
    dispatch level) or is a torch.func wrapper (``_Captured``: a storage that is
    neither an input nor made inside) raises ``RematError`` instead of losing its
    gradient. The enclosing calls' hooks are set aside while the region runs its
    function (``saved_tensors_hooks_set_aside``), so regions nest inside remat'd
    calls and their recomputes. A tensor with history the function hands out other than in its result (a global,
    ``self.aux``) would lose its gradient with the vjp's level: it raises (``_Made``); a dataclass result is taken
    apart (``leaves.py``). ``detach`` is not an op of a region (the number
    torch.func runs depends on the grad mode, which differs between the forward
    and the backward pass): its output is the same value under another name.

    The first call of a remat'd function finds out (torch's error on entering the
    transform); the outermost remat call then restores the random-number state and
    runs again, this function now as a region, and later calls go straight here.
    Differences from a frame: what the policy saves is held whether or not the
    backward pass needs it, and an offload decision keeps the output on its device.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import optree
import torch
from torch.overrides import TorchFunctionMode

from .. import _torch_internals as ti
from .._context import internal
from .._errors import RematError, input_written_before_backward
from .ambient import AmbientState
from .dispatch import Recorder
from .leaves import dataclass_fields
from .ops import storage_key
from .replay import Replayer
from .state import Snapshot
from .wiring import Wiring, known_tokens

__all__ = ["NeedsRegion", "run_region", "enclosed", "forward_pass", "rewind_attempt"]

_TENSOR = object()  # an output leaf that is a tensor (returned by the autograd.Function)


# How many remat calls on this thread are running their function's forward pass (a frame or a region): a call
# that finds out it needs a region, inside another, lets the outermost run again (the enclosing calls have
# recorded the failed attempt's ops).
_FORWARDS: contextvars.ContextVar[int] = contextvars.ContextVar("remat_forwards", default=0)


def enclosed() -> bool:
    """Whether this remat call runs inside another remat call's forward pass."""
    return _FORWARDS.get() > 0


@contextlib.contextmanager
def forward_pass() -> Iterator[None]:
    was = _FORWARDS.get()
    try:
        _FORWARDS.set(was + 1)
        yield
    finally:
        _FORWARDS.set(was)


class NeedsRegion(Exception):
    """Raised through the remat calls on the stack when a function enters a torch.func reverse transform.

    Not a RuntimeError, so that the enclosing frames let it pass to the outermost remat call, which runs
    again (NOTE [reentrant region]). ``origin`` is the frame whose function entered the transform.
    """

    def __init__(self, origin: Any, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.origin = origin
        self.cause = cause
        self.rewind: Callable[[], None] | None = None  # set by the outermost call's engine on the way out


def _differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


class _Call:
    """One call of a remat'd function run as a region: what its backward pass needs."""

    def __init__(self, run: Callable[[list[Any]], Any], flat: list[Any], fn_name: str, policy: Callable[..., Any],
                 preserve_rng: bool, state: Snapshot) -> None:
        self.run = run
        self.flat = flat
        self.fn_name = fn_name
        self.state = state
        self.slots = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
        self.n_inputs = len(self.slots)
        self.recorder = Recorder(policy, fn_name, lambda t, d: t.detach())  # offloaded: kept (see the NOTE)
        self.recorder.region = True
        with internal():
            tensors = [flat[i] for i in self.slots] + list(state.tensors)
            self.ambient = AmbientState.capture(tensors, preserve_rng)
        self.recorder.generators = self.ambient.generators
        self.tensors = tensors
        # under torch.func transforms, a wrapper of theirs read inside, not passed in, would get no gradient
        # (torch.autograd.Function's rule): _Captured refuses it
        self.under_func = bool(ti.interpreter_stack())
        self.out_spec: Any = None
        self.versions: list[int] = []
        self.draws: list[tuple[Any, torch.Tensor]] | None = None  # (run_region's)
        self.out_consts: list[Any] = []
        self.n_float = 0  # the outputs are the differentiable ones, then the others

    def _fn(self, tensors: list[torch.Tensor], diff: list[int], made: _Made | None = None) -> Any:
        """The function of the differentiable tensors ``diff`` (the others fixed), as torch.func.vjp wants it."""
        def fn(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
            full = list(tensors)
            for i, t in zip(diff, ts):
                full[i] = t
            vals = list(self.flat)
            for slot, t in zip(self.slots, full):
                vals[slot] = t
            with self.state.restored(full[self.n_inputs:]), made or contextlib.nullcontext():
                out = self.run(vals)
            leaves, spec = optree.tree_flatten(out, none_is_leaf=True)
            leaves, collapse = dataclass_fields(leaves)  # (a dataclass's fields: results of the region too)
            self.out_spec = spec, collapse
            self.out_consts = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
            ts_out = [x for x in leaves if isinstance(x, torch.Tensor)]
            self._others = [x for x in ts_out if not _differentiable(x)]
            floats = tuple(x for x in ts_out if _differentiable(x))
            self._order = [_differentiable(x) for x in ts_out]
            return floats

        return fn

    def forward(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        rec = self.recorder
        with internal():
            keys = {storage_key(ti.unwrap_all(t)) for t in tensors}
            rec.input_keys = keys
        # NOTE [same reads] in _engine/wiring.py: module state is an input of a region, so which tensor each op reads
        # is a position the recompute must read too (``src = self.W if self.flag else self.V``: its vjp's graph would
        # send the gradient to the other one)
        rec.wiring = Wiring(known_tokens(list(tensors), ti.unwrap_all), loose=True)
        diff = [i for i, t in enumerate(tensors) if _differentiable(t)]
        # Under torch.func.vjp, as in the recompute: the ops a torch.func transform inside runs depend on the
        # grad mode; the graph this builds dies here (only the outputs are kept)
        with contextlib.ExitStack() as es:
            es.enter_context(forward_pass())
            es.enter_context(ti.saved_tensors_hooks_set_aside())
            if self.under_func:
                es.enter_context(_Captured(rec, self.fn_name))
            es.enter_context(rec)
            made = _Made()
            try:
                floats = torch.func.vjp(self._fn(list(tensors), diff, made), *[tensors[i] for i in diff])[0]
            except RuntimeError as e:
                if "mutate a captured Tensor" in str(e):
                    raise _captured_write(self.fn_name) from e
                if "non-empty output" in str(e):  # (no tensor in its result: one inside an object, or none)
                    made.refuse_escaped(self.fn_name)
                raise
        made.refuse_escaped(self.fn_name)  # (the vjp's graph is gone: what it saved too)
        self.versions = [_version(t) for t in self.tensors]  # (written before the backward pass: refused, named)
        if self.draws:
            _same_draws(self.fn_name, self.draws, [r.rng for r in rec.ops if r.rng is not None])
        with internal():
            rec.seal()
            rec.watch_results([])  # (its kept outputs, which the caller may write: NOTE [kept values written ...])
            for r in rec.ops:
                for _, t, _ in r.outside or ():
                    if t.requires_grad and storage_key(t) not in keys:
                        raise _lost(self.fn_name, list(t.shape), rec._label(t))
        f_it, o_it = iter(floats), iter(self._others)
        outs = tuple(next(f_it) if is_f else next(o_it) for is_f in self._order)
        # an input returned as it is would be saved for backward as an output too, which autograd refuses
        with internal():
            outs = tuple(o.detach() if any(o is t for t in tensors) else o for o in outs)
        self.n_float = len(floats)
        return outs

    def rewind(self) -> None:
        """Undo what a forward pass cut short by a :class:`NeedsRegion` did, so that the call can run again."""
        rewind_attempt(self.recorder, self.ambient, self.fn_name)

    def written(self) -> None:
        """Refuse, naming it, an input or a tensor of module state written in place since the forward pass (autograd
        would refuse its saved input with a message that names neither remat nor the tensor)."""
        for i, (t, v) in enumerate(zip(self.tensors, self.versions)):
            if _version(t) != v:
                if i < self.n_inputs:
                    raise input_written_before_backward(self.fn_name, self.slots[i], t)
                raise RematError(
                    f"remat: a tensor of {self.fn_name}'s module state or closure (shape {list(t.shape)}) was "
                    "modified in place after its forward pass and before its backward pass; the recompute would "
                    "read the new value. Run the backward pass first, or update it out of place."
                )

    def backward(self, saved: tuple[torch.Tensor, ...], grads: tuple[Any, ...]) -> tuple[Any, ...]:
        diff = [i for i, t in enumerate(saved) if _differentiable(t)]
        replayer = Replayer(self.recorder)
        if replayer.wiring is not None:  # (this pass's inputs, by position as the forward pass's)
            replayer.wiring.known = known_tokens(list(saved), ti.unwrap_all)
        with contextlib.ExitStack() as es:
            es.enter_context(ti.saved_tensors_hooks_set_aside())
            es.enter_context(self.ambient.restored())
            es.enter_context(replayer)
            try:
                res = torch.func.vjp(self._fn(list(saved), diff), *[saved[i] for i in diff])
            except RuntimeError as e:
                if "randomness" not in str(e):
                    raise
                raise RematError(
                    f"remat: {self.fn_name} enters a torch.func reverse transform itself and draws random numbers, "
                    "under a torch.func.vmap whose randomness is 'error' (jacrev, jacfwd and hessian vmap with it): "
                    "remat runs its Python again in the backward pass (NOTE [reentrant region]), where the draw "
                    "raises. Pass randomness='same' or 'different' to an explicit vmap (vmap(vjp_fn, randomness="
                    "'different')), or call the function without remat there."
                ) from e
            floats, vjp_fn = res[0], res[1]
            replayer.finish()
        float_grads = [g for g, is_f in zip(grads, self._order) if is_f]
        cts = tuple(torch.zeros_like(o) if g is None else g for o, g in zip(floats, float_grads))
        got = vjp_fn(cts) if cts else tuple(torch.zeros_like(saved[i]) for i in diff)
        out: list[Any] = [None] * len(saved)
        for i, g in zip(diff, got):
            out[i] = g
        return tuple(out)


def rewind_attempt(recorder: Recorder, ambient: AmbientState, fn_name: str) -> None:
    """The random-number state goes back to where the call began; writes into outside tensors cannot be undone."""
    if recorder.written_outside:
        raise RematError(
            f"remat: {fn_name} (or a remat'd function it calls) enters torch.func.grad, vjp, jacrev or hessian, so "
            "remat runs it again as one region (NOTE [reentrant region]), but the first attempt already updated a "
            "buffer in place (a BatchNorm's running statistics) and running it again would update it twice. Remat "
            "the parts on either side of the inner transform, so that the part that updates the buffer does not "
            "enter it."
        )
    if ambient.cpu_rng is not None:
        ambient.rewind()
    elif any(r.random for r in recorder.ops):
        raise RematError(
            f"remat: {fn_name} (or a remat'd function it calls) enters torch.func.grad, vjp, jacrev or hessian, so "
            "remat runs it again as one region (NOTE [reentrant region]), but it drew random numbers before and "
            "preserve_rng_state=False: the second run would draw others. Pass preserve_rng_state=True."
        )


def _same_draws(fn_name: str, first: list[tuple[Any, torch.Tensor]], now: list[tuple[Any, torch.Tensor]]) -> None:
    """The region that runs a call again from the top (its first attempt found the inner transform) must start each
    generator's draws where that attempt did (the random state was put back): another state means the first attempt
    changed Python state the draws depend on (``torch.manual_seed(self.seed); self.seed += 1``), and this run would
    compute another function. (Each generator's first draw only: under ``torch.func.vjp`` a random op may run as
    another overload, ``bernoulli.p`` for ``bernoulli_.float``, and the draws after it need not line up.)"""
    then: dict[int, torch.Tensor] = {}
    for gen, state in first:
        then.setdefault(id(gen), state)
    seen: set[int] = set()
    for gen, state in now:
        if id(gen) in seen:
            continue
        seen.add(id(gen))
        s0 = then.get(id(gen))
        if s0 is not None and not torch.equal(s0, state):
            raise RematError(
                f"remat: {fn_name} enters a torch.func reverse transform, so its first call runs again from the top as "
                "one region (NOTE [reentrant region]), and that run drew random numbers from another state than the "
                "first attempt: the first attempt changed Python state the draws depend on (a seed counter: "
                "torch.manual_seed(self.seed); self.seed += 1), and the second run would compute another function. "
                "Remat the parts on either side of the inner transform, or seed outside the function."
            )


def _version(t: torch.Tensor) -> int:
    """``t``'s version (an inference tensor has none: -1, never written as far as this check can tell)."""
    return -1 if t.is_inference() else t._version


def _captured_write(fn_name: str) -> RematError:
    return RematError(
        f"remat: {fn_name} enters a torch.func reverse transform, so remat runs it as one region under "
        "torch.func.vjp (NOTE [reentrant region]), and it writes in place into a tensor that is not an input of "
        "that vjp (a global or closed-over accumulator, or an integer buffer such as a BatchNorm's "
        "num_batches_tracked in training mode), which torch.func refuses. Remat the parts on either side of the "
        "inner transform, so that the part that writes it does not enter it."
    )


def _lost(fn_name: str, shape: list[int], label: str) -> RematError:
    return RematError(
        f"remat: {fn_name} enters a torch.func reverse transform, so remat runs it as one region (NOTE "
        f"[reentrant region]), and it reads a tensor of shape {shape}{label} that requires grad from somewhere "
        "remat does not look (not an argument, not a parameter or buffer of its module, not a closed-over "
        "tensor): its gradient would be lost. Pass it to the function as an argument."
    )


class _Captured(TorchFunctionMode):
    """Under torch.func transforms: refuse a functorch-wrapped tensor the region reads that is neither one of its
    inputs nor made inside it (a tensor of an outer transform reached some way remat does not look). Its gradient
    would be lost (torch.autograd.Function's rule), and the dispatch level cannot tell: it sees the plain tensor
    below, and functorch reuses level numbers, so the wrapper's level does not tell either. Storages can."""

    def __init__(self, recorder: Recorder, fn_name: str) -> None:
        super().__init__()
        self.recorder = recorder
        self.fn_name = fn_name

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        leaves: list[Any] = optree.tree_leaves((args, kwargs or {}), none_is_leaf=True)  # type: ignore[arg-type]
        for t in leaves:
            if isinstance(t, torch.Tensor) and ti.is_wrapped(t):
                with internal():
                    key = storage_key(ti.unwrap_all(t))
                if self.recorder.is_outside(key):
                    raise _lost(self.fn_name, list(t.shape), "")
        return func(*args, **(kwargs or {}))


class _Made(TorchFunctionMode):
    """The tensors with history the region's function makes, weakly: one alive once the forward pass's vjp returned
    (its graph, and the wrappers of the result, gone) was handed out other than in the result (a global, ``self.aux``,
    an object optree cannot take apart), and the vjp's level ended with it: its gradient would be lost, silently."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref[torch.Tensor]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in (out,) if isinstance(out, torch.Tensor) else out if type(out) in (tuple, list) else ():
            if isinstance(t, torch.Tensor) and t.requires_grad:
                self.refs.append(weakref.ref(t))
        return out

    def refuse_escaped(self, fn_name: str) -> None:
        for r in self.refs:
            if (t := r()) is not None:
                raise RematError(
                    f"remat: {fn_name} enters a torch.func reverse transform, so remat runs it as one region under "
                    f"torch.func.vjp (NOTE [reentrant region]), and it hands out a tensor of shape {list(t.shape)} "
                    "that requires grad other than in its result (kept in a global or on a module, such as self.aux, "
                    "returned too or not, or in an object remat cannot take apart): the vjp's level ends with the "
                    "call, and that tensor's gradient would be lost. Return it as part of the result (a tuple, dict "
                    "or dataclass) and keep that, or detach what you keep if no gradient should flow through it."
                )


class _Region(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(call: _Call, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        return call.forward(tensors)

    @staticmethod
    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        call: _Call = inputs[0]
        ctx.call = call
        ctx.save_for_backward(*inputs[1:])
        ctx.mark_non_differentiable(*[t for t in output if not _differentiable(t)])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        call: _Call = ctx.call
        call.written()
        return (None, *call.backward(ctx.saved_tensors, grads))


def run_region(run: Callable[[list[Any]], Any], flat: list[Any], fn_name: str, policy: Callable[..., Any],
               preserve_rng: bool, state: Snapshot, draws: list[tuple[Any, torch.Tensor]] | None = None) -> Any:
    """Run one call of a remat'd function as a reentrant region (NOTE [reentrant region]); ``draws``: on the call that
    found out, the generators its first attempt drew from and their states, in order (``_same_draws``)."""
    call = _Call(run, flat, fn_name, policy, preserve_rng, state)
    call.draws = draws
    try:
        outs = _Region.apply(call, *call.tensors)
    except NeedsRegion as e:  # a remat'd function inside found out: the outermost call runs again
        e.rewind = call.rewind
        raise
    except NotImplementedError as e:  # (forward AD reached the region: a tangent flows into it)
        if "jvp function" not in str(e):
            raise
        raise RematError(
            f"remat: {fn_name} enters a torch.func reverse transform itself (torch.func.grad, vjp or "
            "torch.autograd.grad under one), and a tangent of a forward-mode transform (torch.func.jvp, jacfwd, "
            "hessian) flows into it: remat runs such a function as a region of its own, which has no forward-mode "
            "rule. Call it without remat under forward mode, or take the outer derivative with a reverse transform "
            "(jacrev, jacrev(jacrev) for a hessian)."
        ) from e
    if isinstance(outs, torch.Tensor):
        outs = (outs,)
    it = iter(outs)
    spec, collapse = call.out_spec
    leaves = [next(it) if c is _TENSOR else c for c in call.out_consts]
    return optree.tree_unflatten(spec, leaves if collapse is None else collapse(leaves))
