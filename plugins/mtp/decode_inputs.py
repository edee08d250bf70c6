"""Host-side MTP inputs for one decode step (numpy, vectorised over sequences).

Per sequence with n tokens, whose last ``a`` tokens have no MTP cache entry yet (the tokens the
last step accepted: 1 after prefill; more after steps that ran without speculation):
- main ``model_inputs``: K+1 rows [t(n-1), d1..dK] at positions n-1..n-1+K (drafts filled in
  on the device), or fewer where a sequence verifies fewer drafts than the step made (adaptive
  speculation's per-sequence counts); every row gets logits.
- ``sub_model_inputs``: one ModelInputs per MTP step over the same rows. MTP cache entry i holds
  (t(i+1), h(i)) at rope position i (mindspec's convention; MindIE's code uses i+1: RoPE is
  relative, so either is exact when used everywhere). Rows are ``h`` history entries, the ``a``
  entries made valid by last step's accepted tokens (ending at entry n-2, the lm_head row), then
  padding up to K+1 entries after the history (more when a > K+1). Padding rows never write the
  cache (slot -1).
  * eagle (one module reused): step s shifts positions, context lengths and the lm_head slot by s,
    and only the lm_head row writes, so entries written from verified tokens are never
    overwritten by draft-conditioned ones.
  * vanilla (module s at step s, own cache): same rows every step. Module s's entry i pairs
    t(i+1+s) with module s-1's output at i; entries written from drafts become stale when drafts
    are rejected, so the window starts ``h = min(K-1, start)`` entries early and rewrites them.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import chain
from typing import Optional

import numpy as np

from mindspec.modeling.forward_metadata import ModelInputs, pad_block_tables, row_grid, slots_for


@dataclass
class DecodeLayout:
    """Row bookkeeping shared by the plugin and the trace tool."""

    num_tokens: np.ndarray  # [B] n
    last_accepted: np.ndarray  # [B] a
    history: np.ndarray  # [B] h
    start: np.ndarray  # [B] first MTP entry index of the window
    sub_q_lens: np.ndarray  # [B] h + max(a, K + 1)
    sub_lm_rows: np.ndarray  # [B] flat row of each sequence's lm_head entry (n-2)

    @functools.cached_property
    def window_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(seq index, MTP entry, valid) per sub row [sum(sub_q_lens)]: row i of sequence b's
        window is entry start[b] + i, valid for its first h + a rows (the sub inputs' rows and
        the hidden states they read)."""
        seq_idx, offsets = row_grid(self.sub_q_lens)
        valid = offsets < (self.history + self.last_accepted)[seq_idx]
        return seq_idx, self.start[seq_idx] + offsets, valid


def decode_layout(
    num_tokens: np.ndarray, last_accepted: np.ndarray, k: int, mode: str, hidden_from: np.ndarray | None = None
) -> DecodeLayout:
    """hidden_from [B]: first position whose main hidden state this node has (0, or the hand-off
    point of a sequence prefilled on another node); history never reaches before it."""
    base = num_tokens - last_accepted - 1  # entry of the first newly valid row
    floor = np.zeros_like(base) if hidden_from is None else hidden_from
    history = np.maximum(np.minimum(k - 1, base - floor), 0) if mode == "vanilla" else np.zeros_like(base)
    sub_q = history + np.maximum(last_accepted, k + 1)
    offsets = np.cumsum(sub_q) - sub_q
    return DecodeLayout(
        num_tokens=num_tokens,
        last_accepted=last_accepted,
        history=history,
        start=base - history,
        sub_q_lens=sub_q.astype(np.int32),
        sub_lm_rows=(offsets + history + last_accepted - 1).astype(np.int64),
    )


def main_inputs(last_tokens: np.ndarray, num_tokens: np.ndarray, tables: np.ndarray, block_size: int,
                counts: int | np.ndarray, host_drafts: Optional[dict[int, list[int]]] = None) -> ModelInputs:
    """Sequence b verifies counts[b] drafts (or ``counts`` each): rows [t(n-1), d1..d_counts[b]]
    (ragged q_lens when the counts differ; the model places each MTP draft by
    ``draft_rows.verify_source``). ``host_drafts`` {b: drafts}: sequences that verify drafts made
    on the host instead (counts[b] = len(drafts)), written into their rows here."""
    counts = np.asarray(counts, dtype=np.int64)
    rows = _verify_rows((counts if counts.ndim else np.full(len(num_tokens), counts)).tobytes())
    q_lens, first = rows.q_lens, rows.first
    positions = (num_tokens - 1)[rows.seq_idx] + rows.offsets
    ids = np.zeros(len(positions), dtype=np.int64)
    ids[first] = last_tokens  # MTP drafts go to the other rows inside the model
    in_inputs = None
    if host_drafts:
        in_inputs = np.zeros(len(num_tokens), dtype=bool)
        for b, drafts in host_drafts.items():
            ids[first[b] + 1 : first[b] + 1 + len(drafts)] = drafts
            in_inputs[b] = True
    return ModelInputs(
        input_ids=ids,
        positions=positions,
        slots=slots_for(tables, rows.seq_idx, positions, block_size),
        block_tables=tables,
        seq_lens=(num_tokens - 1 + q_lens).astype(np.int32),
        q_lens=q_lens,
        lm_head_indices=rows.every,
        is_prefill=False,
        block_size=block_size,
        drafts_in_inputs=in_inputs,
    )


@dataclass(frozen=True)
class _VerifyRows:
    """The row structure of a verification whose sequence b verifies counts[b] drafts (read-only,
    kept per counts: steps repeat a few)."""

    q_lens: np.ndarray  # [B] int32 counts + 1
    seq_idx: np.ndarray  # [R] each row's sequence
    offsets: np.ndarray  # [R] each row's place in its sequence
    first: np.ndarray  # [B] each sequence's first row
    every: np.ndarray  # [R] 0..R-1: every row is an lm_head row


@functools.lru_cache(maxsize=256)
def _verify_rows(counts_key: bytes) -> _VerifyRows:
    q_lens = (np.frombuffer(counts_key, dtype=np.int64) + 1).astype(np.int32)
    seq_idx, offsets = row_grid(q_lens)
    rows = _VerifyRows(q_lens, seq_idx, offsets, np.cumsum(q_lens, dtype=np.int64) - q_lens,
                       np.arange(len(seq_idx), dtype=np.int64))
    for a in (rows.q_lens, rows.first, rows.every):
        a.setflags(write=False)
    return rows


def verify_grid(counts: np.ndarray, k: int) -> np.ndarray:
    """[B, k + 1] flat verification row of each sequence's position j, for j past its counts[b]
    its last row (so [B, k + 1] views of targets and probabilities hold only real rows).
    Shared and read-only: kept per counts, which steps repeat."""
    return _verify_grid(np.asarray(counts, dtype=np.int64).tobytes(), k)


@functools.lru_cache(maxsize=256)
def _verify_grid(counts_key: bytes, k: int) -> np.ndarray:
    rows = np.frombuffer(counts_key, dtype=np.int64) + 1
    first = np.cumsum(rows) - rows
    grid = first[:, None] + np.minimum(np.arange(k + 1)[None, :], rows[:, None] - 1)
    grid.setflags(write=False)
    return grid


def window_tokens(seqs, layout: DecodeLayout) -> list[list[int]]:
    """Each sequence's tokens from its window's first entry's token on (entry i carries token
    i + 1): what ``sub_inputs`` and the tree steps read, without copying the whole sequence."""
    return [s.tokens_from(window_offset(start)) for s, start in zip(seqs, layout.start.tolist())]


def window_offset(start: int) -> int:
    """The position of the first token ``window_tokens`` gives for a window starting at ``start``."""
    return max(0, start + 1)


def sub_inputs(
    token_ids: list[list[int]],
    layout: DecodeLayout,
    tables: np.ndarray,
    block_size: int,
    k: int,
    mode: str,
    hidden_from: np.ndarray | None = None,
    dummy_block_id: int | None = None,
) -> list[ModelInputs]:
    """One ModelInputs per MTP step; step 0 carries the tokens (``token_ids[b]``: sequence b's
    last tokens, at least the h + a its window feeds, e.g. ``window_tokens``), later steps'
    tokens come from the device-side roll (their own are never read: MTP Vanilla's later steps
    are step 0's inputs again).

    Rows whose hidden state this node does not have (positions before ``hidden_from``: the first
    decode of a sequence prefilled on another node, fed zeros) write to the dummy block, so the MTP
    KV received from the prefill node is not overwritten (seed 000, PD disaggregation)."""
    q_lens = layout.sub_q_lens
    seq_idx, positions, valid = layout.window_rows
    valid_rows = (layout.history + layout.last_accepted).tolist()
    ids = np.zeros(len(positions), dtype=np.int64)
    # entry i carries token i + 1: each sequence's valid rows (its first) take its last h + a tokens
    ids[valid] = np.fromiter(chain.from_iterable(t[len(t) - v:] for t, v in zip(token_ids, valid_rows)),
                             dtype=np.int64, count=sum(valid_rows))
    slots = np.where(valid, slots_for(tables, seq_idx, np.maximum(positions, 0), block_size), -1)
    if hidden_from is not None and dummy_block_id is not None and hidden_from.any():
        blind = valid & (positions < hidden_from[seq_idx])
        slots = np.where(blind, dummy_block_id * block_size + positions % block_size, slots)
    seq_lens = (layout.start + q_lens).astype(np.int32)
    # Eagle's later steps see up to K-1 positions past the main model's last one, on padding rows
    # only (causal: the lm_head rows never look there); widen the table so every op can index them.
    tables = _widen(tables, int(seq_lens.max()) + (k - 1 if mode == "eagle" else 0), block_size)
    lm = layout.sub_lm_rows
    step0 = ModelInputs(input_ids=ids, positions=positions, slots=slots, block_tables=tables, seq_lens=seq_lens,
                        q_lens=q_lens, lm_head_indices=lm, is_prefill=False, block_size=block_size)
    if mode != "eagle":  # vanilla: every step has step 0's rows, its tokens rolled in on the device
        return [step0] * k
    # Eagle's step s: positions and lengths shifted by s, only the lm_head rows write (at their
    # shifted positions); its tokens are rolled in on the device (these zeros are never read).
    shifts = np.arange(1, k)
    lm_slots = slots_for(tables, np.repeat(np.arange(len(lm)), k - 1), (positions[lm][:, None] + shifts).reshape(-1),
                         block_size).reshape(len(lm), k - 1)  # [B, k - 1]
    later_ids = np.zeros_like(ids)
    steps = [step0]
    for s in range(1, k):
        step_slots = np.full_like(slots, -1)
        step_slots[lm] = lm_slots[:, s - 1]
        steps.append(step0.with_(input_ids=later_ids, positions=positions + s, slots=step_slots, seq_lens=seq_lens + s))
    return steps


def _widen(tables: np.ndarray, max_len: int, block_size: int) -> np.ndarray:
    need = -(-max_len // block_size)
    if need <= tables.shape[1]:
        return tables
    return np.pad(tables, ((0, 0), (0, need - tables.shape[1])))


def hidden_rows(layout: DecodeLayout) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(seq index, hidden position, valid) per sub row: row i of the window needs h(start + i)."""
    return layout.window_rows


def block_tables(tables: list[list[int]]) -> np.ndarray:
    return pad_block_tables(tables)
