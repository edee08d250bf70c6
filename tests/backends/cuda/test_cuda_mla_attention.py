"""Paged absorbed MLA (decode / MTP verification) and the prefill attention equal the cpu backend."""
from dataclasses import replace

import pytest
import torch

import op_references as ref
from cuda_support import DTYPES, assert_close
from mindspec.backend import LatentCache
from mindspec.backends.cuda.mla_attention import mla_decode

H, R, P, NB = 3, 24, 8, 48
SCALE = 0.19


def _case(seq_lens, q_lens, block_size, dtype, device, seed=0, tree=None):
    """A randomly filled paged cache (garbage everywhere a sequence does not own) and queries."""
    g = torch.Generator().manual_seed(seed)
    meta, _ = ref.paged_metadata(seq_lens, q_lens, block_size, NB, seed=seed, tree_mask=tree)
    buf = torch.randn(NB, block_size, R + P, generator=g).to(dtype)
    T = sum(q_lens)
    q_lat, q_pe = torch.randn(T, H, R, generator=g).to(dtype), torch.randn(T, H, P, generator=g).to(dtype)
    return meta, buf, q_lat, q_pe


def _on(device, meta, buf, backend):
    """(cache over ``buf``, metadata) on ``device``."""
    cache_buf = buf.to(device)
    cache = LatentCache(c_kv=cache_buf[..., :R], k_pe=cache_buf[..., R:])
    moved = replace(
        meta, slots=meta.slots.to(device), block_tables=meta.block_tables.to(device), seq_lens=meta.seq_lens.to(device),
        q_lens=meta.q_lens.to(device), q_start_loc=meta.q_start_loc.to(device),
        tree_mask=None if meta.tree_mask is None else meta.tree_mask.to(device), scratch={},
    )
    return cache, moved


def _compare(cuda_backend, cpu_backend, device, meta, buf, q_lat, q_pe, dtype, num_splits=None, scale=1.0):
    cache, dmeta = _on(device, meta, buf, cuda_backend)
    out = mla_decode(q_lat.to(device), q_pe.to(device), cache, dmeta, SCALE, num_splits=num_splits)
    assert out.shape == q_lat.shape and out.dtype == dtype
    ref_cache, _ = _on("cpu", meta, buf, cpu_backend)
    expected = cpu_backend.mla_attention(q_lat, q_pe, ref_cache, meta, SCALE)
    assert_close(out, expected, dtype, scale)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("q_len", [1, 4])
def test_ragged_batches(cuda_backend, cpu_backend, device, dtype, block_size, q_len):
    seq_lens = [3, 9, 17, 40, 1][: 5 if q_len == 1 else 4]
    q_lens = [min(q_len, s) for s in seq_lens]
    meta, buf, q_lat, q_pe = _case(seq_lens, q_lens, block_size, dtype, device, seed=block_size + q_len)
    _compare(cuda_backend, cpu_backend, device, meta, buf, q_lat, q_pe, dtype)


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_split_kv_long_context(cuda_backend, cpu_backend, device, dtype, num_splits):
    # Splits larger than some sequences leave empty splits, which must weigh nothing.
    seq_lens, q_lens = [150, 7, 66], [3, 1, 3]
    meta, buf, q_lat, q_pe = _case(seq_lens, q_lens, 16, dtype, device, seed=num_splits)
    _compare(cuda_backend, cpu_backend, device, meta, buf, q_lat, q_pe, dtype, num_splits=num_splits)


def test_mixed_q_lens_and_tree_mask(cuda_backend, cpu_backend, device):
    seq_lens, q_lens = [9, 17, 6, 30], [4, 3, 4, 1]
    g = torch.Generator().manual_seed(3)
    tree = torch.rand(4, 4, 4, generator=g) < 0.5
    tree |= torch.eye(4, dtype=torch.bool)
    tree[:, :, 0] = True  # every draft sees the root
    tree[1, :, 3] = True  # entries past q_len are padding and must be ignored
    meta, buf, q_lat, q_pe = _case(seq_lens, q_lens, 4, torch.float32, device, seed=3, tree=tree)
    for splits in (1, 3):
        _compare(cuda_backend, cpu_backend, device, meta, buf, q_lat, q_pe, torch.float32, num_splits=splits)


def test_reads_lengths_from_device_tensors_only(cuda_backend, cpu_backend, device):
    """Inside a captured graph the host lists are stale: the kernel must not depend on them."""
    seq_lens, q_lens = [5, 22, 13], [3, 3, 3]
    meta, buf, q_lat, q_pe = _case(seq_lens, q_lens, 4, torch.float32, device, seed=8)
    expected = _compare(cuda_backend, cpu_backend, device, meta, buf, q_lat, q_pe, torch.float32)
    cache, dmeta = _on(device, meta, buf, cuda_backend)
    dmeta.seq_lens_host, dmeta.q_lens_host = [], []
    out = mla_decode(q_lat.to(device), q_pe.to(device), cache, dmeta, SCALE, num_splits=2)
    assert_close(out, expected.cpu(), torch.float32)


def test_zero_new_tokens_in_a_sequence(cuda_backend, cpu_backend, device):
    # The graph runner's slack sequence may have no rows at all.
    seq_lens, q_lens = [6, 1, 10], [2, 0, 3]
    meta, buf, q_lat, q_pe = _case(seq_lens, q_lens, 4, torch.float32, device, seed=4)
    cache, dmeta = _on(device, meta, buf, cuda_backend)
    out = mla_decode(q_lat.to(device), q_pe.to(device), cache, dmeta, SCALE)
    keep = [0, 1, 2, 3, 4]
    expected_meta, _ = ref.paged_metadata([6, 10], [2, 3], 4, NB, seed=4)
    expected_meta.block_tables = meta.block_tables[[0, 2]]
    ref_cache, _ = _on("cpu", meta, buf, cpu_backend)
    expected = cpu_backend.mla_attention(q_lat, q_pe, ref_cache, expected_meta, SCALE)
    assert_close(out[keep], expected, torch.float32)


def test_backend_forwards_its_split_setting(device, cpu_backend):
    from mindspec.backends.cuda import CudaBackend

    be = CudaBackend(device, num_kv_splits=4)
    meta, buf, q_lat, q_pe = _case([70, 20], [2, 2], 16, torch.float32, device, seed=6)
    cache, dmeta = _on(device, meta, buf, be)
    out = be.mla_attention(q_lat.to(device), q_pe.to(device), cache, dmeta, SCALE)
    ref_cache, _ = _on("cpu", meta, buf, cpu_backend)
    assert_close(out, cpu_backend.mla_attention(q_lat, q_pe, ref_cache, meta, SCALE), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill(cuda_backend, cpu_backend, device, dtype):
    seq_lens = [3, 9, 40, 1]
    g = torch.Generator().manual_seed(9)
    meta, _ = ref.paged_metadata(seq_lens, seq_lens, 4, NB, seed=9, is_prefill=True)
    T, DN, DV = sum(seq_lens), 16, 12
    q_nope, q_pe = torch.randn(T, H, DN, generator=g).to(dtype), torch.randn(T, H, P, generator=g).to(dtype)
    kv = torch.randn(T, H, DN + DV, generator=g).to(dtype)  # k_nope and v as views of one tensor, as the model
    k_nope, v = kv[..., :DN], kv[..., DN:]
    k_pe = torch.randn(T, P, generator=g).to(dtype)
    _, dmeta = _on(device, meta, torch.zeros(1, 1, R + P), cuda_backend)
    out = cuda_backend.mla_prefill(*(t.to(device) for t in (q_nope, q_pe, k_nope, k_pe, v)), dmeta, SCALE)
    assert out.shape == (T, H, DV) and out.dtype == dtype
    assert_close(out, cpu_backend.mla_prefill(q_nope, q_pe, k_nope, k_pe, v, meta, SCALE), dtype)


def test_token_count_mismatch_is_named(cuda_backend, device):
    meta, buf, q_lat, q_pe = _case([5, 6], [1, 1], 4, torch.float32, device)
    cache, dmeta = _on(device, meta, buf, cuda_backend)
    with pytest.raises(ValueError, match="new tokens"):
        cuda_backend.mla_attention(q_lat[:1].to(device), q_pe[:1].to(device), cache, dmeta, SCALE)


def _rotary(device, with_cache):
    from mindspec.modeling.rotary import build_rotary, rope_parameters

    # DeepSeek YaRN, factor 40, with a cos/sin attention factor other than 1
    rotary = build_rotary(P, rope_parameters({"rope_theta": 10000.0, "rope_scaling": {
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "mscale": 1.0,
        "mscale_all_dim": 0.707}}), 163840)
    if with_cache:
        rotary.build_cache(512, device)
    return rotary


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits,tree,with_cache", [(1, False, True), (3, False, True), (1, True, True),
                                                    (2, False, False)])
def test_q_rope_inside_the_kernel_equals_rope_first(cuda_backend, cpu_backend, device, dtype, splits, tree, with_cache):
    """rope_mla_attention rotates q_pe as the kernel loads it, rounded as the rope kernel rounds
    it: the same scores, so the same output bit for bit; a launch less per decoder layer."""
    seq_lens, q_lens = [150, 9, 30], [4, 4, 1]
    mask = None
    if tree:
        mask = torch.rand(3, 4, 4, generator=torch.Generator().manual_seed(5)) < 0.5
        mask |= torch.eye(4, dtype=torch.bool)
    meta, buf, q_lat, q_pe = _case(seq_lens, q_lens, 16, dtype, device, seed=11, tree=mask)
    positions = torch.cat([torch.arange(s - q, s) for s, q in zip(seq_lens, q_lens)])
    rotary = _rotary(device, with_cache)
    cache, dmeta = _on(device, meta, buf, cuda_backend)
    q_lat_d, q_pe_d, pos_d = q_lat.to(device), q_pe.to(device), positions.to(device)
    fused = mla_decode(q_lat_d, q_pe_d, cache, dmeta, SCALE, num_splits=splits, rope_q=(pos_d, rotary))
    first = mla_decode(q_lat_d, cuda_backend.rope(q_pe_d, pos_d, rotary), cache, dmeta, SCALE, num_splits=splits)
    assert torch.equal(fused.cpu(), first.cpu())
    ref_cache, _ = _on("cpu", meta, buf, cpu_backend)
    cpu_rotary = _rotary("cpu", with_cache)
    expected = cpu_backend.rope_mla_attention(q_lat, q_pe, positions, cpu_rotary, ref_cache, meta, SCALE)
    assert_close(fused, expected, dtype)
    unroped = mla_decode(q_lat_d, q_pe_d, cache, dmeta, SCALE, num_splits=splits)
    assert not torch.allclose(fused.cpu().float(), unroped.cpu().float(), atol=1e-3)  # the rotation counts
