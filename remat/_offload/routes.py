"""Which tensors an offload decision moves, and how a copy goes from one device to another.

:class:`_Routes` holds what the offload engine works out once and looks up per
saved tensor: the device a policy's device string names and its type, and per
pair of source device and destination name a copy's route (kept on the source
device until a later call, NOTE [keep last] in ``schedule.py``; copied
asynchronously into pinned memory or synchronously; the destination device).
The engine decides the asynchronous part (``OffloadEngine._asynchronous``, which
a subclass may override) and hands it to :meth:`_Routes.add`.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _torch_internals as _ti

__all__ = ["_CPU", "_REAL_DTYPES", "_Route", "_Routes"]

_CPU = torch.device("cpu")
# dtypes no tensor of which is quantized or has its conjugate bit (torch sets the bit on complex tensors only): the
# two questions are asked of the others alone (a call into torch each, per saved tensor)
_REAL_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8,
                          torch.int16, torch.int32, torch.int64, torch.bool})
# whether the source keeps (NOTE [keep last]), whether the copy runs asynchronously, the destination device
_Route = tuple[bool, bool, torch.device]


class _Routes:
    """The routes of copies and the device strings of policies, each worked out once (NOTE [keep last] for a
    route's first field)."""

    __slots__ = ("table", "from_cpu", "keep_types", "devices", "kinds", "types")

    def __init__(self) -> None:
        # (per source device and destination name: its route; looked up once per copy (OffloadEngine._route))
        self.table: dict[tuple[torch.device, str], _Route] = {}
        # (per destination name: the device it names if a copy there from the CPU is synchronous and kept nowhere,
        # else None: OffloadEngine._plain_from_cpu)
        self.from_cpu: dict[str, torch.device | None] = {}
        self.keep_types = frozenset({"cuda"})  # the device types whose storages are kept (tests add "cpu")
        self.devices: dict[str, torch.device] = {"cpu": _CPU}  # (a policy's device strings, parsed once)
        self.kinds: dict[str, str] = {}  # (a policy's device strings: the type of device each names)
        # (a device's type, looked up: torch.device.type makes a new string, ~0.4 us, on the hot path of both passes)
        self.types: dict[torch.device, str] = {}

    def clear(self) -> None:
        """Forget the routes (a setting they were worked out from changed)."""
        self.table.clear()
        self.from_cpu.clear()

    def type(self, dev: torch.device) -> str:
        t = self.types.get(dev)
        if t is None:
            t = self.types[dev] = dev.type
        return t

    def device(self, name: str) -> torch.device:
        dev = self.devices.get(name)
        if dev is None:
            dev = self.devices[name] = torch.device(name)
        return dev

    def add(self, device: torch.device, dst: str, asynchronous: bool, to: torch.device) -> _Route:
        """The route of a copy from ``device`` to the device named ``dst`` (which is ``to``), whose copy runs
        ``asynchronously`` or not: whether it keeps, found once per pair (three lookups and two calls cost ~1 us, per
        copy)."""
        route = self.table[(device, dst)] = (self.type(device) in self.keep_types, asynchronous, to)
        return route

    def bytes_moved(self, t: torch.Tensor, decision: Any) -> int:
        """``t``'s size in bytes if ``decision`` (an Offloadable) moves it, else 0: right source device, plain strided
        (no conjugate or negative bit, not quantized or nested), large enough (``OffloadEngine.applies``)."""
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            return 0
        name = decision.src
        if name is not None:
            kind = self.kinds.get(name)
            if kind is None:
                kind = self.kinds[name] = self.type(self.device(name))
            # (t.is_cpu and t.is_cuda are flags; t.device.type makes a device and a string, ~0.4 us, per saved tensor)
            if not (t.is_cpu if kind == "cpu" else t.is_cuda if kind == "cuda" else self.type(t.device) == kind):
                return 0
        if t.layout is not torch.strided or t.is_meta or t.is_neg() or t.is_nested or _ti.is_zero_tensor(t) \
                or (t.dtype not in _REAL_DTYPES and (t.is_conj() or t.is_quantized)):
            # rebuilt from raw storage, a conjugate or negative view would lose its bit: keep these; a zero tensor
            # (forward AD's zero tangent, under hessian) has no storage at all, and costs nothing kept
            return 0
        nbytes: int = t.nbytes
        return nbytes if nbytes >= decision.min_bytes else 0
