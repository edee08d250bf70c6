"""The Backend interface: the only door between the model and device code.

A backend owns a device, allocates the paged latent cache and implements the ops of DESIGN.md
section 3. The model calls these ops (plus plain torch for glue), GEMMs against its weights
included (``linear``: a backend may keep weights in its own layout), and never checks which
device it runs on. The ``cpu`` backend is the reference every other backend is tested against.

Backends are found by name through a registry of dotted paths, imported on first use, so choosing
``cpu`` never imports triton or torch_npu. Packages extend the registry through the
``mindspec.backends`` entry-point group.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from mindspec.backend_error import BackendError  # noqa: F401 (re-exported: backends raise it from here)


# --------------------------------------------------------------------------------------------
# Records passed from the model wrapper to the ops
# --------------------------------------------------------------------------------------------


@dataclass
class LatentCache:
    """One layer's paged MLA cache: only the latent is stored, never expanded K/V.

    Backends choose the storage; the cpu backend keeps one [num_blocks, block_size, R + P] buffer
    and exposes the two parts as views, Ascend keeps two separate tensors.
    """

    c_kv: torch.Tensor  # [num_blocks, block_size, kv_lora_rank]   normalised latent
    k_pe: torch.Tensor  # [num_blocks, block_size, qk_rope_head_dim] roped key part
    # When both parts live in one buffer (c_kv and k_pe are views of it), the buffer itself, so
    # a backend can write and gather a token's whole latent row at once.
    latent: Optional[torch.Tensor] = None  # [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]

    @property
    def num_blocks(self) -> int:
        return self.c_kv.shape[0]

    @property
    def block_size(self) -> int:
        return self.c_kv.shape[1]


@dataclass
class AttentionMetadata:
    """Where each new token sits in the paged cache, for one forward over a flat token batch.

    Tokens are token-major: sequence b owns rows q_start_loc[b] : q_start_loc[b + 1]. Its new
    tokens are the last q_lens[b] of its seq_lens[b] tokens, so the causal mask is aligned to the
    end of each sequence (bottom-right). Host copies of the lengths exist because Ascend's
    attention ops take Python lists.
    """

    slots: torch.Tensor  # [T] int64, block_id * block_size + offset; -1 = do not write
    block_tables: torch.Tensor  # [B, max_blocks] int32, unused entries may hold anything
    seq_lens: torch.Tensor  # [B] int32, tokens in the cache after this step's writes
    q_lens: torch.Tensor  # [B] int32, new tokens per sequence
    q_start_loc: torch.Tensor  # [B + 1] int32, cumulative q_lens
    seq_lens_host: list[int]
    q_lens_host: list[int]
    is_prefill: bool  # every sequence starts at position 0 (no cached context)
    # Optional tree verification: tree_mask[b, i, j] says new token i of sequence b may attend new
    # token j (j, i < max_q_len); the causal mask among new tokens is replaced by it.
    tree_mask: Optional[torch.Tensor] = None  # [B, max_q_len, max_q_len] bool
    block_size: int = 0  # tokens per cache block (0: unknown here; ops then take the cache's)
    # Per-forward memo for backends: tensors derived from this metadata once (gather indices,
    # masks, cos/sin rows, host argument lists) and reused by every layer of the forward.
    scratch: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens_host)

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens_host) if self.q_lens_host else 0

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host) if self.seq_lens_host else 0


@dataclass(frozen=True)
class RouterConfig:
    """How a DeepSeekMoE router turns logits into (weights, expert ids)."""

    top_k: int
    scoring: str  # "softmax" (V2) | "sigmoid" (V3)
    topk_method: str  # "greedy" | "group_limited_greedy" | "noaux_tc"
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float


@dataclass
class ExpertWeights:
    """Routed experts stacked along dim 0 (the checkpoint stores them one by one). Built by
    ``Backend.expert_weights``, which may return a subclass carrying its own layouts as well."""

    w13: torch.Tensor  # [E, 2 * I, H]  gate_proj rows then up_proj rows
    w2: torch.Tensor  # [E, H, I]       down_proj


@dataclass(eq=False)
class LinearWeight:
    """A GEMM weight as the model holds it: y = x @ weight.T. Built once at load by
    ``Backend.linear_weight``; ``packed`` is the same weight in a layout only that backend reads
    (the cpu backend: oneDNN's blocked layout), or None; ``narrow`` the same values in a
    narrower dtype where every one of them fits it exactly (the cpu backend: a bfloat16
    checkpoint run in float32), or None; ``blocked`` those narrow values in the layout of the
    backend's few-row GEMM (the cpu backend: rows_gemm.block), or None."""

    weight: torch.Tensor  # [out, in]
    packed: Optional[torch.Tensor] = None
    narrow: Optional[torch.Tensor] = None  # [out, in]
    blocked: Optional[torch.Tensor] = None  # [ceil(out / 32), in, 32] on cpu


@dataclass
class HeadWeight:
    """Per-head weights as bmm takes them (MLA's absorbed W_UK and W_UV^T): head h's rows times
    weight[h]. Built once at load by ``Backend.head_weight``; ``blocked`` the same values in a
    layout only that backend reads (the cpu backend: rows_gemm.block_heads), or None."""

    weight: torch.Tensor  # [H, in, out]
    blocked: Optional[torch.Tensor] = None


@dataclass
class IndexedRows:
    """buffer[rows], left for the op that reads them to gather (an MTP step's first hidden
    states: rows of the drafter's hidden cache, read by ``Backend.mtp_eh_proj``)."""

    buffer: torch.Tensor  # [R, D]
    rows: torch.Tensor  # [T] int64

    def materialize(self) -> torch.Tensor:
        """[T, D] the rows."""
        return self.buffer.index_select(0, self.rows)


@dataclass
class RotaryEmbedding:
    """DeepSeek rope (optionally YaRN-scaled): cos/sin follow from positions and inv_freq.

    ``cos_sin_cache`` holds the table for every position up to max_position_embeddings, computed
    once exactly as transformers computes cos/sin per step (float32 positions * inv_freq, times
    attention_factor), so ops look rows up instead of recomputing them in every layer.
    """

    inv_freq: torch.Tensor  # [rope_dim // 2] float32
    attention_factor: float  # multiplies cos and sin (YaRN mscale ratio; 1.0 for released configs)
    cos_sin_cache: Optional[torch.Tensor] = None  # [max_positions, rope_dim] float32: [cos | sin]
    # Tables a backend derives from cos_sin_cache in its own layout, built on first use.
    backend_tables: dict = field(default_factory=dict, repr=False, compare=False)

    def build_cache(self, max_positions: int, device: Optional[torch.device] = None) -> None:
        inv_freq = self.inv_freq.to(device=device, dtype=torch.float32)
        positions = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, rope_dim // 2]
        af = self.attention_factor
        self.inv_freq = inv_freq
        self.cos_sin_cache = torch.cat([freqs.cos() * af, freqs.sin() * af], dim=-1)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each [T, rope_dim // 2] float32, for positions [T]."""
        if self.cos_sin_cache is None:
            freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]
            return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor
        return self.cos_sin_cache[positions].chunk(2, dim=-1)


# --------------------------------------------------------------------------------------------
# The interface
# --------------------------------------------------------------------------------------------


class Backend(ABC):
    """Device, cache allocation and the op set of DESIGN.md section 3."""

    name: str = "abstract"
    dist_backend: str = "gloo"  # torch.distributed backend for multi-process work

    def __init__(self, device: Optional[str] = None):
        self.device = torch.device(device or self.default_device())

    # ---- device services -----------------------------------------------------------------
    @abstractmethod
    def default_device(self) -> str: ...

    def synchronize(self) -> None:
        """Wait for queued device work (no-op where ops are synchronous)."""

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of device memory usable for the KV cache."""
        raise BackendError(f"backend {self.name!r} cannot report device memory")

    def to_device(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.device, non_blocking=True)

    # ---- graph capture (used by mindspec/modeling/graph_runner.py) ---------------------------
    @property
    def supports_graph_capture(self) -> bool:
        """Whether ``capture_graph`` works here (CUDA graphs on the cuda backend). Default: no."""
        return False

    @property
    def steps_branch(self) -> bool:
        """Whether a step may branch on its own values (``torch.cond``, or an ``if`` eagerly):
        not where steps replay as captured graphs."""
        return not self.supports_graph_capture

    def capture_graph(self, fn: Callable[[], object]):
        """Record the device work of ``fn`` once -> an object with ``replay()`` and ``outputs``
        (what fn returned: static tensors that each replay rewrites)."""
        raise BackendError(f"backend {self.name!r} cannot capture graphs")

    # ---- whole-step export (used by mindspec/modeling/exported_step.py) -----------------------
    @property
    def supports_step_export(self) -> bool:
        """Whether decode steps can be exported whole and compiled ahead of time (the cpu
        backend: AOTInductor). Default: no."""
        return False

    def step_kernels(self) -> dict:
        """The backend's own compiled kernels that exported steps call, loaded into this process
        (built on first use): AOTInductor's ``aot_inductor.custom_ops_to_c_shims`` for them, so a
        package calls each directly. Default: none."""
        return {}

    def step_tensors(self, meta: AttentionMetadata, name: str) -> list[tuple[torch.Tensor, dict[int, str]]]:
        """The tensors this backend's ops read from a prepared ``meta``, each with its dynamic
        dims (dim -> a size name, unique per ``name``): an exported step takes them as inputs."""
        raise BackendError(f"backend {self.name!r} cannot export steps")

    def bind_step_tensors(self, meta: AttentionMetadata, tensors: list[torch.Tensor]) -> AttentionMetadata:
        """A copy of ``meta`` whose ops read ``tensors`` (``step_tensors``' order) instead."""
        raise BackendError(f"backend {self.name!r} cannot export steps")

    def cache_tensors(self, caches: list[LatentCache]) -> list[tuple[torch.Tensor, dict[int, str]]]:
        """The storage of ``caches`` as tensors, with their dynamic dims (as ``step_tensors``)."""
        raise BackendError(f"backend {self.name!r} cannot export steps")

    def bind_cache_tensors(self, caches: list[LatentCache], tensors: list[torch.Tensor]) -> list[LatentCache]:
        """Caches like ``caches`` over ``tensors`` (``cache_tensors``' order)."""
        raise BackendError(f"backend {self.name!r} cannot export steps")

    # ---- cache -----------------------------------------------------------------------------
    def allocate_latent_cache(
        self, num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int, dtype: torch.dtype
    ) -> LatentCache:
        buf = torch.zeros(num_blocks, block_size, kv_lora_rank + rope_dim, dtype=dtype, device=self.device)
        return LatentCache(c_kv=buf[..., :kv_lora_rank], k_pe=buf[..., kv_lora_rank:], latent=buf)

    # ---- per-forward preparation ---------------------------------------------------------------
    def prepare(self, meta: AttentionMetadata) -> None:
        """Called once per forward (per AttentionMetadata) before any layer runs: derive what every
        layer would otherwise recompute (gather plans, masks, host argument lists) into
        ``meta.scratch``. Keeps host work out of the layers, and out of captured/compiled
        regions, which may then read only tensors. Default: nothing to prepare."""

    def copy_cache_entries(self, cache: LatentCache, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Entries at slots src [M] -> slots dst [M] (every source read before any is written)."""
        parts = [cache.latent] if cache.latent is not None else [cache.c_kv, cache.k_pe]
        for part in parts:
            flat = part.view(-1, part.shape[-1])
            flat[dst] = flat[src]

    @abstractmethod
    def write_latent_cache(
        self, cache: LatentCache, c_kv: torch.Tensor, k_pe: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """cache[slot] = (c_kv [T, R], k_pe [T, P]) for each token; slot -1 is skipped."""

    def latent_norm_rope_cache(
        self,
        kv_a: torch.Tensor,  # [T, R + P] output of kv_a_proj_with_mqa
        norm_weight: torch.Tensor,  # [R] kv_a_layernorm
        eps: float,
        positions: torch.Tensor,  # [T]
        rotary: RotaryEmbedding,
        cache: LatentCache,
        slots: torch.Tensor,  # [T]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalise the latent, rope k_pe, store both; returns (c_kv [T, R], k_pe [T, P]).

        Composed from the single ops here; Ascend fuses it (npu_kv_rmsnorm_rope_cache).
        """
        rank = norm_weight.shape[0]
        c_kv = self.rms_norm(kv_a[:, :rank], norm_weight, eps)
        k_pe = self.rope(kv_a[:, None, rank:], positions, rotary)[:, 0]
        self.write_latent_cache(cache, c_kv, k_pe, slots)
        return c_kv, k_pe

    # ---- GEMMs against weights ---------------------------------------------------------------
    def keeps_quantized(self, checkpoint_format: str) -> bool:
        """Whether the weights of a quantized checkpoint ("fp8": block FP8, "gguf") may stay
        quantized in memory (mindspec/modeling/quantized.py): ``linear_weight``, ``embedding``
        and ``expert_weights`` then take them. Otherwise every weight is dequantized at load."""
        return False

    def embedding(self, input_ids: torch.Tensor, weight) -> torch.Tensor:
        """input_ids [T] -> rows of weight [vocab, hidden] -> [T, hidden]."""
        if not isinstance(weight, torch.Tensor):  # quantized
            weight = weight.dequantize()
        return F.embedding(input_ids, weight)

    def linear_weight(self, weight: torch.Tensor) -> LinearWeight:
        """A loaded [out, in] weight -> what ``linear`` takes; a backend may add its own layout."""
        return LinearWeight(weight)

    def linear(self, x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
        """x [..., in] -> x @ w.weight.T [..., out]."""
        return F.linear(x, w.weight)

    def head_weight(self, weight: torch.Tensor) -> HeadWeight:
        """Loaded per-head weights [H, in, out] -> what ``head_linear`` takes."""
        return HeadWeight(weight)

    def head_linear(self, x: torch.Tensor, w: HeadWeight) -> torch.Tensor:
        """x [T, H, in] -> [T, H, out]: each head's rows times its weight."""
        return torch.bmm(x.transpose(0, 1), w.weight).transpose(0, 1)

    def linear_rows(
        self, x: torch.Tensor, rows: torch.Tensor, w: LinearWeight, float_out: bool = False
    ) -> torch.Tensor:
        """x [T, in], rows [N] -> linear(x[rows], w) [N, out]: only the rows that need the product
        (the lm_head's), widened to float32 after it with ``float_out`` (logits); a backend may
        gather the rows inside the GEMM and write the float32 values from it."""
        out = self.linear(x[rows], w)
        return out.float() if float_out else out

    def rms_norm_linear(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, w: LinearWeight) -> torch.Tensor:
        """linear(rms_norm(x, norm_weight, eps), w) for a norm that only this projection reads
        (MLA's q_a_layernorm before q_b_proj); a backend may normalise inside the GEMM."""
        return self.linear(self.rms_norm(x, norm_weight, eps), w)

    def add_rms_norm_linear(
        self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, w: LinearWeight,
        rows: Optional[torch.Tensor] = None, float_out: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(RMSNorm(x + residual) * norm_weight, w), x + residual) for a norm that only this
        projection reads (a layer's input norm before MLA's fused q_a / kv_a projection, an MTP
        stage's head norm before its lm_head); with ``rows`` [N] the product of those rows alone
        and ``float_out`` as ``linear_rows``'. A backend may add and normalise inside the GEMM."""
        h, summed = self.add_rms_norm(x, residual, norm_weight, eps)
        if rows is not None:
            return self.linear_rows(h, rows, w, float_out), summed
        out = self.linear(h, w)
        return out.float() if float_out else out, summed

    def linear_silu_and_mul(self, x: torch.Tensor, gate_up: LinearWeight) -> torch.Tensor:
        """SwiGLU's first half: x [T, H], gate_up [2I, H] (rows gate | up) -> silu(x @ gate.T) *
        (x @ up.T) [T, I], as ``silu_and_mul(linear(x, gate_up))``; a backend may fuse the two."""
        return self.silu_and_mul(self.linear(x, gate_up))

    def expert_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> ExpertWeights:
        """Stacked routed experts (w13 [E, 2I, H], w2 [E, H, I]) -> what ``moe_experts`` takes."""
        return ExpertWeights(w13=w13, w2=w2)

    # ---- norms and activations ---------------------------------------------------------------
    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [T, D] -> RMSNorm(x) * weight, computed in float32 and cast back (as HF does)."""

    @abstractmethod
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (RMSNorm(x + residual) * weight, x + residual)."""

    def add_rms_norm_rows(
        self, x: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``add_rms_norm(x, residual[rows], ...)``: x [N, D], residual [T, D], rows [N] (a layer
        whose output only some rows need, after its attention); a backend may gather the rows
        as it loads them."""
        return self.add_rms_norm(x, residual[rows], weight, eps)

    def mtp_eh_input(
        self, input_ids: torch.Tensor, embed, enorm: torch.Tensor, hidden: torch.Tensor, hnorm: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """An MTP module's eh_proj input: input_ids [T], hidden [T, D] -> concat[enorm(embed(ids)),
        hnorm(hidden)] [T, 2D] (DeepSeek's order). A backend may compute it in one pass."""
        e = self.rms_norm(self.embedding(input_ids, embed), enorm, eps)
        return torch.cat([e, self.rms_norm(hidden, hnorm, eps)], dim=-1)

    def mtp_eh_proj(
        self, input_ids: torch.Tensor, embed, enorm: torch.Tensor, hidden: torch.Tensor | IndexedRows,
        hnorm: torch.Tensor, eps: float, eh_proj: LinearWeight,
    ) -> torch.Tensor:
        """An MTP module's block input: linear(mtp_eh_input(...), eh_proj) [T, D]; ``hidden`` may
        be ``IndexedRows``. A backend may build the input rows (and gather hidden's) inside the GEMM."""
        if isinstance(hidden, IndexedRows):
            hidden = hidden.materialize()
        return self.linear(self.mtp_eh_input(input_ids, embed, enorm, hidden, hnorm, eps), eh_proj)

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2I] -> silu(x[:, :I]) * x[:, I:]."""

    # ---- rope --------------------------------------------------------------------------------
    @abstractmethod
    def rope(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding) -> torch.Tensor:
        """Rotate interleaved pairs (x0, x1), (x2, x3), ... of x [T, H, P] by position; the output
        keeps DeepSeek's interleaved layout."""

    # ---- attention -----------------------------------------------------------------------------
    @abstractmethod
    def mla_attention(
        self,
        q_lat: torch.Tensor,  # [T, H, R] q_nope absorbed through W_UK
        q_pe: torch.Tensor,  # [T, H, P] roped
        cache: LatentCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Absorbed MLA over the paged latent cache -> o_lat [T, H, R] (before W_UV).

        score = (q_lat . c_kv + q_pe . k_pe) * scale; values are c_kv. Any q_len >= 1 per
        sequence, causal aligned to the end of each sequence, or meta.tree_mask among new tokens.
        """

    def rope_mla_attention(
        self, q_lat: torch.Tensor, q_pe: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding,
        cache: LatentCache, meta: AttentionMetadata, scale: float,
    ) -> torch.Tensor:
        """``mla_attention`` of a q_pe [T, H, P] not yet roped: ``rope(q_pe, positions, rotary)``
        first; a backend may rotate q_pe as its attention kernel loads it."""
        return self.mla_attention(q_lat, self.rope(q_pe, positions, rotary), cache, meta, scale)

    @abstractmethod
    def mla_prefill(
        self,
        q_nope: torch.Tensor,  # [T, H, Dn]
        q_pe: torch.Tensor,  # [T, H, P]
        k_nope: torch.Tensor,  # [T, H, Dn]
        k_pe: torch.Tensor,  # [T, P] shared by all heads
        v: torch.Tensor,  # [T, H, Dv]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Causal attention of sequences with no cached context, K/V expanded -> [T, H, Dv]."""

    # ---- MoE -----------------------------------------------------------------------------------
    @abstractmethod
    def moe_gate(
        self,
        x: torch.Tensor,  # [T, H]
        gate_weight: torch.Tensor,  # [E, H]
        correction_bias: Optional[torch.Tensor],  # [E] float32, V3 only
        router: RouterConfig,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Router in float32 -> (topk_weights [T, k] float32, topk_ids [T, k] int64)."""

    @abstractmethod
    def moe_experts(
        self,
        x: torch.Tensor,  # [T, H]
        topk_weights: torch.Tensor,  # [T, k] float32
        topk_ids: torch.Tensor,  # [T, k] int64
        experts: ExpertWeights,
        shared: Optional[torch.Tensor] = None,  # [T, H] the shared experts' output
    ) -> torch.Tensor:
        """sum_k w[t, k] * down(silu(gate(x)) * up(x)) over the chosen experts -> [T, H], plus
        ``shared`` where given (added to the rounded sum, as ``out + shared``: one launch less
        where the backend fuses it)."""

    def moe_block(
        self, x: torch.Tensor, gate_weight: torch.Tensor, correction_bias: Optional[torch.Tensor], router: RouterConfig,
        experts: ExpertWeights, shared: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """A MoE block's experts on this rank's tokens: ``moe_experts`` of ``moe_gate``'s routes; a
        backend may plan the experts' work as it routes."""
        topk_weights, topk_ids = self.moe_gate(x, gate_weight, correction_bias, router)
        return self.moe_experts(x, topk_weights, topk_ids, experts, shared)

    # ---- sampling (optional; Ascend fuses it as npu_top_k_top_p) --------------------------------
    def top_k_top_p(self, logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """logits [N, V]; top_k [N] int in [1, V] (V = off); top_p [N] (1.0 = off) -> logits with
        removed tokens at -inf. Keeps tokens >= the k-th largest logit, then those whose strictly
        larger mass under the top-k renormalised softmax is < top_p (threshold based: ties kept)."""
        sorted_l = logits.sort(dim=-1, descending=True).values  # [N, V]
        kth = sorted_l.gather(1, (top_k.to(torch.int64) - 1).clamp(min=0)[:, None])
        sorted_l = sorted_l.masked_fill(sorted_l < kth, float("-inf"))
        csum = sorted_l.float().softmax(dim=-1).cumsum(dim=-1)
        before = torch.cat([torch.zeros_like(csum[:, :1]), csum[:, :-1]], dim=1)  # mass ranked before
        keep = before < top_p.to(csum.dtype)[:, None]
        keep[:, 0] = True
        p_thr = sorted_l.gather(1, keep.sum(dim=-1, keepdim=True) - 1)
        thr = torch.where(top_p[:, None] < 1.0, torch.maximum(kth, p_thr), kth)
        return logits.masked_fill(logits < thr, float("-inf"))

    # ---- speculative drafts and acceptance (optional; cuda runs each as one kernel) -------------
    def argmax_shift_in(
        self,
        logits: torch.Tensor,  # [B, V] each sequence's lm_head row of a draft stage
        ids: torch.Tensor,  # [T] int64 the stage's tokens
        lm_head_indices: torch.Tensor,  # [B] int64 row of each sequence's lm_head entry in ids
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A greedy draft stage's drafts and the next stage's tokens -> (drafts [B]: each row's
        argmax, the first index of its largest value; ``shift_in(ids, drafts, lm_head_indices)``)."""
        drafts = logits.argmax(dim=-1)
        return drafts, shift_in(ids, drafts, lm_head_indices)

    def accept_drafts(
        self,
        buffer: torch.Tensor,  # [R, hidden] the drafter's hidden cache, written in place; row 0 zero
        targets: torch.Tensor,  # [N] each verification row's target token
        exact: Optional[torch.Tensor],  # [] bool: the targets are the sampler's (None: greedy, always)
        hidden: torch.Tensor,  # [N, hidden] the main model's hidden states of the same rows
        drafts: torch.Tensor,  # [B, K]
        starts: torch.Tensor,  # [B] int64 each sequence's first verification row
        counts: torch.Tensor,  # [B] int64 drafts each sequence verifies (<= K)
        keep_rows: torch.Tensor,  # [B, K + 1] int64 cache row of each verification row (0: none)
    ) -> torch.Tensor:
        """Strict acceptance -> accepted drafts [B]: draft j + 1 is kept while it equals the
        target at the sequence's row j, at most its count; the hidden states of the accepted rows
        (the first accepted + 1) go to their cache rows. Where ``exact`` is False nothing is kept
        and every sequence accepts -1 (the host decides)."""
        return accept_drafts(buffer, targets, exact, hidden, drafts, starts, counts, keep_rows)

    def accept_and_pack(
        self, buffer, targets, exact, hidden, drafts, starts, counts, keep_rows,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``accept_drafts`` -> (targets [N], drafts [B, K], accepted [B]): the inputs as they are,
        or their values with the counts as consecutive views of one int64 buffer [N + B * K + B],
        which the host then reads with one copy (a captured step otherwise concatenates them:
        graph_runner._with_greedy)."""
        return targets, drafts, self.accept_drafts(buffer, targets, exact, hidden, drafts, starts, counts, keep_rows)


def shift_in(ids: torch.Tensor, new: torch.Tensor, lm_head_indices: torch.Tensor) -> torch.Tensor:
    """The next MTP stage's tokens: ids [T] rolled left by one, each sequence's lm_head row set to
    its new token [B]. A global roll is safe: what crosses a sequence boundary lands on padding
    rows (decode) or on the lm_head row, which is overwritten."""
    ids = torch.roll(ids, -1)
    ids[lm_head_indices] = new
    return ids


def accept_drafts(buffer, targets, exact, hidden, drafts, starts, counts, keep_rows) -> torch.Tensor:
    """``Backend.accept_drafts`` as tensor ops (what cpu packages trace; rows not kept write
    zeros to row 0, which stays zero)."""
    k = drafts.shape[1]
    j = torch.arange(k + 1, device=drafts.device)  # [K + 1]
    rows = starts[:, None] + torch.minimum(j[None, :], counts[:, None])  # [B, K + 1]; past a count: its last row
    grid = targets[rows]  # [B, K + 1]
    matched = (drafts == grid[:, :k]).to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]
    accepted = torch.minimum(matched, counts)
    keep = (j[None, :] <= accepted[:, None]) & (keep_rows > 0)  # [B, K + 1]
    if exact is not None:
        keep = keep & exact
        accepted = torch.where(exact, accepted, torch.full_like(accepted, -1))
    dst = torch.where(keep, keep_rows, torch.zeros_like(keep_rows)).reshape(-1)
    src = hidden[rows.reshape(-1)].to(buffer.dtype)  # [B * (K + 1), hidden]
    src = torch.where(keep.reshape(-1, 1), src, torch.zeros_like(src))
    buffer.index_copy_(0, dst, src)
    return accepted


def keep_hidden_rows(buffer: torch.Tensor, hidden: torch.Tensor, rows: torch.Tensor) -> None:
    """A plain decode step's hidden states into the drafter's hidden cache: hidden row b [B,
    hidden] goes to buffer row rows[b] [B] int64; rows 0 (padding sequences) write zeros to row
    0, which stays zero."""
    src = torch.where((rows > 0)[:, None], hidden.to(buffer.dtype), torch.zeros((), dtype=buffer.dtype,
                                                                                device=buffer.device))
    buffer.index_copy_(0, rows, src)


# --------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------

BACKENDS: dict[str, str] = {
    "cpu": "mindspec.backends.cpu:CpuBackend",
    "cuda": "mindspec.backends.cuda:CudaBackend",
    "npu": "mindspec.backends.npu:NpuBackend",
}
# MindIE's backendType values both mean the Ascend backend here.
ALIASES = {"atb": "npu", "torch": "npu"}


def _entry_point_backends() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group="mindspec.backends")}


def available_backends() -> list[str]:
    return sorted(set(BACKENDS) | set(_entry_point_backends()))


def resolve_backend_name(name: str) -> str:
    """'auto' picks cuda when a CUDA device is visible, else cpu."""
    name = ALIASES.get(name, name)
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def backend_class(name: str) -> Callable[..., Backend]:
    name = resolve_backend_name(name)
    target = BACKENDS.get(name) or _entry_point_backends().get(name)
    if target is None:
        raise BackendError(f"unknown backend {name!r}; choose one of {', '.join(available_backends())}")
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attr)


def get_backend(name: str = "cpu", device: Optional[str] = None) -> Backend:
    """Instantiate a backend by name ('cpu', 'cuda', 'npu', 'auto', MindIE's 'atb'/'torch')."""
    return backend_class(name)(device)
