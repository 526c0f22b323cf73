"""The reentrant region: remat for functions that enter a torch.func reverse transform, without saved-tensor hooks.

NOTE [reentrant region]
    torch refuses to enter ``torch.func.grad``, ``vjp``, ``jacrev`` or ``hessian``
    while saved-tensor hooks are installed, and remat's frames work through them
    (``_hooks.py``). A remat'd function that enters one therefore runs as a single
    ``torch.autograd.Function``, as ``torch.utils.checkpoint(use_reentrant=True)``
    does: autograd saves nothing but the region's inputs for the backward pass (the
    forward runs on detached inputs, with grad mode on as in the recompute, since the
    ops a torch.func transform runs depend on it; that graph dies with the call),
    under the :class:`~remat._dispatch.Recorder`, which asks
    the policy about every op and holds the outputs it saves; its backward pass
    runs the function again with grad mode on under the
    :class:`~remat._dispatch.Replayer` (saved outputs handed back, not recomputed,
    random numbers and autocast as in the forward pass) and differentiates that
    with ``torch.autograd.grad``. Module state the function reads (parameters,
    buffers, closed-over tensors: NOTE [state is an input]) are inputs of the
    region, so their gradients flow; a tensor that requires grad and is read from
    somewhere remat does not look raises ``RematError`` instead of losing its
    gradient. The enclosing calls' hooks are set aside while the region runs its
    function (``saved_tensors_hooks_set_aside``), so regions nest inside remat'd
    calls and their recomputes.

    The first call of a remat'd function finds out (torch's error on entering the
    transform); the outermost remat call then restores the random-number state and
    runs again, this function now as a region, and later calls go straight here.
    Differences from a frame: what the policy saves is held whether or not the
    backward pass needs it (there is no saved tensor to tell), an offload decision
    keeps the output on its device, and it works under plain autograd only (under
    ``torch.func`` transforms outside remat, ``RematError``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import optree
import torch

from . import _torch_internals as ti
from ._ambient import AmbientState
from ._dispatch import Recorder, Replayer, internal, storage_key
from ._errors import RematError
from ._state import Snapshot

__all__ = ["NeedsRegion", "run_region"]

_TENSOR = object()  # an output leaf that is a tensor (returned by the autograd.Function)


class NeedsRegion(Exception):
    """Raised through the remat calls on the stack when a function enters a torch.func reverse transform.

    Not a RuntimeError, so that the enclosing frames let it pass to the outermost remat call, which runs
    again (NOTE [reentrant region]). ``origin`` is the frame whose function entered the transform.
    """

    def __init__(self, origin: Any, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.origin = origin
        self.cause = cause


class _Call:
    """One call of a remat'd function run as a region: what its backward pass needs."""

    def __init__(self, run: Callable[[list[Any]], Any], flat: list[Any], fn_name: str, policy: Callable[..., Any],
                 preserve_rng: bool, state: Snapshot) -> None:
        self.run = run
        self.flat = flat
        self.fn_name = fn_name
        self.state = state
        self.slots = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
        n = len(self.slots)
        self.n_inputs = n
        self.recorder = Recorder(policy, fn_name, lambda t, d: t.detach())  # offloaded: kept (see the NOTE)
        with internal():
            tensors = [flat[i] for i in self.slots] + list(state.tensors)
            self.ambient = AmbientState.capture(tensors, preserve_rng)
        self.tensors = tensors
        self.out_spec: Any = None
        self.out_consts: list[Any] = []

    def forward(self, ctx: Any) -> tuple[torch.Tensor, ...]:
        rec = self.recorder
        with internal():
            keys = {storage_key(ti.unwrap_all(t)) for t in self.tensors}
            rec.input_keys = keys
        # Grad mode on, as in the recompute (the ops a torch.func transform runs depend on it), on detached
        # inputs: the graph this builds dies with this call (its outputs are detached below).
        with internal():
            ins = [t.detach().requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex()
                   else t.detach() for t in self.tensors]
        vals = list(self.flat)
        for slot, t in zip(self.slots, ins):
            vals[slot] = t
        with contextlib.ExitStack() as es:
            es.enter_context(torch.enable_grad())
            es.enter_context(ti.saved_tensors_hooks_set_aside())
            es.enter_context(self.state.restored(ins[self.n_inputs:]))
            es.enter_context(rec)
            out = self.run(vals)
        with internal():
            rec.seal()
            for r in rec.ops:  # hold what the policy saves: no saved tensor says what the backward reads
                rec.promote(r)
            for r in rec.ops:
                for _, t, _ in r.outside or ():
                    if t.requires_grad and storage_key(t) not in keys:
                        raise RematError(
                            f"remat: {self.fn_name} enters a torch.func reverse transform, so remat runs it as "
                            f"one region (NOTE [reentrant region]), and it reads a tensor of shape {list(t.shape)}"
                            f"{rec._label(t)} that requires grad from somewhere remat does not look (not an "
                            "argument, not a parameter or buffer of its module, not a closed-over tensor): its "
                            "gradient would be lost. Pass it to the function as an argument."
                        )
        leaves, self.out_spec = optree.tree_flatten(out, none_is_leaf=True)
        with internal():
            outs = [x.detach() for x in leaves if isinstance(x, torch.Tensor)]
        self.out_consts = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
        ctx.mark_non_differentiable(*[t for t in outs if not (t.is_floating_point() or t.is_complex())])
        return tuple(outs)

    def backward(self, ctx: Any, grads: tuple[Any, ...]) -> tuple[Any, ...]:
        saved = ctx.saved_tensors
        needs = ctx.needs_input_grad[1:]
        create_graph = torch.is_grad_enabled()
        if create_graph:
            ins = list(saved)  # a double backward differentiates the gradients: keep the inputs' history
        else:
            with internal():
                ins = [t.detach().requires_grad_(need) if t.is_floating_point() or t.is_complex() else t.detach()
                       for t, need in zip(saved, needs)]
        vals = list(self.flat)
        for slot, t in zip(self.slots, ins):
            vals[slot] = t
        replayer = Replayer(self.recorder)
        with contextlib.ExitStack() as es:
            es.enter_context(torch.enable_grad())
            es.enter_context(ti.saved_tensors_hooks_set_aside())
            es.enter_context(self.state.restored(ins[self.n_inputs:]))
            es.enter_context(self.ambient.restored())
            es.enter_context(replayer)
            out = self.run(vals)
            replayer.finish()
        outs = [x for x in optree.tree_leaves(out, none_is_leaf=True) if isinstance(x, torch.Tensor)]
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wrt = [t for t, need in zip(ins, needs) if need and t.requires_grad]
        if not pairs or not wrt:
            return tuple(None for _ in needs)
        got = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True,
                                       create_graph=create_graph))
        return tuple(next(got) if need and t.requires_grad else None for t, need in zip(ins, needs))


class _Region(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, call: _Call, *tensors: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.call = call
        ctx.save_for_backward(*tensors)
        return call.forward(ctx)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        call: _Call = ctx.call
        return (None, *call.backward(ctx, grads))


def run_region(run: Callable[[list[Any]], Any], flat: list[Any], fn_name: str, policy: Callable[..., Any],
               preserve_rng: bool, state: Snapshot) -> Any:
    """Run one call of a remat'd function as a reentrant region (NOTE [reentrant region])."""
    if ti.interpreter_stack():
        raise RematError(
            f"remat: {fn_name} enters torch.func.grad, vjp, jacrev or hessian, which torch refuses to run while "
            "saved-tensor hooks are installed; remat runs such a function as one region under plain autograd, "
            "but not under torch.func transforms. Put remat inside the inner transform (torch.func.grad(remat(f))), "
            "or remat the function the inner transform differentiates."
        )
    call = _Call(run, flat, fn_name, policy, preserve_rng, state)
    outs = _Region.apply(call, *call.tensors)
    it = iter(outs)
    return optree.tree_unflatten(call.out_spec, [next(it) if c is _TENSOR else c for c in call.out_consts])
