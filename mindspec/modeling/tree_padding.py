"""A tree speculation step padded to a static shape, for captured graphs and compiled packages.

A tree step's sizes per sequence are the tree's (``TreeShape``: R_d tree rows in draft step d,
N + 1 verification rows) except the draft steps' *windows*, which depend on how many tokens each
sequence accepted last time. Padding makes every sequence of draft step d ``rows[d]`` rows long
(the most a window can need plus R_d: ``draft_rows``) and the batch a bucket of sequences, so a
tree configuration has one shape per bucket:

- a real sequence keeps its rows first (window, then tree rows); the rows after them write
  nothing (slot -1), repeat its last position, feed from no real row and attend only its window
  (``step_mask``), so no real row sees them;
- a padding sequence has a one-row window in step 0 (its root) and tree rows only afterwards,
  one cached token in the dummy block and the dummy block as its whole table; it writes nothing,
  its tokens are the drafter's own top-k, and its outputs are dropped;
- the verification forward is padded as a plain decode step of N + 1 rows (graph_runner.pad_inputs).

Row indices that point into a step's rows (window_src, tree_first, root_src, lm_head_indices) are
re-based to the padded rows; ``root_src`` past the previous step's rows (its appended root or
zero row per sequence) moves to the padded appended rows.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from mindspec.modeling.forward_metadata import ModelInputs
from mindspec.modeling.graph_runner import PadSpec, pad_inputs
from mindspec.modeling.tree_speculation import DraftTree, TreeStepHost


@dataclass(frozen=True)
class TreePad:
    """The static shape of one padded tree step."""

    num_seqs: int  # the bucket
    rows: tuple[int, ...]  # [D] rows per sequence of each draft step
    verify_rows: int  # N + 1: the root and the nodes
    width: int  # block-table columns
    dummy_block: int
    block_size: int


def draft_rows(steps: list[TreeStepHost], depth: int, eagle: bool) -> tuple[int, ...]:
    """Rows per sequence of each draft step: the most any sequence can need, so that one shape
    serves every step of a bucket. Step 0's window is the tokens accepted last time (at most
    depth + 1) plus MTP Vanilla's history (at most depth - 1); MTP Vanilla's step d drops d of
    them, MTP Eagle's later steps have none. A step that needs more (not made by tree_inputs)
    gets its most rows, rounded up to even."""
    window = depth + 1 + (0 if eagle else depth - 1)
    rows = []
    for d, s in enumerate(steps):
        bound = window if d == 0 else (0 if eagle else max(0, window - d))
        most, need = int(s.inputs.q_lens.max()), bound + s.tree_visible.shape[1]
        rows.append(need if most <= need else most + most % 2)
    return tuple(rows)


def pad_tree_step(main: ModelInputs, steps: list[TreeStepHost], pad: TreePad) -> tuple[ModelInputs, list[TreeStepHost], np.ndarray]:
    """-> (padded verification inputs, padded draft steps, the padded row of each of step 0's
    rows [T0]: where its hidden state goes)."""
    nodes = pad.verify_rows
    spec = PadSpec(pad.num_seqs, nodes, pad.num_seqs * nodes, pad.width, pad.dummy_block, pad.block_size)
    padded_main = pad_inputs(main, spec, nodes)
    padded, maps = [], []
    prev_total = prev_padded = prev_tree = 0
    for d, (step, rows) in enumerate(zip(steps, pad.rows)):
        tree = step.tree_visible.shape[1]
        expanded = 1 if d == 0 else tree - prev_tree  # lm_head rows per sequence: the root, then E_d
        new_step, row_map = _pad_draft_step(step, d, rows, expanded, pad, maps[-1] if maps else None, prev_total,
                                            prev_padded)
        padded.append(new_step)
        maps.append(row_map)
        prev_total, prev_padded, prev_tree = step.inputs.num_tokens, pad.num_seqs * rows, tree
    return padded_main, padded, maps[0]


def _pad_draft_step(step: TreeStepHost, d: int, rows: int, expanded: int, pad: TreePad, prev_map, prev_total: int,
                    prev_padded: int) -> tuple[TreeStepHost, np.ndarray]:
    x = step.inputs
    real, seqs = x.num_seqs, pad.num_seqs
    q = x.q_lens.astype(np.int64)
    if (q > rows).any():
        raise ValueError(f"draft step {d}: q_lens {q.tolist()} exceed {rows} rows per sequence")
    tree = step.tree_visible.shape[1]
    seq_idx = np.repeat(np.arange(real), q)
    row_map = seq_idx * rows + np.arange(len(seq_idx)) - np.repeat(np.cumsum(q) - q, q)
    total = seqs * rows
    last = x.positions[np.cumsum(q) - 1] if real else np.zeros(0, dtype=np.int64)

    def spread(values: np.ndarray, real_fill, pad_fill) -> np.ndarray:
        out = np.concatenate([np.repeat(np.asarray(real_fill), rows) if np.ndim(real_fill) else
                              np.full(real * rows, real_fill), np.full(total - real * rows, pad_fill)])
        out[row_map] = values
        return out.astype(values.dtype)

    pad_seqs = np.arange(real, seqs)
    pad_window = 1 if d == 0 else 0  # step 0: the root alone; later steps: tree rows alone
    window = np.concatenate([step.window_lens, np.full(len(pad_seqs), pad_window)]).astype(np.int64)
    tree_first = np.arange(seqs, dtype=np.int64) * rows + window
    # a padding sequence's lm_head rows: its root (step 0), then its deepest tree rows
    pad_lm = pad_seqs * rows if d == 0 else (tree_first[real:, None] + tree - expanded + np.arange(expanded)).reshape(-1)
    window_src = step.window_src
    if prev_map is not None:
        window_src = np.where(window_src >= 0, prev_map[np.maximum(window_src, 0)], -1)
        appended = step.root_src >= prev_total  # the previous step's appended root (or zero) row
        real_root = np.where(appended, prev_padded + np.arange(real),
                             prev_map[np.minimum(step.root_src, prev_total - 1)])
        root_src = np.concatenate([real_root, prev_padded + pad_seqs])
    else:
        root_src = np.zeros(seqs, dtype=np.int64)
    tables = np.full((seqs, pad.width), pad.dummy_block, dtype=np.int32)
    tables[:real, : x.block_tables.shape[1]] = x.block_tables
    inputs = ModelInputs(
        input_ids=spread(x.input_ids, 0, 0),
        positions=spread(x.positions, last, 0),
        slots=spread(x.slots, -1, -1),
        block_tables=tables,
        seq_lens=np.concatenate([x.seq_lens + (rows - q), np.full(len(pad_seqs), rows + 1)]).astype(np.int32),
        q_lens=np.full(seqs, rows, dtype=np.int32),
        lm_head_indices=np.concatenate([row_map[x.lm_head_indices], pad_lm]).astype(np.int64),
        is_prefill=False,
        block_size=x.block_size,
    )
    visible = np.ones((seqs, tree), dtype=bool)
    visible[:real] = step.tree_visible
    return TreeStepHost(
        module_idx=step.module_idx, inputs=inputs, window_src=spread(window_src.astype(np.int64), -1, -1),
        window_lens=window, tree_first=tree_first, root_src=root_src.astype(np.int64), tree_visible=visible,
    ), row_map


def real_outputs(out, tree: DraftTree, num_rows: int, num_seqs: int, copy: bool = False):
    """A padded tree step's outputs cut to the real verification rows and sequences (``copy``:
    out of buffers the next replay overwrites) -> (ModelOutput, DraftTree)."""
    def cut(t, n):
        return t[:n].clone() if copy else t[:n]

    out = replace(out, logits=cut(out.logits, num_rows), hidden_states=cut(out.hidden_states, num_rows))
    return out, DraftTree(cut(tree.tokens, num_seqs), cut(tree.parents, num_seqs), cut(tree.depths, num_seqs))
