"""MLA attention of the npu backend (FIA through the torch_npu reference) against the cpu backend:
decode (one query token), MTP verification (K + 1 tokens, causal), head padding, prefill, and the
composed path outside FIA's limits."""
import pytest
import torch

import op_references as opr
from mindspec.backends.cpu import CpuBackend
from npu_cases import HALF, close, filled_caches, rand

CPU = CpuBackend()
SCALE = 192 ** -0.5


def _decode(be_npu, npu_ref, seq_lens, q_lens, heads, dtype=torch.bfloat16, rank=512, rope=64, block=16, seed=0,
            tree_mask=None):
    g = torch.Generator().manual_seed(seed)
    meta, (c_npu, c_cpu), latents = filled_caches([be_npu, CPU], seq_lens, q_lens, block, 24, rank, rope, dtype, g)
    new_c = torch.cat([c[s - q:] for (c, _), s, q in zip(latents, seq_lens, q_lens)])
    new_pe = torch.cat([k[s - q:] for (_, k), s, q in zip(latents, seq_lens, q_lens)])
    CPU.write_latent_cache(c_cpu, new_c, new_pe, meta.slots)
    be_npu.write_latent_cache(c_npu, new_c, new_pe, meta.slots)
    meta.tree_mask = tree_mask
    T = sum(q_lens)
    q_lat, q_pe = rand(g, T, heads, rank, dtype=dtype, scale=0.05), rand(g, T, heads, rope, dtype=dtype)
    out = be_npu.mla_attention(q_lat, q_pe, c_npu, meta, SCALE)
    expected = CPU.mla_attention(q_lat, q_pe, c_cpu, meta, SCALE)
    close(out, expected, dtype)
    return meta


@pytest.mark.parametrize("dtype", HALF)
def test_decode_one_token_per_sequence(npu_backend, npu_ref, dtype):
    meta = _decode(npu_backend, npu_ref, [5, 40, 17, 1], [1, 1, 1, 1], heads=32, dtype=dtype)
    (call,) = npu_ref.calls("npu_fused_infer_attention_score_v2")
    q, k, v = call.args
    kw = call.kwargs
    assert q.shape == (4, 32, 512) and k is v and k.shape == (24, 16, 512)
    assert kw["query_rope"].shape == (4, 32, 64) and kw["key_rope"].shape == (24, 16, 64)
    assert kw["input_layout"] == "TND" and kw["sparse_mode"] == 0 and kw["atten_mask"] is None
    assert kw["actual_seq_qlen"] == [1, 2, 3, 4] and kw["actual_seq_kvlen"] == [5, 40, 17, 1]
    assert all(type(v) is int for v in kw["actual_seq_qlen"] + kw["actual_seq_kvlen"])  # host lists
    assert kw["block_table"].dtype == torch.int32 and kw["block_table"] is meta.block_tables
    assert (kw["num_query_heads"], kw["num_key_value_heads"], kw["block_size"]) == (32, 1, 16)
    assert not npu_backend.fallbacks.counts


def test_mtp_verification_is_causal_with_the_2048_mask(npu_backend, npu_ref):
    _decode(npu_backend, npu_ref, [9, 33, 4], [4, 4, 4], heads=64, seed=1)
    (call,) = npu_ref.calls("npu_fused_infer_attention_score_v2")
    kw = call.kwargs
    mask = kw["atten_mask"]
    assert kw["sparse_mode"] == 3 and mask.shape == (2048, 2048) and mask.dtype == torch.int8
    assert torch.equal(mask, torch.triu(torch.ones(2048, 2048, dtype=torch.int8), diagonal=1))
    assert kw["actual_seq_qlen"] == [4, 8, 12] and kw["actual_seq_kvlen"] == [9, 33, 4]


@pytest.mark.parametrize("heads,padded", [(4, 32), (48, 64), (128, 128)])
def test_query_heads_are_padded_to_what_fia_takes(npu_backend, npu_ref, heads, padded):
    _decode(npu_backend, npu_ref, [7, 20], [2, 2], heads=heads, seed=heads, block=128)
    (call,) = npu_ref.calls("npu_fused_infer_attention_score_v2")
    assert call.args[0].shape[1] == padded == call.kwargs["num_query_heads"]
    assert not npu_backend.fallbacks.counts


@pytest.mark.parametrize("case", ["heads_256", "block_4", "q_17", "fp32", "small_latent", "tree"])
def test_outside_fia_limits_uses_the_composed_path(npu_backend, npu_ref, case):
    kw = dict(seq_lens=[9, 20], q_lens=[2, 3], heads=32)
    if case == "heads_256":
        kw["heads"] = 256
    elif case == "block_4":
        kw["block"] = 4
    elif case == "q_17":
        kw.update(seq_lens=[30, 20], q_lens=[17, 1])
    elif case == "fp32":
        kw["dtype"] = torch.float32
    elif case == "small_latent":
        kw.update(rank=32, rope=8, heads=4)
    else:
        tree = torch.tril(torch.ones(2, 3, 3, dtype=torch.bool))
        tree[:, 2, 1] = False
        kw["tree_mask"] = tree
    _decode(npu_backend, npu_ref, **kw)
    assert not npu_ref.calls("npu_fused_infer_attention_score_v2")
    assert "mla_attention" in npu_backend.fallbacks.ops()


@pytest.mark.parametrize("dtype", HALF)
def test_prefill_fused_in_bfloat16_composed_otherwise(npu_backend, npu_ref, dtype):
    g = torch.Generator().manual_seed(7)
    seq_lens = [3, 17, 1]
    meta, _ = opr.paged_metadata(seq_lens, seq_lens, 16, 8, seed=7, is_prefill=True)
    T, H = sum(seq_lens), 4
    q_nope, k_nope, v = (rand(g, T, H, 128, dtype=dtype, scale=0.3) for _ in range(3))
    q_pe, k_pe = rand(g, T, H, 64, dtype=dtype), rand(g, T, 64, dtype=dtype)
    out = npu_backend.mla_prefill(q_nope, q_pe, k_nope, k_pe, v, meta, SCALE)
    close(out, CPU.mla_prefill(q_nope, q_pe, k_nope, k_pe, v, meta, SCALE), dtype)
    calls = npu_ref.calls("npu_fused_infer_attention_score")
    if dtype == torch.bfloat16:
        (call,) = calls
        kw = call.kwargs
        assert kw["input_layout"] == "TND" and kw["sparse_mode"] == 3 and kw["atten_mask"].shape == (2048, 2048)
        assert kw["actual_seq_lengths"] == kw["actual_seq_lengths_kv"] == [3, 20, 21]
        assert kw["key_rope"].shape == (T, H, 64) and kw["num_heads"] == kw["num_key_value_heads"] == H
    else:  # FIA's TND prefill takes bfloat16 only
        assert not calls and npu_backend.fallbacks.ops() == {"mla_prefill"}


def test_empty_batch(npu_backend, npu_ref):
    meta, _ = opr.paged_metadata([4], [1], 16, 4)
    meta.q_lens_host, meta.seq_lens_host = [], []
    cache = npu_backend.allocate_latent_cache(4, 16, 512, 64, torch.bfloat16)
    out = npu_backend.mla_attention(torch.zeros(0, 32, 512, dtype=torch.bfloat16),
                                    torch.zeros(0, 32, 64, dtype=torch.bfloat16), cache, meta, SCALE)
    assert out.shape == (0, 32, 512)
