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
@pytest.mark.parametrize("rows", [[3], [0, 4, 9], list(range(70))[::-1]])
def test_add_rms_norm_of_gathered_residual_rows(cuda_backend, cpu_backend, device, dtype, rows):
    # A last draft stage after its attention: only the lm_head rows go on, the residual's rows
    # gathered as the norm kernel loads them
    g = torch.Generator().manual_seed(len(rows))
    res = _rand(g, 70, 72, dtype=dtype, scale=4.0)
    x, w = _rand(g, len(rows), 72, dtype=dtype), (1 + 0.1 * torch.randn(72, generator=g)).to(dtype)
    idx = torch.tensor(rows)
    normed, summed = cuda_backend.add_rms_norm_rows(x.to(device), res.to(device), idx.to(device), w.to(device), EPS)
    want_normed, want_summed = cuda_backend.add_rms_norm(x.to(device), res.to(device)[idx.to(device)], w.to(device), EPS)
    assert torch.equal(summed, want_summed) and torch.equal(normed, want_normed)
    ref_normed, ref_summed = cpu_backend.add_rms_norm_rows(x, res, idx, w, EPS)
    assert torch.equal(summed.cpu(), ref_summed)
    assert_close(normed, ref_normed, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 16), (6, 48), (40, 130)])
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32])
def test_mtp_eh_input(cuda_backend, cpu_backend, device, dtype, rows, dim, id_dtype):
    """An MTP module's [enorm(embed(ids)), hnorm(h)] in one launch equals the separate ops; the
    hidden rows may be a strided view (a stage's block output rows)."""
    g = torch.Generator().manual_seed(rows + dim)
    embed = _rand(g, 97, dim, dtype=dtype, scale=2.0)
    wide = _rand(g, rows, dim + 8, dtype=dtype, scale=3.0)
    hidden = wide[:, 4:4 + dim]
    ids = torch.randint(0, 97, (rows,), generator=g).to(id_dtype)
    enorm, hnorm = ((1 + 0.1 * torch.randn(dim, generator=g)).to(dtype) for _ in range(2))
    out = cuda_backend.mtp_eh_input(ids.to(device), embed.to(device), enorm.to(device), wide.to(device)[:, 4:4 + dim],
                                    hnorm.to(device), EPS)
    assert out.shape == (rows, 2 * dim) and out.dtype == dtype
    expected = cpu_backend.mtp_eh_input(ids, embed, enorm, hidden, hnorm, EPS)
    assert_close(out, expected, dtype)
    # each half is its own norm: swapping the weights must show
    assert not torch.allclose(out.cpu().float()[:, :dim], cpu_backend.rms_norm(embed[ids.long()], hnorm, EPS).float())


def test_mtp_eh_input_of_mixed_dtypes_takes_the_separate_ops(cuda_backend, cpu_backend, device):
    g = torch.Generator().manual_seed(5)
    embed, hidden = torch.randn(11, 16, generator=g), torch.randn(3, 16, generator=g).half()
    ids, w = torch.tensor([1, 10, 4]), torch.rand(16, generator=g) + 0.5
    out = cuda_backend.mtp_eh_input(ids.to(device), embed.to(device), w.to(device), hidden.to(device), w.half().to(device),
                                    EPS)
    assert_close(out, cpu_backend.mtp_eh_input(ids, embed, w, hidden, w.half(), EPS), torch.float16)


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
    empty_ids = torch.zeros(0, dtype=torch.long, device=device)
    w = torch.ones(16, device=device)
    assert cuda_backend.mtp_eh_input(empty_ids, torch.ones(5, 16, device=device), w, x, w, EPS).shape == (0, 32)
    assert cuda_backend.rms_norm(x, torch.ones(16, device=device), EPS).shape == (0, 16)
    assert cuda_backend.silu_and_mul(torch.zeros(0, 32, device=device)).shape == (0, 16)


def test_bad_shapes_are_named(cuda_backend, device):
    with pytest.raises(ValueError, match="weight"):
        cuda_backend.rms_norm(torch.ones(2, 8, device=device), torch.ones(4, device=device), EPS)
    with pytest.raises(ValueError, match="embed_norm_concat"):
        ones = torch.ones(8, device=device)
        cuda_backend.mtp_eh_input(torch.zeros(2, dtype=torch.long, device=device), torch.ones(5, 4, device=device),
                                  ones, torch.ones(2, 8, device=device), ones, EPS)
    with pytest.raises(ValueError, match="even"):
        cuda_backend.silu_and_mul(torch.ones(2, 7, device=device))
