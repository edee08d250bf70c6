"""Strict acceptance of a speculative step with the accepted rows' hidden states kept, in one kernel.

As tensor ops (``mindspec.backend.accept_drafts``) this is ~20 tiny launches inside every captured
speculative step; here one program per sequence walks its drafts against the targets of its
verification rows, writes the accepted count, and copies the hidden states of the accepted rows
(the first accepted + 1) to their cache rows. Rows not kept are not written (row 0, the cache's
zero row, stays zero). ``accept_and_pack`` also writes the targets and the drafts beside the counts
in one buffer, which the host reads with one copy (no concatenation launched after it).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from mindspec.backends.cuda.launch import pow2


@triton.jit
def _accept_kernel(
    targets_ptr, exact_ptr, hidden_ptr, drafts_ptr, starts_ptr, counts_ptr, keep_ptr, buffer_ptr, accepted_ptr,
    packed_ptr, num_rows, hidden_size, stride_h, stride_d, stride_keep, stride_buf,
    K: tl.constexpr, HAS_EXACT: tl.constexpr, BLOCK_H: tl.constexpr, PACK_ROWS: tl.constexpr,
):
    # PACK_ROWS > 0: packed_ptr [N + B * K] gets the targets (program b: rows b * PACK_ROWS on)
    # and then the drafts; accepted_ptr is the packed buffer's tail
    b = tl.program_id(0).to(tl.int64)
    if PACK_ROWS > 0:
        r = b * PACK_ROWS + tl.arange(0, PACK_ROWS)
        tl.store(packed_ptr + r, tl.load(targets_ptr + r, mask=r < num_rows), mask=r < num_rows)
    start = tl.load(starts_ptr + b)
    count = tl.load(counts_ptr + b)
    matched = tl.full((), 0, tl.int64)  # drafts equal to their targets, up to the first that is not
    going = tl.full((), 1, tl.int64)
    for j in tl.static_range(K):
        target = tl.load(targets_ptr + start + tl.minimum(j, count))  # past its count: its last row
        draft = tl.load(drafts_ptr + b * stride_d + j)
        if PACK_ROWS > 0:
            tl.store(packed_ptr + num_rows + b * K + j, draft)
        going = going * (draft == target).to(tl.int64)
        matched += going
    accepted = tl.minimum(matched, count)
    if HAS_EXACT:  # targets the sampler would not have drawn: the host accepts instead
        accepted = tl.where(tl.load(exact_ptr) != 0, accepted, -1)
    tl.store(accepted_ptr + b, accepted)
    h = tl.arange(0, BLOCK_H)
    for j in tl.static_range(K + 1):
        dst = tl.load(keep_ptr + b * stride_keep + j)
        if (j <= accepted) & (dst > 0):
            src = hidden_ptr + (start + tl.minimum(j, count)) * stride_h
            for h0 in range(0, hidden_size, BLOCK_H):
                ok = h0 + h < hidden_size
                row = tl.load(src + h0 + h, mask=ok)
                tl.store(buffer_ptr + dst * stride_buf + h0 + h, row.to(buffer_ptr.dtype.element_ty), mask=ok)


def accept_drafts(
    buffer: torch.Tensor, targets: torch.Tensor, exact: Optional[torch.Tensor], hidden: torch.Tensor,
    drafts: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, keep_rows: torch.Tensor,
) -> torch.Tensor:
    """``Backend.accept_drafts`` (see mindspec/backend.py) -> accepted [B] int64."""
    accepted = torch.empty(drafts.shape[0], dtype=torch.int64, device=drafts.device)
    _launch(buffer, targets, exact, hidden, drafts, starts, counts, keep_rows, accepted, None)
    return accepted


def accept_and_pack(
    buffer: torch.Tensor, targets: torch.Tensor, exact: Optional[torch.Tensor], hidden: torch.Tensor,
    drafts: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor, keep_rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``Backend.accept_and_pack``: (targets [N], drafts [B, K], accepted [B]), consecutive views
    of one int64 buffer [N + B * K + B]."""
    num_rows, (num_seqs, k) = targets.shape[0], drafts.shape
    packed = torch.empty(num_rows + num_seqs * (k + 1), dtype=torch.int64, device=drafts.device)
    targets_out, drafts_out = packed[:num_rows], packed[num_rows : num_rows + num_seqs * k].view(num_seqs, k)
    accepted = packed[num_rows + num_seqs * k :]
    if num_seqs == 0:
        targets_out.copy_(targets)
    _launch(buffer, targets, exact, hidden, drafts, starts, counts, keep_rows, accepted, packed)
    return targets_out, drafts_out, accepted


def _launch(buffer, targets, exact, hidden, drafts, starts, counts, keep_rows, accepted, packed) -> None:
    num_seqs, k = drafts.shape
    if num_seqs == 0:
        return
    hidden = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    drafts = drafts if drafts.stride(-1) == 1 else drafts.contiguous()
    hidden_size, num_rows = hidden.shape[-1], targets.shape[0]
    _accept_kernel[(num_seqs,)](
        targets, targets if exact is None else exact, hidden, drafts, starts, counts, keep_rows, buffer, accepted,
        accepted if packed is None else packed, num_rows, hidden_size, hidden.stride(0), drafts.stride(0),
        keep_rows.stride(0), buffer.stride(0), K=k, HAS_EXACT=exact is not None,
        BLOCK_H=min(pow2(hidden_size), 1024), PACK_ROWS=0 if packed is None else pow2(triton.cdiv(num_rows, num_seqs)),
    )
