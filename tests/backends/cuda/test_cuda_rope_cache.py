"""Rope, the latent-cache write and the fused latent norm + rope + cache step equal the cpu backend."""
import pytest
import torch

from cuda_support import DTYPES, assert_close
from mindspec.modeling.rotary import build_rotary, rope_parameters

R, P = 32, 8


def _rotary(device, with_cache=True):
    # DeepSeek YaRN, factor 40; mscale != mscale_all_dim so the cos/sin attention factor is not 1
    hf = {"rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                           "mscale": 1.0, "mscale_all_dim": 0.707}, "rope_theta": 10000.0}
    rotary = build_rotary(P, rope_parameters(hf), 163840)
    assert abs(rotary.attention_factor - 1.0) > 0.01
    if with_cache:
        rotary.build_cache(5000, device)
    return rotary


def _cpu_rotary(rotary):
    import copy

    r = copy.copy(rotary)
    r.inv_freq = rotary.inv_freq.cpu()
    r.cos_sin_cache = None if rotary.cos_sin_cache is None else rotary.cos_sin_cache.cpu()
    return r


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_cache", [True, False])
def test_rope_matches_cpu(cuda_backend, cpu_backend, device, dtype, with_cache):
    g = torch.Generator().manual_seed(3)
    rotary = _rotary(device, with_cache)
    q = torch.randn(13, 3, 24, generator=g).to(dtype)  # [T, H, nope 16 | rope 8]: rope on a strided view
    positions = torch.randint(0, 4999, (13,), generator=g)
    out = cuda_backend.rope(q.to(device)[..., 16:], positions.to(device), rotary)
    assert out.shape == (13, 3, P) and out.dtype == dtype
    assert_close(out, cpu_backend.rope(q[..., 16:], positions, _cpu_rotary(rotary)), dtype)


def _slots(g, num_tokens, num_blocks, block_size, skip):
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[list(skip)] = -1
    return slots


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_latent_cache(cuda_backend, cpu_backend, device, dtype, block_size):
    g = torch.Generator().manual_seed(block_size)
    num_blocks, T = 12, 21
    c_kv, k_pe = torch.randn(T, R, generator=g).to(dtype), torch.randn(T, P, generator=g).to(dtype)
    slots = _slots(g, T, num_blocks, block_size, skip=(0, 7, 20))
    ours = cuda_backend.allocate_latent_cache(num_blocks, block_size, R, P, dtype)
    ref = cpu_backend.allocate_latent_cache(num_blocks, block_size, R, P, dtype)
    ours.c_kv.fill_(5.0)  # what was there must survive where nothing is written (slot -1, other slots)
    ref.c_kv.fill_(5.0)
    cuda_backend.write_latent_cache(ours, c_kv.to(device), k_pe.to(device), slots.to(device))
    cpu_backend.write_latent_cache(ref, c_kv, k_pe, slots)
    assert torch.equal(ours.c_kv.cpu(), ref.c_kv) and torch.equal(ours.k_pe.cpu(), ref.k_pe)


def test_write_into_separate_cache_tensors_of_another_dtype(cuda_backend, cpu_backend, device):
    # Caches need not be views of one buffer, and may be stored in a lower precision.
    from mindspec.backend import LatentCache

    g = torch.Generator().manual_seed(0)
    c_kv, k_pe = torch.randn(6, R, generator=g), torch.randn(6, P, generator=g)
    slots = torch.tensor([3, -1, 9, 10, 0, 17])
    ours = LatentCache(torch.zeros(5, 4, R, dtype=torch.float16, device=device), torch.zeros(5, 4, P, dtype=torch.float16, device=device))
    ref = LatentCache(torch.zeros(5, 4, R, dtype=torch.float16), torch.zeros(5, 4, P, dtype=torch.float16))
    cuda_backend.write_latent_cache(ours, c_kv.to(device), k_pe.to(device), slots.to(device))
    cpu_backend.write_latent_cache(ref, c_kv, k_pe, slots)
    assert torch.equal(ours.c_kv.cpu(), ref.c_kv) and torch.equal(ours.k_pe.cpu(), ref.k_pe)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_latent_norm_rope_cache(cuda_backend, cpu_backend, device, dtype, block_size):
    g = torch.Generator().manual_seed(10 + block_size)
    rotary = _rotary(device)
    num_blocks, T = 10, 17
    kv_a = (torch.randn(T, R + P, generator=g) * 2).to(dtype)
    w = (1 + 0.1 * torch.randn(R, generator=g)).to(dtype)
    positions = torch.randint(0, 4000, (T,), generator=g)
    slots = _slots(g, T, num_blocks, block_size, skip=(4,))
    ours = cuda_backend.allocate_latent_cache(num_blocks, block_size, R, P, dtype)
    ref = cpu_backend.allocate_latent_cache(num_blocks, block_size, R, P, dtype)
    c, pe = cuda_backend.latent_norm_rope_cache(kv_a.to(device), w.to(device), 1e-6, positions.to(device), rotary, ours, slots.to(device))
    # the cpu backend composes rms_norm + rope + write_latent_cache (the interface default)
    rc, rpe = cpu_backend.latent_norm_rope_cache(kv_a, w, 1e-6, positions, _cpu_rotary(rotary), ref, slots)
    assert c.dtype == rc.dtype and pe.dtype == rpe.dtype
    assert_close(c, rc, dtype)
    assert_close(pe, rpe, dtype)
    assert_close(ours.c_kv, ref.c_kv, dtype)
    assert_close(ours.k_pe, ref.k_pe, dtype)
    # nothing but the written slots changed
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert torch.count_nonzero(ours.c_kv.cpu().reshape(-1, R)[~written]) == 0


def test_slots_must_match_tokens(cuda_backend, device):
    cache = cuda_backend.allocate_latent_cache(4, 4, R, P, torch.float32)
    with pytest.raises(ValueError, match="slots"):
        cuda_backend.write_latent_cache(cache, torch.zeros(3, R, device=device), torch.zeros(3, P, device=device),
                                        torch.zeros(2, dtype=torch.int64, device=device))
