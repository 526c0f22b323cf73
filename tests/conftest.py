"""Shared fixtures: check that remat leaves no hook, mode or transform of its own installed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack


def ambient_state() -> dict[str, object]:
    """Everything remat installs while it runs, read through torch (not through remat)."""
    return {
        "dispatch_modes": list(_get_current_dispatch_mode_stack()),
        "saved_tensor_hooks": torch._C._autograd._top_saved_tensors_default_hooks(False),
        "functorch_stack": torch._C._functorch.get_interpreter_stack() or [],
        "grad_enabled": torch.is_grad_enabled(),
    }


CLEAN = {"dispatch_modes": [], "saved_tensor_hooks": None, "functorch_stack": [], "grad_enabled": True}


@pytest.fixture
def clean_after() -> Iterator[None]:
    """Fail the test if it leaves any saved-tensor hook, dispatch mode or transform installed."""
    assert ambient_state() == CLEAN
    yield
    assert ambient_state() == CLEAN


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one thread for the test, its thread count put back after (``pytestmark`` of the offload tests)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
