"""A stand-in for a CUDA graph where there is no GPU: it replays its function eagerly into the
tensors of its first run's outputs, as a captured graph's outputs are its static buffers (whatever
a caller kept of an earlier replay's outputs changes with the next). Backends that pretend to
capture return it from ``capture_graph``."""
from __future__ import annotations

import dataclasses

import torch


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if dataclasses.is_dataclass(value):
        return [t for f in dataclasses.fields(value) for t in _tensors(getattr(value, f.name))]
    return []


class StaticGraph:
    def __init__(self, fn):
        self.fn = fn
        self.outputs = fn()  # the warm-up run, as the CUDA capture does

    def replay(self) -> None:
        for kept, new in zip(_tensors(self.outputs), _tensors(self.fn()), strict=True):
            kept.copy_(new)
