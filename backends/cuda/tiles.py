"""Device-side work plans: which sequence and which of its new tokens each program handles.

Attention programs own a tile of up to ``tile_q`` new tokens of one sequence. The plan is computed
with torch ops on the device from ``q_lens`` (no host lists, no sync), so it is valid inside a
captured CUDA graph; its size depends only on static shapes (tokens, sequences), and programs past
the real tile count find sequence -1 and exit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from mindspec.backend import AttentionMetadata


@dataclass
class TilePlan:
    tile_seq: torch.Tensor  # [G] int32 sequence of each tile, -1 = no work
    tile_first: torch.Tensor  # [G] int32 index of the tile's first token among the sequence's new tokens

    @property
    def num_programs(self) -> int:
        return self.tile_seq.shape[0]


def build_tile_plan(q_lens: torch.Tensor, num_tokens: int, tile_q: int) -> TilePlan:
    q_lens = q_lens.to(torch.int64)
    num_seqs = q_lens.shape[0]
    tiles = (q_lens + tile_q - 1) // tile_q  # [B]
    ends = torch.cumsum(tiles, 0)  # [B]
    # Each sequence wastes at most one partial tile, so this bound holds for any q_lens.
    bound = triton.cdiv(num_tokens, tile_q) + num_seqs
    g = torch.arange(bound, device=q_lens.device)
    seq = torch.searchsorted(ends, g, right=True)  # [G], num_seqs past the last tile
    seq_c = seq.clamp(max=max(num_seqs - 1, 0))
    first = (g - (ends[seq_c] - tiles[seq_c])) * tile_q
    valid = seq < num_seqs
    return TilePlan(
        tile_seq=torch.where(valid, seq, -1).to(torch.int32),
        tile_first=torch.where(valid, first, 0).to(torch.int32),
    )


def tile_plan(meta: AttentionMetadata, num_tokens: int, tile_q: int) -> TilePlan:
    """The plan for this forward, built once and reused by every layer (meta.scratch)."""
    key = ("cuda.tile_plan", num_tokens, tile_q)
    plan = meta.scratch.get(key)
    if plan is None:
        plan = build_tile_plan(meta.q_lens, num_tokens, tile_q)
        meta.scratch[key] = plan
    return plan


def check_token_count(op: str, meta: AttentionMetadata, num_tokens: int) -> None:
    """Host-side consistency check (skipped while a graph is captured: its lists are static)."""
    if meta.q_lens_host and sum(meta.q_lens_host) != num_tokens:
        raise ValueError(f"{op}: metadata describes {sum(meta.q_lens_host)} new tokens, got {num_tokens}")
    if meta.q_lens.shape[0] + 1 != meta.q_start_loc.shape[0] or meta.seq_lens.shape != meta.q_lens.shape:
        raise ValueError(
            f"{op}: q_lens {tuple(meta.q_lens.shape)}, seq_lens {tuple(meta.seq_lens.shape)} and "
            f"q_start_loc {tuple(meta.q_start_loc.shape)} disagree on the number of sequences"
        )
