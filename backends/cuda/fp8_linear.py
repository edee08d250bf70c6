"""Block-FP8 GEMM (w8a8): y = x @ W.T with W as DeepSeek publishes it, e4m3 values and a float32
scale per block of rows x columns, and x quantized on the fly to e4m3 with one scale per token
and group of columns (the K block), as DeepSeek's inference code and vLLM's block-FP8 kernels do.

Per K block the kernel multiplies the e4m3 tiles and scales the partial products by the
activation scale of each row and the weight scale of each column's row block:
    y[m, n] = sum_kb (x_q[m, kb] . w[n, kb]) * x_s[m, kb] * w_s[n // bn, kb]
The e4m3 tiles go into tl.dot as they are on GPUs with FP8 tensor cores (compute capability 8.9
and up) when the K block is at least one FP8 MMA deep (32); elsewhere they are upcast first, to
bfloat16 on a GPU (e4m3 values are exact there) and to float32 under Triton's interpreter (whose
bfloat16 is not to be trusted). Weights whose K block is too narrow for tl.dot (< 16) or not a
power of two are dequantized for the call instead.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mindspec.backends.cuda.availability import interpreting
from mindspec.backends.cuda.launch import MIN_DOT, pow2
from mindspec.modeling.fp8 import E4M3_MAX, Fp8Weight

SCALE_FLOOR = 1e-10  # an all-zero activation group gets this scale (its values quantize to 0)
FP8_MMA_K = 32  # the K depth of one 8-bit tensor-core MMA (sm89 mma.sync, sm90 wgmma): tl.dot's least
E4M3_DOT, BF16_DOT, F32_DOT = 0, 1, 2  # how the kernel multiplies its tiles (UPCAST)
E4M3_MIN_CAPABILITY = (8, 9)  # Triton loads e4m3 (its fp8e4nv) from Ada and Hopper on; not on an A100


@triton.jit
def _fp8_block_linear_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, num_rows, n_out, k_in,
    stride_xm, stride_xsm, stride_wn, stride_wsn, stride_om,
    SCALE_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # E4M3_DOT, BF16_DOT or F32_DOT
):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < num_rows, n < n_out
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(k_in, BLOCK_K)):
        k = kb * BLOCK_K + kk
        k_ok = k < k_in
        a = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + n[None, :].to(tl.int64) * stride_wn + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        a_s = tl.load(xs_ptr + m * stride_xsm + kb, mask=m_ok, other=0.0)  # [BLOCK_M]
        b_s = tl.load(ws_ptr + (n // SCALE_ROWS) * stride_wsn + kb, mask=n_ok, other=0.0)  # [BLOCK_N]
        if UPCAST == 2:
            part = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        elif UPCAST == 1:
            part = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
        else:
            part = tl.dot(a, b)
        acc += part * a_s[:, None] * b_s[None, :]
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, ceil(K / group)]): each token's group of
    columns scaled so that its largest magnitude maps to e4m3's largest."""
    rows, k = x.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(rows, groups, group)
    scales = padded.abs().amax(dim=-1).div(E4M3_MAX).clamp(min=SCALE_FLOOR)  # [M, groups]
    q = (padded / scales[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(rows, groups * group)[:, :k], scales


def fits(w: Fp8Weight) -> bool:
    bk = w.format.block[1]
    return w.weight.dim() == 2 and bk >= MIN_DOT and bk == pow2(bk) and w.weight.stride(-1) == 1


def dot_mode(capability: tuple[int, int] | None, block_k: int) -> int:
    """How tiles of a K block ``block_k`` wide are multiplied on a GPU of ``capability``
    (None: Triton's interpreter)."""
    if capability is None:
        return F32_DOT
    return E4M3_DOT if capability >= E4M3_MIN_CAPABILITY and block_k >= FP8_MMA_K else BF16_DOT


def supported(device: torch.device) -> bool:
    """Whether the kernel compiles for ``device`` (always under the interpreter)."""
    capability = _capability(device)
    return capability is None or capability >= E4M3_MIN_CAPABILITY


def _capability(device: torch.device) -> tuple[int, int] | None:
    if interpreting() or device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def fp8_block_linear(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x's dtype, W a block-FP8 weight [N, K]."""
    if not fits(w):
        return torch.nn.functional.linear(x, w.dequantize(x.dtype))
    lead, (n_out, k_in) = x.shape[:-1], w.shape
    bn, bk = w.format.block
    x_q, x_s = quantize_activations(x.reshape(-1, k_in), bk)
    rows = x_q.shape[0]
    out = torch.empty((rows, n_out), dtype=x.dtype, device=x.device)
    block_m = min(pow2(rows, MIN_DOT), 64)
    block_n = min(pow2(n_out, MIN_DOT), 256) if interpreting() else 64
    grid = (triton.cdiv(rows, block_m), triton.cdiv(n_out, block_n))
    _fp8_block_linear_kernel[grid](
        x_q, x_s, w.weight, w.scale_inv, out, rows, n_out, k_in,
        x_q.stride(0), x_s.stride(0), w.weight.stride(0), w.scale_inv.stride(0), out.stride(0),
        SCALE_ROWS=bn, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, UPCAST=dot_mode(_capability(x.device), bk), num_warps=4,
    )
    return out.view(*lead, n_out)
