"""CudaBackend: the Backend interface on Triton kernels (one file per kernel family).

Projections of a decode or verification step (at most 16 rows, a small weight) run in one
Triton launch each (linear.py); larger GEMMs and the per-head absorb matmuls stay in torch,
where cuBLAS is at the roofline. Everything else runs in the Triton kernels of this package.

The kernels are imported only after ``choose_device`` has checked that triton and a CUDA device
(or Triton's interpreter, for tests on CPU tensors) are there.
"""
from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Callable, Optional

import torch

from mindspec.backend import (
    AttentionMetadata,
    Backend,
    ExpertWeights,
    LatentCache,
    LinearWeight,
    RotaryEmbedding,
    RouterConfig,
)
from mindspec.backends.cuda.availability import choose_device, current_environment
from mindspec.modeling import quantized
from mindspec.modeling.fp8 import Fp8Weight


class CudaBackend(Backend):
    name = "cuda"
    dist_backend = "nccl"

    def __init__(self, device: Optional[str] = None, num_kv_splits: Optional[int] = None):
        chosen = choose_device(device, current_environment())
        if chosen.type == "cuda" and chosen.index is None:
            chosen = torch.device("cuda", torch.cuda.current_device())  # kernels launch on one device
        self._device = chosen
        super().__init__(str(chosen))
        if chosen.type == "cuda":
            torch.cuda.set_device(chosen)
        # Imported here, not at module top: choosing another backend never imports triton.
        from mindspec.backends.cuda import (
            acceptance, activation, draft_shift, eh_proj, fp8_linear, fused_moe, latent_cache, linear, mla_attention,
            moe_gate, norm, rope,
        )

        self._k = SimpleNamespace(
            acceptance=acceptance, activation=activation, draft_shift=draft_shift, eh_proj=eh_proj,
            fp8_linear=fp8_linear, fused_moe=fused_moe, latent_cache=latent_cache, linear=linear,
            mla_attention=mla_attention, moe_gate=moe_gate, norm=norm, rope=rope,
        )
        self.num_kv_splits = num_kv_splits  # None: chosen per launch from the device (tests force > 1)

    def default_device(self) -> str:
        return str(self._device)

    # ---- device services -----------------------------------------------------------------
    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def mem_get_info(self) -> tuple[int, int]:
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)
        page = os.sysconf("SC_PAGE_SIZE")  # the interpreter runs on host memory
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

    @property
    def supports_graph_capture(self) -> bool:
        return self.device.type == "cuda"

    def capture_graph(self, fn: Callable[[], object]):
        from mindspec.backends.cuda.graphs import capture_cuda_graph

        return capture_cuda_graph(fn, self.device)

    # ---- cache ---------------------------------------------------------------------------
    def write_latent_cache(self, cache: LatentCache, c_kv: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor) -> None:
        self._k.latent_cache.write_latent_cache(cache, c_kv, k_pe, slots)

    def latent_norm_rope_cache(
        self, kv_a: torch.Tensor, norm_weight: torch.Tensor, eps: float, positions: torch.Tensor,
        rotary: RotaryEmbedding, cache: LatentCache, slots: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._k.latent_cache.latent_norm_rope_cache(kv_a, norm_weight, eps, positions, rotary, cache, slots)

    # ---- dense projections -------------------------------------------------------------------
    def keeps_quantized(self, checkpoint_format: str) -> bool:
        """Block FP8 GEMM weights stay FP8 (fp8_linear.py) where Triton can load e4m3 (compute
        capability 8.9 and up), and are dequantized at load on older GPUs; the routed experts are
        dequantized at load (``expert_weights``: no FP8 fused-MoE kernel yet), GGUF files entirely."""
        return checkpoint_format == "fp8" and self._k.fp8_linear.supported(self.device)

    def linear(self, x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
        if isinstance(w.weight, Fp8Weight):
            return self._k.fp8_linear.fp8_block_linear(x, w.weight)
        return self._k.linear.project(x, w.weight)

    def linear_rows(self, x: torch.Tensor, rows: torch.Tensor, w: LinearWeight, float_out: bool = False):
        # the skinny kernel gathers the rows and writes float32 itself; otherwise an index first
        if not isinstance(w.weight, Fp8Weight) and self._k.linear.fits_gathered(x, rows, w.weight):
            return self._k.linear.skinny_linear(x, w.weight, rows=rows, out_dtype=torch.float32 if float_out else None)
        return super().linear_rows(x, rows, w, float_out)

    def rms_norm_linear(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, w: LinearWeight):
        if not isinstance(w.weight, Fp8Weight) and self._k.linear.fits_normed(x, norm_weight, w.weight):
            return self._k.linear.skinny_linear(x, w.weight, norm=(norm_weight, eps))
        return super().rms_norm_linear(x, norm_weight, eps, w)

    def add_rms_norm_linear(self, x, residual, norm_weight, eps: float, w: LinearWeight, rows=None,
                            float_out: bool = False):
        if not isinstance(w.weight, Fp8Weight) and self._k.linear.fits_add_normed(x, residual, norm_weight, w.weight,
                                                                                   rows):
            return self._k.linear.add_norm_linear(x, residual, norm_weight, eps, w.weight, rows,
                                                  torch.float32 if float_out else None)
        return super().add_rms_norm_linear(x, residual, norm_weight, eps, w, rows, float_out)

    def linear_silu_and_mul(self, x: torch.Tensor, gate_up: LinearWeight) -> torch.Tensor:
        if not isinstance(gate_up.weight, Fp8Weight) and self._k.linear.fits_swiglu(x, gate_up.weight):
            return self._k.linear.skinny_linear(x, gate_up.weight, swiglu=True)
        return super().linear_silu_and_mul(x, gate_up)

    def expert_weights(self, w13, w2) -> ExpertWeights:
        return super().expert_weights(quantized.dense(w13), quantized.dense(w2))

    # ---- norms and activations -----------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._k.norm.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        return self._k.norm.add_rms_norm(x, residual, weight, eps)

    def add_rms_norm_rows(self, x, residual, rows, weight, eps: float):
        return self._k.norm.add_rms_norm(x, residual, weight, eps, residual_rows=rows)

    def mtp_eh_input(self, input_ids, embed, enorm, hidden, hnorm, eps: float) -> torch.Tensor:
        if isinstance(embed, torch.Tensor):
            out = self._k.norm.embed_norm_concat(input_ids, embed, enorm, hidden, hnorm, eps)
            if out is not None:
                return out
        return super().mtp_eh_input(input_ids, embed, enorm, hidden, hnorm, eps)

    def mtp_eh_proj(self, input_ids, embed, enorm, hidden, hnorm, eps: float, eh_proj: LinearWeight) -> torch.Tensor:
        w = eh_proj.weight
        if not isinstance(w, Fp8Weight) and self._k.eh_proj.fits(input_ids, embed, enorm, hidden, hnorm, w):
            return self._k.eh_proj.eh_proj(input_ids, embed, enorm, hidden, hnorm, eps, w)
        return super().mtp_eh_proj(input_ids, embed, enorm, hidden, hnorm, eps, eh_proj)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self._k.activation.silu_and_mul(x)

    # ---- rope ------------------------------------------------------------------------------
    def rope(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        return self._k.rope.rope(x, positions, rotary)

    # ---- attention ---------------------------------------------------------------------------
    def mla_attention(self, q_lat, q_pe, cache: LatentCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self._k.mla_attention.mla_decode(q_lat, q_pe, cache, meta, scale, num_splits=self.num_kv_splits)

    def rope_mla_attention(self, q_lat, q_pe, positions, rotary: RotaryEmbedding, cache: LatentCache,
                           meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self._k.mla_attention.mla_decode(q_lat, q_pe, cache, meta, scale, num_splits=self.num_kv_splits,
                                                rope_q=(positions, rotary))

    def mla_prefill(self, q_nope, q_pe, k_nope, k_pe, v, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self._k.mla_attention.mla_prefill(q_nope, q_pe, k_nope, k_pe, v, meta, scale)

    # ---- MoE ---------------------------------------------------------------------------------
    def moe_gate(self, x, gate_weight, correction_bias, router: RouterConfig):
        return self._k.moe_gate.moe_gate(x, gate_weight, correction_bias, router)

    def moe_experts(self, x, topk_weights, topk_ids, experts: ExpertWeights, shared=None) -> torch.Tensor:
        return self._k.fused_moe.moe_experts(x, topk_weights, topk_ids, experts, shared)

    def moe_block(self, x, gate_weight, correction_bias, router: RouterConfig, experts: ExpertWeights, shared=None):
        # the router plans the experts' GEMMs in its own launch where one program routes every token
        block_m = self._k.fused_moe.block_rows(x.shape[0] * router.top_k)
        weights, ids, plan = self._k.moe_gate.route_and_plan(x, gate_weight, correction_bias, router, block_m)
        return self._k.fused_moe.moe_experts(x, weights, ids, experts, shared, plan=plan)

    # ---- speculative drafts and acceptance --------------------------------------------------
    def argmax_shift_in(self, logits, ids, lm_head_indices) -> tuple[torch.Tensor, torch.Tensor]:
        return self._k.draft_shift.argmax_shift_in(logits, ids, lm_head_indices)

    def accept_drafts(self, buffer, targets, exact, hidden, drafts, starts, counts, keep_rows) -> torch.Tensor:
        return self._k.acceptance.accept_drafts(buffer, targets, exact, hidden, drafts, starts, counts, keep_rows)

    def accept_and_pack(self, buffer, targets, exact, hidden, drafts, starts, counts, keep_rows):
        return self._k.acceptance.accept_and_pack(buffer, targets, exact, hidden, drafts, starts, counts, keep_rows)
