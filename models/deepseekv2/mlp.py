"""Feed-forward blocks: the dense SwiGLU MLP and DeepSeekMoE (routed experts + shared experts)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from mindspec.backend import Backend, ExpertWeights, RouterConfig

from .tensors import TensorBag


def _fused_gate_up(w: TensorBag) -> torch.Tensor:
    # One GEMM for gate and up: rows [gate | up] as silu_and_mul expects.
    return torch.cat([w.take("gate_proj.weight"), w.take("up_proj.weight")], dim=0)  # [2I, hidden]


class DenseMlp:
    def __init__(self, w: TensorBag, backend: Backend):
        self.backend = backend
        self.gate_up = _fused_gate_up(w)  # [2I, hidden]
        self.down = w.take("down_proj.weight")  # [hidden, I]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.backend.silu_and_mul(F.linear(x, self.gate_up)), self.down)


class DeepseekMoe:
    def __init__(self, w: TensorBag, backend: Backend, router: RouterConfig, num_experts: int, has_shared: bool):
        self.backend = backend
        self.router = router
        self.gate_weight = w.take("gate.weight")  # [E, hidden]
        bias = w.take_optional("gate.e_score_correction_bias")
        self.correction_bias: Optional[torch.Tensor] = None if bias is None else bias.float()  # [E]
        experts = [w.scope(f"experts.{e}.") for e in range(num_experts)]
        self.experts = ExpertWeights(
            w13=torch.stack([_fused_gate_up(e) for e in experts]),  # [E, 2I, hidden]
            w2=torch.stack([e.take("down_proj.weight") for e in experts]),  # [E, hidden, I]
        )
        self.shared = DenseMlp(w.scope("shared_experts."), backend) if has_shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.backend.moe_gate(x, self.gate_weight, self.correction_bias, self.router)
        out = self.backend.moe_experts(x, weights, ids, self.experts)
        if self.shared is not None:
            out = out + self.shared.forward(x)
        return out
