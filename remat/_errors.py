"""The one exception type of remat, and the message for broken invariants."""

from __future__ import annotations

__all__ = ["RematError", "internal_error"]


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
