import torch

import op_references as ref
from mindspec.backend import LatentCache, RotaryEmbedding
from mindspec.backends.cpu import CpuBackend

R, P, BS, NB = 16, 8, 4, 10


def test_write_skips_negative_slots_and_lands_in_shared_buffer():
    be = CpuBackend()
    cache = be.allocate_latent_cache(NB, BS, R, P, torch.float32)
    assert cache.latent.shape == (NB, BS, R + P)
    assert cache.c_kv.data_ptr() == cache.latent.data_ptr()
    assert cache.k_pe.data_ptr() == cache.c_kv.data_ptr() + R * cache.c_kv.element_size()
    g = torch.Generator().manual_seed(0)
    c_kv, k_pe = torch.randn(5, R, generator=g), torch.randn(5, P, generator=g)
    slots = torch.tensor([0, 13, -1, 39, 6])
    be.write_latent_cache(cache, c_kv, k_pe, slots)
    flat = cache.latent.view(NB * BS, R + P)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        assert torch.equal(flat[s, :R], c_kv[t]) and torch.equal(flat[s, R:], k_pe[t])
    written = {0, 13, 39, 6}
    for s in range(NB * BS):
        if s not in written:
            assert torch.count_nonzero(flat[s]) == 0, s
    assert cache.num_blocks == NB and cache.block_size == BS


def test_each_slots_tensor_gets_its_own_rows():
    """Rows are derived once per slots tensor (all layers of a forward write the same slots):
    a new tensor with other slots, or the same slots in another cache, writes where it says."""
    be = CpuBackend()
    first, second = (be.allocate_latent_cache(NB, BS, R, P, torch.float32) for _ in range(2))
    c_kv, k_pe = torch.ones(2, R), torch.ones(2, P)
    be.write_latent_cache(first, c_kv, k_pe, torch.tensor([3, -1]))
    be.write_latent_cache(first, 2 * c_kv, 2 * k_pe, torch.tensor([-1, 8]))
    slots = torch.tensor([5, 6])
    be.write_latent_cache(second, c_kv, k_pe, slots)
    be.write_latent_cache(second, 3 * c_kv, 3 * k_pe, slots)
    rows = first.latent.view(NB * BS, R + P)
    assert rows[3].eq(1).all() and rows[8].eq(2).all() and torch.count_nonzero(rows) == 2 * (R + P)
    rows = second.latent.view(NB * BS, R + P)
    assert rows[5].eq(3).all() and rows[6].eq(3).all() and torch.count_nonzero(rows) == 2 * (R + P)


def test_write_to_separate_latent_and_rope_tensors():
    """A LatentCache of two separate tensors (Ascend's layout) is written the same way."""
    be = CpuBackend()
    cache = LatentCache(c_kv=torch.zeros(NB, BS, R), k_pe=torch.zeros(NB, BS, P))
    g = torch.Generator().manual_seed(1)
    c_kv, k_pe = torch.randn(3, R, generator=g), torch.randn(3, P, generator=g)
    be.write_latent_cache(cache, c_kv, k_pe, torch.tensor([7, -1, 2]))
    assert torch.equal(cache.c_kv[1, 3], c_kv[0]) and torch.equal(cache.k_pe[0, 2], k_pe[2])
    assert torch.count_nonzero(cache.c_kv) == 2 * R and torch.count_nonzero(cache.k_pe) == 2 * P


def test_write_casts_to_cache_dtype():
    be = CpuBackend()
    cache = be.allocate_latent_cache(2, BS, R, P, torch.bfloat16)
    c_kv, k_pe = torch.randn(2, R), torch.randn(2, P)
    be.write_latent_cache(cache, c_kv, k_pe, torch.tensor([1, 5]))
    assert torch.equal(cache.c_kv[1, 1], c_kv[1].to(torch.bfloat16))
    assert torch.equal(cache.k_pe[0, 1], k_pe[0].to(torch.bfloat16))


def test_latent_norm_rope_cache():
    be = CpuBackend()
    cache = be.allocate_latent_cache(NB, BS, R, P, torch.float32)
    g = torch.Generator().manual_seed(1)
    kv_a = torch.randn(4, R + P, generator=g)
    w = torch.randn(R, generator=g)
    positions = torch.tensor([0, 3, 9, 2])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, P, 2, dtype=torch.float32) / P))
    rot = RotaryEmbedding(inv_freq=inv_freq, attention_factor=1.0)
    slots = torch.tensor([7, -1, 20, 2])
    c_kv, k_pe = be.latent_norm_rope_cache(kv_a, w, 1e-6, positions, rot, cache, slots)
    exp_c = ref.rms_norm(kv_a[:, :R], w, 1e-6)
    exp_pe = ref.rope(kv_a[:, None, R:], positions, inv_freq)[:, 0]
    torch.testing.assert_close(c_kv.double(), exp_c, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_pe.double(), exp_pe, atol=1e-5, rtol=1e-5)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(cache.c_kv[s // BS, s % BS], c_kv[t])
            assert torch.equal(cache.k_pe[s // BS, s % BS], k_pe[t])
    assert torch.count_nonzero(cache.c_kv[0, 1]) == 0  # nothing else written
