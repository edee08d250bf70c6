"""NpuBackend: the Backend interface on Ascend NPUs through torch_npu ops.

torch_npu is imported when the backend is created, never when this module is imported (choosing
another backend must not load it). Every op maps to the torch_npu op(s) of the table in README.md;
where a model is outside an op's documented limits the composed torch path runs instead and the
reason is logged once (``self.fallbacks``).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch

from mindspec.backend import AttentionMetadata, Backend, LatentCache
from mindspec.backends.cpu.backend import CpuBackend

from ._torch_npu import load_torch_npu
from .device import NpuDevice
from .fallback import FallbackLog
from .fia_args import causal_mask, fia_lengths
from .ops_attention import AttentionOps, GraphCapture
from .ops_moe import MoeOps
from .ops_norm_rope import NormRopeOps
from .sampling import SamplingOps


class NpuBackend(Backend):
    name = "npu"
    dist_backend = "hccl"

    def __init__(self, device: Optional[str] = None):
        self.torch_npu = load_torch_npu()
        self.npu_device = NpuDevice(self.torch_npu, device)
        self.device = self.npu_device.device
        self.fallbacks = FallbackLog()
        parts = (self.torch_npu, CpuBackend(), self.fallbacks)
        self.norm_rope = NormRopeOps(*parts)
        self.attention = AttentionOps(*parts)
        self.moe = MoeOps(*parts)
        self.sampling = SamplingOps(*parts)

    def default_device(self) -> str:
        return "npu:0"

    # ---- device services ----------------------------------------------------------------------
    def synchronize(self) -> None:
        self.npu_device.synchronize()

    def mem_get_info(self) -> tuple[int, int]:
        return self.npu_device.mem_get_info()

    def new_stream(self):
        return self.npu_device.new_stream()

    def new_event(self):
        return self.npu_device.new_event()

    def stream(self, stream):
        return self.npu_device.stream(stream)

    # ---- cache --------------------------------------------------------------------------------
    def allocate_latent_cache(self, num_blocks, block_size, kv_lora_rank, rope_dim, dtype) -> LatentCache:
        """Two separate tensors, as Ascend's cache ops take them (nope cache and rope cache)."""
        return LatentCache(
            c_kv=torch.zeros(num_blocks, block_size, kv_lora_rank, dtype=dtype, device=self.device),
            k_pe=torch.zeros(num_blocks, block_size, rope_dim, dtype=dtype, device=self.device),
        )

    def prepare(self, meta: AttentionMetadata) -> None:
        fia_lengths(meta)  # host argument lists, once per forward
        causal_mask(self.device)  # the fixed 2048 mask, created outside any captured region

    def write_latent_cache(self, cache, c_kv, k_pe, slots) -> None:
        self.norm_rope.write_latent_cache(cache, c_kv, k_pe, slots)

    def latent_norm_rope_cache(self, kv_a, norm_weight, eps, positions, rotary, cache, slots):
        return self.norm_rope.latent_norm_rope_cache(kv_a, norm_weight, eps, positions, rotary, cache, slots)

    # ---- norms, activation, rope --------------------------------------------------------------
    def rms_norm(self, x, weight, eps):
        return self.norm_rope.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        return self.norm_rope.add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x):
        return self.norm_rope.silu_and_mul(x)

    def rope(self, x, positions, rotary):
        return self.norm_rope.rope(x, positions, rotary)

    # ---- attention ----------------------------------------------------------------------------
    def mla_attention(self, q_lat, q_pe, cache, meta, scale):
        return self.attention.mla_attention(q_lat, q_pe, cache, meta, scale)

    def mla_prefill(self, q_nope, q_pe, k_nope, k_pe, v, meta, scale):
        return self.attention.mla_prefill(q_nope, q_pe, k_nope, k_pe, v, meta, scale)

    # ---- MoE ----------------------------------------------------------------------------------
    def moe_gate(self, x, gate_weight, correction_bias, router):
        return self.moe.moe_gate(x, gate_weight, correction_bias, router)

    def moe_experts(self, x, topk_weights, topk_ids, experts, shared=None):
        out = self.moe.moe_experts(x, topk_weights, topk_ids, experts)
        return out if shared is None else out + shared

    # ---- sampling -----------------------------------------------------------------------------
    def top_k_top_p(self, logits, top_k, top_p):
        return self.sampling.top_k_top_p(logits, top_k, top_p)

    # ---- graph capture ------------------------------------------------------------------------
    @contextmanager
    def capturing_attention(self) -> Iterator[GraphCapture]:
        """While open, decode attention calls are issued as graph task groups and remembered."""
        if self.attention.capture is not None:
            raise RuntimeError("an NPU graph capture is already in progress on this backend")
        capture = GraphCapture()
        self.attention.capture = capture
        try:
            yield capture
        finally:
            self.attention.capture = None

    def update_captured_attention(self, capture: GraphCapture, metas: dict[int, AttentionMetadata], stream) -> None:
        """Before a replay: re-issue captured attention with the new metadata's host lists."""
        self.attention.update_captured(capture, metas, stream)
