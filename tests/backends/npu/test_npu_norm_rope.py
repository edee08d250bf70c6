"""Norms, SwiGLU, rope and the latent-cache write of the npu backend (torch_npu reference on the
host) against the cpu backend, plus the fallbacks outside the fused ops' limits."""
import pytest
import torch

from mindspec.backends.cpu import CpuBackend
from mindspec.backends.npu.rope_layout import to_half_order, to_interleaved
from npu_cases import HALF, close, filled_caches, rand, rotary

CPU = CpuBackend()
ALL = [torch.float32] + HALF


@pytest.mark.parametrize("dtype", ALL)
def test_rms_norm_add_rms_norm_swiglu(npu_backend, npu_ref, dtype):
    g = torch.Generator().manual_seed(1)
    x, res = rand(g, 9, 48, dtype=dtype), rand(g, 9, 48, dtype=dtype)
    w = (1 + 0.1 * torch.randn(48, generator=g)).to(dtype)
    close(npu_backend.rms_norm(x, w, 1e-6), CPU.rms_norm(x, w, 1e-6), dtype)
    y, summed = npu_backend.add_rms_norm(x, res, w, 1e-6)
    y_ref, summed_ref = CPU.add_rms_norm(x, res, w, 1e-6)
    close(y, y_ref, dtype)
    close(summed, summed_ref, dtype)
    h = rand(g, 9, 64, dtype=dtype)
    close(npu_backend.silu_and_mul(h), CPU.silu_and_mul(h), dtype)
    assert {c.name for c in npu_ref.CALLS} == {"npu_rms_norm", "npu_add_rms_norm", "npu_swiglu"}
    assert not npu_backend.fallbacks.counts


def test_rms_norm_with_mixed_dtypes_falls_back(npu_backend, npu_ref):
    x, w = torch.randn(3, 16, dtype=torch.bfloat16), torch.ones(16)
    close(npu_backend.rms_norm(x, w, 1e-6), CPU.rms_norm(x, w, 1e-6), torch.bfloat16)
    assert not npu_ref.calls("npu_rms_norm") and npu_backend.fallbacks.ops() == {"rms_norm"}


@pytest.mark.parametrize("dtype", HALF)
def test_rope_fused_keeps_interleaved_layout(npu_backend, npu_ref, dtype):
    g = torch.Generator().manual_seed(2)
    rot = rotary(64)
    x, pos = rand(g, 11, 4, 64, dtype=dtype), torch.randint(0, 8000, (11,), generator=g)
    close(npu_backend.rope(x, pos, rot), CPU.rope(x, pos, rot), dtype)
    (call,) = npu_ref.calls("npu_interleave_rope")
    x4, cos, sin = call.args
    assert x4.shape == (11, 4, 1, 64) and cos.shape == sin.shape == (11, 1, 1, 64) and cos.dtype == dtype


@pytest.mark.parametrize("rope_dim,dtype", [(8, torch.bfloat16), (64, torch.float32)])
def test_rope_outside_limits_falls_back(npu_backend, npu_ref, rope_dim, dtype):
    g = torch.Generator().manual_seed(3)
    rot = rotary(rope_dim)
    x, pos = rand(g, 5, 2, rope_dim, dtype=dtype), torch.arange(5)
    torch.testing.assert_close(npu_backend.rope(x, pos, rot), CPU.rope(x, pos, rot), rtol=0, atol=0)
    assert not npu_ref.calls("npu_interleave_rope") and npu_backend.fallbacks.ops() == {"rope"}


def test_rope_layout_permutations_are_inverse():
    x = torch.arange(64.0)
    assert to_half_order(x)[:4].tolist() == [0, 2, 4, 6] and to_half_order(x)[32:34].tolist() == [1, 3]
    assert torch.equal(to_interleaved(to_half_order(x)), x)


@pytest.mark.parametrize("dtype", HALF)
def test_latent_norm_rope_cache_fused(npu_backend, npu_ref, dtype):
    g = torch.Generator().manual_seed(4)
    rot = rotary(64)
    seq_lens, q_lens = [5, 20, 3], [1, 4, 3]
    meta, (c_npu, c_cpu), _ = filled_caches([npu_backend, CPU], seq_lens, q_lens, 16, 12, 512, 64, dtype, g,
                                            skip_slots=(2,))
    kv_a = rand(g, 8, 576, dtype=dtype)
    w = (1 + 0.1 * torch.randn(512, generator=g)).to(dtype)
    pos = torch.tensor([4, 16, 17, 18, 19, 0, 1, 2])
    out = npu_backend.latent_norm_rope_cache(kv_a, w, 1e-6, pos, rot, c_npu, meta.slots)
    ref = CPU.latent_norm_rope_cache(kv_a, w, 1e-6, pos, rot, c_cpu, meta.slots)
    close(out[0], ref[0], dtype)
    close(out[1], ref[1], dtype)
    # The npu cache keeps k_pe in half order (what the fused op writes); c_kv as is.
    close(c_npu.c_kv, c_cpu.c_kv, dtype)
    close(to_interleaved(c_npu.k_pe), c_cpu.k_pe, dtype)
    assert int(meta.slots[2]) == -1  # token 2 is not written; equal caches show it was skipped
    (call,) = npu_ref.calls("npu_kv_rmsnorm_rope_cache")
    kv, gamma, cos, sin, index, k_cache, ckv_cache = call.args
    assert kv.shape == (8, 1, 1, 576) and cos.shape == (8, 1, 1, 64) and index.dtype == torch.int64
    assert k_cache.shape == (12, 16, 1, 64) and ckv_cache.shape == (12, 16, 1, 512)
    assert call.kwargs["cache_mode"] == "PA" and call.kwargs["is_output_kv"] and call.kwargs["epsilon"] == 1e-6
    assert not npu_backend.fallbacks.counts


def test_latent_norm_rope_cache_small_model_falls_back(npu_backend, npu_ref):
    g = torch.Generator().manual_seed(5)
    rot = rotary(8)
    dtype = torch.float32
    meta, (c_npu, c_cpu), _ = filled_caches([npu_backend, CPU], [6, 3], [2, 3], 4, 8, 32, 8, dtype, g)
    kv_a, w = rand(g, 5, 40), 1 + 0.1 * torch.randn(32, generator=g)
    pos = torch.tensor([4, 5, 0, 1, 2])
    out = npu_backend.latent_norm_rope_cache(kv_a, w, 1e-6, pos, rot, c_npu, meta.slots)
    ref = CPU.latent_norm_rope_cache(kv_a, w, 1e-6, pos, rot, c_cpu, meta.slots)
    close(out[0], ref[0], dtype)
    close(out[1], ref[1], dtype)
    close(to_interleaved(c_npu.k_pe), c_cpu.k_pe, dtype)
    assert not npu_ref.calls("npu_kv_rmsnorm_rope_cache")
    assert {"latent_norm_rope_cache", "write_latent_cache", "rope"} <= npu_backend.fallbacks.ops()


@pytest.mark.parametrize("dtype", HALF)
def test_write_latent_cache_scatter(npu_backend, npu_ref, dtype):
    g = torch.Generator().manual_seed(6)
    c_npu = npu_backend.allocate_latent_cache(4, 16, 512, 64, dtype)
    c_cpu = CPU.allocate_latent_cache(4, 16, 512, 64, dtype)
    assert c_npu.c_kv.is_contiguous() and c_npu.k_pe.is_contiguous()  # two separate tensors
    assert c_npu.c_kv.untyped_storage().data_ptr() != c_npu.k_pe.untyped_storage().data_ptr()
    c_kv, k_pe = rand(g, 5, 512, dtype=dtype), rand(g, 5, 64, dtype=dtype)
    slots = torch.tensor([3, -1, 40, 17, 63])
    for be, cache in ((npu_backend, c_npu), (CPU, c_cpu)):
        be.write_latent_cache(cache, c_kv, k_pe, slots)
    torch.testing.assert_close(c_npu.c_kv, c_cpu.c_kv, rtol=0, atol=0)
    torch.testing.assert_close(to_interleaved(c_npu.k_pe), c_cpu.k_pe, rtol=0, atol=0)
    (call,) = npu_ref.calls("npu_scatter_pa_kv_cache")
    assert call.args[0].shape == (5, 1, 512) and call.args[2].shape == (4, 16, 1, 512)
    assert call.args[4].dtype == torch.int64 and call.kwargs["cache_mode"] == "Norm"
