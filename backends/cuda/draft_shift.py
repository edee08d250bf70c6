"""A greedy draft stage's argmax and the next stage's tokens in one kernel.

Between two MTP draft stages the drafts are each lm_head row's argmax, and the next stage's
tokens are this stage's rolled left by one with each sequence's lm_head row set to its draft
(``Backend.argmax_shift_in``). As torch ops that is an argmax, a roll and an indexed write: three
launches a stage in every captured speculative step. Here the first B programs each take one
logits row's argmax and write the draft to its lm_head row; the others copy a block of rolled
tokens, skipping the lm_head rows, so no two programs write the same row (whatever the order of
the lm_head rows).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mindspec.backends.cuda.availability import interpreting
from mindspec.backends.cuda.launch import pow2


@triton.jit
def _argmax_shift_kernel(
    logits_ptr, ids_ptr, lm_ptr, draft_ptr, next_ptr, num_seqs, vocab, num_tokens, stride_l,
    BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr, SEQS: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < num_seqs:  # the argmax of logits row pid, the first index of the largest value (torch's)
        v = tl.arange(0, BLOCK_V)
        row = logits_ptr + pid.to(tl.int64) * stride_l
        best = tl.full((), float("-inf"), tl.float32)
        best_at = tl.full((), 0, tl.int32)
        for v0 in range(0, vocab, BLOCK_V):
            x = tl.load(row + v0 + v, mask=v0 + v < vocab, other=float("-inf")).to(tl.float32)
            top = tl.max(x, axis=0)
            at = v0 + tl.argmax(x, axis=0, tie_break_left=True).to(tl.int32)
            better = top > best  # a later block's tie keeps the earlier index
            best_at = tl.where(better, at, best_at)
            best = tl.where(better, top, best)
        draft = best_at.to(tl.int64)
        tl.store(draft_ptr + pid, draft)
        tl.store(next_ptr + tl.load(lm_ptr + pid), draft)
    else:  # rows j <- ids[(j + 1) % T], but for the lm_head rows (theirs are the drafts)
        j = (pid - num_seqs) * BLOCK_T + tl.arange(0, BLOCK_T)
        s = tl.arange(0, SEQS)
        lm = tl.load(lm_ptr + s, mask=s < num_seqs, other=-1)
        is_lm = tl.max((j[:, None] == lm[None, :]).to(tl.int32), axis=1) > 0  # [BLOCK_T]
        src = tl.where(j + 1 < num_tokens, j + 1, 0)
        keep = (j < num_tokens) & (~is_lm)
        tl.store(next_ptr + j, tl.load(ids_ptr + src, mask=keep), mask=keep)


def argmax_shift_in(
    logits: torch.Tensor,  # [B, V] each sequence's lm_head row
    ids: torch.Tensor,  # [T] int64 this stage's tokens
    lm_head_indices: torch.Tensor,  # [B] int64 row of each sequence's lm_head entry in ids
) -> tuple[torch.Tensor, torch.Tensor]:
    """``Backend.argmax_shift_in`` -> (drafts [B] int64, next stage's tokens [T] int64)."""
    num_seqs, vocab = logits.shape
    num_tokens = ids.shape[0]
    drafts = torch.empty(num_seqs, dtype=torch.int64, device=logits.device)
    if num_seqs == 0 or num_tokens == 0:
        return drafts, ids.roll(-1)
    shifted = torch.empty_like(ids)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    block_t = pow2(min(num_tokens, 1024)) if interpreting() else 128
    block_v = pow2(min(vocab, 1 << 16)) if interpreting() else 2048
    _argmax_shift_kernel[(num_seqs + triton.cdiv(num_tokens, block_t),)](
        logits, ids, lm_head_indices, drafts, shifted, num_seqs, vocab, num_tokens, logits.stride(0),
        BLOCK_V=block_v, BLOCK_T=block_t, SEQS=pow2(num_seqs), num_warps=4,
    )
    return drafts, shifted
