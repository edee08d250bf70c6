"""Top-k / top-p filtering with npu_top_k_top_p (k int32 <= 1024, p in the logits dtype)."""
from __future__ import annotations

import torch

from mindspec.backend import Backend

from .limits import top_k_top_p_refusal
from .op_group import OpGroup


class SamplingOps(OpGroup):
    def top_k_top_p(self, logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """logits [N, V]; top_k [N] in [1, V] (V = off); top_p [N] (1.0 = off) -> filtered logits."""
        # One host read of the largest k decides the path (the sampler's metadata is host-built).
        reason = top_k_top_p_refusal(int(top_k.max()) if top_k.numel() else 0, logits.dtype)
        if reason:
            self.fallbacks.note("top_k_top_p", reason)
            return Backend.top_k_top_p(self.composed, logits, top_k, top_p)
        return self.npu.npu_top_k_top_p(logits, top_p.to(logits.dtype), top_k.to(torch.int32))
