"""The one exception type of remat, and the message for broken invariants."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["RematError", "internal_error", "input_written_in_forward", "input_written_before_backward",
           "saved_shape_differs", "saved_written_after_save"]


class RematError(RuntimeError):
    """A runtime failure of a ``remat``-wrapped function.

    Raised for misuse that can only be seen while running (a policy that returns
    something that is not a decision, a recompute that diverges from the forward
    pass, an input mutated in place before the backward pass, a transform that
    cannot be supported) and for internal invariants that fail.

    Example:
        >>> import torch
        >>> from remat import remat, RematError
        >>> issubclass(RematError, RuntimeError)
        True
    """


def internal_error(what: str) -> RematError:
    """An invariant of remat failed: say so, and ask for a report."""
    return RematError(
        f"remat: internal error: {what}. This is a bug in remat, please report it "
        "with the code that triggered it."
    )


def _shape(t: Any) -> str:
    return f"shape {list(t.shape)}, {str(t.dtype).replace('torch.', '')}"


def input_written_in_forward(fn_name: str, i: int, t: Any) -> RematError:
    """The function wrote its input ``i`` in place during its forward pass (the recompute would read the new value)."""
    return RematError(
        f"remat: {fn_name} modified its input #{i} ({_shape(t)}) in place during its forward pass; the recompute "
        "would read the modified value and give wrong gradients. Clone the input inside the function before "
        "modifying it (x = x.clone()), or do the in-place update outside the remat'd function."
    )


def inference_tensor(fn_name: str, what: str, t: Any) -> RematError:
    """The call reads a tensor made under ``torch.inference_mode()`` (no version counter)."""
    return RematError(
        f"remat: {fn_name} reads {what} ({_shape(t)}) that was made under torch.inference_mode(). An inference "
        "tensor has no version counter, so remat cannot tell whether it is written in place before the backward "
        "pass, which reads it again. Make it under torch.no_grad() instead, or pass a copy (x.clone(), made "
        "outside inference mode)."
    )


def input_written_before_backward(fn_name: str, i: int, t: Any) -> RematError:
    """Input ``i`` was written in place between the forward pass and the recompute."""
    return RematError(
        f"remat: input #{i} ({_shape(t)}) of {fn_name} was modified in place after its forward pass and before "
        "its backward pass; the recompute would read the new value. Clone it before modifying it, or run the "
        "backward pass first."
    )


def saved_shape_differs(fn_name: str, t: Any, meta: tuple[Any, ...], pos: int) -> RematError:
    """The recompute saved a tensor of another shape or dtype than the forward pass at position ``pos``."""
    return RematError(
        f"remat: the recompute of {fn_name} saved a tensor of shape {list(t.shape)} {t.dtype} where its forward "
        f"pass saved {list(meta[0])} {meta[1]} (saved tensor #{pos}); the function must compute the same shapes "
        "every time it is called (a key/value cache that grows on every call changes them: for a Hugging Face model "
        "pass use_cache=False (model.config.use_cache = False))."
    )


def mutation_allowed(fn_name: str, what: str) -> RematError:
    """Under ``torch.autograd.graph.allow_mutation_on_saved_tensors()`` a write into a saved tensor is legal (the
    context clones it first, through saved-tensor hooks remat's own take the place of): say that, not "plain
    autograd raises here too"."""
    return RematError(
        f"remat: {fn_name} saved a tensor ({what}) that was modified in place after it was saved, under "
        "torch.autograd.graph.allow_mutation_on_saved_tensors(), which remat does not support: remat's saved-tensor "
        "hooks take the place of the context's, which would have cloned the tensor before the write. Clone it "
        "before writing it (h = h.clone(); h.mul_(3)), or call the function without remat inside that context."
    )


def saved_written_after_save(fn_name: str, pos: int, t: Any, v0: int, v1: int, allowed: bool = False) -> RematError:
    """The function wrote a tensor in place after saving it for the backward pass (seen when the recompute replays
    the write after making the tensor at position ``pos``); ``allowed``: under ``allow_mutation_on_saved_tensors``."""
    return mutation_allowed(fn_name, _shape(t)) if allowed else RematError(
        f"remat: {fn_name} modified a tensor ({_shape(t)}, saved tensor #{pos}) in place after an op saved it for "
        f"the backward pass (version {v0} -> {v1}); plain autograd raises here too (\"one of the variables needed "
        "for gradient computation has been modified by an inplace operation\"; torch.func's transforms do not "
        "check, and hand the backward pass whichever value the tensor holds then), and the recompute would hand the "
        "modified value to the backward pass. Use the out-of-place op (x = x * 3, not x.mul_(3)), or clone the "
        "tensor before modifying it."
    )


def data_replaced(fn_name: str, shape: list[int]) -> RematError:
    """``t.data = ...`` replaced a saved tensor's data (NOTE [data replaced] in ``_engine/traced.py``)."""
    return RematError(
        f"remat: {fn_name} replaced the data of a tensor of shape {shape} with `t.data = ...` after "
        "an op had saved it for the backward pass (NOTE [data replaced]). Plain autograd reads the new data where "
        "the tensor was saved as an op's input and the old data where it was saved as its own op's output, which "
        "remat cannot tell apart, so it cannot recompute or fetch the saved value. Rebind the name instead "
        "(t = t * 2), or keep the tensor (a policy that saves the op that made it)."
    )


def lifted_changed(fn_name: str, t: Any) -> RematError:
    """Python data of over 16 MiB lifted inside the call (``torch.as_tensor(array)``) changed before the replay."""
    return RematError(
        f"remat: {fn_name} built a tensor of shape {list(t.shape)} from Python data inside the call "
        "(torch.as_tensor of a NumPy array, or torch.tensor), and its values changed between the forward and the "
        "backward pass (a write through NumPy, which no version counter shows); the recompute would read the new "
        "values. Remat copies such data up to 16 MiB and checks a hash of larger data. Write the array after the "
        "backward pass, or pass the tensor to the function as an argument."
    )


def offloaded_written_after_save(fn_name: str, shape: Any) -> RematError:
    """A tensor the call offloaded was written in place after it was saved."""
    return RematError(
        f"remat: a tensor of shape {list(shape)} that {fn_name} offloaded for the backward pass was "
        "modified in place after it was saved; plain autograd raises here too (\"one of the variables needed "
        "for gradient computation has been modified by an inplace operation\"). Do not modify intermediate "
        "results in place after an op has used them; clone them first."
    )


def kept_written_after_save(fn_name: str, t: Any, v0: int, allowed: bool = False) -> RematError:
    """A tensor the call kept (an input or a result) was written in place after it was saved at version ``v0``."""
    return mutation_allowed(fn_name, _shape(t)) if allowed else RematError(
        f"remat: a tensor of shape {list(t.shape)} that {fn_name} saved for the backward pass was "
        f"modified in place after it was saved (version {v0} -> {t._version}). Do not modify inputs "
        "or results of a remat'd function in place before the backward pass; clone them first."
    )


def outside_written_before_backward(fn_name: str, label: str | None, t: Any, v0: int) -> RematError:
    """A tensor from outside the call's arguments (``label``: the module attribute it is) was written in place
    between the forward pass and the recompute, which reads it."""
    return RematError(
        f"remat: a tensor that {fn_name} read from outside its arguments ({label + ', ' if label else ''}"
        f"shape {list(t.shape)}) was modified in place after the forward pass read it (version {v0} -> "
        f"{t._version}); the recompute would read the new value. Plain autograd refuses this too "
        "when it saved the tensor. Modify it after the backward pass, or clone it first."
    )


def hooks_disabled(fn_name: str, message: str) -> RematError:
    """The call runs where saved-tensor hooks are disabled (``torch.autograd.graph.disable_saved_tensors_hooks``)."""
    return RematError(
        f"remat: {fn_name} is called where saved-tensor hooks are disabled "
        f"(torch.autograd.graph.disable_saved_tensors_hooks: {message!r}); remat needs them to drop, keep or "
        "offload what its forward pass saves. Call it outside that block, or call the function without remat "
        "there (remat.unremat_module for a module)."
    )


def empty_written(fn_name: str, t: Any, func: Any) -> RematError:
    """On the re-run routes, an op resizes an empty tensor the call did not make (no storage address to copy by)."""
    return RematError(
        f"remat: {fn_name} writes in place into an empty tensor it did not make ({_shape(t)}, {func}: an out= op "
        "or resize_ that resizes it); on this route (debug=True, a memory budget's first call, torch.func) the "
        "recompute cannot tell its storage apart and would read its last value. Allocate it at its final shape "
        "before the call, or make it inside."
    )


def draw_raced(fn_name: str, op: Any) -> RematError:
    """NOTE [draws in threads] in _engine/ambient.py."""
    return RematError(
        f"remat: the replay of {op} ({fn_name}'s random op) did not draw the numbers its forward pass drew: another "
        "thread drew from the same torch generator while the forward pass's op drew, so which numbers it drew (a "
        "dropout mask) cannot be known, and the gradient would be wrong. Give the other thread a generator of its own "
        "(torch.rand(..., generator=torch.Generator())), or run its draws and this forward pass under one lock."
    )


def sparse_outside_written(fn_name: str, t: Any) -> RematError:
    return RematError(
        f"remat: {fn_name} writes in place into the indices ({_shape(t)}) of a sparse tensor from outside the call (a "
        "global, a buffer, an argument), which the replay cannot give the reads before the write as they were. "
        "Clone the sparse tensor inside the function before writing it (g = g.clone()), or write a copy."
    )


def ended_level_read(fn_name: str) -> RematError:
    return RematError(
        f"remat: the recompute of {fn_name} read a tensor of a torch.func transform that has ended since: one made "
        "inside the transformed function and read from a dict, a global or an attribute of an object rather than "
        "taken as an argument (under jacrev(jacfwd) or vjp(jvp) the inner transform ends before the outer one's "
        f"backward pass recomputes). Pass it to {fn_name} as an argument, or keep what reads it "
        "(policy='save-everything')."
    )


def brief_repr(obj: Any) -> str:
    """``obj`` for an error message, with its type: a tensor by its shape and dtype (not its values), anything else by
    its repr cut at 80 characters."""
    if isinstance(obj, torch.Tensor):
        return f"a {obj.dtype} tensor of shape {list(obj.shape)} ({type(obj).__name__})"
    r = repr(obj)
    r = r if len(r) <= 80 and "\n" not in r else r.replace("\n", " ")[:77] + "..."
    return f"{r} ({type(obj).__name__})"
