"""Device services of the npu backend: device strings, visibility, streams, events, memory.

Devices are ``npu:N`` where N counts the NPUs made visible by ASCEND_RT_VISIBLE_DEVICES (the
Ascend analogue of CUDA_VISIBLE_DEVICES, applied by the driver before the process sees devices).
The one exception is the test-support reference of torch_npu, which runs its ops on the host and
says so (``REFERENCE_ON_HOST``): only then is device ``cpu`` accepted.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Iterator, Optional

import torch

from mindspec.backend import BackendError

VISIBLE_DEVICES_ENV = "ASCEND_RT_VISIBLE_DEVICES"


@dataclass(frozen=True)
class DeviceChoice:
    device: str  # "npu:N" or, with the host reference, "cpu"
    index: Optional[int]  # N for npu devices


def resolve_device(spec: Optional[str], available: bool, device_count: int, host_reference: bool) -> DeviceChoice:
    """Validate a device string for the npu backend; None means npu:0."""
    spec = (spec or "npu:0").strip()
    if spec == "cpu":
        if host_reference:
            return DeviceChoice("cpu", None)
        raise BackendError("the npu backend runs on npu:N devices; device 'cpu' is only accepted with the "
                           "test-support reference of torch_npu (use backend 'cpu' for host runs)")
    kind, _, idx = spec.partition(":")
    if kind != "npu" or (idx and not idx.isdigit()):
        raise BackendError(f"device {spec!r} is not an NPU device string; use 'npu' or 'npu:N'")
    index = int(idx) if idx else 0
    visible = os.environ.get(VISIBLE_DEVICES_ENV)
    where = f"{VISIBLE_DEVICES_ENV}={visible!r}" if visible is not None else f"{VISIBLE_DEVICES_ENV} unset"
    if not available or device_count == 0:
        raise BackendError(f"no NPU is visible to this process (torch.npu.is_available() is False; {where}); "
                           "check the Ascend driver (npu-smi info) and the visible-devices setting")
    if index >= device_count:
        raise BackendError(f"device npu:{index} does not exist: {device_count} NPU(s) visible ({where}); "
                           f"indices count visible devices from 0")
    return DeviceChoice(f"npu:{index}", index)


class NpuDevice:
    """Thin wrappers over torch.npu so the rest of the backend never reaches for it directly."""

    def __init__(self, torch_npu: ModuleType, spec: Optional[str]):
        self.npu = torch.npu  # registered by torch_npu (or its host reference in tests)
        host_reference = bool(getattr(torch_npu, "REFERENCE_ON_HOST", False))
        choice = resolve_device(spec, bool(self.npu.is_available()), int(self.npu.device_count()), host_reference)
        self.on_host = choice.index is None
        if not self.on_host:
            self.npu.set_device(choice.index)
        self.device = torch.device(choice.device)

    def synchronize(self) -> None:
        self.npu.synchronize()

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self.npu.mem_get_info()
        return int(free), int(total)

    def current_stream(self):
        return self.npu.current_stream()

    def new_stream(self):
        return self.npu.Stream()

    def new_event(self):
        return self.npu.Event()

    @contextmanager
    def stream(self, stream) -> Iterator[None]:
        with self.npu.stream(stream):
            yield
