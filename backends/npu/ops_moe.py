"""DeepSeekMoE on torch_npu: fused gate, then permute -> grouped GEMMs -> SwiGLU -> unpermute.

Gate: npu_moe_gating_top_k for DeepSeek-V3's noaux_tc router (sigmoid, correction bias, group
top-2-sum selection, renormalise, routed scaling) within its A2/A3 limits; any other router, or a
model outside the limits, runs the composed torch router.
Experts (vllm-ascend's all-gather path without quantisation): npu_moe_init_routing_v2 sorts the
(token, expert) pairs by expert and counts tokens per expert, npu_grouped_matmul runs w13 and w2 per
expert group (weights [E, K, N]), npu_swiglu in between, and npu_moe_token_unpermute gathers each
token's k rows back, weighted, in float32 (vllm-ascend avoids npu_moe_finalize_routing).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from mindspec.backend import ExpertWeights, RouterConfig

from .limits import gating_refusal
from .op_group import OpGroup


class MoeOps(OpGroup):
    def moe_gate(self, x, gate_weight, correction_bias: Optional[torch.Tensor], router: RouterConfig):
        num_experts = gate_weight.shape[0]
        reason = gating_refusal(num_experts, router.top_k, router.n_group, router.topk_group, router.scoring,
                                router.topk_method, router.norm_topk_prob, correction_bias is not None)
        if reason:
            self.fallbacks.note("moe_gate", reason)
            return self.composed.moe_gate(x, gate_weight, correction_bias, router)
        logits = F.linear(x.to(torch.float32), gate_weight.to(torch.float32))  # [T, E] router in fp32
        weights, ids, _ = self.npu.npu_moe_gating_top_k(
            logits,
            router.top_k,
            bias=correction_bias.to(torch.float32),
            k_group=router.topk_group,
            group_count=router.n_group,
            group_select_mode=1,  # group score = sum of its top-2 experts (DeepSeek-V3)
            renorm=0,
            norm_type=1,  # sigmoid
            out_flag=False,
            routed_scaling_factor=router.routed_scaling_factor,
            eps=1e-20,
        )
        return weights.to(torch.float32), ids.to(torch.int64)

    def moe_experts(self, x, topk_weights, topk_ids, experts: ExpertWeights) -> torch.Tensor:
        T, k = topk_ids.shape
        if T == 0:
            return torch.zeros_like(x)
        num_experts = experts.w13.shape[0]
        # Ids outside [0, E) belong to experts elsewhere (expert parallelism): keep shapes static
        # by routing them to expert 0 with weight 0 instead of dropping rows.
        owned = (topk_ids >= 0) & (topk_ids < num_experts)
        ids = torch.where(owned, topk_ids, 0).to(torch.int32)
        weights = torch.where(owned, topk_weights, 0.0).to(torch.float32)
        expanded_x, expanded_row_idx, tokens_per_expert, _ = self.npu.npu_moe_init_routing_v2(
            x,
            ids,
            active_num=T * k,
            expert_num=num_experts,
            expert_tokens_num_type=1,  # counts per expert
            expert_tokens_num_flag=True,
            active_expert_range=[0, num_experts],
            quant_mode=-1,
            row_idx_type=0,  # gather index: row of each (token, k) pair in expanded_x
        )
        w13, w2 = _gmm_weights(experts)
        gate_up = self._grouped_matmul(expanded_x, w13, tokens_per_expert)  # [T*k, 2I]
        down = self._grouped_matmul(self.npu.npu_swiglu(gate_up, dim=-1), w2, tokens_per_expert)  # [T*k, H]
        out = self.npu.npu_moe_token_unpermute(down.to(torch.float32), expanded_row_idx, probs=weights)
        return out.to(x.dtype)  # [T, H]

    def _grouped_matmul(self, x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        return self.npu.npu_grouped_matmul(
            [x], [weight], group_list=tokens_per_expert, split_item=2, group_type=0, group_list_type=1
        )[0]


def _gmm_weights(experts: ExpertWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, H, 2I], w2 [E, I, H]) contiguous, as npu_grouped_matmul takes weights [E, K, N].

    The checkpoint layout is [E, N, K]; the first call re-lays the record's storage out once
    (keeping its logical shape, so every other backend reads it unchanged) instead of copying the
    experts on every forward or holding a second transposed copy.
    """
    for name in ("w13", "w2"):
        w = getattr(experts, name)
        if not w.transpose(1, 2).is_contiguous():
            setattr(experts, name, w.transpose(1, 2).contiguous().transpose(1, 2))
    return experts.w13.transpose(1, 2), experts.w2.transpose(1, 2)
