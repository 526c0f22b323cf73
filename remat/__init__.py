"""remat: JAX-style rematerialization (``jax.checkpoint``) for PyTorch, composable with ``torch.func``.

Example:
    >>> import torch
    >>> from remat import remat
    >>> f = remat(lambda x: torch.sin(x).exp().sum(), policy="save-nothing")
    >>> x = torch.randn(8, requires_grad=True)
    >>> f(x).backward()
"""

from . import offload as offload
from . import policies as policies
from ._errors import RematError as RematError
from ._naming import checkpoint_name as checkpoint_name
from ._transform import checkpoint as checkpoint
from ._transform import remat as remat

__all__ = ["remat", "checkpoint", "checkpoint_name", "policies", "offload", "RematError"]
__version__ = "0.1.0"
