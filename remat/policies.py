"""Policies for :func:`remat.remat`: which outputs to keep, recompute or offload.

Names and meanings follow ``jax.checkpoint_policies``. A policy is any callable
``policy(op, *args, **kwargs)`` returning ``True``/``False``, :data:`Saveable`,
:data:`Recompute` or :class:`Offloadable`.
"""

from ._budgets.budget_policy import BudgetPlan, MemoryBudget, memory_budget
from ._policies.core import (
    DEFAULT_MIN_OFFLOAD_BYTES,
    Decision,
    Offloadable,
    Recompute,
    Saveable,
    checkpoint_dots,
    checkpoint_dots_with_no_batch_dims,
    dots_saveable,
    dots_with_no_batch_dims_saveable,
    everything_saveable,
    nothing_saveable,
    offload_dot_with_no_batch_dims,
    offload_to_cpu,
    save_and_offload_only_these_names,
    save_any_names_but_these,
    save_anything_except_these_names,
    save_from_both_policies,
    save_only_these_names,
)

__all__ = [
    "Decision",
    "Saveable",
    "Recompute",
    "Offloadable",
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
    "memory_budget",
    "MemoryBudget",
    "BudgetPlan",
]
