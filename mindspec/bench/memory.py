"""Resident weight bytes of a loaded model: every tensor reachable from the model's objects
(weights, packed copies, FP8 values and scales), each storage counted once."""
from __future__ import annotations

import torch

_SKIP = ("backend", "rotary", "ep")  # shared helpers, not weights
_OWN_MODULES = ("mindspec", "models", "backends")


def resident_weight_bytes(model) -> int:
    return _bytes(model, set())


def _bytes(obj, seen: set) -> int:
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return _tensor_bytes(obj, seen)
    if isinstance(obj, (list, tuple)):
        return sum(_bytes(o, seen) for o in obj)
    if isinstance(obj, dict):
        return sum(_bytes(o, seen) for o in obj.values())
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith(_OWN_MODULES):
        return sum(_bytes(v, seen) for k, v in vars(obj).items() if k not in _SKIP)
    return 0


def _tensor_bytes(t: torch.Tensor, seen: set) -> int:
    try:
        storage = t.untyped_storage()
    except NotImplementedError:  # oneDNN's packed weights (OpaqueTensorImpl) have no storage to read
        return t.numel() * t.element_size()
    key = ("storage", storage.data_ptr(), t.device.type)
    if key in seen:
        return 0
    seen.add(key)
    return storage.nbytes()
