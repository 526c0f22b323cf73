"""The module API: rematerialize an ``nn.Module``'s forward in place, keeping its class, names and hooks."""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from .. import _torch_internals as ti
from .transform import Rematted, remat

__all__ = ["remat_module", "remat_modules", "unremat_module", "unremat_modules"]


def remat_module(module: nn.Module, *, policy: Any = None, preserve_rng_state: bool = True,
                 debug: bool = False) -> nn.Module:
    """Rematerialize a module's forward pass, in place; return the same module.

    The module keeps its class (``isinstance`` checks keep working), its
    ``state_dict()`` keys and ``named_parameters()`` names (no wrapper, no
    ``_checkpoint_wrapped_module.`` prefix), and its forward pre/post hooks
    (FSDP2's, DDP's, your own), which run outside the remat'd region as with
    ``torch.distributed._composable.checkpoint``. Only ``forward`` is replaced,
    by an instance attribute holding ``remat(module.forward, policy=...)``; its
    parameters and buffers are inputs of every call (NOTE [state is an input]):
    under ``torch.func.functional_call`` the recompute uses the parameters the
    forward pass used, and buffers written in the forward pass (BatchNorm's
    running statistics) are written once. The module survives
    ``copy.deepcopy`` (the copy uses its own parameters) and ``torch.save`` /
    ``torch.load``. Calling it again replaces the policy;
    :func:`unremat_module` undoes it.

    Works under plain autograd and every ``torch.func`` transform, like
    :func:`remat`.

    Args:
        module: the module.
        policy: a policy, as for :func:`remat` (default: save nothing).
        preserve_rng_state, debug: as for :func:`remat`.

    Returns:
        ``module`` itself.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, or a bad policy.

    Example:
        >>> import torch
        >>> from remat import remat_module
        >>> block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
        >>> block = remat_module(block, policy="save-matmuls")
        >>> isinstance(block, torch.nn.Sequential), list(block.state_dict())[:2]
        (True, ['0.weight', '0.bias'])
        >>> block(torch.randn(4, 8)).sum().backward()
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"remat_module: expected an nn.Module, got {type(module).__name__}; for a function use "
            "remat(f, policy=...)."
        )
    parts = ti.compiled_parts(module) if ti.is_compiled_callable(module) else None
    if parts is not None:
        # torch.compile(block): its original module is rematerialized in place and compiled with it (the compiled
        # module calls it), as remat_module(block) before torch.compile(block)
        remat_module(parts[0], policy=policy, preserve_rng_state=preserve_rng_state, debug=debug)
        return module
    unremat_module(module)
    module.forward = remat(module.forward, policy=policy, preserve_rng_state=preserve_rng_state, debug=debug)
    return module


def unremat_module(module: nn.Module) -> nn.Module:
    """Undo :func:`remat_module`: the module's forward is its own again. A no-op on other modules.

    Example:
        >>> import torch
        >>> from remat import remat_module, unremat_module
        >>> m = remat_module(torch.nn.Linear(2, 2))
        >>> "forward" in vars(unremat_module(m))
        False
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"unremat_module: expected the torch.nn.Module that remat_module changed, got {module!r} "
                        f"({type(module).__name__}); for every remat'd module of a model: remat.unremat_modules(model)")
    fwd = module.__dict__.get("forward")
    if not isinstance(fwd, Rematted):
        return module
    target = fwd.__remat_target__
    if (isinstance(target, types.MethodType) and target.__self__ is module
            and target.__func__ is getattr(type(module).forward, "__func__", type(module).forward)):
        del module.__dict__["forward"]
    else:  # the module had a forward of its own before (an instance attribute): put it back
        module.__dict__["forward"] = target
    return module


def _declared_blocks(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """``where="auto"``: the modules whose class (or a base class) the model names in ``_no_split_modules``, outermost
    first (a declared block inside another is not chosen again)."""
    declared = None
    for m in root.modules():
        names = getattr(m, "_no_split_modules", None)
        if names:
            declared = set(names)
            break
    if not declared:
        raise TypeError(
            f"remat_modules(model, \"auto\"): {type(root).__name__} declares no block classes (Hugging Face models list "
            "them in _no_split_modules); pass the block class instead: remat_modules(model, Block, policy=...)."
        )
    chosen: list[tuple[str, nn.Module]] = []
    for name, m in root.named_modules():
        if any(c.__name__ in declared for c in type(m).__mro__) and not any(
                name.startswith(f"{outer}.") or outer == "" for outer, _ in chosen):
            chosen.append((name, m))
    if not chosen:
        raise TypeError(
            f"remat_modules(model, \"auto\"): no module of {type(root).__name__} is one of the block classes it "
            f"declares ({', '.join(sorted(declared))}); pass the block class instead: "
            "remat_modules(model, Block, policy=...)."
        )
    return chosen


def _selector(where: Any) -> Callable[[str, nn.Module], bool]:
    if isinstance(where, type) and issubclass(where, nn.Module):
        return lambda name, m: isinstance(m, where)
    if isinstance(where, tuple) and where and all(isinstance(c, type) and issubclass(c, nn.Module) for c in where):
        return lambda name, m: isinstance(m, where)
    if isinstance(where, nn.Module):
        raise TypeError(
            f"remat_modules: where={type(where).__name__}(...) is a module instance; pass its class, "
            f"where={type(where).__name__}, to remat every submodule of that class (or remat_module(block) for one)."
        )
    if callable(where) and not isinstance(where, type):
        return where  # type: ignore[no-any-return]
    raise TypeError(
        f"remat_modules: where must be an nn.Module subclass, a tuple of them, a predicate "
        f"where(qualified_name, module) -> bool, or \"auto\"; got {where!r}."
    )


def remat_modules(root: nn.Module, where: Any, *, policy: Any = None,
                  preserve_rng_state: bool = True, debug: bool = False) -> list[str]:
    """Apply :func:`remat_module` to every submodule of ``root`` that ``where`` selects; return their names.

    Like torch's ``apply_activation_checkpointing``, but in place and without
    wrappers: names, classes and hooks are unchanged.

    Args:
        root: the model.
        where: an ``nn.Module`` subclass (``GPT2Block``), a tuple of them, a
            predicate ``where(qualified_name, module) -> bool``, or ``"auto"``: the
            block classes the model declares, as Hugging Face models do in
            ``_no_split_modules`` (which accelerate's FSDP auto-wrap reads; a
            subclass counts, so ``fully_shard``'s ``FSDPGPT2Block`` does), the
            outermost ones only.
        policy, preserve_rng_state, debug: as for :func:`remat`.

    Returns:
        The qualified names of the modules changed, in ``named_modules`` order
        (``""`` for ``root`` itself).

    Example:
        >>> import torch
        >>> from remat import remat_modules
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
        >>> remat_modules(model, torch.nn.Linear, policy="save-nothing")
        ['0', '2']
    """
    if not isinstance(root, nn.Module):
        raise TypeError(f"remat_modules: root must be an nn.Module (the model), got {type(root).__name__}; for a "
                        "function use remat(f, policy=...).")
    if isinstance(where, str) and where == "auto":
        chosen = _declared_blocks(root)
    else:
        select = _selector(where)
        chosen = [(name, m) for name, m in root.named_modules() if select(name, m)]
    if not chosen:
        # (a selector that matches nothing does nothing: said once, at the call, not discovered as memory that
        # never went down)
        warnings.warn(
            f"remat_modules: {where!r} selects no submodule of {type(root).__name__}, so nothing is remat'd. Pass "
            "the class of the model's blocks (one of its submodules' classes), a predicate (name, module) -> bool, "
            "or \"auto\" for a Hugging Face model.", UserWarning, stacklevel=2)
    for _, m in chosen:
        remat_module(m, policy=policy, preserve_rng_state=preserve_rng_state, debug=debug)
    return [name for name, _ in chosen]


def unremat_modules(root: nn.Module) -> list[str]:
    """Undo :func:`remat_module` on ``root`` and every submodule; return the names of those changed.

    Example:
        >>> import torch
        >>> from remat import remat_modules, unremat_modules
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> remat_modules(model, torch.nn.Linear)
        ['0']
        >>> unremat_modules(model)
        ['0']
    """
    names = [name for name, m in root.named_modules() if isinstance(m.__dict__.get("forward"), Rematted)]
    for name in names:
        unremat_module(root.get_submodule(name))
    return names
