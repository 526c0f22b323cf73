"""The offload engine behind the offload policies (see :mod:`remat.policies`)."""

from ._offload import Offloaded, OffloadEngine, default_engine, use_engine

__all__ = ["OffloadEngine", "Offloaded", "default_engine", "use_engine"]
