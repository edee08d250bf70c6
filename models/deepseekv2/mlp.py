"""Feed-forward blocks: the dense SwiGLU MLP and DeepSeekMoE (routed experts + shared experts).

With expert parallelism (moe_ep > 1) a DeepseekMoe keeps only this rank's slice of the routed
experts and sends every token through the ep group's collectives (ExpertParallel); the router,
the shared experts and everything else stay replicated, so the layer's output is the same.
"""
from __future__ import annotations

from typing import Optional

import torch

from mindspec.backend import Backend, RouterConfig
from mindspec.distributed.expert_parallel import ExpertParallel
from mindspec.modeling import quantized

from .tensors import TensorBag


def _fused_gate_up(w: TensorBag) -> quantized.Weight:
    # One GEMM for gate and up: rows [gate | up] as silu_and_mul expects (quantized stays so).
    return quantized.cat_rows([w.take("gate_proj.weight"), w.take("up_proj.weight")])  # [2I, hidden]


def _drop_expert(w: TensorBag) -> None:
    # Another rank's expert: consumed from the bag (every loaded tensor must find a home) and freed.
    for name in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
        w.take(name)


class DenseMlp:
    def __init__(self, w: TensorBag, backend: Backend):
        self.backend = backend
        self.gate_up = backend.linear_weight(_fused_gate_up(w))  # [2I, hidden]
        self.down = backend.linear_weight(w.take("down_proj.weight"))  # [hidden, I]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.linear(self.backend.linear_silu_and_mul(x, self.gate_up), self.down)


class DeepseekMoe:
    def __init__(self, w: TensorBag, backend: Backend, router: RouterConfig, num_experts: int, has_shared: bool):
        self.backend = backend
        self.router = router
        # [E, hidden] float32: every backend's router GEMM runs in float32 (as transformers'), and
        # a copy in the model dtype would be widened again at every call (a launch per layer).
        self.gate_weight = w.take("gate.weight").float()
        bias = w.take_optional("gate.e_score_correction_bias")
        self.correction_bias: Optional[torch.Tensor] = None if bias is None else bias.float()  # [E]
        self.ep = ExpertParallel.for_current_process(num_experts)  # None: every expert lives here
        local = self.ep.local_experts if self.ep else range(num_experts)
        experts = [w.scope(f"experts.{e}.") for e in range(num_experts)]
        self.experts = backend.expert_weights(
            w13=quantized.stack([_fused_gate_up(experts[e]) for e in local]),  # [E_local, 2I, hidden]
            w2=quantized.stack([experts[e].take("down_proj.weight") for e in local]),  # [E_local, hidden, I]
        )
        for e in range(num_experts):
            if e not in local:
                _drop_expert(experts[e])
        self.shared = DenseMlp(w.scope("shared_experts."), backend) if has_shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = None if self.shared is None else self.shared.forward(x)
        if self.ep is None:
            return self.backend.moe_block(x, self.gate_weight, self.correction_bias, self.router, self.experts, shared)
        weights, ids = self.backend.moe_gate(x, self.gate_weight, self.correction_bias, self.router)
        # every rank's tokens through this rank's experts, partial sums reduced back
        x_all, weights_all, local_ids = self.ep.dispatch(x, weights, ids)
        out = self.ep.combine(self.backend.moe_experts(x_all, weights_all, local_ids, self.experts))
        return out if shared is None else out + shared
