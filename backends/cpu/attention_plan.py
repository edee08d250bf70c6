"""The cpu backend's per-forward attention plan: computed once from AttentionMetadata, reused by
every layer of that forward (DESIGN.md section 3: the host work stays out of the layers).

The flat token batch [T] is viewed as a padded [B, Q] grid (sequence b's new tokens in row b,
left-aligned). When every sequence has the same q_len, as in plain decode and MTP verification,
the grid is a reshape of the flat batch and no scatter is needed. Keys are gathered from the paged
cache as one [B, S] index of flat cache rows (memoised per block size); the mask is an additive
float32 bias [B, Q, 1, S] (0 allowed, -inf masked), broadcast over heads. Prefill uses the same
plan: with no cached context its keys are the new tokens themselves. An exported step computes
the same plan inside, as tensor ops over the lengths and block tables (``traced_plan``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from mindspec.backend import AttentionMetadata

PLAN_KEY = "cpu_attention_plan"  # meta.scratch keys
ROWS_KEY = "cpu_cache_rows"
GROUPS_KEY = "cpu_attention_groups"
# A sequence feeding more rows than this (a prefill chunk, a prompt's tail after cached context)
# attends apart from the others: in one grid every sequence would be padded to its rows and its
# context (8 decode rows beside a 256-token chunk at 4k context: 9 x 256 x 4k cells, not 8 x 4k + 256 x 4k).
GROUP_ROWS = 16


@dataclass
class AttentionPlan:
    num_seqs: int  # B
    max_q: int  # Q
    max_s: int  # S, longest sequence (context + new tokens)
    # Flat token t sits at grid cell (tok_seq[t], tok_pos[t]); None when the grid is a reshape.
    tok_seq: Optional[torch.Tensor]  # [T] int64
    tok_pos: Optional[torch.Tensor]  # [T] int64
    bias: torch.Tensor  # [B, Q, 1, S] float32, 0 where key s is visible to query q, else -inf
    # With a tree mask: the column of key s among sequence b's new rows, -1 for context and past
    # the sequence [B, S]; ``bias`` then holds the context part until ``with_tree`` adds the tree's
    # (on the device: the mask is drafted there, and a compiled step computes it inside).
    tree_cols: Optional[torch.Tensor] = None
    _tree: Optional[torch.Tensor] = field(default=None, repr=False)  # the mask ``bias`` includes
    _context: Optional[torch.Tensor] = field(default=None, repr=False)  # ``bias`` before any tree
    _head_bias: dict = field(default_factory=dict, repr=False)

    # Sizes come from tensor shapes, not the int fields, so that a compiled forward sees them as
    # symbolic sizes rather than constants to specialise (and recompile) on.
    def to_grid(self, x: torch.Tensor) -> torch.Tensor:
        """Flat [T, ...] -> [B, Q, ...] (padding cells are zero)."""
        B, Q = self.bias.shape[0], self.bias.shape[1]
        if self.tok_seq is None:
            return x.view((B, Q) + tuple(x.shape[1:]))
        out = x.new_zeros((B, Q) + tuple(x.shape[1:]))
        out[self.tok_seq, self.tok_pos] = x
        return out

    def head_bias(self, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
        """The bias repeated per head, [B, Q * H, S] in ``dtype`` (0 and -inf are exact in any
        float dtype): the addend of a baddbmm over [B, Q * H] query rows; once per forward."""
        key = (num_heads, dtype)
        bias = self._head_bias.get(key)
        if bias is None:
            B, Q, _, S = self.bias.shape
            bias = self._head_bias[key] = self.bias.expand(B, Q, num_heads, S).reshape(B, Q * num_heads, S).to(dtype)
        return bias

    @property
    def context_bias(self) -> torch.Tensor:
        """``bias`` without the tree mask's part (all of it when there is no tree)."""
        return self.bias if self._tree is None else self._context

    def with_tree(self, tree_mask: torch.Tensor) -> None:
        """``bias`` allows the keys among the new rows that ``tree_mask`` [B, Q, Q] allows."""
        if tree_mask is self._tree:
            return
        context = self.context_bias
        B, Q, _, S = context.shape
        cols = self.tree_cols
        among = tree_mask[:, :Q].gather(2, cols.clamp_min(0)[:, None, :].expand(B, Q, S)) & (cols >= 0)[:, None, :]
        self._context, self._tree = context, tree_mask
        self.bias = torch.where(among[:, :, None, :], torch.zeros((), dtype=context.dtype), context)
        self._head_bias.clear()

    def from_grid(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Q, ...] -> flat [T, ...]."""
        if self.tok_seq is None:
            return x.flatten(0, 1)
        return x[self.tok_seq, self.tok_pos]


def attention_plan(meta: AttentionMetadata, device: torch.device) -> AttentionPlan:
    """The plan for ``meta``, built from the host lengths on first use and memoised in
    ``meta.scratch`` (where an exported step binds its traced_plan instead), with its tree mask
    applied."""
    plan = meta.scratch.get(PLAN_KEY)
    if plan is None:
        plan = meta.scratch[PLAN_KEY] = _build(meta, device)
    if plan.tree_cols is not None:
        plan.with_tree(meta.tree_mask)
    return plan


@dataclass
class AttentionGroup:
    tokens: torch.Tensor  # [t] int64 flat rows of the group's sequences, in batch order
    meta: AttentionMetadata  # the metadata of those sequences alone (its own plan and cache rows)


def attention_groups(meta: AttentionMetadata, device: torch.device) -> Optional[list[AttentionGroup]]:
    """Mixed batches split for attention: every sequence with more than GROUP_ROWS rows alone,
    the others together; None when one grid serves (at most one sequence, no long one, a tree
    mask). Memoised in ``meta.scratch``."""
    if GROUPS_KEY in meta.scratch:
        return meta.scratch[GROUPS_KEY]
    q_lens = np.asarray(meta.q_lens_host, dtype=np.int64)
    groups = None
    if len(q_lens) > 1 and q_lens.max() > GROUP_ROWS and meta.tree_mask is None:
        long = np.flatnonzero(q_lens > GROUP_ROWS)
        short = np.flatnonzero(q_lens <= GROUP_ROWS)
        members = ([short] if len(short) else []) + [long[i : i + 1] for i in range(len(long))]
        groups = [_group(meta, idx, q_lens, device) for idx in members]
    meta.scratch[GROUPS_KEY] = groups
    return groups


def _group(meta: AttentionMetadata, idx: np.ndarray, q_lens: np.ndarray, device: torch.device) -> AttentionGroup:
    starts = np.cumsum(q_lens) - q_lens
    tokens = np.concatenate([np.arange(starts[b], starts[b] + q_lens[b]) for b in idx])
    sel = _tensor(idx, meta.block_tables.device)
    sub_q = q_lens[idx]
    sub = AttentionMetadata(
        slots=meta.slots[_tensor(tokens, meta.slots.device)],
        block_tables=meta.block_tables[sel],
        seq_lens=meta.seq_lens[sel],
        q_lens=meta.q_lens[sel],
        q_start_loc=_tensor(np.concatenate([[0], np.cumsum(sub_q)]).astype(np.int32), meta.q_start_loc.device),
        seq_lens_host=[meta.seq_lens_host[b] for b in idx],
        q_lens_host=sub_q.tolist(),
        is_prefill=False,
        block_size=meta.block_size,
    )
    return AttentionGroup(_tensor(tokens, device), sub)


def cache_rows(meta: AttentionMetadata, block_size: int, device: torch.device) -> torch.Tensor:
    """[B, S] int64 flat cache row (block * block_size + offset) of every key of every sequence;
    keys past a sequence's length read row 0 (masked by the plan's bias)."""
    key = (ROWS_KEY, block_size)
    rows = meta.scratch.get(key)
    if rows is None:
        seq_lens = np.asarray(meta.seq_lens_host, dtype=np.int64)
        rows = meta.scratch[key] = _tensor(_cache_rows(meta, seq_lens, block_size, meta.max_seq_len), device)
    return rows


# The plan is built with numpy from the host lengths: a dozen numpy ops on arrays of a few hundred
# entries cost ~1 us each against 2-4 us for the same torch ops, and a speculative step builds
# one plan per draft stage plus the verification's (59 -> 21 us per plan at batch 1, README).
def _tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(a).to(device)  # every array here is freshly made and contiguous; no copy on the cpu


def grid_indices(meta: AttentionMetadata, device: torch.device) -> tuple[Optional[torch.Tensor], ...]:
    """(tok_seq, tok_pos) [T] of the plan: each flat token's grid cell; (None, None) when every
    sequence has the same q_len (the grid is a reshape)."""
    if min(meta.q_lens_host, default=0) == meta.max_q_len:
        return None, None
    q_lens = np.asarray(meta.q_lens_host, dtype=np.int64)
    seq = np.repeat(np.arange(len(q_lens)), q_lens)
    starts = np.cumsum(q_lens) - q_lens
    return _tensor(seq, device), _tensor(np.arange(len(seq)) - starts[seq], device)


def _build(meta: AttentionMetadata, device: torch.device) -> AttentionPlan:
    B, Q, S = meta.num_seqs, meta.max_q_len, meta.max_seq_len
    q_lens = np.asarray(meta.q_lens_host, dtype=np.int64)
    seq_lens = np.asarray(meta.seq_lens_host, dtype=np.int64)
    tok_seq, tok_pos = grid_indices(meta, device)
    tree_cols = None
    if meta.tree_mask is not None:
        tree_cols = _tensor(_tree_cols(q_lens, seq_lens, S), device)
    return AttentionPlan(
        num_seqs=B, max_q=Q, max_s=S, tok_seq=tok_seq, tok_pos=tok_pos,
        bias=_tensor(_bias(meta, q_lens, seq_lens, Q, S), device), tree_cols=tree_cols,
    )


def _cache_rows(meta: AttentionMetadata, seq_lens: np.ndarray, block_size: int, S: int) -> np.ndarray:
    s = np.arange(S)
    n_blocks = -(-S // block_size)
    tables = meta.block_tables.cpu().numpy()[:, :n_blocks].astype(np.int64)  # [B, n_blocks]
    if tables.shape[1] < n_blocks:  # a table narrower than the longest sequence: only padding reads it
        tables = np.pad(tables, ((0, 0), (0, n_blocks - tables.shape[1])))
    rows = tables[:, s // block_size] * block_size + s % block_size  # [B, S]
    # Unused table entries may hold anything: never let a masked key index outside the cache.
    return np.where(s[None, :] < seq_lens[:, None], rows, 0)


def _bias(meta: AttentionMetadata, q_lens: np.ndarray, seq_lens: np.ndarray, Q: int, S: int) -> np.ndarray:
    """Key s is visible to new token i of sequence b when s < seq_len and s is context, or
    (bottom-right causal) s <= ctx + i; with a tree mask, only context here (``with_tree`` adds
    the new tokens the mask allows)."""
    k_idx = np.arange(S)[None, None, :]
    i_idx = np.arange(Q)[None, :, None]
    ctx = (seq_lens - q_lens)[:, None, None]  # cached tokens before the new ones
    in_seq = k_idx < seq_lens[:, None, None]
    among_new = k_idx <= ctx + i_idx if meta.tree_mask is None else False
    allowed = in_seq & ((k_idx < ctx) | among_new)
    # Padding query cells (i >= q_len) are dropped later; let them see key 0 so softmax has no NaN.
    allowed = allowed | ((i_idx >= q_lens[:, None, None]) & (k_idx == 0))
    bias = np.where(allowed, np.float32(0), np.float32(-np.inf))
    return bias.reshape(len(q_lens), Q, 1, S)  # [B, Q, 1, S]


def _tree_cols(q_lens: np.ndarray, seq_lens: np.ndarray, S: int) -> np.ndarray:
    """[B, S] the column of key s among the sequence's new rows, -1 outside them."""
    col = np.arange(S)[None, :] - (seq_lens - q_lens)[:, None]
    return np.where((col >= 0) & (col < q_lens[:, None]), col, -1).astype(np.int64)


# ---- the plan as tensor ops: what an exported step computes inside ---------------------------
# The same values as _bias, _cache_rows and _tree_cols, from the metadata's device tensors, so a
# compiled step takes its lengths and tables as inputs and the host builds no plan. The key
# count S is the size of ``key_index`` (arange(S)): the step's one dynamic size.


def traced_plan(meta: AttentionMetadata, key_index: torch.Tensor, tok_seq: Optional[torch.Tensor] = None,
                tok_pos: Optional[torch.Tensor] = None) -> tuple[AttentionPlan, torch.Tensor]:
    """-> (the plan, cache rows [B, S]) of ``meta`` (its seq_lens, q_lens and block_tables
    tensors; max_q_len from the host lengths), a tree mask's columns included when it has one."""
    seq_lens = meta.seq_lens.to(torch.int64)[:, None]  # [B, 1]
    q_lens = meta.q_lens.to(torch.int64)[:, None]
    ctx = seq_lens - q_lens  # cached tokens before the new ones
    k = key_index[None, :]  # [1, S]
    in_seq = k < seq_lens  # [B, S]
    columns = (key_index // meta.block_size).clamp_max(meta.block_tables.shape[1] - 1)
    table = meta.block_tables.to(torch.int64)[:, columns]  # [B, S]
    rows = torch.where(in_seq, table * meta.block_size + k % meta.block_size, 0)
    i = torch.arange(meta.max_q_len, device=key_index.device)[None, :, None]  # [1, Q, 1]
    allowed = in_seq[:, None, :] & (k[:, None, :] < ctx[:, :, None])
    if meta.tree_mask is None:  # bottom-right causal among the new tokens
        allowed = allowed | (in_seq[:, None, :] & (k[:, None, :] <= ctx[:, :, None] + i))
    allowed = allowed | ((i >= q_lens[:, :, None]) & (k[:, None, :] == 0))  # padding cells see key 0
    bias = torch.where(allowed, 0.0, float("-inf")).to(torch.float32)[:, :, None, :]  # [B, Q, 1, S]
    tree_cols = None
    if meta.tree_mask is not None:
        col = k - ctx
        tree_cols = torch.where((col >= 0) & (col < q_lens), col, -1)
    plan = AttentionPlan(num_seqs=meta.num_seqs, max_q=meta.max_q_len, max_s=0, tok_seq=tok_seq, tok_pos=tok_pos,
                         bias=bias, tree_cols=tree_cols)
    return plan, rows
