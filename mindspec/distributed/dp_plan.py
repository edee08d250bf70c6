"""Attention data parallel on the host: which rank keeps which sequence, and this rank's padded
share of a flat batch (MindIE generator_torch: _dp_partition_data, the dummy "陪跑" input,
_lm_head_local_dp_calc). numpy only; every rank computes the same plan from the same batch.

- A sequence stays on one rank for its life (its KV cache lives there). Owners are keyed by the
  sequence's first KV block, which is unique among live sequences and never changes while the
  sequence holds KV; a sequence with no cached context (new, or recomputed after preemption) is
  (re)assigned to the least-loaded rank.
- Each rank keeps its sequences in batch order; lm_head rows are re-based to its share.
- Every rank is padded to the same token count (the MoE collectives need equal shapes) with dummy
  sequences on the reserved block; a rank with no sequences runs only dummies. Real rows come
  first on every rank, so outputs are un-padded by keeping a prefix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from mindspec.modeling.forward_metadata import ModelInputs
from mindspec.modeling.tree_speculation import TreeStepHost

LM_LAST, LM_ALL, LM_FIRST, LM_NONE = "last", "all", "first", "none"  # logits rows of a dummy sequence


class DpAssigner:
    """Sticky sequence -> dp rank map (identical on every rank: same batches, same decisions)."""

    def __init__(self, dp_size: int):
        self.dp_size = dp_size
        self.owner: dict[int, int] = {}  # first KV block of a sequence -> rank
        self.load = np.zeros(dp_size, dtype=np.int64)  # running sequences per rank (for balance only)

    def assign(self, inputs: ModelInputs) -> np.ndarray:
        """-> owner rank per sequence [B]."""
        first_blocks = inputs.block_tables[:, 0].tolist() if inputs.num_seqs else []
        fresh = (inputs.seq_lens - inputs.q_lens) == 0  # no cached context: its KV is made here
        owners = np.empty(inputs.num_seqs, dtype=np.int64)
        if not fresh.all():  # a decode-type batch lists the running sequences: reset the load
            self.load[:] = 0
        for b, block in enumerate(first_blocks):
            rank = None if fresh[b] else self.owner.get(block)
            if rank is None:  # new; or prefilled on another node (its KV was written on every rank)
                rank = int(np.argmin(self.load))
                self.owner[block] = rank
            owners[b] = rank
            self.load[rank] += 1
        return owners


@dataclass
class RankRows:
    """One rank's real rows in the global batch, in batch order (its local rows 0..n-1)."""

    seqs: np.ndarray  # [b] global sequence indices
    token_rows: np.ndarray  # [t] global token rows
    lm_rows: np.ndarray  # [n] indices into the global lm_head_indices


def rank_rows(inputs: ModelInputs, owners: np.ndarray, rank: int) -> RankRows:
    tok_seq = np.repeat(np.arange(inputs.num_seqs), inputs.q_lens)  # [T]
    mine = owners == rank
    lm_seq = tok_seq[inputs.lm_head_indices]
    return RankRows(
        seqs=np.flatnonzero(mine),
        token_rows=np.flatnonzero(mine[tok_seq]),
        lm_rows=np.flatnonzero(mine[lm_seq]),
    )


def local_inputs(inputs: ModelInputs, rows: RankRows) -> ModelInputs:
    """The rank's real sequences only; lm_head_indices re-based to its rows."""
    local_row = np.full(inputs.num_tokens, -1, dtype=np.int64)
    local_row[rows.token_rows] = np.arange(len(rows.token_rows))
    own = inputs.drafts_in_inputs
    return inputs.with_(
        drafts_in_inputs=None if own is None else own[rows.seqs],
        input_ids=inputs.input_ids[rows.token_rows],
        positions=inputs.positions[rows.token_rows],
        slots=inputs.slots[rows.token_rows],
        block_tables=inputs.block_tables[rows.seqs],
        seq_lens=inputs.seq_lens[rows.seqs],
        q_lens=inputs.q_lens[rows.seqs],
        lm_head_indices=local_row[inputs.lm_head_indices[rows.lm_rows]],
    )


def lm_head_local_dp(sub_inputs: ModelInputs, owners: np.ndarray, rank: int) -> np.ndarray:
    """The drafter's lm_head rows of ``rank``'s sequences, re-based to its share (seed 000's name)."""
    return local_inputs(sub_inputs, rank_rows(sub_inputs, owners, rank)).lm_head_indices


def dummy_inputs(
    q_lens: list[int], lm: list[str], dummy_block: int, block_size: int, is_prefill: bool, min_width: int = 1,
    own_rows: Optional[list[bool]] = None,
) -> ModelInputs:
    """Dummy sequences on the reserved block: token 0 at positions 0..q-1, writing only there
    (every entry of their block tables is the reserved block). ``own_rows``: per dummy, whether a
    verification feeds its rows their own token (drafts_in_inputs) rather than MTP drafts."""
    q = np.asarray(q_lens, dtype=np.int64)
    starts = np.cumsum(q) - q
    positions = np.arange(int(q.sum())) - np.repeat(starts, q)
    width = max(min_width, -(-int(q.max(initial=1)) // block_size))
    rows = {LM_LAST: lambda s, n: [s + n - 1], LM_ALL: lambda s, n: list(range(s, s + n)),
            LM_FIRST: lambda s, n: [s], LM_NONE: lambda s, n: []}
    lm_rows = [r for s, n, mode in zip(starts.tolist(), q.tolist(), lm) for r in rows[mode](s, n)]
    return ModelInputs(
        input_ids=np.zeros(len(positions), dtype=np.int64),
        positions=positions,
        slots=dummy_block * block_size + positions % block_size,
        block_tables=np.full((len(q), width), dummy_block, dtype=np.int32),
        seq_lens=q.astype(np.int32),
        q_lens=q.astype(np.int32),
        lm_head_indices=np.asarray(lm_rows, dtype=np.int64),
        is_prefill=is_prefill,
        block_size=block_size,
        drafts_in_inputs=None if own_rows is None else np.asarray(own_rows, dtype=bool),
    )


def concat(a: ModelInputs, b: ModelInputs) -> ModelInputs:
    """Sequences of ``a`` then ``b`` in one flat batch (tables padded with 0 to one width)."""
    width = max(a.block_tables.shape[1], b.block_tables.shape[1])

    def widen(t: np.ndarray) -> np.ndarray:
        return np.pad(t, ((0, 0), (0, width - t.shape[1])))

    own = None
    if a.drafts_in_inputs is not None or b.drafts_in_inputs is not None:
        own = np.concatenate([_own_rows(a), _own_rows(b)])
    return a.with_(
        drafts_in_inputs=own,
        input_ids=np.concatenate([a.input_ids, b.input_ids]),
        positions=np.concatenate([a.positions, b.positions]),
        slots=np.concatenate([a.slots, b.slots]),
        block_tables=np.concatenate([widen(a.block_tables), widen(b.block_tables)]),
        seq_lens=np.concatenate([a.seq_lens, b.seq_lens]).astype(np.int32),
        q_lens=np.concatenate([a.q_lens, b.q_lens]).astype(np.int32),
        lm_head_indices=np.concatenate([a.lm_head_indices, b.lm_head_indices + a.num_tokens]).astype(np.int64),
    )


def _own_rows(inputs: ModelInputs) -> np.ndarray:
    own = inputs.drafts_in_inputs
    return np.zeros(inputs.num_seqs, dtype=bool) if own is None else own


@dataclass
class Padding:
    """Dummy sequences appended to one rank's share: main inputs, and drafter inputs (decode)."""

    main_q_lens: list[int]
    main_lm: list[str]
    sub_q_lens: list[int]
    sub_lm: list[str]
    main_own_rows: Optional[list[bool]] = None  # per main dummy: its rows feed their own token


def plain_padding(num_tokens: list[int]) -> list[Padding]:
    """Prefill / plain decode: one dummy sequence brings each rank to the largest token count; it
    has one logits row (so no rank runs an empty lm_head). An idle rank runs that dummy alone."""
    target = max(max(num_tokens), 1)
    return [Padding([target - t] if t < target else [], [LM_LAST] if t < target else [], [], []) for t in num_tokens]


def speculative_padding(num_seqs: list[int], num_sub_tokens: list[int], rows_per_seq: int,
                        num_main_tokens: Optional[list[int]] = None) -> list[Padding]:
    """MTP decode: ranks are equalised in whole dummy sequences of ``rows_per_seq`` (K+1) main
    rows, each with a drafter entry (its lm row first), so every rank's drafter has one lm row per
    sequence; a last drafter-only dummy (no lm row) equalises the drafter rows. ``num_main_tokens``:
    the ranks' main rows where sequences verify unequal numbers of drafts (ragged rows, suffix
    drafts); a last main-only dummy (no drafter entry, no logits row, its rows feed their own
    token) then equalises the main rows."""
    target = max(max(num_seqs), 1)
    out = []
    for b, ts in zip(num_seqs, num_sub_tokens):
        extra = target - b
        out.append(Padding([rows_per_seq] * extra, [LM_ALL] * extra, [rows_per_seq] * extra, [LM_FIRST] * extra))
    sub_totals = [ts + (target - b) * rows_per_seq for b, ts in zip(num_seqs, num_sub_tokens)]
    for pad, gap in zip(out, _shortfalls(sub_totals)):
        if gap:
            pad.sub_q_lens.append(gap)
            pad.sub_lm.append(LM_NONE)
    if num_main_tokens is not None:
        main_totals = [t + (target - b) * rows_per_seq for b, t in zip(num_seqs, num_main_tokens)]
        for pad, gap in zip(out, _shortfalls(main_totals)):
            pad.main_own_rows = [False] * len(pad.main_q_lens) + ([True] if gap else [])
            if gap:
                pad.main_q_lens.append(gap)
                pad.main_lm.append(LM_NONE)
    return out


def _shortfalls(totals: list[int]) -> list[int]:
    """Rows each rank lacks to the largest count."""
    most = max(totals)
    return [most - t for t in totals]


def padded(inputs: ModelInputs, q_lens: list[int], lm: list[str], dummy_block: int, block_size: int,
           own_rows: Optional[list[bool]] = None) -> ModelInputs:
    if not q_lens:
        return inputs
    dummies = dummy_inputs(q_lens, lm, dummy_block, block_size, inputs.is_prefill, inputs.block_tables.shape[1],
                           own_rows)
    return concat(inputs, dummies)


@dataclass
class DpShard:
    """This rank's inputs for one forward and every rank's rows, to put outputs back."""

    main: ModelInputs
    subs: Optional[list[ModelInputs]]  # drafter steps (MTP decode)
    hidden_rows: Optional[np.ndarray]  # global drafter rows whose hidden states this rank needs
    num_sub_pad: int  # drafter rows appended after them
    rows: list[RankRows]  # per rank, main inputs (drafts come back per sequence: rows[r].seqs)


def shard(
    main: ModelInputs,
    subs: Optional[list[ModelInputs]],
    owners: np.ndarray,
    rank: int,
    dp_size: int,
    dummy_block: int,
    block_size: int,
) -> DpShard:
    rows = [rank_rows(main, owners, r) for r in range(dp_size)]
    local = local_inputs(main, rows[rank])
    if subs is None:
        pad = plain_padding([len(r.token_rows) for r in rows])[rank]
        return DpShard(padded(local, pad.main_q_lens, pad.main_lm, dummy_block, block_size), None, None, 0, rows)
    sub_rows = [rank_rows(subs[0], owners, r) for r in range(dp_size)]
    ragged = main.drafts_in_inputs is not None or bool((main.q_lens != main.q_lens[0]).any())
    rows_per_seq = len(subs) + 1 if ragged else int(main.q_lens[0])  # K + 1: a dummy verifies its K drafts
    pad = speculative_padding([len(r.seqs) for r in rows], [len(r.token_rows) for r in sub_rows], rows_per_seq,
                              [len(r.token_rows) for r in rows] if ragged else None)[rank]
    local_subs = [padded(local_inputs(s, sub_rows[rank]), pad.sub_q_lens, pad.sub_lm, dummy_block, block_size)
                  for s in subs]
    return DpShard(
        main=padded(local, pad.main_q_lens, pad.main_lm, dummy_block, block_size, pad.main_own_rows),
        subs=local_subs,
        hidden_rows=sub_rows[rank].token_rows,
        num_sub_pad=int(sum(pad.sub_q_lens)),
        rows=rows,
    )


def tree_shard(steps: list[TreeStepHost], owners: np.ndarray, rank: int) -> tuple[list[TreeStepHost], np.ndarray]:
    """A tree step's draft steps for ``rank``'s sequences alone (no padding: trees run without
    expert parallelism, so ranks need not run equal rows), with every row index re-based to the
    rank's rows -> (local steps, the global rows of step 0 whose hidden states the rank needs)."""
    local_steps, prev_map, prev_global, prev_local = [], None, 0, 0
    for step in steps:
        rows = rank_rows(step.inputs, owners, rank)
        local = local_inputs(step.inputs, rows)
        seqs = rows.seqs
        src = step.window_src[rows.token_rows]
        if prev_map is not None:
            src = np.where(src >= 0, prev_map[np.maximum(src, 0)], -1)
            root = step.root_src[seqs]
            appended = prev_local + np.arange(len(seqs))  # the root or zero row appended per sequence
            root_src = np.where(root < prev_global, prev_map[np.minimum(root, prev_global - 1)], appended)
        else:
            root_src = np.zeros(len(seqs), dtype=np.int64)
        q = local.q_lens.astype(np.int64)
        window = step.window_lens[seqs]
        local_steps.append(TreeStepHost(
            module_idx=step.module_idx, inputs=local, window_src=src.astype(np.int64), window_lens=window,
            tree_first=(np.cumsum(q) - q + window).astype(np.int64), root_src=root_src.astype(np.int64),
            tree_visible=step.tree_visible[seqs],
        ))
        prev_map = np.full(step.inputs.num_tokens, -1, dtype=np.int64)
        prev_map[rows.token_rows] = np.arange(len(rows.token_rows))
        prev_global, prev_local = step.inputs.num_tokens, len(rows.token_rows)
    return local_steps, rank_rows(steps[0].inputs, owners, rank).token_rows
