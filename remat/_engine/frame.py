"""What a call's frame is, on either engine: the one interface the route table (``select.py``), autograd's
saved-tensor hooks, the reentrant region and the recompute talk to.

Two engines implement it: ``traced.TraceFrame`` records the call's ATen ops and its recompute replays them (plain
autograd), and ``full.Frame`` records every op of the call with its per-op checks (``debug=True``, a call under
``torch.func``, a tensor subclass, a memory budget measuring), whose recompute replays the call's program
(``program.py``) or re-runs the function through ``recompute.py``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["CallFrame"]


@runtime_checkable
class CallFrame(Protocol):
    """One call of a remat'd function, between its forward pass and the end of its backward pass."""

    fn_name: str  # for messages
    forwarding: bool  # its forward pass is running (a backward pass inside it reads partial state)
    recomputes: int  # how many times its recompute ran (tests count it)

    def forward(self) -> Any:
        """Run the forward pass under the frame's saved-tensor hooks; return the function's result."""

    def pack(self, t: torch.Tensor) -> Any:
        """autograd's pack hook: what to hold for a saved tensor (itself, a handle, or nothing but its shape)."""

    def unpack(self, p: Any) -> torch.Tensor:
        """autograd's unpack hook: the saved tensor back, recomputed on the first read of a dropped one."""

    def rewind(self) -> None:
        """Undo what a forward pass cut short did (random state), so that the call can run again."""
