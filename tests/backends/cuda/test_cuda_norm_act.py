"""RMSNorm, add+RMSNorm and SwiGLU kernels equal the cpu backend."""
import pytest
import torch

from cuda_support import DTYPES, assert_close

EPS = 1e-6


def _rand(g, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 16), (7, 48), (33, 130)])
def test_rms_norm(cuda_backend, cpu_backend, device, dtype, rows, dim):
    g = torch.Generator().manual_seed(rows * dim)
    x, w = _rand(g, rows, dim, dtype=dtype, scale=3.0), (1 + 0.1 * torch.randn(dim, generator=g)).to(dtype)
    out = cuda_backend.rms_norm(x.to(device), w.to(device), EPS)
    assert out.dtype == dtype and out.shape == (rows, dim)
    assert_close(out, cpu_backend.rms_norm(x, w, EPS), dtype)


def test_rms_norm_of_a_strided_view(cuda_backend, cpu_backend, device):
    # The model normalises kv_a[:, :rank], a view whose rows are longer than the normalised part.
    g = torch.Generator().manual_seed(1)
    kv_a, w = torch.randn(9, 40, generator=g), torch.rand(32, generator=g) + 0.5
    out = cuda_backend.rms_norm(kv_a.to(device)[:, :32], w.to(device), EPS)
    assert_close(out, cpu_backend.rms_norm(kv_a[:, :32], w, EPS), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(cuda_backend, cpu_backend, device, dtype):
    g = torch.Generator().manual_seed(2)
    x, res = _rand(g, 11, 72, dtype=dtype), _rand(g, 11, 72, dtype=dtype, scale=4.0)
    w = (1 + 0.1 * torch.randn(72, generator=g)).to(dtype)
    normed, summed = cuda_backend.add_rms_norm(x.to(device), res.to(device), w.to(device), EPS)
    ref_normed, ref_summed = cpu_backend.add_rms_norm(x, res, w, EPS)
    assert torch.equal(summed.cpu(), ref_summed)  # one rounding of x + residual, as torch
    assert_close(normed, ref_normed, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 16), (5, 40), (20, 160)])
def test_silu_and_mul(cuda_backend, cpu_backend, device, dtype, rows, inter):
    g = torch.Generator().manual_seed(rows + inter)
    x = _rand(g, rows, 2 * inter, dtype=dtype, scale=3.0)
    out = cuda_backend.silu_and_mul(x.to(device))
    assert out.shape == (rows, inter) and out.dtype == dtype
    assert_close(out, cpu_backend.silu_and_mul(x), dtype)


def test_empty_batches(cuda_backend, device):
    x = torch.zeros(0, 16, device=device)
    assert cuda_backend.rms_norm(x, torch.ones(16, device=device), EPS).shape == (0, 16)
    assert cuda_backend.silu_and_mul(torch.zeros(0, 32, device=device)).shape == (0, 16)


def test_bad_shapes_are_named(cuda_backend, device):
    with pytest.raises(ValueError, match="weight"):
        cuda_backend.rms_norm(torch.ones(2, 8, device=device), torch.ones(4, device=device), EPS)
    with pytest.raises(ValueError, match="even"):
        cuda_backend.silu_and_mul(torch.ones(2, 7, device=device))
