"""An MTP stage's eh_proj with its input rows built inside the GEMM (backends/cuda/eh_proj.py)
equals the separate kernels it replaces (the embedding-and-norms kernel, then the skinny GEMM)
bit for bit, and the cpu backend within the dtype's rounding; where it does not fit, the
separate ops run."""
import pytest
import torch

from cuda_support import ON_GPU, assert_close
from mindspec.backend import Backend, IndexedRows
from mindspec.backends.cuda import eh_proj

EPS = 1e-6
HALF = [torch.float16] + ([torch.bfloat16] if ON_GPU else [])


def _stage(rows: int, dim: int, dtype: torch.dtype, vocab: int = 50, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows,), generator=g)
    embed = torch.randn(vocab, dim, generator=g).to(dtype)
    hidden = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    enorm = (1 + 0.1 * torch.randn(dim, generator=g)).to(dtype)
    hnorm = (1 + 0.1 * torch.randn(dim, generator=g)).to(dtype)
    weight = (torch.randn(dim + 8, 2 * dim, generator=g) / (2 * dim) ** 0.5).to(dtype)
    return ids, embed, enorm, hidden, hnorm, weight


def _on(device, *tensors):
    return [t.to(device) for t in tensors]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("rows,dim", [(1, 192), (4, 192), (16, 24), (3, 512), (2, 96)])
def test_one_kernel_equals_the_separate_kernels(cuda_backend, cpu_backend, device, dtype, rows, dim):
    ids, embed, enorm, hidden, hnorm, weight = _on(device, *_stage(rows, dim, dtype, seed=rows * dim))
    w = cuda_backend.linear_weight(weight)
    assert eh_proj.fits(ids, embed, enorm, hidden, hnorm, weight)
    got = cuda_backend.mtp_eh_proj(ids, embed, enorm, hidden, hnorm, EPS, w)
    separate = Backend.mtp_eh_proj(cuda_backend, ids, embed, enorm, hidden, hnorm, EPS, w)
    assert got.dtype == dtype and got.shape == (rows, dim + 8)
    assert torch.equal(got, separate)
    cpu = [t.cpu() for t in (ids, embed, enorm, hidden, hnorm)]
    assert_close(got, cpu_backend.mtp_eh_proj(*cpu, EPS, cpu_backend.linear_weight(weight.cpu())), dtype)


@pytest.mark.parametrize("case", ["float32", "too many rows", "too wide", "quantized embedding"])
def test_what_does_not_fit_takes_the_separate_ops(cuda_backend, cpu_backend, device, case):
    dtype = torch.float32 if case == "float32" else torch.float16
    rows = 17 if case == "too many rows" else 3
    dim = 520 if case == "too wide" else 32
    ids, embed, enorm, hidden, hnorm, weight = _on(device, *_stage(rows, dim, dtype))
    if case == "quantized embedding":
        embed = _Dequantizing(embed)
    assert not eh_proj.fits(ids, embed, enorm, hidden, hnorm, weight)
    got = cuda_backend.mtp_eh_proj(ids, embed, enorm, hidden, hnorm, EPS, cuda_backend.linear_weight(weight))
    plain = embed.weight if case == "quantized embedding" else embed
    want = cpu_backend.mtp_eh_proj(*[t.cpu() for t in (ids, plain, enorm, hidden, hnorm)], EPS,
                                   cpu_backend.linear_weight(weight.cpu()))
    assert_close(got, want, dtype, scale=2.0)


class _Dequantizing:
    """A quantized embedding as the backends see one: not a tensor, ``dequantize()`` gives it."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def dequantize(self) -> torch.Tensor:
        return self.weight


@pytest.mark.parametrize("dtype", HALF)
def test_hidden_rows_of_a_cache_are_gathered_inside_the_kernel(cuda_backend, device, dtype):
    """The first draft stage's hidden states as rows of the drafter's hidden cache (row 0: the
    zero row of positions with no state yet): the same output as the rows gathered first."""
    ids, embed, enorm, hidden, hnorm, weight = _on(device, *_stage(4, 192, dtype, seed=9))
    buffer = torch.cat([torch.zeros_like(hidden[:1]), hidden, hidden.flip(0)])  # [9, D]
    rows = torch.tensor([5, 0, 2, 8], device=device)
    w = cuda_backend.linear_weight(weight)
    indexed = IndexedRows(buffer, rows)
    assert eh_proj.fits(ids, embed, enorm, indexed, hnorm, weight)
    got = cuda_backend.mtp_eh_proj(ids, embed, enorm, indexed, hnorm, EPS, w)
    assert torch.equal(got, cuda_backend.mtp_eh_proj(ids, embed, enorm, buffer[rows], hnorm, EPS, w))
    assert torch.equal(Backend.mtp_eh_proj(cuda_backend, ids, embed, enorm, indexed, hnorm, EPS, w), got)
