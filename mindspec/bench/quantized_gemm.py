"""``mindspec bench --scenario quantized-gemm``: one GEMM against a weight kept quantized, each
way the cpu backend could run it, side by side (JSON + PNG).

    mindspec bench --scenario quantized-gemm --out benchmarks/results/quantized_gemm_cpu

Per weight shape (the shipped model's and DeepSeek-V2-Lite's) and activation rows (1: a decode
step, 16: a batch): float32 and bfloat16 F.linear (the unquantized references), the backend's
dequantizing GEMM (backends/cpu/linear.py: row chunks dequantized into float32, then F.linear)
for GGUF Q8_0 / Q4_0 / Q4_K / Q6_K and block FP8, and torch's packed low-bit kernels:
``_weight_int8pack_mm`` (int8 with one scale per output row: what Q8_0 would have to be
re-quantized to, since its scales are per 32 weights) and ``_weight_int4pack_mm_for_cpu`` (int4
in groups of 32 with a scale and zero each: Q4_0 / Q4_K sub-blocks map onto it). The packed
kernels run on random codes of the right layout (their speed does not depend on the values).
Rounds interleave every method; times are medians, in microseconds.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from mindspec.backends.cpu.linear import quantized_linear
from mindspec.modeling import gguf_quants
from mindspec.modeling.fp8 import BlockFp8Format, Fp8Weight, quantize

SHAPES = {  # name: (N, K) of y = x @ W.T
    "shipped q_b 192x96": (192, 96),
    "shipped gate_up 192->1024": (1024, 192),
    "shipped lm_head 192->4096": (4096, 192),
    "v2-lite expert gate_up 2048->2816": (2816, 2048),
    "v2-lite dense gate_up 2048->21888": (21888, 2048),
}
ROWS = (1, 16)


def _methods(w: torch.Tensor, x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    n, k = w.shape
    out = {"float32": lambda: F.linear(x, w)}
    wb, xb = w.bfloat16(), x.bfloat16()
    out["bfloat16"] = lambda: F.linear(xb, wb)
    for qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q6_K):
        if k % GGML_QUANT_SIZES[qtype][0] == 0:
            g = gguf_quants.from_raw(gguf_quants.quantize(w, qtype), qtype, (n, k), torch.float32)
            out[f"{qtype.name} dequantizing"] = lambda g=g: quantized_linear(x, g)
    fmt = BlockFp8Format((128, 128))
    f8 = Fp8Weight(*quantize(w, fmt), fmt, torch.float32)
    out["FP8 dequantizing"] = lambda: quantized_linear(x, f8)
    codes8, scales8 = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n)
    out["int8pack_mm (per-row scale)"] = lambda: torch.ops.aten._weight_int8pack_mm(x, codes8, scales8)
    if k % 32 == 0:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
        zeros = torch.rand(k // 32, n, 2)
        out["int4pack_mm (groups of 32)"] = lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, zeros)
    return out


def _time(fn: Callable[[], torch.Tensor], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def run(rounds: int = 5, calls: int = 20, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    results = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=gen) * 0.05
        for rows in ROWS:
            methods = _methods(w, torch.randn(rows, k, generator=gen))
            for fn in methods.values():
                fn()  # warm up (allocator, kernel selection)
            times: dict[str, list[float]] = {m: [] for m in methods}
            big = n * k > 4_000_000
            for _ in range(rounds):
                for m, fn in methods.items():
                    times[m].append(_time(fn, max(2, calls // 8) if big else calls))
            results[f"{name}, rows {rows}"] = {m: statistics.median(t) for m, t in times.items()}
    return {"scenario": "quantized-gemm", "rounds": rounds, "threads": torch.get_num_threads(),
            "unit": "microseconds per GEMM (median)", "results": results}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(report["results"])
    methods = sorted({m for r in report["results"].values() for m in r}, key=lambda m: (m != "float32", m))
    fig, ax = plt.subplots(figsize=(14, 5.5))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        ratio = [report["results"][c].get(m, float("nan")) / report["results"][c]["float32"] for c in cases]
        ax.bar([j + i * width for j in range(len(cases))], ratio, width, label=m)
    ax.set_yscale("log")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], cases, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("time / float32 F.linear (log)")
    ax.legend(fontsize=7, ncol=3)
    ax.set_title(f"one GEMM against a quantized weight, cpu, {report['threads']} thread(s), "
                 f"medians of {report['rounds']} interleaved rounds", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
