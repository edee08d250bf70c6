"""Many small host arrays to the device in one copy.

A decode step's inputs are a dozen arrays of a few to a few hundred integers each. Copied one by
one, each is a separate host-to-device transfer (~10-20 us of host time on a GPU, most of a
small step's host work there); packed back to back into one staging buffer (pinned on CUDA, so
the copy is asynchronous) they are one transfer, and the device tensors are views into it.
Back, a step's outputs laid out in one buffer are read with one copy (``packed_span``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

ALIGN = 8  # bytes: every view starts at a multiple of the widest element (int64 / float64)


@dataclass(frozen=True)
class PackedLayout:
    """Where each array lives in the byte buffer: (numpy dtype, shape, byte offset)."""

    fields: tuple[tuple[np.dtype, tuple[int, ...], int], ...]
    nbytes: int

    @classmethod
    def of(cls, arrays: Sequence[np.ndarray]) -> "PackedLayout":
        fields, offset = [], 0
        for a in arrays:
            fields.append((a.dtype, tuple(a.shape), offset))
            offset += -(-a.nbytes // ALIGN) * ALIGN
        return cls(tuple(fields), max(offset, ALIGN))

    def fits(self, arrays: Sequence[np.ndarray]) -> bool:
        return len(arrays) == len(self.fields) and all(
            a.shape == shape and (a.dtype is dt or a.dtype == dt) for a, (dt, shape, _) in zip(arrays, self.fields)
        )

    def stage(self, arrays: Sequence[np.ndarray], pinned: bool = False) -> torch.Tensor:
        """A host uint8 tensor [nbytes] holding the arrays at their offsets."""
        self.check(arrays)
        staging = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.write(arrays, staging)
        return staging

    def check(self, arrays: Sequence[np.ndarray]) -> None:
        if not self.fits(arrays):
            got = [(a.dtype.name, tuple(a.shape)) for a in arrays]
            want = [(dt.name, shape) for dt, shape, _ in self.fields]
            raise ValueError(f"packed transfer: arrays {got} do not fit the layout {want}")

    def write(self, arrays: Sequence[np.ndarray], buffer: torch.Tensor) -> None:
        """The arrays into a host uint8 ``buffer`` [>= nbytes] at their offsets (they fit: ``check``)."""
        for view, a in zip(self.host_views(buffer), arrays):
            view[...] = a

    def host_views(self, buffer: torch.Tensor) -> list[np.ndarray]:
        """Typed numpy arrays over a host uint8 ``buffer`` [>= nbytes], one per field: ``write``
        assigns into them; a caller that fills the same buffer every step keeps them instead of
        making them again each time (~8x the assignments' cost for a step's few dozen arrays)."""
        raw = buffer.numpy()
        return [raw[off : off + dt.itemsize * math.prod(shape)].view(dt).reshape(shape) for dt, shape, off in self.fields]

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """Typed tensors over ``buffer`` (uint8 [nbytes], any device), one per field."""
        out = []
        for dt, shape, off in self.fields:
            size = math.prod(shape) * dt.itemsize
            out.append(buffer[off : off + size].view(_torch_dtype(dt)).view(shape))
        return out


def _torch_dtype(dt: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dt)).dtype


def pinned_staging(device: torch.device) -> bool:
    """Page-locked staging makes a host-to-device copy asynchronous; only CUDA has it here."""
    return device.type == "cuda"


class Staging:
    """One reusable host buffer for a caller's packed host-to-device copies (page-locked where
    the device has it), instead of a fresh one per copy: a step then allocates nothing on the
    host. The copies are asynchronous, so the buffer is rewritten only once the device has
    read the previous copy out of it (an event recorded after each copy)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.pinned = pinned_staging(self.device)
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._read = torch.cuda.Event() if self.pinned else None  # page-locked staging is CUDA's (pinned_staging)
        self._pending = False
        # the last layout's typed views of the buffer: a caller sending one layout every step (a
        # graph runner's static inputs) assigns into them (PackedLayout.host_views)
        self._views: tuple[Optional[PackedLayout], list[np.ndarray]] = (None, [])

    def send(self, layout: PackedLayout, arrays: Sequence[np.ndarray],
             into: torch.Tensor | None = None) -> torch.Tensor:
        """``arrays`` on the device in one asynchronous copy: into ``into`` (uint8, ``layout.nbytes``)
        or a new device buffer, which is returned."""
        host = self.fill(layout, arrays)
        moved = host.to(self.device, non_blocking=True) if into is None else into.copy_(host, non_blocking=True)
        if self._read is not None:  # the copy is queued on the device's current stream
            self._read.record(torch.cuda.current_stream(self.device))
            self._pending = True
        return moved

    def fill(self, layout: PackedLayout, arrays: Sequence[np.ndarray]) -> torch.Tensor:
        """The host tensor [layout.nbytes] holding ``arrays``, once the previous copy out of the
        buffer has been read."""
        layout.check(arrays)
        if self._pending:
            self._read.synchronize()
            self._pending = False
        if self.buffer.numel() < layout.nbytes:
            size = max(layout.nbytes, 2 * self.buffer.numel())
            # zeros: the alignment gaps between fields are copied too, and stay defined
            self.buffer = torch.zeros(size, dtype=torch.uint8, pin_memory=self.pinned)
            self._views = (None, [])
        kept, views = self._views
        if kept is not layout and kept != layout:
            views = layout.host_views(self.buffer)
            self._views = (layout, views)
        for view, a in zip(views, arrays):
            view[...] = a
        return self.buffer[: layout.nbytes]


def to_device_packed(arrays: Sequence[np.ndarray], device: torch.device | str,
                     staging: Staging | None = None) -> list[torch.Tensor]:
    """The arrays as device tensors (views of one buffer), moved in one copy, through
    ``staging`` when the caller keeps one. On cpu nothing moves: the tensors share the arrays'
    memory (read-only arrays, kept and shared by the host's builders, are copied)."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    if device.type == "cpu":  # (several calls a step: no new objects where none are needed)
        return [torch.from_numpy(a if a.flags.c_contiguous and a.flags.writeable else a.copy()) for a in arrays]
    layout = PackedLayout.of(arrays)
    if staging is None:
        return layout.views(layout.stage(arrays, pinned=pinned_staging(device)).to(device, non_blocking=True))
    return layout.views(staging.send(layout, arrays))


def packed_span(first: torch.Tensor, *rest: torch.Tensor) -> Optional[torch.Tensor]:
    """One 1-D view over contiguous tensors of one buffer, each after the one before; None where
    they are not laid out so."""
    if first.dim() != 1 or not first.is_contiguous():
        return None
    before = first
    for t in rest:
        if (t.dtype != first.dtype or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or t.storage_offset() < before.storage_offset() + before.numel()):
            return None
        before = t
    length = before.storage_offset() + before.numel() - first.storage_offset()
    return first.as_strided((length,), (1,), first.storage_offset())
