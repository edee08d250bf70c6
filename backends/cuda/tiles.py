"""Which sequence and which of its new tokens each attention program handles.

Attention programs own a tile of up to ``tile_q`` new tokens of one sequence; sequence b owns
ceil(q_len_b / tile_q) consecutive tiles. Each program finds its own tile from ``q_lens`` on the
device (``tile_of``, a running sum over the sequences), so a forward launches nothing to plan
its attention (a speculative step is four forwards) and no host list is read: valid inside a
captured CUDA graph. The program count
depends only on static shapes (tokens, sequences); programs past the last tile find sequence -1
and exit.
"""
from __future__ import annotations

import triton
import triton.language as tl

from mindspec.backend import AttentionMetadata
from mindspec.backends.cuda.launch import pow2

MAX_SEQ_BLOCK = 256  # sequences summed per loop iteration in tile_of


def num_tile_programs(num_tokens: int, num_seqs: int, tile_q: int) -> int:
    """Programs enough for any q_lens of these sizes: each sequence wastes at most one partial tile."""
    return triton.cdiv(num_tokens, tile_q) + num_seqs


def seq_block(num_seqs: int) -> int:
    """``tile_of``'s SEQ_BLOCK for a batch of ``num_seqs`` sequences."""
    return min(pow2(num_seqs), MAX_SEQ_BLOCK)


@triton.jit
def tile_of(q_lens_ptr, num_seqs, pid, TILE_Q: tl.constexpr, SEQ_BLOCK: tl.constexpr):
    """(sequence, index of its first new token) of tile ``pid``; sequence -1 past the last tile.
    Sequence b is the number of sequences whose tiles all come before ``pid`` (tile ends <= pid),
    its first tile the count of those tiles."""
    seq = 0
    before = 0  # tiles of the sequences before ``seq``
    carry = 0  # tiles of the sequences of earlier blocks
    for s0 in range(0, num_seqs, SEQ_BLOCK):
        s = s0 + tl.arange(0, SEQ_BLOCK)
        q = tl.load(q_lens_ptr + s, mask=s < num_seqs, other=0).to(tl.int32)
        tiles = (q + TILE_Q - 1) // TILE_Q
        ends = carry + tl.cumsum(tiles, 0)
        done = (ends <= pid) & (s < num_seqs)
        seq += tl.sum(done.to(tl.int32), 0)
        before += tl.sum(tl.where(done, tiles, 0), 0)
        carry += tl.sum(tiles, 0)
    first = (pid - before) * TILE_Q
    return tl.where(seq < num_seqs, seq, -1), first


def check_token_count(op: str, meta: AttentionMetadata, num_tokens: int) -> None:
    """Host-side consistency check (skipped while a graph is captured: its lists are static)."""
    if meta.q_lens_host and sum(meta.q_lens_host) != num_tokens:
        raise ValueError(f"{op}: metadata describes {sum(meta.q_lens_host)} new tokens, got {num_tokens}")
    if meta.q_lens.shape[0] + 1 != meta.q_start_loc.shape[0] or meta.seq_lens.shape != meta.q_lens.shape:
        raise ValueError(
            f"{op}: q_lens {tuple(meta.q_lens.shape)}, seq_lens {tuple(meta.seq_lens.shape)} and "
            f"q_start_loc {tuple(meta.q_start_loc.shape)} disagree on the number of sequences"
        )
