"""Shared inputs of the npu backend tests: tolerances per dtype, random tensors, a rotary table,
and paged caches filled identically on the cpu and npu backends."""
from __future__ import annotations

import torch

import op_references as opr
from mindspec.modeling.rotary import build_rotary
from tests.support.checkpoints import tiny_v3_config

# The reference ops compute in float32 and round once; the cpu backend rounds some intermediates
# in the activation dtype (as transformers does), so results differ by a few ulps of the dtype.
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}
HALF = [torch.float16, torch.bfloat16]


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype])


def rand(g: torch.Generator, *shape, dtype=torch.float32, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def rotary(rope_dim: int = 64):
    params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
              "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    rot = build_rotary(rope_dim, params, 8192)
    rot.build_cache(8192)
    return rot


def filled_caches(backends, seq_lens, q_lens, block_size, num_blocks, rank, rope, dtype, g, skip_slots=()):
    """(meta, caches, latents) with each sequence's context already in every backend's cache;
    latents[b] = (c_kv [s, R], k_pe [s, P]) of all tokens of sequence b (new ones included)."""
    meta, all_slots = opr.paged_metadata(seq_lens, q_lens, block_size, num_blocks, seed=int(g.initial_seed()),
                                         skip_slots=skip_slots)
    caches = [be.allocate_latent_cache(num_blocks, block_size, rank, rope, dtype) for be in backends]
    latents = []
    for s, q, slots in zip(seq_lens, q_lens, all_slots):
        c_kv, k_pe = rand(g, s, rank, dtype=dtype), rand(g, s, rope, dtype=dtype)
        for be, cache in zip(backends, caches):
            be.write_latent_cache(cache, c_kv[: s - q], k_pe[: s - q], torch.tensor(slots[: s - q]))
        latents.append((c_kv, k_pe))
    return meta, caches, latents


def ascend_config():
    """Tiny DeepSeek-V3 config inside every fused op's limits: latent 512 + rope 64, q/k/v head dims
    128, 4 heads (FIA pads them to 32), 256 experts in 8 groups of which 4 are kept, top-8."""
    return tiny_v3_config(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                          num_attention_heads=4, num_key_value_heads=4, n_routed_experts=256, n_group=8, topk_group=4,
                          num_experts_per_tok=8, moe_intermediate_size=8, num_hidden_layers=2, first_k_dense_replace=1,
                          num_nextn_predict_layers=1, max_position_embeddings=4096, initializer_range=0.2)
