"""Backend.top_k_top_p: the composed default equals the sampler's filter; the npu backend's
npu_top_k_top_p (reference) equals it on untied logits, and falls back for k > 1024."""
import pytest
import torch

from mindspec.backends.cpu import CpuBackend
from mindspec.text_generator.sampling.sampler import filter_logits


class _Md:
    """The fields filter_logits reads for top-k / top-p."""

    def __init__(self, top_k, top_p):
        self.top_k, self.top_p, self.num_rows = top_k, top_p, top_k.shape[0]
        self.max_top_k = int(top_k.max())  # an upper bound is enough: the ranked head's width
        self.any_filters = self.any_top_k = self.any_top_p = True
        self.any_min_p = self.any_typical_p = False


def _case(seed, rows=32, vocab=300):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 3
    top_k = torch.randint(1, vocab + 1, (rows,), generator=g)
    top_k[::4] = vocab  # off
    top_p = torch.rand(rows, generator=g)
    top_p[1::3] = 1.0  # off
    return logits, top_k, top_p


@pytest.mark.parametrize("seed", [0, 1])
def test_default_equals_sampler_filter(seed):
    logits, top_k, top_p = _case(seed)
    out = CpuBackend().top_k_top_p(logits, top_k, top_p)
    assert torch.equal(out, filter_logits(logits, _Md(top_k, top_p)))
    assert torch.isfinite(out).any(dim=1).all()


@pytest.mark.parametrize("seed", [2, 3])
def test_npu_top_k_top_p(npu_backend, npu_ref, seed):
    logits, top_k, top_p = _case(seed)
    out = npu_backend.top_k_top_p(logits, top_k, top_p)
    assert torch.equal(out, CpuBackend().top_k_top_p(logits, top_k, top_p))
    (call,) = npu_ref.calls("npu_top_k_top_p")
    _, p, k = call.args
    assert k.dtype == torch.int32 and p.dtype == logits.dtype
    assert not npu_backend.fallbacks.counts


def test_npu_top_k_above_1024_falls_back(npu_backend, npu_ref):
    logits, top_k, top_p = _case(4, rows=6, vocab=2000)  # top_k "off" is 2000 > 1024
    out = npu_backend.top_k_top_p(logits, top_k, top_p)
    assert torch.equal(out, CpuBackend().top_k_top_p(logits, top_k, top_p))
    assert not npu_ref.calls("npu_top_k_top_p") and npu_backend.fallbacks.ops() == {"top_k_top_p"}
