"""A name-scoped view of loaded checkpoint tensors that each component takes its weights from."""
from __future__ import annotations

from typing import Optional

import torch


class TensorBag:
    """Tensors keyed by full checkpoint name; ``scope`` prefixes lookups, ``take`` consumes.

    Taking (rather than reading) lets the model check at the end that every loaded tensor found
    a home, so a layout mistake shows up as an error instead of silently unused weights.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], prefix: str = ""):
        self._tensors = tensors
        self._prefix = prefix

    def scope(self, prefix: str) -> "TensorBag":
        return TensorBag(self._tensors, self._prefix + prefix)

    def take(self, name: str) -> torch.Tensor:
        return self._tensors.pop(self._prefix + name)

    def take_optional(self, name: str) -> Optional[torch.Tensor]:
        return self._tensors.pop(self._prefix + name, None)

    def has(self, name: str) -> bool:
        return self._prefix + name in self._tensors

    def remaining(self) -> list[str]:
        return sorted(k for k in self._tensors if k.startswith(self._prefix))
