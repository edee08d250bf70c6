"""The block-FP8 GEMM (w8a8, backends/cuda/fp8_linear.py) against its definition in torch: the
activations quantized per token and K block, multiplied with the dequantized weight in float64;
and against the full-precision product within the bound e4m3 rounding of the activations allows.
Then an FP8 checkpoint through the whole model on the cuda backend against the cpu backend."""
import numpy as np
import pytest
import torch

from mindspec.modeling.fp8 import E4M3_MAX, BlockFp8Format, Fp8Weight, quantize

CASES = [  # (N, K, block rows, block cols, rows of x)
    (96, 64, 16, 16, 3),
    (200, 256, 128, 128, 1),  # partial row blocks
    (130, 300, 128, 128, 17),  # partial row and column blocks, more rows than one tile
    (100, 96, 1, 32, 5),  # a scale per row (gate and up concatenated off block boundaries)
]


def _weight(n, k, block, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    fmt = BlockFp8Format(block)
    q, scale = quantize(torch.randn(n, k, generator=gen) * 0.1, fmt)
    return Fp8Weight(q.to(device), scale.to(device), fmt, torch.float32)


def _definition(x, w, group):
    from mindspec.backends.cuda.fp8_linear import quantize_activations

    x_q, x_s = quantize_activations(x, group)
    k = x.shape[-1]
    cols = torch.arange(k, device=x.device) // group
    x_dq = x_q.double() * x_s.double()[:, cols]
    return x_dq @ w.dequantize(torch.float64).T


@pytest.mark.parametrize("n,k,bn,bk,rows", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_equals_its_definition(device, n, k, bn, bk, rows, dtype):
    from mindspec.backends.cuda.fp8_linear import fp8_block_linear

    w = _weight(n, k, (bn, bk), device)
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(1))).to(device, dtype)
    out = fp8_block_linear(x, w)
    assert out.dtype == dtype and out.shape == (rows, n)
    expected = _definition(x.float(), w, bk)
    tol = 1e-5 if dtype == torch.float32 else 2e-3  # float32 accumulation; float16 output rounding
    torch.testing.assert_close(out.double().cpu(), expected.cpu(), atol=tol * expected.abs().max().item(), rtol=0)


@pytest.mark.parametrize("n,k,bn,bk,rows", CASES)
def test_kernel_is_within_e4m3_rounding_of_the_full_precision_product(device, n, k, bn, bk, rows):
    """Each activation is rounded to 3 mantissa bits (relative error <= 2^-4 for normals; the
    group scale puts the largest at 448, so the rest are normal down to 2^-15 of it)."""
    from mindspec.backends.cuda.fp8_linear import fp8_block_linear

    w = _weight(n, k, (bn, bk), device, seed=2)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3)).to(device)
    wd = w.dequantize(torch.float64)
    exact = x.double() @ wd.T
    bound = 2.0**-4 * (x.double().abs() @ wd.abs().T) + 1e-6
    assert ((fp8_block_linear(x, w).double() - exact).abs() <= bound).all()


def test_activation_groups_map_their_largest_value_to_e4m3s_largest(device):
    from mindspec.backends.cuda.fp8_linear import quantize_activations

    x = torch.randn(4, 100, generator=torch.Generator().manual_seed(4)).to(device)
    x[2, 32:64] = 0.0  # an all-zero group quantizes to zeros
    q, s = quantize_activations(x, 32)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (4, 100) and s.shape == (4, 4)
    groups = torch.nn.functional.pad(x.abs(), (0, 28)).view(4, 4, 32).amax(-1)
    nonzero = groups > 0
    torch.testing.assert_close(s[nonzero] * E4M3_MAX, groups[nonzero])
    assert (q[2, 32:64].float() == 0).all()


def test_a_k_block_too_narrow_for_tl_dot_falls_back_to_dequantizing(device):
    from mindspec.backends.cuda.fp8_linear import fits, fp8_block_linear

    w = _weight(40, 64, (8, 8), device)
    assert not fits(w)
    x = torch.randn(3, 64).to(device)
    torch.testing.assert_close(fp8_block_linear(x, w), x @ w.dequantize(torch.float32).T)


def test_e4m3_tiles_reach_tl_dot_only_on_fp8_tensor_cores_and_k_blocks_one_mma_deep():
    """Hopper's and Ada's 8-bit MMAs are 32 deep (the kernel's cases with 16-wide K blocks failed
    natively on an H200, the 32- and 128-wide ones passed): narrower e4m3 tiles are upcast."""
    from mindspec.backends.cuda.fp8_linear import BF16_DOT, E4M3_DOT, F32_DOT, dot_mode

    assert dot_mode((9, 0), 128) == E4M3_DOT
    assert dot_mode((8, 9), 32) == E4M3_DOT
    assert dot_mode((9, 0), 16) == BF16_DOT
    assert dot_mode((8, 0), 128) == BF16_DOT
    assert dot_mode(None, 128) == F32_DOT


def test_gpus_before_ada_dequantize_fp8_projections_at_load(monkeypatch, cuda_backend):
    """Triton loads e4m3 from compute capability 8.9 on (compiled for sm_80 the kernel fails:
    "type fp8e4nv not supported", tests/backends/cuda/test_cuda_native_compile.py): on an A100 an
    FP8 checkpoint's projections load in the model's dtype instead."""
    from mindspec.backends.cuda import fp8_linear

    for capability, kept in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(fp8_linear, "_capability", lambda device, c=capability: c)
        assert cuda_backend.keeps_quantized("fp8") is kept
        assert not cuda_backend.keeps_quantized("gguf")


@pytest.mark.slow
def test_fp8_checkpoint_on_cuda_keeps_its_projections_fp8_and_follows_cpu(tmp_path, device):
    """The same FP8 checkpoint: cpu runs dequantized weights on full-precision activations, cuda
    its w8a8 kernel, so logits differ by the activations' e4m3 rounding, not more."""
    from mindspec.backend import get_backend
    from mindspec.models.deepseekv2.flash_causal_deepseekv2 import FlashCausalDeepseekV2
    from tests.models.deepseekv2.harness import PagedRunner
    from tests.support.checkpoints import make_block_fp8_checkpoint, make_checkpoint, tiny_v3_config

    cfg = tiny_v3_config()
    fp8, _ = make_block_fp8_checkpoint(make_checkpoint(tmp_path / "src", cfg, seed=5), tmp_path / "fp8", block=(16, 16))
    prompt = np.random.default_rng(0).integers(2, cfg.vocab_size, 12).tolist()
    logits = []
    for backend in (get_backend("cpu"), get_backend("cuda", device)):
        model = FlashCausalDeepseekV2.load(fp8, backend, torch.float32, progress=False, num_mtp_modules=0)
        runner = PagedRunner(model, num_blocks=16, block_size=4, max_tokens_per_seq=len(prompt), num_seqs=1)
        logits.append(runner.step([prompt], all_rows=True).logits.cpu())
    assert isinstance(model.layers[1].self_attn.o_proj.weight, Fp8Weight)  # cuda kept the projection FP8
    cpu, cuda = logits
    assert ((cuda - cpu).norm() / cpu.norm()) < 0.05
    assert (cuda.argmax(-1) == cpu.argmax(-1)).float().mean() >= 0.9
