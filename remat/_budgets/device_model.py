"""``remat.DeviceModel``: what a device computes and copies per second, for budgets that weigh offloading.

NOTE [device model]: a budget that may keep, offload or recompute each value
(``policies.memory_budget(b, offload=...)``, ``remat.sequential(..., offload=...)``)
prices its choices in seconds on one device:

* ``flops``: the FLOP rate of the device's compute (an op's cost in the budget's
  model, FLOPs by torch's formulas and at least one per element written, over
  ``flops`` is its time); the backward pass of an op costs ``backward`` times its
  forward pass (2 for a matrix product: two products of the same size);
* ``d2h`` and ``h2d``: the copy bandwidth from device to host and back, in bytes
  per second; a copy runs on its own stream, overlapping the compute, so only the
  part of it that the compute cannot hide costs time (NOTE [three-way budget] in
  ``_budgets/budget_offload.py`` says how that is modelled);
* ``max_inflight_bytes``: the offload engine's bound on copies in flight
  (``OffloadEngine(max_inflight_bytes=...)``): past it the compute waits.

The model is measured once per device and process by :meth:`DeviceModel.probe`
(a matrix product and a copy each way; about a second) or given. On the CPU
nothing is probed for a budget: offloading from host memory to host memory frees
nothing, so ``offload=True`` there raises and a given model stands in (tests, and
planning for a GPU from a machine without one: :meth:`DeviceModel.h200`).
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from .._context import CACHES

__all__ = ["DeviceModel"]


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    """A device's FLOP rate and copy bandwidth each way (NOTE [device model] in ``remat/_budgets/device_model.py``).

    Args:
        flops: FLOPs per second of the device (> 0).
        d2h: bytes per second copied from the device to host memory (>= 0; 0: no link, nothing is offloaded;
            ``math.inf``: copies are free).
        h2d: bytes per second copied back (as ``d2h``).
        max_inflight_bytes: bytes of device-to-host copies in flight before the compute waits for the oldest (the
            offload engine's bound, ``OffloadEngine(max_inflight_bytes=...)``).
        backward: the cost of an op's backward pass over its forward pass's.

    Example:
        >>> from remat import DeviceModel
        >>> m = DeviceModel(flops=1e12, d2h=50e9, h2d=50e9)
        >>> m.copy_seconds(50_000_000), m.compute_seconds(2e12)
        ((0.001, 0.001), 2.0)
        >>> DeviceModel.h200().d2h / 1e9  # PCIe Gen5 x16, GB/s each way
        64.0
    """

    flops: float
    d2h: float
    h2d: float
    max_inflight_bytes: int = 8 << 30
    backward: float = 2.0

    def __post_init__(self) -> None:
        for name in ("flops", "d2h", "h2d", "backward"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
                raise ValueError(f"DeviceModel: {name} must be a non-negative number, got {v!r}")
        if not self.flops > 0 or math.isinf(self.flops):
            raise ValueError(f"DeviceModel: flops must be a positive finite rate (FLOPs per second), got {self.flops!r}")
        if isinstance(self.max_inflight_bytes, bool) or not isinstance(self.max_inflight_bytes, int) \
                or self.max_inflight_bytes <= 0:
            raise ValueError(f"DeviceModel: max_inflight_bytes must be a positive int, got {self.max_inflight_bytes!r}")

    @property
    def can_copy(self) -> bool:
        """Whether values can be offloaded at all (a link each way)."""
        return self.d2h > 0 and self.h2d > 0

    def compute_seconds(self, cost: float) -> float:
        """The seconds ``cost`` FLOPs take."""
        return cost / self.flops

    def copy_seconds(self, nbytes: int) -> tuple[float, float]:
        """The seconds a copy of ``nbytes`` takes to the host and back (``inf`` without a link)."""
        return (nbytes / self.d2h if self.d2h else math.inf, nbytes / self.h2d if self.h2d else math.inf)

    @classmethod
    def h200(cls) -> DeviceModel:
        """An H200 over PCIe Gen5 x16: 989e12 FLOP/s (dense bfloat16) and 64 GB/s each way (the link's rate;
        a measured pinned copy gets about 55)."""
        return cls(flops=989e12, d2h=64e9, h2d=64e9)

    @classmethod
    def probe(cls, device: str | torch.device | None = None) -> DeviceModel:
        """Measure ``device`` (default: the current CUDA device) once per process: a matrix product's FLOP rate
        and a pinned copy's bandwidth each way. Later calls return the measured model.

        Raises:
            ValueError: for a device that is not a CUDA device (offloading from host memory frees nothing; give a
                ``DeviceModel(...)`` to plan as if on a device), or where no CUDA device is available.
        """
        dev = torch.device(device if device is not None else "cuda")
        if dev.type != "cuda":
            raise ValueError(
                f"DeviceModel.probe: {dev} is not a CUDA device; offloading from it to host memory frees nothing. "
                "To plan as if on a GPU (tests, a machine without one), give the model: "
                "DeviceModel(flops=..., d2h=..., h2d=...) or DeviceModel.h200()."
            )
        if not torch.cuda.is_available():
            raise ValueError(
                "DeviceModel.probe: no CUDA device here (this torch has no CUDA, or no GPU is visible), so there is "
                "nothing to measure. To plan as if on a GPU, give the model: DeviceModel(flops=..., d2h=..., "
                "h2d=...) or DeviceModel.h200()."
            )
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        models = CACHES.get().devices
        found = models.get(str(dev))
        if found is None:
            found = models[str(dev)] = _measure_cuda(dev)
        return found


def _measure_cuda(dev: torch.device) -> DeviceModel:  # pragma: no cover - needs a GPU (benchmarks/gpu_check.py)
    n = 4096
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    nbytes = 256 << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def timed(fn: object, reps: int) -> float:
        for _ in range(2):
            fn()  # type: ignore[operator]
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()  # type: ignore[operator]
        torch.cuda.synchronize(dev)
        return (time.perf_counter() - t0) / reps

    flops = 2 * n**3 / timed(lambda: a @ a, 20)
    d2h = nbytes / timed(lambda: host.copy_(src, non_blocking=True), 5)
    h2d = nbytes / timed(lambda: src.copy_(host, non_blocking=True), 5)
    return DeviceModel(flops=flops, d2h=d2h, h2d=h2d)
