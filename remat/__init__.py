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
from ._api.checkpoint import checkpoint as checkpoint
from ._api.checkpoint import checkpoint_sequential as checkpoint_sequential
from ._api.checkpoint import route_torch_checkpoint as route_torch_checkpoint
from ._api.module import remat_module as remat_module
from ._api.module import remat_modules as remat_modules
from ._api.module import unremat_module as unremat_module
from ._api.module import unremat_modules as unremat_modules
from ._api.transform import remat as remat
from ._budgets.device_model import DeviceModel as DeviceModel
from ._budgets.sequential import sequential as sequential
from ._errors import RematError as RematError
from ._inspection.inspect import MemoryReport as MemoryReport
from ._inspection.inspect import SavedResidual as SavedResidual
from ._inspection.inspect import format_saved_residuals as format_saved_residuals
from ._inspection.inspect import memory_report as memory_report
from ._inspection.inspect import print_saved_residuals as print_saved_residuals
from ._inspection.inspect import saved_residuals as saved_residuals
from ._policies.naming import checkpoint_name as checkpoint_name

__all__ = ["remat", "checkpoint", "checkpoint_sequential", "route_torch_checkpoint", "checkpoint_name", "remat_module", "remat_modules", "unremat_module",
           "unremat_modules", "sequential", "policies", "offload", "RematError", "saved_residuals",
           "print_saved_residuals", "format_saved_residuals", "SavedResidual", "memory_report", "MemoryReport",
           "DeviceModel"]
__version__ = "0.1.0"
