"""Policies: plain callables that decide, per ATen op of the forward pass, what happens to its outputs.

A policy is called as ``policy(op, *args, **kwargs)`` for every ATen op the
wrapped function runs in its forward pass (``op`` an ``OpOverload`` such as
``torch.ops.aten.mm.default``, the arguments as the op received them) and for
every ``checkpoint_name`` call (``op`` is :func:`remat.checkpoint_name` itself,
``kwargs["name"]`` the name). It returns ``True``/:data:`Saveable` (keep the
outputs until the backward pass), ``False``/:data:`Recompute` (drop them and
recompute them in the backward pass) or :class:`Offloadable` (move them to
another device and back). The names and meanings follow ``jax.checkpoint_policies``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch

from .._errors import RematError, brief_repr
from .naming import checkpoint_name

__all__ = [
    "Decision",
    "Saveable",
    "Recompute",
    "Offloadable",
    "Policy",
    "nothing_saveable",
    "everything_saveable",
    "dots_saveable",
    "checkpoint_dots",
    "dots_with_no_batch_dims_saveable",
    "checkpoint_dots_with_no_batch_dims",
    "save_only_these_names",
    "save_anything_except_these_names",
    "save_any_names_but_these",
    "save_from_both_policies",
    "offload_to_cpu",
    "save_and_offload_only_these_names",
    "offload_dot_with_no_batch_dims",
    "DEFAULT_MIN_OFFLOAD_BYTES",
    "resolve_policy",
    "decide",
    "decide_explicit",
]


class Decision:
    """Base class of what a policy may return (besides ``True``/``False``).

    Example:
        >>> import torch
        >>> from remat import remat
        >>> from remat.policies import Decision, Recompute, Saveable
        >>> isinstance(Saveable, Decision) and isinstance(Recompute, Decision)
        True
        >>> def keep_sin(op, *args, **kwargs) -> Decision:
        ...     return Saveable if op is torch.ops.aten.sin.default else Recompute
        >>> x = torch.randn(3, requires_grad=True)
        >>> remat(lambda x: x.sin().exp().sum(), policy=keep_sin)(x).backward()
        >>> torch.allclose(x.grad, x.cos() * x.sin().exp())
        True
    """


class _Saveable(Decision):
    def __repr__(self) -> str:
        return "Saveable"

    __reduce__ = __repr__  # (copied or unpickled, the one object: answers are told apart by identity)


class _Recompute(Decision):
    def __repr__(self) -> str:
        return "Recompute"

    __reduce__ = __repr__


Saveable: Decision = _Saveable()
"""Keep the op's outputs until the backward pass (same as returning ``True``)."""

Recompute: Decision = _Recompute()
"""Drop the op's outputs; recompute them in the backward pass (same as ``False``)."""


@dataclasses.dataclass(frozen=True)
class Offloadable(Decision):
    """Move the op's outputs from device ``src`` to device ``dst`` until the backward pass.

    Outputs on another device than ``src`` (``None``: any device) or smaller
    than ``min_bytes`` are kept where they are instead. Nothing offloaded is
    recomputed; it is copied back when the backward pass needs it.

    ``defer``: on CUDA the offload engine keeps the newest call's outputs on the
    device until a later call offloads (NOTE [keep last] in
    ``remat/_offload/schedule.py``), since the backward pass starts with them.
    ``defer=False`` copies the call's outputs at once: a memory budget's
    decisions (``memory_budget(b, offload=...)``), whose device bytes must go.

    Example:
        >>> from remat.policies import Offloadable
        >>> Offloadable("cuda", "cpu")
        Offloadable(src='cuda', dst='cpu', min_bytes=0)
    """

    src: str | None = "cuda"
    dst: str = "cpu"
    min_bytes: int = 0
    defer: bool = dataclasses.field(default=True, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.defer, bool):
            raise TypeError(f"Offloadable: defer must be a bool, got {self.defer!r}")
        if not isinstance(self.min_bytes, int) or self.min_bytes < 0:
            raise ValueError(f"Offloadable: min_bytes must be a non-negative int, got {self.min_bytes!r}")
        for what, dev in (("src", self.src), ("dst", self.dst)):
            if dev is None and what == "src":
                continue
            if not isinstance(dev, str):
                raise TypeError(f"Offloadable: {what} must be a device string such as 'cpu', got {dev!r}")
            try:
                torch.device(dev)
            except RuntimeError as e:
                raise ValueError(f"Offloadable: {what}={dev!r} is not a device: {e}") from None
        if torch.device(self.dst).type == "meta":
            raise ValueError("Offloadable: dst='meta' holds no data, so nothing could be copied back for the backward "
                             "pass; offload to 'cpu' (dst='cpu').")


Policy = Callable[..., Any]


def decide(policy: Policy, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any = None) -> Decision:
    """Call ``policy`` and normalise its answer to a Decision, or explain what is wrong (``output``: what the op
    returned, for a policy that reads it: ``ask``)."""
    return decide_explicit(policy, op, args, kwargs, output)[0]


def ask(policy: Policy, output: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """``policy``'s answer for ``op``; a policy with a ``with_output`` method (a torch selective-checkpointing
    policy, whose ``ctx.op_output`` is the op's output) is handed what the op returned too."""
    with_output = getattr(policy, "with_output", None)
    if with_output is not None:
        return with_output(output, op, *args, **kwargs)
    return policy(op, *args, **kwargs)


def decide_explicit(policy: Policy, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                    output: Any = None) -> tuple[Decision, bool]:
    """Like :func:`decide`, and whether the answer was the explicit :data:`Recompute`.

    NOTE [names decide for the value]: a ``checkpoint_name`` tags the value an op
    computed. A policy that saves the name saves that op's output (so the op is
    not recomputed); a policy that answers :data:`Recompute` (the object, not
    ``False``) for a name drops the value even if it would save the op that made
    it. ``False`` only says the name is no reason to save: ``dots_saveable``
    answers ``False`` for names and still keeps a named matmul output.
    """
    try:
        out = ask(policy, output, op, *args, **kwargs)
    except RematError:
        raise  # (a policy of remat's own that says what is wrong: as it is, not chained to itself)
    except Exception as e:  # noqa: BLE001 (re-raised as the policy's error, never as the user's op)
        raise policy_failed(policy, op, kwargs, e) from e
    if out is Recompute:
        return Recompute, True
    return _normalize(policy, op, kwargs, out), False


def policy_failed(policy: Policy, op: Any, kwargs: dict[str, Any], e: BaseException) -> RematError:
    """The error for a policy that raised when asked about ``op``: the policy's, naming it and the op, not an error
    of the user's line that ran the op."""
    return RematError(
        f"remat: policy {_describe(policy)} raised {type(e).__name__}: {e} when asked about {_op_name(op, kwargs)}. "
        "A policy is called as policy(op, *args, **kwargs) for every ATen op of the function (args: the op's "
        "arguments, tensors included); fix the policy (the traceback above shows where it failed)."
    )


def decide_answer(policy: Policy, op: Any, kwargs: dict[str, Any], out: Any) -> Decision:
    """A policy's answer ``out`` for ``op``, normalised to a Decision (what :func:`decide` does after the call)."""
    return _normalize(policy, op, kwargs, out)


def _normalize(policy: Policy, op: Any, kwargs: dict[str, Any], out: Any) -> Decision:
    if out is True:
        return Saveable
    if out is False:
        return Recompute
    if out is Saveable or out is Recompute or isinstance(out, Offloadable):
        return out  # (not ``Decision()`` itself, nor a subclass of the user's: neither says what to do)
    torchs = type(out).__name__ == "CheckpointPolicy"
    raise RematError(
        f"remat: policy {_describe(policy)} returned {out!r:.80} for {_op_name(op, kwargs)}; return True, "
        "False, remat.policies.Saveable, remat.policies.Recompute or remat.policies.Offloadable(src, dst)."
        + (" That is torch's CheckpointPolicy: a remat policy answers True to keep the op's outputs and False to "
           "recompute them; a torch selective-checkpointing policy_fn(ctx, op, *args) takes a context first, which "
           "remat does not pass: use it through torch's call, remat.checkpoint(fn, *args, use_reentrant=False, "
           "context_fn=functools.partial(create_selective_checkpoint_contexts, policy_fn))." if torchs else "")
    )


def is_remat_policy(obj: Any) -> bool:
    """Whether ``obj`` is one of remat's own policies (a function of its policy modules, or one of their classes'
    instances): what ``remat(policies.dots_saveable)``, meaning ``remat(policy=...)``, passed as the function."""
    mod = getattr(obj, "__module__", None) if inspect.isfunction(obj) else type(obj).__module__
    return isinstance(mod, str) and mod.startswith(("remat._policies", "remat._budgets.budget_policy"))


def _op_name(op: Any, kwargs: dict[str, Any]) -> str:
    """What a policy was asked about, for its errors: the ATen op, or ``checkpoint_name('h')``."""
    name = getattr(op, "__name__", None) if callable(op) and not hasattr(op, "_schema") else None
    return f"checkpoint_name({kwargs.get('name')!r})" if name == "checkpoint_name" else str(op)


def _describe(policy: Policy) -> str:
    return getattr(policy, "__name__", None) or repr(policy)


def _is_name(op: Any) -> bool:
    return op is checkpoint_name


# ---- fixed policies -------------------------------------------------------


def nothing_saveable(op: Any, *args: Any, **kwargs: Any) -> bool:
    """Save nothing: recompute every intermediate in the backward pass (the default).

    Only the inputs of the wrapped function are held between the forward and the
    backward pass. The most memory saved, for one extra forward pass of compute.

    Example:
        >>> import torch
        >>> from remat import remat, policies
        >>> f = remat(lambda x: x.sin().sin(), policy=policies.nothing_saveable)
        >>> x = torch.ones(3, requires_grad=True)
        >>> f(x).sum().backward()
    """
    return False


def everything_saveable(op: Any, *args: Any, **kwargs: Any) -> bool:
    """Save everything autograd saves and recompute nothing (remat becomes a no-op).

    Useful as a baseline, and inside :func:`save_from_both_policies`.

    Example:
        >>> from remat import policies
        >>> policies.everything_saveable(None)
        True
    """
    return True


_NO_BATCH_DOTS = frozenset({
    "mm",
    "addmm",
    "mv",
    "addmv",
    "dot",
    "vdot",
    "_addmm_activation",
    "_int_mm",
    "_scaled_mm",
    "linear",
    "addr",
    "outer",
})
_BATCH_DOTS = frozenset({"bmm", "baddbmm", "addbmm", "matmul", "_scaled_mm_v2"})
_CONVS = frozenset({
    "convolution",
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "mkldnn_convolution",
    "cudnn_convolution",
    "cudnn_convolution_transpose",
    "miopen_convolution",
    "convolution_overrideable",
    "_slow_conv2d_forward",
    "slow_conv3d_forward",
    "slow_conv_transpose2d",
    "slow_conv_dilated2d",
    "thnn_conv2d",
})


def _packet(op: Any) -> str:
    name = getattr(op, "_opname", None)
    if name is None:
        return ""
    return str(name)


def dots_saveable(op: Any, *args: Any, **kwargs: Any) -> bool:
    """Save the outputs of matrix products and convolutions; recompute everything else.

    JAX's ``dots_saveable``: mm, addmm, bmm, baddbmm, matmul, linear, products that
    einsum lowers to, and convolutions. The cheap elementwise work (activations,
    normalisations, softmax) is recomputed; no matrix product is.

    Example:
        >>> import torch
        >>> from remat import policies
        >>> policies.dots_saveable(torch.ops.aten.mm.default)
        True
        >>> policies.dots_saveable(torch.ops.aten.sin.default)
        False
    """
    p = _packet(op)
    return p in _NO_BATCH_DOTS or p in _BATCH_DOTS or p in _CONVS


checkpoint_dots = dots_saveable


def dots_with_no_batch_dims_saveable(op: Any, *args: Any, **kwargs: Any) -> bool:
    """Save only matrix products without batch dimensions (mm, addmm, linear, mv, dot).

    JAX's ``dots_with_no_batch_dims_saveable``: keeps the weight products of linear
    layers, recomputes batched products such as attention's ``bmm`` (whose outputs
    grow with the square of the sequence length) and everything elementwise.

    Example:
        >>> import torch
        >>> from remat import policies
        >>> policies.dots_with_no_batch_dims_saveable(torch.ops.aten.addmm.default)
        True
        >>> policies.dots_with_no_batch_dims_saveable(torch.ops.aten.bmm.default)
        False
    """
    p = _packet(op)
    return p in _NO_BATCH_DOTS or (p in _BATCH_DOTS and not _has_batch_dims(p, args))


def _has_batch_dims(packet: str, args: tuple[Any, ...]) -> bool:
    """Whether a batched product op (bmm, baddbmm) contracts with batch dimensions.

    JAX decides on ``dot_general``'s dimension numbers. torch's ``einsum`` lowers every
    contraction, ``"ij,jk->ik"`` included, to ``bmm`` on views with a batch of 1: so a batch
    of 1 whose operands are views of tensors of at most two dimensions (no batch dimension
    in the contraction the user wrote) is a plain product. A batch of 1 cut from a tensor
    that had one (``"bij,bjk->bik"`` with b = 1) stays batched.
    """
    ops = [a for a in args[:3] if isinstance(a, torch.Tensor)]
    if packet == "baddbmm" or packet == "addbmm":
        ops = ops[1:]
    if len(ops) < 2 or ops[0].dim() != 3 or ops[0].shape[0] != 1:
        return True
    return any((t._base if t._is_view() and t._base is not None else t).dim() > 2 for t in ops[:2])


checkpoint_dots_with_no_batch_dims = dots_with_no_batch_dims_saveable


# ---- name policies ---------------------------------------------------------


def _check_names(factory: str, names: tuple[Any, ...]) -> frozenset[str]:
    for n in names:
        if not isinstance(n, str):
            raise TypeError(
                f"{factory}: names must be strings given to checkpoint_name, got {n!r} "
                f"({type(n).__name__}); write {factory}('attn', 'mlp')."
            )
    return frozenset(names)


@dataclasses.dataclass(frozen=True)
class save_only_these_names:
    """Save only values tagged with one of ``names`` by :func:`checkpoint_name`.

    Everything else is recomputed. JAX's ``save_only_these_names``.

    Example:
        >>> import torch
        >>> from remat import remat, checkpoint_name, policies
        >>> def f(x):
        ...     h = checkpoint_name(x.sin(), "h")
        ...     return h.cos().sum()
        >>> g = remat(f, policy=policies.save_only_these_names("h"))
        >>> x = torch.ones(3, requires_grad=True)
        >>> g(x).backward()
        >>> policies.save_only_these_names("h")
        save_only_these_names('h')
    """

    names: frozenset[str]

    def __init__(self, *names: str) -> None:
        object.__setattr__(self, "names", _check_names("save_only_these_names", names))

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        return _is_name(op) and kwargs.get("name") in self.names

    def __repr__(self) -> str:
        return f"save_only_these_names({', '.join(map(repr, sorted(self.names)))})"


@dataclasses.dataclass(frozen=True)
class save_anything_except_these_names:
    """Save the output of every op except values tagged with one of ``names``.

    The named values (and only they) are dropped and recomputed. Unlike JAX's
    version of the same name, which saves everything, this one means what it says.

    Example:
        >>> from remat import policies
        >>> policies.save_anything_except_these_names("big")
        save_anything_except_these_names('big')
    """

    names: frozenset[str]

    def __init__(self, *names: str) -> None:
        object.__setattr__(self, "names", _check_names("save_anything_except_these_names", names))

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> Decision | bool:
        if _is_name(op) and kwargs.get("name") in self.names:
            return Recompute  # explicit: drops the named value (NOTE [names decide for the value])
        return True

    def __repr__(self) -> str:
        return f"save_anything_except_these_names({', '.join(map(repr, sorted(self.names)))})"


@dataclasses.dataclass(frozen=True)
class save_any_names_but_these:
    """Save every value tagged by :func:`checkpoint_name` except those named in ``names``.

    Untagged values are recomputed, as are the named ones listed here. JAX's
    ``save_any_names_but_these``.

    Example:
        >>> from remat import policies
        >>> policies.save_any_names_but_these("scores")
        save_any_names_but_these('scores')
    """

    names: frozenset[str]

    def __init__(self, *names: str) -> None:
        object.__setattr__(self, "names", _check_names("save_any_names_but_these", names))

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> bool:
        return _is_name(op) and kwargs.get("name") not in self.names

    def __repr__(self) -> str:
        return f"save_any_names_but_these({', '.join(map(repr, sorted(self.names)))})"


@dataclasses.dataclass(frozen=True)
class save_from_both_policies:
    """Save what either policy saves; offload what either offloads (saving wins over offloading).

    Example:
        >>> import torch
        >>> from remat import policies
        >>> p = policies.save_from_both_policies(policies.dots_saveable, policies.save_only_these_names("h"))
        >>> p(torch.ops.aten.mm.default)
        Saveable
    """

    left: Policy
    right: Policy

    def __post_init__(self) -> None:
        for side in ("left", "right"):
            p = getattr(self, side)
            if not callable(p) and not isinstance(p, str):
                raise TypeError(
                    f"save_from_both_policies: {p!r} is not a policy; pass callables such as "
                    "remat.policies.dots_saveable."
                )
            # (a factory not called, a misspelt shortcut: said as at remat(policy=...); a shortcut is its policy)
            object.__setattr__(self, side, resolve_policy(p))

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> Decision | bool:
        a, a_explicit = decide_explicit(self.left, op, args, kwargs)
        if a is Saveable:
            return a
        b, b_explicit = decide_explicit(self.right, op, args, kwargs)
        if b is Saveable or isinstance(b, Offloadable):
            return b
        if isinstance(a, Offloadable):
            return a
        # neither saves: an explicit Recompute from either side still drops a named value
        return Recompute if (a_explicit or b_explicit) else False

    def __repr__(self) -> str:
        return f"save_from_both_policies({_describe(self.left)}, {_describe(self.right)})"


# ---- offload policies --------------------------------------------------------

DEFAULT_MIN_OFFLOAD_BYTES = 1 << 20
"""Tensors under 1 MiB stay on the device: their copies cost more in latency than they save."""


@dataclasses.dataclass(frozen=True)
class offload_to_cpu:
    """Offload every saved intermediate of at least ``min_bytes`` to host memory; recompute nothing.

    The inputs of the wrapped function (and parameters it reads) are held by
    reference, never copied. Smaller tensors are kept on the device. On CUDA the
    copies are asynchronous into pinned memory and prefetched in the backward pass
    (see :mod:`remat.offload`); on the CPU the path runs synchronously.
    The string ``policy="offload-to-cpu"`` is ``offload_to_cpu()``.

    Args:
        min_bytes: smallest tensor worth moving (default 1 MiB).
        src: the device type to offload from (``None``: any device, so it also
            runs on CPU-only machines).

    Example:
        >>> import torch
        >>> from remat import remat, policies
        >>> f = remat(lambda x: x.sin().exp().sum(), policy=policies.offload_to_cpu(min_bytes=0))
        >>> x = torch.randn(100, requires_grad=True)
        >>> f(x).backward()
    """

    min_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES
    src: str | None = None

    def __post_init__(self) -> None:
        Offloadable(self.src, "cpu", self.min_bytes)  # validates

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> Decision:
        return Offloadable(self.src, "cpu", self.min_bytes)


@dataclasses.dataclass(frozen=True)
class save_and_offload_only_these_names:
    """Save the values named in ``names_which_can_be_saved``, offload those in ``names_which_can_be_offloaded``.

    Everything else is recomputed. JAX's policy of the same name and arguments.

    Example:
        >>> from remat import policies
        >>> policies.save_and_offload_only_these_names(
        ...     names_which_can_be_saved=["attn"], names_which_can_be_offloaded=["mlp"],
        ...     offload_src="cuda", offload_dst="cpu")
        save_and_offload_only_these_names(saved=['attn'], offloaded=['mlp'], 'cuda' -> 'cpu')
    """

    names_which_can_be_saved: frozenset[str]
    names_which_can_be_offloaded: frozenset[str]
    offload_src: str | None = "cuda"
    offload_dst: str = "cpu"

    def __init__(self, *, names_which_can_be_saved: Any = (), names_which_can_be_offloaded: Any = (),
                 offload_src: str | None = "cuda", offload_dst: str = "cpu") -> None:
        f = "save_and_offload_only_these_names"
        for arg, given in (("names_which_can_be_saved", names_which_can_be_saved),
                           ("names_which_can_be_offloaded", names_which_can_be_offloaded)):
            if isinstance(given, str):  # (a string is an iterable of its letters)
                raise TypeError(f"{f}: {arg}={given!r} is one string; pass a list of names: {arg}=[{given!r}].")
        saved = _check_names(f, tuple(names_which_can_be_saved))
        off = _check_names(f, tuple(names_which_can_be_offloaded))
        both = saved & off
        if both:
            raise ValueError(f"{f}: names {sorted(both)} are both saved and offloaded; pick one for each.")
        Offloadable(offload_src, offload_dst)
        object.__setattr__(self, "names_which_can_be_saved", saved)
        object.__setattr__(self, "names_which_can_be_offloaded", off)
        object.__setattr__(self, "offload_src", offload_src)
        object.__setattr__(self, "offload_dst", offload_dst)

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> Decision:
        if _is_name(op):
            n = kwargs.get("name")
            if n in self.names_which_can_be_saved:
                return Saveable
            if n in self.names_which_can_be_offloaded:
                return Offloadable(self.offload_src, self.offload_dst)
        return Recompute

    def __repr__(self) -> str:
        return (f"save_and_offload_only_these_names(saved={sorted(self.names_which_can_be_saved)}, "
                f"offloaded={sorted(self.names_which_can_be_offloaded)}, "
                f"{self.offload_src!r} -> {self.offload_dst!r})")


@dataclasses.dataclass(frozen=True)
class offload_dot_with_no_batch_dims:
    """Offload the outputs of matrix products without batch dimensions; recompute the rest.

    JAX's ``offload_dot_with_no_batch_dims(offload_src, offload_dst)``.

    Example:
        >>> import torch
        >>> from remat import policies
        >>> p = policies.offload_dot_with_no_batch_dims("cuda", "cpu")
        >>> p(torch.ops.aten.mm.default)
        Offloadable(src='cuda', dst='cpu', min_bytes=0)
    """

    offload_src: str | None = "cuda"
    offload_dst: str = "cpu"

    def __post_init__(self) -> None:
        Offloadable(self.offload_src, self.offload_dst)

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> Decision | bool:
        if dots_with_no_batch_dims_saveable(op, *args, **kwargs):
            return Offloadable(self.offload_src, self.offload_dst)
        return False if op is checkpoint_name else Recompute  # (a name is no reason to drop a product, as in JAX)


# ---- string shortcuts -------------------------------------------------------

_SHORTCUTS: Mapping[str, Policy] = MappingProxyType({
    "save-nothing": nothing_saveable,
    "save-everything": everything_saveable,
    "save-matmuls": dots_saveable,
})


def resolve_policy(policy: Any) -> Policy:
    """Turn ``policy=`` (None, a string shortcut or a callable) into a callable."""
    if policy is None:
        return nothing_saveable
    if isinstance(policy, str):
        if policy == "offload-to-cpu":
            return offload_to_cpu()
        if policy in _SHORTCUTS:
            return _SHORTCUTS[policy]
        known = ", ".join(repr(k) for k in [*_SHORTCUTS, "offload-to-cpu"])
        raise ValueError(
            f"remat: unknown policy {policy!r}; use one of {known} or a callable from remat.policies."
        )
    if not callable(policy):
        raise TypeError(
            f"remat: policy must be a callable policy(op, *args, **kwargs) or a string, got "
            f"{brief_repr(policy)}; for example policy=remat.policies.dots_saveable."
        )
    if isinstance(policy, torch.nn.Module):
        raise TypeError(
            f"remat: policy={type(policy).__name__}(...) is a module, not a policy (the module goes first: "
            "remat(module, policy=...), remat_module(module, policy=...)); a policy is a callable "
            "policy(op, *args, **kwargs), for example policy=remat.policies.dots_saveable."
        )
    if isinstance(policy, type):
        name = f"remat.policies.{policy.__name__}" if policy.__module__.startswith("remat") else policy.__name__
        raise TypeError(
            f"remat: policy={name} is a policy factory, not a policy: call it, policy={name}(...) (for example "
            "policy=remat.policies.offload_to_cpu(), policy=remat.policies.save_only_these_names(\"h\"))."
        )
    _check_signature(policy)
    return policy


def op_only(policy: Any) -> bool:
    """Whether ``policy``'s answer for an op that is not a ``checkpoint_name`` depends on the op alone (not its
    arguments nor its output), so that a caller may ask it once per op: the fixed policies, the name policies
    (which decide names only) and their combination. A user's callable is asked every time."""
    if policy in (nothing_saveable, everything_saveable, dots_saveable):
        return True
    if type(policy) in (save_only_these_names, save_anything_except_these_names, save_any_names_but_these):
        return True
    if type(policy) is save_from_both_policies:
        return op_only(policy.left) and op_only(policy.right)
    return False


def _check_signature(policy: Policy) -> None:
    """A policy is called as ``policy(op, *args, **kwargs)`` with each op's arguments: refuse one that cannot take
    that call when it is given, not at the user's first op."""
    if torch.compiler.is_compiling():
        return  # (remat(f, policy=p) inside a function Dynamo traces: checked when the same line runs eagerly)
    try:
        sig = inspect.signature(policy)
    except (TypeError, ValueError):
        return  # (a builtin or an object without a signature: called as it is)
    params = list(sig.parameters)
    torch_style = len(params) >= 2 and params[0] in ("ctx", "context") and params[1] == "op"
    if not torch_style:
        try:
            sig.bind(object(), object(), object(), some_keyword=object())
            return
        except TypeError:
            pass
    if inspect.isfunction(policy) and str(getattr(policy, "__module__", "")).startswith("remat._budgets"):
        # (policies.memory_budget: the one policy factory that is a function, not a class)
        name = f"remat.policies.{policy.__name__}"
        raise TypeError(
            f"remat: policy={name} is a policy factory, not a policy: call it, policy={name}(...) (for example "
            "policy=remat.policies.memory_budget(0.25), policy=remat.policies.offload_to_cpu())."
        )
    hint = ""
    if torch_style:
        hint = (" It looks like a torch selective-checkpointing policy, policy_fn(ctx, op, *args, **kwargs): pass it "
                "as torch does, remat.checkpoint(fn, *args, context_fn=functools.partial("
                "create_selective_checkpoint_contexts, policy_fn)), or drop the ctx argument.")
    raise TypeError(
        f"remat: policy {_describe(policy)}{sig} cannot be called as policy(op, *args, **kwargs), which remat does "
        f"for every ATen op (args: the op's arguments, kwargs: its keyword arguments). Define it as "
        f"def policy(op, *args, **kwargs).{hint}"
    )
