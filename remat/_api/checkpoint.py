"""torch's call forms, for users of ``torch.utils.checkpoint``: ``checkpoint(fn, *args, use_reentrant=False, ...)``
runs the call, ``checkpoint_sequential(functions, segments, input)`` runs a sequence, and a selective-checkpointing
``context_fn`` (``functools.partial(create_selective_checkpoint_contexts, policy_fn_or_list)``) becomes a remat
policy. ``checkpoint(fn)`` with the function alone, or with remat's own keywords, stays JAX's decorator.

NOTE [torch's policies]
    torch's selective checkpointing asks ``policy_fn(ctx, op, *args, **kwargs)`` per ATen op and gets a
    ``CheckpointPolicy``: ``MUST_SAVE``/``PREFER_SAVE`` keep the op's outputs, ``MUST_RECOMPUTE``/
    ``PREFER_RECOMPUTE`` recompute them, ``MUST_CPU_OFFLOAD``/``PREFER_CPU_OFFLOAD`` (where torch has them) move
    them to host memory. remat asks its policy the same question with ``(op, *args, **kwargs)``; the translation
    passes a ``SelectiveCheckpointContext`` with ``is_recompute=False`` (remat asks in the forward pass only, as
    torch does) and ``op_output``, what the op returned (the engines hand it to a policy with a ``with_output``
    method: ``_policies.core.ask``), and maps the answer. A list of ops keeps those ops' outputs, as torch's does.
    A ``context_fn`` that makes the contexts itself (torchtitan's, whose policy counts the matmuls of each call) is
    called once per call, as torch calls it, and its policy read from the forward context it returns; any other
    ``context_fn`` cannot be translated: it raises, saying what to pass instead.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.utils.checkpoint as tc

from .. import _torch_internals as ti
from .._context import CACHES, ROUTES
from .._errors import RematError
from .._policies.core import Decision, Offloadable, Recompute, Saveable, resolve_policy
from .transform import remat

__all__ = ["checkpoint", "checkpoint_sequential", "from_torch_policy", "route_torch_checkpoint"]

# torch's own functions (a routing block replaces the names on torch.utils.checkpoint, never remat's own globals)
_TORCH_CHECKPOINT, _TORCH_SEQUENTIAL = tc.checkpoint, tc.checkpoint_sequential
_TORCH_ONLY = ("use_reentrant", "context_fn", "determinism_check", "early_stop")
_REMAT_OWN = ("policy", "static_argnums")
_UNSET: Any = object()


def _decisions() -> dict[Any, Decision]:
    out: dict[Any, Decision] = {}
    for name, decision in (("MUST_SAVE", Saveable), ("PREFER_SAVE", Saveable), ("MUST_RECOMPUTE", Recompute),
                           ("PREFER_RECOMPUTE", Recompute), ("MUST_CPU_OFFLOAD", Offloadable(None, "cpu")),
                           ("PREFER_CPU_OFFLOAD", Offloadable(None, "cpu"))):
        member = getattr(tc.CheckpointPolicy, name, None)  # (the offload members are recent)
        if member is not None:
            out[member] = decision
    return out


class TorchPolicy:
    """A torch selective-checkpointing policy (a ``policy_fn`` or a list of ops) as a remat policy (NOTE [torch's
    policies]).

    Example:
        >>> import torch
        >>> from remat import remat
        >>> from remat._api.checkpoint import TorchPolicy
        >>> keep_mm = TorchPolicy([torch.ops.aten.mm.default])
        >>> keep_mm(torch.ops.aten.mm.default)
        Saveable
    """

    def __init__(self, policy_fn_or_list: Any) -> None:
        if isinstance(policy_fn_or_list, (list, tuple, set, frozenset)):
            ops = list(policy_fn_or_list)
            for op in ops:
                if isinstance(op, ti.OpOverloadPacket):
                    raise ValueError(
                        f"remat.checkpoint: the list of ops to save holds {op}, an op packet; name one overload, as "
                        f"torch's selective checkpointing requires: {op}.default"
                    )
                if not isinstance(op, (ti.OpOverload, ti.HigherOrderOperator)):
                    raise ValueError(f"remat.checkpoint: the list of ops to save holds {op!r}, which is not an ATen "
                                     "op overload such as torch.ops.aten.mm.default")
            # (a tuple, not a frozenset: Dynamo cannot rebuild a frozenset of ops after a graph break)
            self.ops: tuple[Any, ...] | None = tuple(dict.fromkeys(ops))
            self.fn: Callable[..., Any] | None = None
        elif callable(policy_fn_or_list):
            self.ops, self.fn = None, policy_fn_or_list
        else:
            raise TypeError(f"remat.checkpoint: a selective-checkpointing policy is a function "
                            f"policy_fn(ctx, op, *args, **kwargs) or a list of ops, got {policy_fn_or_list!r}")
        self._map = _decisions()
        self.__name__ = f"torch_policy({getattr(policy_fn_or_list, '__name__', 'ops')})"

    def __call__(self, op: Any, *args: Any, **kwargs: Any) -> Decision:
        return self.with_output(None, op, *args, **kwargs)

    def with_output(self, output: Any, op: Any, *args: Any, **kwargs: Any) -> Decision:
        """The decision for ``op``, which returned ``output`` (torch's ``ctx.op_output``; the engines hand it over)."""
        if self.ops is not None:
            return Saveable if op in self.ops else Recompute
        assert self.fn is not None
        answer = self.fn(_context(output), op, *args, **kwargs)
        decision = self._map.get(answer)
        if decision is None:
            if isinstance(answer, bool):  # (torch's earliest policies returned a bool: True saves)
                return Saveable if answer else Recompute
            raise RematError(
                f"remat.checkpoint: the selective-checkpointing policy {getattr(self.fn, '__name__', self.fn)!r} "
                f"returned {answer!r} for {op}; it must return a torch.utils.checkpoint.CheckpointPolicy "
                f"({', '.join(m.name for m in self._map)}), or a bool (True saves)."
            )
        return decision


def _context(output: Any) -> Any:
    """torch's context for one question: ``is_recompute`` False (remat asks in the forward pass only, as torch does)
    and ``op_output`` what the op returned (torch 2.11's context has no such argument: set on it all the same)."""
    ctx = tc.SelectiveCheckpointContext(is_recompute=False)
    ctx.op_output = output
    return ctx


def from_torch_policy(context_fn: Any) -> Callable[..., Any] | None:
    """The remat policy a torch ``context_fn`` stands for (None: plain checkpointing, torch's ``noop_context_fn``):
    torch's selective-checkpointing factory, or a function that returns what it makes; raises for any other
    (NOTE [torch's policies])."""
    if context_fn is None or context_fn is tc.noop_context_fn:
        return None
    if isinstance(context_fn, functools.partial) and context_fn.func is tc.create_selective_checkpoint_contexts:
        given = context_fn.args[0] if context_fn.args else context_fn.keywords.get("policy_fn_or_list")
        return TorchPolicy(given)
    if callable(context_fn):
        # a function that makes torch's contexts itself (torchtitan's, with a policy of per-call state): called once
        # per checkpoint call, as torch does, and its policy read from what it made
        try:
            made = context_fn()
        except TypeError as e:  # (one that takes arguments: not torch's kind)
            raise _untranslatable(context_fn) from e
        fn = ti.selective_policy_of(made)
        if fn is not None:
            return TorchPolicy(fn)
    raise _untranslatable(context_fn)


def _untranslatable(context_fn: Any) -> RematError:
    return RematError(
        f"remat.checkpoint: context_fn={context_fn!r} does not make torch's selective-checkpointing contexts, and "
        "remat cannot run arbitrary contexts around its forward pass and recompute (it replays the recorded ops "
        "instead of running the function again). Pass context_fn=functools.partial(create_selective_checkpoint_"
        "contexts, policy_fn_or_list) (or a function returning create_selective_checkpoint_contexts(...)), or "
        "remat's own policy: remat.checkpoint(fn, *args, policy=...)."
    )


def _call(fn: Callable[..., Any], policy: Any, static_argnums: Any, preserve_rng_state: bool, debug: bool,
          args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``remat(fn, ...)(*args, **kwargs)``; for a module, a bound method (bound anew at each access), or a class's
    function called with its module first (Hugging Face's layers pass ``partial(forward, self, **kwargs)``),
    remat's wrapper of the function is made once per object and settings, held by the object weakly and holding no
    reference to it (a training loop calls checkpoint every step). Other functions get a wrapper per call: a lambda
    made anew each step could not be cached without keeping every one of them alive, and the wrappers of one
    function share what is learnt about it."""
    if isinstance(fn, torch.nn.Module):
        fn = fn.__call__
    if isinstance(fn, types.MethodType) and not static_argnums:
        func, obj = fn.__func__, fn.__self__
    elif isinstance(fn, types.FunctionType) and args and isinstance(args[0], torch.nn.Module) and not static_argnums:
        # (a class's function with its module first: Hugging Face's layers pass partial(forward, self, **kwargs))
        func, obj, args = fn, args[0], args[1:]
    else:
        return remat(fn, policy=policy, static_argnums=static_argnums, preserve_rng_state=preserve_rng_state,
                     debug=debug)(*args, **kwargs)
    key = (id(policy), preserve_rng_state, debug, func)
    try:
        per_obj = CACHES.get().wrappers.setdefault(obj, {})
    except TypeError:  # (an object that cannot be referred to weakly)
        per_obj = {}
    hit = per_obj.get(key)
    if hit is None or hit[0] is not policy:  # (the policy is held with it: its id stays its own)
        per_obj.pop(key, None)
        while len(per_obj) >= _WRAPPERS_PER_OBJECT:
            # (a policy made anew per call, ``save_only_these_names("h")`` inside the training loop: the oldest
            # wrapper goes, or the cache grows by one every step)
            del per_obj[next(iter(per_obj))]
        hit = per_obj[key] = (policy, remat(func, policy=policy, preserve_rng_state=preserve_rng_state, debug=debug))
        if func is torch.nn.Module.__call__:  # (its messages name the module's class, not Module._wrapped_call_impl)
            hit[1]._name = type(obj).__name__  # type: ignore[attr-defined]
    return hit[1](obj, *args, **kwargs)


_WRAPPERS_PER_OBJECT = 8  # remat.checkpoint's wrappers held per module (per policy and settings: a few in practice)


_TORCH_KEYWORDS = frozenset({"use_reentrant", "context_fn", "determinism_check", "debug", "early_stop",
                             "preserve_rng_state"})


def checkpoint(fn: Any = None, *args: Any, use_reentrant: bool | None = _UNSET, context_fn: Any = _UNSET,
               determinism_check: str = _UNSET, debug: bool = _UNSET, early_stop: bool = _UNSET,
               preserve_rng_state: bool = _UNSET, policy: Any = None, static_argnums: Any = (), **kwargs: Any) -> Any:
    """``jax.checkpoint``'s decorator and ``torch.utils.checkpoint.checkpoint``'s call, in one name.

    With the function alone, or with remat's own keywords (``policy``, ``static_argnums``), it is
    :func:`remat.remat`: ``@remat.checkpoint`` or ``remat.checkpoint(f, policy=...)``. With arguments for the
    function, or any of torch's keywords (``preserve_rng_state`` and ``debug`` included, as torch reads
    ``checkpoint(closure, preserve_rng_state=False)``), it runs the call as torch's ``checkpoint(fn, *args,
    **kwargs)`` does, on remat: exact under plain autograd and every ``torch.func`` transform, Python state
    changed before the backward pass included.

    Args:
        fn: the function (a module, a function, a bound method).
        *args, **kwargs: the call's arguments; keywords other than those below go to ``fn``.
        use_reentrant: ``False`` or unset. ``True`` raises: torch's reentrant variant exists for code that
            saved-tensor hooks could not handle, and remat handles that code without it.
        context_fn: torch's selective checkpointing, ``functools.partial(create_selective_checkpoint_contexts,
            policy_fn_or_list)``: translated to a remat policy (NOTE [torch's policies]).
        determinism_check: ``"default"`` or ``"none"``: accepted; remat checks more than torch's default (a
            replay cannot diverge; a re-run checks every op).
        debug: remat's ``debug=True`` (the re-run engine, every op checked).
        early_stop: accepted (remat's recompute stops once it has what the backward pass reads).
        preserve_rng_state: as torch's; remat's replay draws the forward pass's random numbers either way.
        policy, static_argnums: remat's own (``policy`` and ``context_fn`` together raise).

    Example:
        >>> import torch
        >>> import remat
        >>> block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> remat.checkpoint(block, x, use_reentrant=False).sum().backward()
        >>> x.grad.shape
        torch.Size([2, 4])
    """
    torch_kw: dict[str, Any] = {k: v for k, v in (("use_reentrant", use_reentrant), ("context_fn", context_fn),
                                                  ("determinism_check", determinism_check), ("early_stop", early_stop))
                                if v is not _UNSET}
    shared: dict[str, Any] = {k: v for k, v in (("preserve_rng_state", preserve_rng_state), ("debug", debug))
                              if v is not _UNSET}
    own = policy is not None or static_argnums != ()
    if fn is None:
        if args or kwargs or torch_kw:
            raise TypeError("remat.checkpoint: the function comes first: remat.checkpoint(fn, *args, ...)")
        return remat(policy=policy, static_argnums=static_argnums, **shared)
    if not args and not kwargs and not torch_kw and (own or not shared):
        return remat(fn, policy=policy, static_argnums=static_argnums, **shared)
    return checkpoint_call(fn, args, kwargs, policy=policy, static_argnums=static_argnums, **torch_kw, **shared)


def checkpoint_call(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], use_reentrant: bool | None = None,
                    context_fn: Any = None, determinism_check: str = "default", debug: bool = False,
                    early_stop: bool = True, preserve_rng_state: bool = True, policy: Any = None,
                    static_argnums: Any = ()) -> Any:
    """``checkpoint``'s call form, whatever the arguments (a function of none included): what
    :class:`route_torch_checkpoint` runs in place of torch's checkpoint."""
    if not callable(fn):
        raise TypeError(f"remat.checkpoint: the first argument must be the function to run, got {fn!r}")
    if use_reentrant is not None and not isinstance(use_reentrant, bool):
        raise TypeError(f"remat.checkpoint: use_reentrant must be False (or left out), got {use_reentrant!r}")
    if use_reentrant is True:
        raise RematError(
            "remat.checkpoint: use_reentrant=True is torch's older variant, for code that saved-tensor hooks could "
            "not handle (torch.autograd.grad inside, inputs that need no gradient, torch.func); remat handles all "
            "of it with its hooks and replay. Pass use_reentrant=False (or leave it out)."
        )
    if determinism_check not in ("default", "none"):
        raise ValueError(f"remat.checkpoint: determinism_check={determinism_check!r}; torch accepts 'default' or "
                         "'none'")
    translated = from_torch_policy(context_fn)
    if translated is not None and policy is not None:
        raise ValueError("remat.checkpoint: pass a policy either as torch's context_fn or as remat's policy=, "
                         "not both")
    chosen = translated if translated is not None else policy
    if isinstance(translated, TorchPolicy):
        # (a policy object made anew per call from the same partial: cached by the partial's policy)
        chosen = _policy_cache(context_fn, translated)
    while isinstance(fn, functools.partial) and not static_argnums:
        # (``partial(layer.__call__, **kwargs)``, made anew per call by Hugging Face's layers: its function is what
        # the wrapper is made once for; its arguments are the call's)
        args, kwargs = (*fn.args, *args), {**fn.keywords, **kwargs}
        fn = fn.func
    return _call(fn, chosen, static_argnums, preserve_rng_state, debug, args, kwargs)


def _policy_cache(context_fn: functools.partial[Any], translated: TorchPolicy) -> TorchPolicy:
    """One TorchPolicy per policy function (or set of ops): a training loop passes the same partial every step, or
    makes a new one each step around the same function (as torch's docs write it inline); either way the wrappers
    ``_call`` caches per module and policy are found again, and nothing grows per step."""
    # (held weakly, by the function's id or the set of ops: the wrappers that use a policy keep it alive, and a
    # function made anew per step, which no wrapper finds again, lets go of its entry with its wrapper)
    fn, ops = translated.fn, translated.ops
    # (a bound method, ``self.policy_fn``, is made anew at each access: by its function and object)
    key: Any = ops if fn is None else (id(fn.__func__), id(fn.__self__)) if isinstance(fn, types.MethodType) else id(fn)
    cache = CACHES.get().torch_policies
    hit = cache.get(key)
    if hit is not None and (hit.fn is fn or (fn is not None and hit.fn == fn)) and hit.ops == ops:
        return hit  # type: ignore[no-any-return]
    cache[key] = translated
    return translated


def checkpoint_sequential(functions: torch.nn.Sequential | Iterable[Callable[..., Any]], segments: int, input: Any,
                          use_reentrant: bool | None = _UNSET, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint_sequential`` on remat: the functions (a ``Sequential``'s children, or a
    list) run in ``segments`` chunks, each but the last through :func:`checkpoint`; the last runs plainly, as in
    torch. Keywords: ``preserve_rng_state``, and remat's ``policy``.

    Example:
        >>> import torch
        >>> import remat
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> remat.checkpoint_sequential(model, 2, x, use_reentrant=False).sum().backward()
    """
    policy = kwargs.pop("policy", None)
    preserve = kwargs.pop("preserve_rng_state", True)
    if kwargs:
        raise ValueError("remat.checkpoint_sequential: unexpected keyword arguments: " + ", ".join(kwargs))
    if use_reentrant is True:
        checkpoint(lambda: None, use_reentrant=True)  # (its error)
    if isinstance(functions, torch.nn.Module) and not isinstance(functions, (torch.nn.Sequential,
                                                                            torch.nn.ModuleList)):
        raise TypeError(f"remat.checkpoint_sequential: functions must be an nn.Sequential or a list of functions, "
                        f"got one {type(functions).__name__}; for a single module use remat.checkpoint(module, x).")
    fns: list[Callable[..., Any]] = (list(functions.children()) if isinstance(functions, torch.nn.Sequential)
                                     else list(functions))
    if not isinstance(segments, int) or segments < 1:
        raise ValueError(f"remat.checkpoint_sequential: segments must be a positive int, got {segments!r}")
    if segments > len(fns):
        raise ValueError(f"remat.checkpoint_sequential: segments={segments} is more than the {len(fns)} functions to "
                         "run; pass at most one segment per function")
    size = len(fns) // segments
    end = -1
    for start in range(0, size * (segments - 1), size):
        end = start + size - 1
        input = checkpoint(_Run(fns, start, end), input, use_reentrant=False, preserve_rng_state=preserve,
                           policy=policy)
    return _Run(fns, end + 1, len(fns) - 1)(input)


class _Run:
    """Functions ``start`` to ``end`` of a sequence, chained (an object: remat's wrapper of it is made per call)."""

    def __init__(self, fns: list[Callable[..., Any]], start: int, end: int) -> None:
        self.fns = fns[start:end + 1]
        self.__name__ = f"segment[{start}:{end + 1}]"

    def __call__(self, x: Any) -> Any:
        for f in self.fns:
            x = f(x)
        return x


class route_torch_checkpoint:
    """Within the ``with`` block, ``torch.utils.checkpoint.checkpoint`` and ``checkpoint_sequential`` are remat's:
    code that calls torch's checkpoint (a training loop, a library that calls it inside, Hugging Face's
    ``gradient_checkpointing_enable``) runs on remat, with ``policy``. Undone on exit.

    NOTE [routing torch's checkpoint]
        The one place remat replaces something of torch's, because the user asks for it by name, for the scope
        of a ``with`` block. It sets the two functions on ``torch.utils.checkpoint`` and every global that a loaded
        module bound to them by name (``from torch.utils.checkpoint import checkpoint`` in a module imported
        earlier, as ``transformers.modeling_utils`` does; remat's own modules excepted: under ``torch.compile`` remat
        lowers to torch's checkpoint), and puts each back on exit, exceptions included; on exit a module first
        imported inside the block that bound the routed function by name gets torch's back as well. The routing is
        process-wide: blocks nest (and may close in any order), but two threads' blocks must not overlap (the later
        one would put back the earlier one's routed functions on exit). What a call made inside the block keeps is
        remat's for good: ``model.gradient_checkpointing_enable()`` inside it stores a partial of the routed function
        in the model's layers, so the model keeps checkpointing with remat after the block (and its copies: the
        routed function holds the policy alone, so a model is copied and saved inside the block as outside it). A
        call with its own ``context_fn`` (torch's selective checkpointing) keeps that policy; ``use_reentrant=True``,
        which existing code passes, runs on remat's hooks like ``False``.

    Args:
        policy: the remat policy of the routed calls (default: save nothing, as torch's checkpoint).

    Example:
        >>> import torch
        >>> import remat
        >>> block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> with remat.route_torch_checkpoint(policy="save-matmuls"):
        ...     y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        >>> y.sum().backward()
        >>> torch.utils.checkpoint.checkpoint is not remat.checkpoint
        True
    """

    def __init__(self, policy: Any = None) -> None:
        if policy is not None:
            resolve_policy(policy)  # (a misspelt policy says so here, not at the first routed call of a training step)
        self.policy = policy
        self._undo: list[tuple[Any, str, Any]] = []
        self._installed: dict[int, tuple[Any, Any]] = {}

    def __enter__(self) -> route_torch_checkpoint:
        if self._undo:
            raise RuntimeError("remat.route_torch_checkpoint: this routing is active already; nest a new one")
        swaps = {id(tc.checkpoint): (tc.checkpoint, _Routed(self.policy, sequential=False)),
                 id(tc.checkpoint_sequential): (tc.checkpoint_sequential, _Routed(self.policy, sequential=True))}
        # (the routed functions -> what they replaced: on exit, a module first imported inside the block, which bound
        # the routed function by name, gets torch's back too)
        self._installed = {id(routed): (routed, torch_fn) for torch_fn, routed in swaps.values()}
        try:
            self._swap(swaps)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        ROUTES.append(self)
        return self

    def _swap(self, swaps: dict[int, tuple[Any, Any]]) -> None:
        """Set every loaded module's global that is a key of ``swaps`` (by identity) to its replacement."""
        import sys

        for mod_name, mod in list(sys.modules.items()):
            if mod_name == "remat" or mod_name.startswith("remat."):
                continue  # (remat's own use of torch's checkpoint: the torch.compile route)
            d = getattr(mod, "__dict__", None)
            if not isinstance(d, dict):
                continue
            for name, value in list(d.items()):
                hit = swaps.get(id(value))
                if hit is not None and value is hit[0]:
                    self._undo.append((mod, name, value))
                    setattr(mod, name, hit[1])

    def __exit__(self, *exc: Any) -> None:
        i = next((k for k, r in enumerate(ROUTES) if r is self), None)
        if i is not None:
            del ROUTES[i]
            if i < len(ROUTES):
                self._leave_early(ROUTES[i:])
                return
        for mod, name, value in reversed(self._undo):
            setattr(mod, name, value)
        self._undo = []
        installed, self._installed = self._installed, {}
        if installed:
            self._swap(installed)
            self._undo = []

    def _leave_early(self, later: list[route_torch_checkpoint]) -> None:
        """This block closes before blocks entered after it (``a`` entered, ``b`` entered, ``a`` closed): their
        functions stay in place until they close, and then put back what this block replaced, not this block's
        routed functions."""
        def before(v: Any) -> Any:
            hit = self._installed.get(id(v))  # (routed -> what it replaced)
            return hit[1] if hit is not None and hit[0] is v else v

        for r in later:
            r._undo = [(mod, name, before(value)) for mod, name, value in r._undo]
            r._installed = {k: (routed, before(prev)) for k, (routed, prev) in r._installed.items()}
        self._undo = []
        self._installed = {}


# (the modules of torch's own callers of its checkpoint: the checkpoint region of torch.compile, which calls it with
# ``Interpreter(body).run`` or a function of its own)
_TORCH_CALLERS = frozenset({"torch._higher_order_ops.wrap", "torch.fx.interpreter"})


class _Routed:
    """What a routing block puts in place of torch's ``checkpoint`` (or ``checkpoint_sequential``): torch's call on
    remat with the block's policy. It holds the policy alone, so a model that stored it
    (``gradient_checkpointing_enable()`` inside the block) is copied (``copy.deepcopy``: the same object) and saved
    (``torch.save``: by its policy) as with torch's function."""

    __slots__ = ("policy", "sequential")

    def __init__(self, policy: Any, sequential: bool) -> None:
        self.policy = policy
        self.sequential = sequential

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return (self._sequential if self.sequential else self._checkpoint)(*args, **kwargs)

    def _checkpoint(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("use_reentrant") is True:
            kwargs["use_reentrant"] = False
        cf = kwargs.get("context_fn")
        own = cf is not None and cf is not tc.noop_context_fn
        fn_kw = {k: v for k, v in kwargs.items() if k not in _TORCH_KEYWORDS}
        torch_kw = {k: v for k, v in kwargs.items() if k in _TORCH_KEYWORDS}
        if getattr(function, "__module__", None) in _TORCH_CALLERS:
            # torch.compile's checkpoint region runs its body through torch's checkpoint, imported by name at the
            # call (a routed one took it over, and torch's partitioner then failed): torch's own runs it (Dynamo
            # itself takes the routed function for torch's, by identity: docs/transforms.md, "torch.compile")
            return _TORCH_CHECKPOINT(function, *args, **kwargs)
        # (always the call: torch's checkpoint(closure) runs the closure, where remat.checkpoint(closure, policy=...)
        # would be the decorator)
        return checkpoint_call(function, args, fn_kw, **torch_kw) if own else \
            checkpoint_call(function, args, fn_kw, policy=self.policy, **torch_kw)

    def _sequential(self, functions: Any, segments: int, input: Any, use_reentrant: Any = None,
                    **kwargs: Any) -> Any:
        kwargs.setdefault("policy", self.policy)
        return checkpoint_sequential(functions, segments, input, use_reentrant=False, **kwargs)

    @property
    def __name__(self) -> str:  # (as torch's function's, for code that names what it wraps)
        return "checkpoint_sequential" if self.sequential else "checkpoint"

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(_TORCH_SEQUENTIAL if self.sequential else _TORCH_CHECKPOINT)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Routed:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Routed, (self.policy, self.sequential))

    def __repr__(self) -> str:
        return f"<torch.utils.checkpoint.{self.__name__} routed to remat, policy={self.policy!r}>"
