import pytest
import torch

import op_references as ref
from mindspec.backends.cpu import CpuBackend


@pytest.fixture(scope="module")
def be():
    return CpuBackend()


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_rms_norm(be, dtype, atol):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 48, generator=g) * 3).to(dtype)
    w = torch.randn(48, generator=g).to(dtype)
    out = be.rms_norm(x, w, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), ref.rms_norm(x, w, 1e-6), atol=atol, rtol=atol)


def test_rms_norm_matches_hf(be):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 32, generator=g).to(torch.bfloat16)
    norm = DeepseekV3RMSNorm(32, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32, generator=g))
        assert torch.equal(be.rms_norm(x, norm.weight, 1e-6), norm(x))


def test_add_rms_norm(be):
    g = torch.Generator().manual_seed(2)
    x, r, w = torch.randn(6, 32, generator=g), torch.randn(6, 32, generator=g), torch.randn(32, generator=g)
    normed, summed = be.add_rms_norm(x, r, w, 1e-6)
    torch.testing.assert_close(summed, x + r)
    torch.testing.assert_close(normed.double(), ref.rms_norm(x + r, w, 1e-6), atol=1e-5, rtol=1e-5)


def test_silu_and_mul(be):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 2 * 24, generator=g)
    out = be.silu_and_mul(x)
    assert out.shape == (9, 24)
    torch.testing.assert_close(out.double(), ref.silu_and_mul(x), atol=1e-5, rtol=1e-5)
