"""The cpu backend's GEMM against a weight kept quantized: dequantized in row chunks, the same
result as one GEMM against the whole weight dequantized, for GGUF blocks and block FP8."""
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from mindspec.backends.cpu import linear as cpu_linear
from mindspec.modeling import gguf_quants
from mindspec.modeling.fp8 import BlockFp8Format, Fp8Weight, quantize


def _gguf(w, qtype):
    return gguf_quants.from_raw(gguf_quants.quantize(w, qtype), qtype, tuple(w.shape), torch.float32)


def _fp8(w, block):
    q, scale = quantize(w, BlockFp8Format(block))
    return Fp8Weight(q, scale, BlockFp8Format(block), torch.float32)


@pytest.mark.parametrize("make", [lambda w: _gguf(w, Q.Q8_0), lambda w: _gguf(w, Q.Q4_K),
                                  lambda w: _fp8(w, (128, 128)), lambda w: _fp8(w, (96, 64))],
                         ids=["q8_0", "q4_k", "fp8 128x128", "fp8 96x64"])
@pytest.mark.parametrize("rows", [1, 5])
def test_chunked_dequantizing_gemm_equals_the_whole_weights(monkeypatch, make, rows):
    monkeypatch.setattr(cpu_linear, "DEQUANT_CHUNK", 128 * 256)  # 128-row chunks of a 700 x 256 weight
    gen = torch.Generator().manual_seed(0)
    w = make(torch.randn(700, 256, generator=gen) * 0.05)
    x = torch.randn(rows, 256, generator=gen)
    expected = F.linear(x, w.dequantize(torch.float32))
    torch.testing.assert_close(cpu_linear.quantized_linear(x, w), expected, rtol=0, atol=1e-6)
