"""Kernel benchmarks for ``mindspec bench --backend cuda``: achieved memory bandwidth of the paged
MLA attention and the fused MoE kernels, as a fraction of the device's peak (GPU only).

Bytes moved are the bytes a kernel must touch at least once (the byte counters below are plain
arithmetic, tested on CPU); time is triton.testing.do_bench's median with the L2 cache flushed
between repetitions. The peak is the spec sheet's HBM bandwidth for known devices and, always, a
measured device-to-device copy, so the fraction can be read against either.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch

# HBM bandwidth from the vendors' spec sheets, bytes/s, matched on torch's device name.
SPEC_PEAK_BYTES_PER_S = {
    "H200": 4.8e12,
    "H100 NVL": 3.9e12,
    "H100 PCIe": 2.0e12,
    "H100": 3.35e12,  # SXM5 (HBM3)
    "GH200": 4.0e12,
    "A100-SXM4-80GB": 2.039e12,
    "A100 80GB PCIe": 1.935e12,
    "A100-SXM4-40GB": 1.555e12,
    "A100-PCIE-40GB": 1.555e12,
    "L40S": 0.864e12,
    "L4": 0.3e12,
    "A10": 0.6e12,
    "RTX 4090": 1.008e12,
}


def spec_peak(device_name: str) -> Optional[float]:
    """Longest matching key wins ("H100 PCIe" before "H100")."""
    hits = [k for k in SPEC_PEAK_BYTES_PER_S if k in device_name]
    return SPEC_PEAK_BYTES_PER_S[max(hits, key=len)] if hits else None


def attention_bytes(batch: int, q_len: int, context: int, heads: int, rank: int, rope: int, itemsize: int) -> int:
    """Latent cache rows read once per sequence (context + new tokens), q_lat and q_pe read, o_lat written."""
    tokens = batch * q_len
    cache = batch * (context + q_len) * (rank + rope) * itemsize
    return cache + tokens * heads * (2 * rank + rope) * itemsize


def moe_bytes(tokens: int, top_k: int, experts_hit: int, hidden: int, inter: int, itemsize: int) -> int:
    """Weights of every expert hit (gate, up, down) read once; x read; the SwiGLU activations and
    the per-pair outputs written and read back; the output written."""
    weights = experts_hit * 3 * hidden * inter * itemsize
    pairs = tokens * top_k
    return weights + 2 * tokens * hidden * itemsize + pairs * 2 * (inter + hidden) * itemsize


@dataclass
class KernelResult:
    kernel: str
    shape: dict
    ms: float
    bytes: int
    gb_per_s: float
    fraction_of_spec_peak: Optional[float]
    fraction_of_copy_peak: float


def _bench_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def copy_bandwidth(device: torch.device, mib: int = 1024) -> float:
    """Achievable bandwidth: a large device-to-device copy (read + write), bytes/s."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = _bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3)


def _result(kernel, shape, ms, nbytes, spec, copy) -> KernelResult:
    rate = nbytes / (ms * 1e-3)
    return KernelResult(kernel, shape, ms, nbytes, rate / 1e9, None if spec is None else rate / spec, rate / copy)


def bench_attention(backend, batch, q_len, context, heads, rank, rope, block_size, dtype, spec, copy) -> KernelResult:
    from mindspec.backend import AttentionMetadata

    dev = backend.device
    per_seq = -(-(context + q_len) // block_size)
    cache = backend.allocate_latent_cache(batch * per_seq + 1, block_size, rank, rope, dtype)
    cache.c_kv.normal_()
    cache.k_pe.normal_()
    tables = torch.randperm(batch * per_seq, device=dev).view(batch, per_seq).to(torch.int32)
    seq_lens = [context + q_len] * batch
    q_lens = [q_len] * batch
    meta = AttentionMetadata(
        slots=torch.full((batch * q_len,), -1, dtype=torch.int64, device=dev), block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        q_lens=torch.tensor(q_lens, dtype=torch.int32, device=dev),
        q_start_loc=torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=dev),
        seq_lens_host=seq_lens, q_lens_host=q_lens, is_prefill=False,
    )
    q_lat = torch.randn(batch * q_len, heads, rank, dtype=dtype, device=dev)
    q_pe = torch.randn(batch * q_len, heads, rope, dtype=dtype, device=dev)
    scale = 0.135
    # The tile plan is built once per forward and shared by all layers: build it before timing.
    backend.mla_attention(q_lat, q_pe, cache, meta, scale)
    ms = _bench_ms(lambda: backend.mla_attention(q_lat, q_pe, cache, meta, scale))
    shape = dict(batch=batch, q_len=q_len, context=context, heads=heads, kv_lora_rank=rank, rope_dim=rope, block_size=block_size)
    nbytes = attention_bytes(batch, q_len, context, heads, rank, rope, q_lat.element_size())
    return _result("mla_attention", shape, ms, nbytes, spec, copy)


def bench_moe(backend, tokens, num_experts, top_k, hidden, inter, dtype, spec, copy) -> KernelResult:
    from mindspec.backend import ExpertWeights

    dev = backend.device
    experts = ExpertWeights(
        w13=torch.randn(num_experts, 2 * inter, hidden, dtype=dtype, device=dev) * 0.02,
        w2=torch.randn(num_experts, hidden, inter, dtype=dtype, device=dev) * 0.02,
    )
    x = torch.randn(tokens, hidden, dtype=dtype, device=dev)
    ids = torch.rand(tokens, num_experts, device=dev).topk(top_k, dim=1).indices  # uniform routing
    weights = torch.rand(tokens, top_k, device=dev)
    ms = _bench_ms(lambda: backend.moe_experts(x, weights, ids, experts))
    hit = int(ids.unique().numel())
    shape = dict(tokens=tokens, experts=num_experts, experts_hit=hit, top_k=top_k, hidden=hidden, moe_intermediate=inter)
    nbytes = moe_bytes(tokens, top_k, hit, hidden, inter, x.element_size())
    del experts
    return _result("moe_experts", shape, ms, nbytes, spec, copy)


def run_kernel_benchmarks(backend, dtype: torch.dtype, quick: bool, heads: int, moe_experts: int) -> dict:
    """DeepSeek-V3 shapes: latent 512 + rope 64, block 64; MoE hidden 7168, intermediate 2048, top-8."""
    dev = backend.device
    name = torch.cuda.get_device_name(dev)
    spec = spec_peak(name)
    copy = copy_bandwidth(dev)
    attention = []
    batches, contexts = ((1, 32), (1024, 8192)) if quick else ((1, 8, 32, 128), (1024, 4096, 16384))
    for batch in batches:
        for context in contexts:
            for q_len in (1, 4):  # plain decode; MTP verification with K = 3
                attention.append(bench_attention(backend, batch, q_len, context, heads, 512, 64, 64, dtype, spec, copy))
    moe = []
    for tokens in ((1, 64) if quick else (1, 4, 16, 64, 256)):
        moe.append(bench_moe(backend, tokens, moe_experts, 8, 7168, 2048, dtype, spec, copy))
    return {
        "spec_peak_bytes_per_s": spec,
        "copy_peak_bytes_per_s": copy,
        "attention": [asdict(r) for r in attention],
        "moe": [asdict(r) for r in moe],
    }


# (K, N) of the decode projections: the shipped model's (fused q_a/kv_a, q_b, o_proj, router,
# lm_head, shared-expert down, eh_proj) and DeepSeek-V2-Lite's (kv_a, shared gate_up, q, o_proj, down).
LINEAR_SHAPES = ((192, 176), (96, 192), (128, 192), (192, 6), (192, 4096), (512, 192), (384, 192),
                 (2048, 576), (512, 3072), (2048, 2048), (2048, 2816), (1408, 2048))


def graph_us(fn, device: torch.device, calls: int = 50, replays: int = 5) -> float:
    """Microseconds per call of ``fn`` replayed in one CUDA graph of ``calls`` calls (median of
    ``replays``): the cost inside a captured decode step, launch overhead excluded."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()  # compiles and warms up outside the capture
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return float(sorted(times)[len(times) // 2])


def run_linear_benchmarks(device: torch.device, dtypes: tuple[torch.dtype, ...], rows=(1, 4, 8),
                          shapes=LINEAR_SHAPES, timer=graph_us) -> list[dict]:
    """Each decode projection through cuBLAS (F.linear) and through the skinny kernel, and which
    one the backend routes it to (``linear.fits``)."""
    import torch.nn.functional as F

    from mindspec.backends.cuda import linear

    results = []
    for dtype in dtypes:
        for k, n in shapes:
            w = torch.randn(n, k, dtype=dtype, device=device)
            for m in rows:
                x = torch.randn(m, k, dtype=dtype, device=device)
                results.append(dict(
                    dtype=str(dtype).removeprefix("torch."), rows=m, k=k, n=n,
                    cublas_us=timer(lambda: F.linear(x, w), device),
                    skinny_us=timer(lambda: linear.skinny_linear(x, w), device),
                    routed_to="skinny" if linear.fits(x, w) else "cublas",
                ))
    return results
