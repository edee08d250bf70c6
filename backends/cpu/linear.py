"""GEMMs against weights on the cpu backend, with oneDNN's prepacked weight layout.

F.linear on x86 calls MKL's sgemm, which repacks the weight on every call; for the thin
activations of decoding (a few to a few hundred rows) that repacking is most of the call. oneDNN
keeps the weight in its blocked layout, packed once at load (what Inductor's CPU weight freezing
does). On this project's 2-core AVX-512 machine, float32, F.linear against packed (us, median of
3 x 600 calls; scratch lin_sweep.py):

    in -> out        rows:  1        4         16        64         256
    192 -> 1152             13 / 18  40 / 18   66 / 28   176 / 74   593 / 240
    192 -> 4096 (lm_head)   50 / 34  131 / 35  192 / 72  687 / 217  2096 / 798
    192 -> 192              3 / 15   9 / 13    16 / 19   36 / 25    109 / 50

A packed call costs ~13 us however small, against 3 us for F.linear's one-row GEMV, so small
products stay on F.linear: a GEMM goes packed from PACKED_MIN_MACS multiply-adds on. Results are
the same floats as F.linear's from 4 rows on; one or two rows differ in the last bits (a GEMV
sums in another order), as F.linear's own GEMV and GEMM paths already differ from each other.
Every weight is packed, small ones too (they go packed in prefills and big batches), so the
weights take twice their memory on the cpu backend (packing stops while a quarter of the
machine's memory is still free: CpuBackend._room_for); MINDSPEC_CPU_PACKED_LINEAR=0 turns it off.

Inside a compiled decode step the weights stream from memory every step. A float32 weight whose
values are all bfloat16 (a bfloat16 checkpoint run in float32) also keeps a bfloat16 copy. On an
AVX-512 cpu it is ``blocked`` for rows_gemm.cpp, and every GEMM of up to rows_gemm.LINEAR_MAX_ROWS
rows runs ``rows_linear`` on it (one pass over the weight for all rows; rows_gemm.py). Elsewhere
it is ``narrow``, and a GEMM of one or two rows reads it in ``thin_linear``: the same float32
products from half the bytes. Its kernel sums each output with one horizontal reduction, which
costs per row, so more rows go to Inductor's GEMM on the float32 weight (per GEMM, weights cycled
from memory, 192 -> 1152: 18 / 32 / 48 us at 1 / 2 / 3 rows against 38 / 72 / 124; a compiled
plain step of the shipped model 1.05 -> 0.73 ms, while thin verifications of four rows made an MTP
K=3 step slower: 3.24 against 2.97 ms; benchmarks/README.md).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.nn.functional as F

from mindspec.backend import LinearWeight
from mindspec.modeling import quantized

from . import rows_gemm

PACKED_MIN_MACS = 384 * 1024  # rows * in * out from which the packed GEMM is faster (table above)
PACKED_DTYPES = (torch.float32, torch.bfloat16)
ENV_SWITCH = "MINDSPEC_CPU_PACKED_LINEAR"  # "0": plain F.linear everywhere (A/B benchmarks)
THIN_MAX_ROWS = 2  # compiled GEMMs of up to this many rows against a ``narrow`` weight: thin_linear


def packing_enabled() -> bool:
    ops = torch.ops.mkldnn
    return (
        os.environ.get(ENV_SWITCH, "1") != "0"
        and torch.backends.mkldnn.is_available()
        and hasattr(ops, "_reorder_linear_weight")
        and hasattr(ops, "_linear_pointwise")
    )


def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs weights of ``dtype`` on this cpu (bfloat16 needs AVX-512 BF16 or
    AVX-NE-CONVERT: on an AVX2-only cpu bfloat16 weights stay on F.linear)."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype in PACKED_DTYPES


def pack(weight: torch.Tensor, enabled: bool) -> Optional[torch.Tensor]:
    """weight [out, in] -> oneDNN's blocked copy, or None where it would not be used."""
    if not enabled or weight.dim() != 2 or weight.device.type != "cpu" or not packs(weight.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


def narrow(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """A float32 weight's bfloat16 copy when every value is a bfloat16 (a bfloat16 checkpoint run
    in float32), else None: a compiled thin GEMM reads it instead (``thin_linear``)."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
        return None
    half = weight.to(torch.bfloat16)
    return half if torch.equal(half.to(torch.float32), weight) else None


def thin_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ weight.T inside a compiled step, for a few rows: one fused reduction that
    widens each weight to x's dtype as it reads it. A decode step streams its weights from memory,
    so a bfloat16 copy of float32 values halves its bytes and computes the same products; each
    output sums over ``in`` in one order whatever the row count, so a row's result does not
    depend on its batch."""
    rows = materialized(x.reshape(-1, 1, x.shape[-1]))  # [R, 1, in]
    out = (rows * weight.to(x.dtype)).sum(dim=-1)  # [R, out]
    return out.view(*x.shape[:-1], weight.shape[0])


def materialized(x: torch.Tensor) -> torch.Tensor:
    """x itself, as a buffer of its own inside a compiled step. Inductor inlines a pointwise
    producer (an rms norm, a residual add) into the reduction that reads it, so a thin GEMM would
    recompute its input once per output; a view of x's storage makes Inductor store x first
    (``as_strided`` needs a buffer). The same floats either way."""
    return x.as_strided(x.shape, x.stride())


def linear(x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
    """x [..., in] -> [..., out]: packed where it is faster, F.linear otherwise; a quantized
    weight is dequantized for this call only."""
    if not isinstance(w.weight, torch.Tensor):  # quantized (mindspec/modeling/quantized.py)
        return quantized_linear(x, w.weight)
    if torch.compiler.is_compiling():  # first: a traced graph must not touch the oneDNN tensor
        rows = x.numel() // w.weight.shape[1]
        if w.blocked is not None and rows <= rows_gemm.LINEAR_MAX_ROWS and rows_gemm.available():
            return rows_gemm.rows_linear(x, w.blocked, w.weight.shape[0])
        if w.narrow is not None and rows <= THIN_MAX_ROWS:
            return thin_linear(x, w.narrow)
        return F.linear(x, w.weight)
    if w.packed is None or x.dtype != w.packed.dtype:
        return F.linear(x, w.weight)
    rows = x.numel() // w.weight.shape[1]
    if rows * w.weight.numel() < PACKED_MIN_MACS:
        return F.linear(x, w.weight)
    return torch.ops.mkldnn._linear_pointwise(x, w.packed, None, "none", [], "")


# Elements of a quantized weight dequantized at once: 4 MB of float32 stays in cache and below
# glibc's mmap threshold, where a whole big weight's copy would be mapped and unmapped per call
# (a [10944, 2048] Q8_0 weight, batch 1, 2 threads: 41 ms whole against 5.7 ms in chunks).
DEQUANT_CHUNK = 1 << 20


def quantized_linear(x: torch.Tensor, w) -> torch.Tensor:
    """x [..., K] @ w.T for a quantized w [N, K], dequantized into x's dtype a few hundred rows at
    a time (a multiple of 128, FP8's block height)."""
    n, k = w.shape
    step = max(128, DEQUANT_CHUNK // k // 128 * 128)
    if n <= step:
        return F.linear(x, w.dequantize(x.dtype))
    return torch.cat([F.linear(x, quantized.rows(w, r, r + step).dequantize(x.dtype)) for r in range(0, n, step)], dim=-1)
