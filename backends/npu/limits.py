"""What the fused torch_npu ops accept, as the backend checks it before choosing them.

Each predicate returns None when the fused op applies, else the reason the composed torch path is
used instead (logged once per reason). Where the op documents disagree between versions, the
stricter rule is kept so the fused path is valid on either (sources: shared/reference/npu_ops.md,
op-plugin docs of npu_fused_infer_attention_score(_v2), npu_kv_rmsnorm_rope_cache,
npu_moe_gating_top_k).
"""
from __future__ import annotations

from typing import Optional

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)

# Absorbed MLA decode (FIA v2, paged, TND): latent 512 + rope 64, key heads 1.
MLA_LATENT_DIM = 512
MLA_ROPE_DIM = 64
MLA_QUERY_HEADS = (32, 64, 128)  # FIA v2 MLA constraint; v1 docs also allow 1..16, stricter kept
MLA_BLOCK_SIZES = (16, 128)  # FIA v2 page attention with D=512 (ND cache)
MAX_Q_PER_SEQ = 16  # TND layout: 1..16 query tokens per request
MAX_TND_BATCH = 4096
MASK_SIZE = 2048  # sparse_mode 3 takes this fixed triu mask

# Prefill (FIA v1, TND without paging): q/k/v head dim 128 + rope 64, bfloat16 only.
PREFILL_HEAD_DIM = 128
PREFILL_KV_GROUP_MAX = 64

# npu_moe_gating_top_k: A2/A3 limits of the PyTorch 7.0.0 page (256 experts, k_group 4, k <= 32,
# bias required) on top of the generic aclnn ones.
GATING_EXPERTS = 256
GATING_K_GROUP = 4
GATING_MAX_K = 32

TOP_K_MAX = 1024  # npu_top_k_top_p


def padded_query_heads(num_heads: int) -> Optional[int]:
    """Smallest head count FIA's MLA path accepts that holds num_heads (vllm-ascend pads heads)."""
    return next((n for n in MLA_QUERY_HEADS if n >= num_heads), None)


def mla_decode_refusal(num_heads: int, latent: int, rope: int, dtype: torch.dtype, block_size: int,
                       q_lens: list[int], has_tree_mask: bool) -> Optional[str]:
    if has_tree_mask:
        return "tree mask (FIA takes only the causal sparse_mode 3 mask)"
    if (latent, rope) != (MLA_LATENT_DIM, MLA_ROPE_DIM):
        return f"latent {latent} + rope {rope} (FIA MLA needs 512 + 64)"
    if dtype not in HALF_DTYPES:
        return f"dtype {dtype} (FIA needs float16/bfloat16)"
    if padded_query_heads(num_heads) is None:
        return f"{num_heads} query heads (FIA MLA takes at most {MLA_QUERY_HEADS[-1]})"
    if block_size not in MLA_BLOCK_SIZES:
        return f"cache block size {block_size} (FIA MLA paging takes {MLA_BLOCK_SIZES})"
    if len(q_lens) > MAX_TND_BATCH:
        return f"{len(q_lens)} sequences (TND takes at most {MAX_TND_BATCH})"
    if q_lens and max(q_lens) > MAX_Q_PER_SEQ:
        return f"{max(q_lens)} query tokens in one sequence (TND takes at most {MAX_Q_PER_SEQ})"
    return None


def mla_prefill_refusal(nope_dim: int, rope_dim: int, v_dim: int, dtype: torch.dtype, num_seqs: int) -> Optional[str]:
    if (nope_dim, rope_dim, v_dim) != (PREFILL_HEAD_DIM, MLA_ROPE_DIM, PREFILL_HEAD_DIM):
        return f"head dims q/k {nope_dim}+{rope_dim}, v {v_dim} (FIA TND prefill needs 128+64, v 128)"
    if dtype != torch.bfloat16:
        return f"dtype {dtype} (FIA TND prefill takes bfloat16 only)"
    if num_seqs > MAX_TND_BATCH:
        return f"{num_seqs} sequences (TND takes at most {MAX_TND_BATCH})"
    return None


def latent_cache_refusal(latent: int, rope: int, dtype: torch.dtype) -> Optional[str]:
    if (latent, rope) != (MLA_LATENT_DIM, MLA_ROPE_DIM):
        return f"latent {latent} + rope {rope} (npu_kv_rmsnorm_rope_cache needs 512 + 64)"
    if dtype not in HALF_DTYPES:
        return f"dtype {dtype} (npu_kv_rmsnorm_rope_cache needs float16/bfloat16)"
    return None


def rope_refusal(rope: int, dtype: torch.dtype) -> Optional[str]:
    if rope != MLA_ROPE_DIM:
        return f"rope dim {rope} (npu_interleave_rope needs 64)"
    if dtype not in HALF_DTYPES:
        return f"dtype {dtype} (npu_interleave_rope needs float16/bfloat16)"
    return None


def gating_refusal(num_experts: int, top_k: int, n_group: int, topk_group: int, scoring: str,
                   topk_method: str, norm_topk_prob: bool, has_bias: bool) -> Optional[str]:
    if (scoring, topk_method) != ("sigmoid", "noaux_tc") or not norm_topk_prob:
        return f"router {scoring}/{topk_method} (the fused gate is used for DeepSeek-V3 noaux_tc only)"
    if not has_bias:
        return "no e_score_correction_bias (required on A2/A3)"
    if num_experts != GATING_EXPERTS or topk_group != GATING_K_GROUP or top_k > GATING_MAX_K:
        return (f"{num_experts} experts, top-{top_k}, k_group {topk_group} (A2/A3 take {GATING_EXPERTS} "
                f"experts, k_group {GATING_K_GROUP}, k <= {GATING_MAX_K})")
    per_group = num_experts // n_group if n_group else 0
    if n_group <= 0 or num_experts % n_group or per_group <= 2 or -(-per_group // 32) * 32 * n_group > 2048:
        return f"{n_group} expert groups of {num_experts} experts"
    if not 1 <= top_k <= per_group * topk_group:
        return f"top-{top_k} over {topk_group} groups of {per_group}"
    return None


def top_k_top_p_refusal(top_k_max: int, dtype: torch.dtype) -> Optional[str]:
    if top_k_max > TOP_K_MAX:
        return f"top_k {top_k_max} (npu_top_k_top_p takes k <= {TOP_K_MAX})"
    if dtype not in HALF_DTYPES + (torch.float32,):
        return f"dtype {dtype}"
    return None
