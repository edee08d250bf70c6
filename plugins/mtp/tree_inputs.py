"""Host-side inputs of a tree speculation step (numpy; the device side: modeling/tree_speculation.py).

Per sequence with n tokens whose last ``a`` lack an MTP entry (decode_inputs' window: entries
start .. n-2, the last pairing the fed token t(n-1) with h(n-2)):

- step 0: the window rows, no padding; its last row is the root (lm_head row).
- MTP Vanilla step d >= 1 (module d): the window entries start .. n-2-d, whose token t(i+1+d) is
  verified (module d's later entries pair draft tokens, so they are the tree rows of the path),
  then the tree rows: every expanded node of depth e = 1..d at position n-2-d+e. Cache indices
  follow the window; entries they overwrite pair drafts and are rewritten by the next step's
  history (the window reaches K-1 entries back).
- MTP Eagle step d >= 1: the tree rows alone at positions n-2+e, after the context (entries
  before n-1, written by step 0); the root's output is step 0's.
- verification: plugins/tree_verify.py's ``verification_inputs``.

Rows whose position precedes ``hidden_from`` (no hidden state here: a PD hand-off, a shared
prefix) write to the dummy block, as the chain's do.
"""
from __future__ import annotations

import numpy as np

from mindspec.modeling.draft_tree import TreeShape
from mindspec.modeling.forward_metadata import ModelInputs, slots_for, token_positions
from mindspec.modeling.tree_speculation import TreeStepHost

from .decode_inputs import DecodeLayout, window_offset


def draft_steps(token_ids: list[list[int]], layout: DecodeLayout, tables: np.ndarray, block_size: int,
                shape: TreeShape, eagle: bool, hidden_from: np.ndarray, dummy_block_id: int) -> list[TreeStepHost]:
    """``token_ids[b]``: sequence b's tokens from its window on (decode_inputs.window_tokens)."""
    n = layout.num_tokens
    start = layout.start
    steps = []
    prev_rows = prev_tree_first = prev_window = None
    block_depth = np.repeat(np.arange(1, shape.depth), shape.expanded[1:])  # depth of each tree row
    for d in range(shape.depth):
        if d == 0:
            window = n - 1 - start
        else:
            window = np.zeros_like(n) if eagle else np.maximum(0, n - 1 - d - start)
        tree = 0 if d == 0 else int(sum(shape.expanded[1 : d + 1]))
        depths = block_depth[:tree]
        q_lens = (window + tree).astype(np.int32)
        first = np.cumsum(q_lens) - q_lens
        # cache index of each sequence's first new row; tree rows follow the window
        c0 = start if d == 0 else (n - 1 if eagle else np.minimum(start, n - 1 - d))
        seq_idx, cache_idx = token_positions(c0, q_lens)
        row = np.arange(len(seq_idx)) - np.repeat(first, q_lens)  # row within its sequence
        is_tree = row >= np.repeat(window, q_lens)
        tree_row = np.where(is_tree, row - np.repeat(window, q_lens), 0)
        positions = np.where(is_tree, np.repeat(n - 2 if eagle else n - 2 - d, q_lens) + depths[tree_row] if tree else 0,
                             cache_idx)
        # MTP Vanilla: a node's entry in module d lies before position 0 when the sequence is
        # shorter than the path (a chain has no such entry): it writes nothing and no row sees it
        before_start = is_tree & (positions < 0)
        positions = np.maximum(positions, 0)
        ids = np.zeros(len(seq_idx), dtype=np.int64)
        for b, toks in enumerate(token_ids):  # window entry i pairs token i + 1 + d
            w, at = int(window[b]), int(start[b]) + 1 + d - window_offset(int(start[b]))
            ids[first[b] : first[b] + w] = toks[at : at + w]
        slots = slots_for(tables, seq_idx, cache_idx, block_size)
        blind = positions < np.repeat(hidden_from, q_lens)
        slots = np.where(blind, dummy_block_id * block_size + cache_idx % block_size, slots)
        slots = np.where(before_start, -1, slots)
        tree_first = first + window
        if d == 0:
            lm = first + window - 1
            window_src = np.full(len(seq_idx), -1, dtype=np.int64)
            root_src = np.zeros(len(n), dtype=np.int64)
        else:
            lm = (tree_first[:, None] + int(sum(shape.expanded[1:d])) + np.arange(shape.expanded[d])).reshape(-1)
            # window row i of this step reads the previous step's row of the same entry
            offset = np.repeat(prev_tree_first - prev_window, q_lens) + row
            window_src = np.where(is_tree, -1, offset)
            has_root = (prev_window > 0) & (not eagle)
            root_src = np.where(has_root, prev_tree_first - 1, prev_rows + np.arange(len(n)))
        steps.append(TreeStepHost(
            module_idx=0 if eagle else d,
            inputs=ModelInputs(
                input_ids=ids, positions=positions.astype(np.int64), slots=slots, block_tables=tables,
                seq_lens=(c0 + q_lens).astype(np.int32), q_lens=q_lens, lm_head_indices=lm.astype(np.int64),
                is_prefill=False, block_size=block_size,
            ),
            window_src=window_src.astype(np.int64), window_lens=window.astype(np.int64),
            tree_first=tree_first.astype(np.int64), root_src=root_src.astype(np.int64),
            tree_visible=(~before_start[is_tree]).reshape(len(n), tree),
        ))
        prev_rows, prev_tree_first, prev_window = len(seq_idx), tree_first, window
    return steps


def hidden_positions(layout: DecodeLayout) -> tuple[np.ndarray, np.ndarray]:
    """(seq index, position) of step 0's rows: the main hidden state each one takes."""
    return token_positions(layout.start, (layout.num_tokens - 1 - layout.start).astype(np.int64))
