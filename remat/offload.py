"""The offload engine behind the offload policies (see :mod:`remat.policies`), and offloading under torch.compile."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

from . import _torch_internals as ti
from ._offload import Offloaded, OffloadEngine, default_engine, use_engine

__all__ = ["OffloadEngine", "Offloaded", "default_engine", "use_engine", "compiled_offloading"]


@contextlib.contextmanager
def compiled_offloading() -> Iterator[None]:
    """Offload under ``torch.compile``: while the body compiles, what a remat'd function's policy offloads to the
    host (``Offloadable(..., dst="cpu")``) is moved there by torch's compile-time activation offloading pass.

    Wrap the call that compiles (the first call of a ``torch.compile``'d function, or any call that recompiles);
    later calls run the compiled graphs, offloads included. Outside it, remat recomputes those values instead,
    with a warning (NOTE [compiled remat] in ``remat/_engine/compiled.py``). torch's pass moves saved values that
    are neither views nor non-contiguous nor the graph's outputs; it keeps the others on the device.

    On a torch without the pass and the joint-graph hook remat drives it with (torch 2.11 to 2.13 have both), it warns
    and the body runs as without it.

    Example:
        >>> from remat.offload import compiled_offloading
        >>> with compiled_offloading():  # around the call that compiles: step = torch.compile(...); step(x)
        ...     pass  # (docs/offloading.md runs a compiled step)
    """
    if not ti.activation_offloading_available():
        warnings.warn(
            f"remat: compiled_offloading() needs torch's compile-time activation offloading pass and its "
            f"joint-graph hook (functorch's config: enable_activation_offloading, joint_custom_pass; torch 2.11 to 2.13), "
            f"which torch {torch.__version__} lacks: remat recomputes what the policy offloads in compiled code. "
            "Offload outside the compiled region to move it to host memory.",
            stacklevel=3)
        yield
        return
    with ti.activation_offloading():
        yield
