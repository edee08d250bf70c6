"""Rope dimension order on Ascend.

mindspec's interface keeps DeepSeek's interleaved rope layout (pairs (x0, x1), (x2, x3), ...).
Ascend's rope ops (npu_interleave_rope, npu_kv_rmsnorm_rope_cache) de-interleave first and apply
rotate-half, so they emit the "half" order [x0, x2, ..., x1, x3, ...] (shared/reference/npu_ops.md
1.5; unconfirmed on hardware). The npu backend therefore stores k_pe in the cache in half order,
turns q_pe into half order before attention, and returns interleaved tensors from its rope ops:
q.k is unchanged by the common permutation, and the interface stays the one every backend shares.
"""
from __future__ import annotations

import torch

from mindspec.backend import RotaryEmbedding

_INDEX: dict[tuple[str, int, str], torch.Tensor] = {}


def _index(order: str, dim: int, device: torch.device) -> torch.Tensor:
    key = (order, dim, str(device))
    if key not in _INDEX:
        half = torch.cat([torch.arange(0, dim, 2), torch.arange(1, dim, 2)])  # interleaved -> half
        _INDEX[key] = (half if order == "half" else torch.argsort(half)).to(device)
    return _INDEX[key]


def to_half_order(x: torch.Tensor) -> torch.Tensor:
    """[..., P] interleaved -> half order (what Ascend's rope ops produce)."""
    return x.index_select(-1, _index("half", x.shape[-1], x.device))


def to_interleaved(x: torch.Tensor) -> torch.Tensor:
    """[..., P] half order -> DeepSeek's interleaved order."""
    return x.index_select(-1, _index("interleaved", x.shape[-1], x.device))


def half_cos_sin(rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [T, P] in ``dtype`` in the rotate-half layout [f0..f(P/2-1), f0..f(P/2-1)]."""
    cos, sin = rotary.cos_sin(positions)  # [T, P/2] float32 each, attention factor applied
    return torch.cat([cos, cos], dim=-1).to(dtype), torch.cat([sin, sin], dim=-1).to(dtype)
