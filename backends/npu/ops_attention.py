"""MLA attention on torch_npu.

- Decode and MTP verification (absorbed, over the paged latent cache): npu_fused_infer_attention_score_v2
  with key = value = the latent cache [nb, bs, 512], query_rope / key_rope (64), TND layout, int32
  block table and host-list lengths (fia_args.py). Query heads are padded with zero heads to the
  next count FIA accepts (32, 64, 128), as vllm-ascend pads heads; the padded heads are dropped.
- Prefill (no cached context, K/V expanded): npu_fused_infer_attention_score (v1) in TND layout with
  query_rope / key_rope, sparse_mode 3 and the 2048 mask, cumulative lengths (bfloat16 only).

While a graph is being captured (graph.py) each decode FIA call is issued inside its own graph
task group and remembered, so that its host-list lengths can be re-issued before every replay.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F

from mindspec.backend import AttentionMetadata, LatentCache

from .fia_args import FiaLengths, causal_mask, fia_lengths
from .limits import mla_decode_refusal, mla_prefill_refusal, padded_query_heads
from .op_group import OpGroup
from .rope_layout import to_half_order


@dataclass
class DecodeCall:
    """The tensor arguments of one decode FIA call (the lengths come from its metadata)."""

    query: torch.Tensor  # [T, N, 512] heads padded to N
    query_rope: torch.Tensor  # [T, N, 64] half order
    key: torch.Tensor  # [nb, bs, 512] latent cache, also the value
    key_rope: torch.Tensor  # [nb, bs, 64]
    block_table: torch.Tensor  # [B, max_blocks] int32
    block_size: int
    scale: float

    def kwargs(self, lengths: FiaLengths) -> dict:
        return dict(
            query_rope=self.query_rope,
            key_rope=self.key_rope,
            atten_mask=causal_mask(self.query.device) if lengths.needs_mask else None,
            actual_seq_qlen=lengths.actual_seq_qlen,
            actual_seq_kvlen=lengths.actual_seq_kvlen,
            block_table=self.block_table,
            num_query_heads=self.query.shape[1],
            num_key_value_heads=1,
            softmax_scale=self.scale,
            input_layout="TND",
            sparse_mode=lengths.sparse_mode,
            block_size=self.block_size,
        )


@dataclass
class CapturedAttention:
    """One decode FIA call inside a captured graph and what re-issuing it needs."""

    meta_key: int  # id() of the static metadata whose host lists the call was captured with
    call: DecodeCall
    lengths: FiaLengths
    handle: Any  # graph task group handle
    event: Any  # ExternalEvent: the captured call waits for the update recorded before replay
    workspace: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor


@dataclass
class GraphCapture:
    attention: list[CapturedAttention] = field(default_factory=list)


class AttentionOps(OpGroup):
    def __init__(self, *args):
        super().__init__(*args)
        self.capture: Optional[GraphCapture] = None

    # ---- decode / MTP verification ----------------------------------------------------------
    def mla_attention(self, q_lat, q_pe, cache: LatentCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        T, H, R = q_lat.shape
        reason = mla_decode_refusal(H, R, q_pe.shape[-1], q_lat.dtype, cache.block_size,
                                    meta.q_lens_host, meta.tree_mask is not None)
        if reason is None and cache.c_kv.dtype != q_lat.dtype:
            reason = f"cache dtype {cache.c_kv.dtype} != query dtype {q_lat.dtype}"
        if reason:
            if self.capture is not None:
                raise RuntimeError(f"cannot capture mla_attention on the composed path ({reason}): it reads "
                                   "host lengths that a graph would bake in")
            self.fallbacks.note("mla_attention", reason)
            # The npu cache holds k_pe in half order, so the query joins it there.
            return self.composed.mla_attention(q_lat, to_half_order(q_pe), cache, meta, scale)
        if T == 0:
            return q_lat.new_zeros((0, H, R))
        heads = padded_query_heads(H)
        call = DecodeCall(
            query=_pad_heads(q_lat, heads),
            query_rope=_pad_heads(to_half_order(q_pe), heads),
            key=cache.c_kv,
            key_rope=cache.k_pe,
            block_table=meta.block_tables.to(torch.int32),
            block_size=cache.block_size,
            scale=scale,
        )
        lengths = fia_lengths(meta)
        if self.capture is not None:
            out = self._captured_decode(call, lengths, meta)
        else:
            out, _ = self.npu.npu_fused_infer_attention_score_v2(call.query, call.key, call.key, **call.kwargs(lengths))
        return out[:, :H]  # [T, H, R]

    def _captured_decode(self, call: DecodeCall, lengths: FiaLengths, meta: AttentionMetadata) -> torch.Tensor:
        """vllm-ascend's pattern: an ExternalEvent the update records, then FIA in a task group."""
        npu_api = torch.npu
        stream = npu_api.current_stream()
        event = npu_api.ExternalEvent()
        event.wait(stream)
        event.reset(stream)
        kwargs = call.kwargs(lengths)
        fia = self.npu.npu_fused_infer_attention_score_v2
        workspace = self.npu._npu_fused_infer_attention_score_v2_get_max_workspace(call.query, call.key, call.key, **kwargs)
        out = torch.empty_like(call.query)
        lse = torch.empty(1, dtype=torch.float32, device=call.query.device)
        npu_api.graph_task_group_begin(stream)
        fia.out(call.query, call.key, call.key, **kwargs, workspace=workspace, out=[out, lse])
        handle = npu_api.graph_task_group_end(stream)
        self.capture.attention.append(CapturedAttention(id(meta), call, lengths, handle, event, workspace, out, lse))
        return out

    def update_captured(self, capture: GraphCapture, metas: dict[int, AttentionMetadata], stream) -> None:
        """Re-issue every captured decode FIA call with the host lists of its new metadata."""
        npu_api = torch.npu
        fia = self.npu.npu_fused_infer_attention_score_v2
        with npu_api.stream(stream):
            for att in capture.attention:
                lengths = fia_lengths(metas[att.meta_key])
                if lengths.actual_seq_qlen != att.lengths.actual_seq_qlen:
                    raise ValueError(
                        f"captured attention took query lengths {att.lengths.actual_seq_qlen}, replay gives "
                        f"{lengths.actual_seq_qlen}: pad the batch to the captured shape"
                    )
                call = att.call
                npu_api.graph_task_update_begin(stream, att.handle)
                fia.out(call.query, call.key, call.key, **call.kwargs(lengths), workspace=att.workspace, out=[att.out, att.lse])
                npu_api.graph_task_update_end(stream)
                att.event.record(stream)

    # ---- prefill ----------------------------------------------------------------------------
    def mla_prefill(self, q_nope, q_pe, k_nope, k_pe, v, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        T, H, nope = q_nope.shape
        reason = mla_prefill_refusal(nope, q_pe.shape[-1], v.shape[-1], q_nope.dtype, meta.num_seqs)
        if reason:
            self.fallbacks.note("mla_prefill", reason)
            return self.composed.mla_prefill(q_nope, q_pe, k_nope, k_pe, v, meta, scale)
        if T == 0:
            return v.new_zeros((0, H, v.shape[-1]))
        # No cached context: key lengths equal query lengths, both cumulative in TND.
        ends = fia_lengths(meta).actual_seq_qlen
        out, _ = self.npu.npu_fused_infer_attention_score(
            q_nope.contiguous(),
            k_nope.contiguous(),
            v.contiguous(),
            query_rope=q_pe.contiguous(),
            key_rope=k_pe[:, None, :].expand(T, H, k_pe.shape[-1]).contiguous(),  # shared by all heads
            atten_mask=causal_mask(q_nope.device),
            actual_seq_lengths=ends,
            actual_seq_lengths_kv=ends,
            num_heads=H,
            num_key_value_heads=H,
            scale=scale,
            input_layout="TND",
            sparse_mode=3,
            softmax_lse_flag=False,
        )
        return out  # [T, H, v]


def _pad_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[T, H, D] -> [T, heads, D] with zero heads appended (contiguous, as FIA requires)."""
    return F.pad(x, (0, 0, 0, heads - x.shape[1])).contiguous()
