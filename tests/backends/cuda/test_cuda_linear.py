"""The skinny linear kernel (decode and verification projections) equals torch's F.linear, and
the backend sends it exactly the products it is for."""
import pytest
import torch
import torch.nn.functional as F

from cuda_support import DTYPES, ON_GPU, assert_close
from mindspec.backend import LinearWeight
from mindspec.backends.cuda import linear


def _rand(g, *shape, dtype):
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k_in,n_out", [(1, 192, 176), (4, 96, 192), (8, 384, 192), (16, 130, 6), (3, 512, 4096),
                                             (5, 1024, 33)])
def test_skinny_linear_equals_torch(device, dtype, rows, k_in, n_out):
    # Widths of the shipped model's projections (fused q_a/kv_a 176, router 6, lm_head 4096), and
    # ones no tile divides (130).
    g = torch.Generator().manual_seed(rows * k_in + n_out)
    x, w = _rand(g, rows, k_in, dtype=dtype), _rand(g, n_out, k_in, dtype=dtype) / k_in ** 0.5
    out = linear.skinny_linear(x.to(device), w.to(device))
    assert out.shape == (rows, n_out) and out.dtype == dtype
    assert_close(out, F.linear(x.float(), w.float()).to(dtype), dtype)


def test_leading_dims_and_a_strided_input(device):
    g = torch.Generator().manual_seed(0)
    x, w = _rand(g, 2, 3, 80, dtype=torch.float32), _rand(g, 40, 64, dtype=torch.float32)
    view = x.to(device)[..., :64]  # rows longer than the product's K
    out = linear.skinny_linear(view, w.to(device))
    assert out.shape == (2, 3, 40)
    assert_close(out, F.linear(x[..., :64], w), torch.float32)


def test_the_backend_routes_skinny_products_only(cuda_backend, device, monkeypatch):
    calls = []
    real = linear.skinny_linear
    monkeypatch.setattr(linear, "skinny_linear",
                        lambda x, w, swiglu=False, rows=None, out_dtype=None: calls.append(x.shape[0])
                        or real(x, w, swiglu, rows, out_dtype))
    g = torch.Generator().manual_seed(1)
    half = torch.float16
    w = LinearWeight(_rand(g, 48, 32, dtype=half).to(device))
    for rows in (1, 16, 17):
        x = _rand(g, rows, 32, dtype=half).to(device)
        assert_close(cuda_backend.linear(x, w), F.linear(x.cpu().float(), w.weight.cpu().float()).to(half), half)
    assert calls == [1, 16]  # a prefill's 17 rows go to torch
    w32 = LinearWeight(w.weight.float())
    cuda_backend.linear(torch.zeros(1, 32, device=device), w32)  # float32: cuBLAS is faster
    long_rows = torch.zeros(8, linear.MAX_K + 1, dtype=half, device=device)
    cuda_backend.linear(torch.zeros(1, linear.MAX_K + 1, dtype=half, device=device), LinearWeight(long_rows))
    monkeypatch.setenv(linear.ENV_SWITCH, "0")
    cuda_backend.linear(torch.zeros(1, 32, dtype=half, device=device), w)
    assert calls == [1, 16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k_in,inter", [(1, 192, 192), (4, 96, 40), (16, 130, 33), (3, 1024, 1408), (17, 64, 24)])
def test_linear_silu_and_mul_equals_the_separate_ops(cuda_backend, cpu_backend, device, dtype, rows, k_in, inter):
    # A dense MLP's or shared expert's [gate | up] product and SwiGLU: one skinny launch up to 16
    # rows (float16 / bfloat16), the GEMM and the SwiGLU kernel otherwise (17 rows, float32).
    g = torch.Generator().manual_seed(rows * k_in + inter)
    x, w = _rand(g, rows, k_in, dtype=dtype) * 2, _rand(g, 2 * inter, k_in, dtype=dtype) / k_in ** 0.5
    out = cuda_backend.linear_silu_and_mul(x.to(device), LinearWeight(w.to(device)))
    assert out.shape == (rows, inter) and out.dtype == dtype
    assert_close(out, cpu_backend.linear_silu_and_mul(x, LinearWeight(w)), dtype)
    gate_only = F.silu(F.linear(x.float(), w[:inter].float()))  # up must count
    assert not torch.allclose(out.cpu().float(), gate_only, atol=1e-2, rtol=1e-2)


def test_the_fused_swiglu_takes_the_skinny_launch_where_it_fits(cuda_backend, device, monkeypatch):
    calls = []
    real = linear.skinny_linear
    monkeypatch.setattr(linear, "skinny_linear",
                        lambda x, w, swiglu=False, rows=None, out_dtype=None: calls.append(swiglu)
                        or real(x, w, swiglu, rows, out_dtype))
    half = torch.float16
    w = LinearWeight(torch.randn(64, 32, dtype=half, device=device))
    for rows in (2, 17):
        cuda_backend.linear_silu_and_mul(torch.randn(rows, 32, dtype=half, device=device), w)
    assert calls == [True]  # 17 rows: torch's GEMM, then the SwiGLU kernel


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [[0], [5, 2, 2, 7], list(range(15, -1, -1)), list(range(17))])
def test_linear_rows_equals_the_gathered_product(cuda_backend, device, dtype, rows):
    # The lm_head's rows of a flat batch (out of order, repeated): gathered inside the skinny
    # kernel up to 16 rows in half precision, an index and the GEMM otherwise.
    g = torch.Generator().manual_seed(len(rows))
    x, w = _rand(g, 20, 96, dtype=dtype), _rand(g, 300, 96, dtype=dtype) / 96 ** 0.5
    idx = torch.tensor(rows)
    out = cuda_backend.linear_rows(x.to(device), idx.to(device), LinearWeight(w.to(device)))
    assert out.shape == (len(rows), 300) and out.dtype == dtype
    assert_close(out, F.linear(x[idx].float(), w.float()).to(dtype), dtype)
    # logits: float32 written by the GEMM, holding the product rounded to x's dtype
    logits = cuda_backend.linear_rows(x.to(device), idx.to(device), LinearWeight(w.to(device)), float_out=True)
    assert logits.dtype == torch.float32
    assert torch.equal(logits.cpu(), out.cpu().float())


def test_linear_rows_gathers_inside_the_kernel_where_it_fits(cuda_backend, device, monkeypatch):
    calls = []
    real = linear.skinny_linear
    monkeypatch.setattr(linear, "skinny_linear", lambda x, w, swiglu=False, rows=None, out_dtype=None:
                        calls.append(rows is not None) or real(x, w, swiglu, rows, out_dtype))
    half = torch.float16
    x, w = torch.randn(30, 32, dtype=half, device=device), LinearWeight(torch.randn(48, 32, dtype=half, device=device))
    for n in (3, 17):
        cuda_backend.linear_rows(x, torch.arange(n, device=device), w)
    assert calls == [True]  # 17 rows: an index, then torch's GEMM


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k_in,n_out", [(1, 96, 192), (4, 96, 192), (16, 300, 40), (3, 1024, 64), (17, 64, 24)])
def test_rms_norm_linear_equals_the_separate_ops(cuda_backend, cpu_backend, device, dtype, rows, k_in, n_out):
    # MLA's q_a_layernorm then q_b_proj (the shipped model: 96 -> 4 heads x 48): one skinny launch
    # up to 16 rows in half precision, normalising each row inside it; the norm kernel and the
    # GEMM otherwise (17 rows, float32).
    g = torch.Generator().manual_seed(rows * k_in + n_out)
    x, w = _rand(g, rows, k_in, dtype=dtype) * 3, _rand(g, n_out, k_in, dtype=dtype) / k_in ** 0.5
    norm_w = (1 + 0.2 * torch.randn(k_in, generator=g)).to(dtype)
    lw = LinearWeight(w.to(device))
    out = cuda_backend.rms_norm_linear(x.to(device), norm_w.to(device), 1e-6, lw)
    assert out.shape == (rows, n_out) and out.dtype == dtype
    assert_close(out, cpu_backend.rms_norm_linear(x, norm_w, 1e-6, LinearWeight(w)), dtype)
    separate = cuda_backend.linear(cuda_backend.rms_norm(x.to(device), norm_w.to(device), 1e-6), lw)
    if not ON_GPU and k_in <= 512:  # one K tile here: the sums of squares in the norm kernel's order
        assert torch.equal(out.cpu(), separate.cpu())
    assert_close(out, separate.cpu(), dtype)
    assert not torch.allclose(out.cpu().float(), F.linear(x.float(), w.float()), atol=1e-2, rtol=1e-2)  # normalised


def test_the_norm_takes_the_skinny_launch_where_it_fits(cuda_backend, device, monkeypatch):
    calls = []
    real = linear.skinny_linear
    monkeypatch.setattr(linear, "skinny_linear", lambda x, w, swiglu=False, rows=None, out_dtype=None, norm=None:
                        calls.append(norm is not None) or real(x, w, swiglu, rows, out_dtype, norm))
    for rows, dtype in ((2, torch.float16), (17, torch.float16), (2, torch.float32)):
        w = LinearWeight(torch.randn(48, 32, dtype=dtype, device=device))
        cuda_backend.rms_norm_linear(torch.randn(rows, 32, dtype=dtype, device=device),
                                     torch.ones(32, dtype=dtype, device=device), 1e-6, w)
    assert calls == [True]  # 17 rows, float32: the norm kernel, then the GEMM


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k_in,n_out", [(1, 192, 176), (4, 192, 176), (16, 300, 40), (3, 1024, 64), (17, 64, 24)])
def test_add_rms_norm_linear_equals_the_separate_ops(cuda_backend, cpu_backend, device, dtype, rows, k_in, n_out):
    # A layer's residual add and input norm, then the fused q_a/kv_a projection (the shipped
    # model: 192 -> 176): one skinny launch up to 16 rows in half precision, its first program
    # writing the residual stream; the add-norm kernel and the GEMM otherwise.
    g = torch.Generator().manual_seed(rows * k_in + n_out + 1)
    x, res = _rand(g, rows, k_in, dtype=dtype) * 3, _rand(g, rows, k_in, dtype=dtype)
    w = _rand(g, n_out, k_in, dtype=dtype) / k_in ** 0.5
    norm_w = (1 + 0.2 * torch.randn(k_in, generator=g)).to(dtype)
    lw = LinearWeight(w.to(device))
    out, summed = cuda_backend.add_rms_norm_linear(x.to(device), res.to(device), norm_w.to(device), 1e-6, lw)
    assert out.shape == (rows, n_out) and out.dtype == dtype and summed.shape == x.shape
    assert torch.equal(summed.cpu(), x + res)
    want, want_sum = cpu_backend.add_rms_norm_linear(x, res, norm_w, 1e-6, LinearWeight(w))
    assert_close(out, want, dtype) and torch.equal(want_sum, x + res)
    h, _ = cuda_backend.add_rms_norm(x.to(device), res.to(device), norm_w.to(device), 1e-6)
    separate = cuda_backend.linear(h, lw)
    if not ON_GPU and k_in <= 512:  # one K tile here: the sums of squares in the norm kernel's order
        assert torch.equal(out.cpu(), separate.cpu())
    assert_close(out, separate.cpu(), dtype)


def test_the_add_and_norm_take_the_skinny_launch_where_they_fit(cuda_backend, device, monkeypatch):
    calls = []
    real = linear.add_norm_linear
    monkeypatch.setattr(linear, "add_norm_linear", lambda *args: calls.append(args[0].shape[0]) or real(*args))
    for rows, dtype, res_dtype in ((2, torch.float16, torch.float16), (17, torch.float16, torch.float16),
                                   (2, torch.float32, torch.float32), (2, torch.float16, torch.float32)):
        w = LinearWeight(torch.randn(48, 32, dtype=dtype, device=device))
        x = torch.randn(rows, 32, dtype=dtype, device=device)
        cuda_backend.add_rms_norm_linear(x, torch.randn(rows, 32, dtype=res_dtype, device=device),
                                         torch.ones(32, dtype=dtype, device=device), 1e-6, w)
    assert calls == [2]  # 17 rows, float32, a residual of another dtype: the add-norm kernel, then the GEMM


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_rows,rows", [(4, [3]), (9, [2, 5, 8]), (40, [0, 13, 39, 7]), (16, list(range(16)))])
@pytest.mark.parametrize("float_out", [False, True])
def test_add_rms_norm_linear_of_gathered_rows(cuda_backend, cpu_backend, device, dtype, x_rows, rows, float_out):
    # An MTP stage's head: the residual stream of every row (what the next stage reads), the
    # lm_head of each sequence's lm_head row (in the model dtype for a draft's argmax, or float32).
    g = torch.Generator().manual_seed(x_rows + len(rows))
    x, res = _rand(g, x_rows, 192, dtype=dtype) * 3, _rand(g, x_rows, 192, dtype=dtype)
    w = _rand(g, 400, 192, dtype=dtype) / 192 ** 0.5
    norm_w = (1 + 0.2 * torch.randn(192, generator=g)).to(dtype)
    idx = torch.tensor(rows)
    lw = LinearWeight(w.to(device))
    out, summed = cuda_backend.add_rms_norm_linear(x.to(device), res.to(device), norm_w.to(device), 1e-6, lw,
                                                   idx.to(device), float_out)
    assert out.shape == (len(rows), 400) and out.dtype == (torch.float32 if float_out else dtype)
    assert torch.equal(summed.cpu(), x + res)
    want, _ = cpu_backend.add_rms_norm_linear(x, res, norm_w, 1e-6, LinearWeight(w), idx, float_out)
    assert_close(out, want, dtype)
    h, _ = cuda_backend.add_rms_norm(x.to(device), res.to(device), norm_w.to(device), 1e-6)
    separate = cuda_backend.linear_rows(h, idx.to(device), lw, float_out)
    if not ON_GPU:  # one K tile here: the sums of squares in the norm kernel's order
        assert torch.equal(out.cpu(), separate.cpu())
    assert_close(out, separate.cpu(), dtype)
