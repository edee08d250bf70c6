"""Which MTP draft steps run on each sequence's lm_head row alone, and their inputs there.

The plugin builds every draft step in seed 000's layout: the rows of the first step, rolled left
by one per step. From MTP Eagle's second step on, only the lm_head rows write a cache entry (the
others would overwrite entries of verified tokens with draft-conditioned ones, so they get slot
-1), and a row's output feeds only the same row of the next step. So from the first step whose
other rows write nothing, to the last, those rows compute outputs nobody reads. The model wrapper
runs such a suffix of steps on the lm_head rows alone, one row per sequence, as TensorRT-LLM and
vLLM feed an eagle step after the first; the drafts are the same. MTP Vanilla's steps write every
row (each module has its own cache) and keep the full layout.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from mindspec.modeling.forward_metadata import ModelInputs, token_positions


def lm_rows_only_steps(sub_steps: list[ModelInputs]) -> list[bool]:
    """Per step, whether it can run on its lm_head rows alone: never the first step (its rows feed
    from the main model's hidden states), then a suffix of steps that write no other row."""
    narrow = [False] * len(sub_steps)
    for s in range(len(sub_steps) - 1, 0, -1):
        if not _writes_lm_rows_only(sub_steps[s]):
            break
        narrow[s] = True
    return narrow


def _writes_lm_rows_only(step: ModelInputs) -> bool:
    lm = step.lm_head_indices
    if lm.shape[0] != step.num_seqs:  # one lm_head row per sequence, in sequence order
        return False
    others = np.ones(step.num_tokens, dtype=bool)
    others[lm] = False
    return not bool((step.slots[others] >= 0).any())


def on_lm_rows(step: ModelInputs) -> ModelInputs:
    """The step over its lm_head rows alone: row b is sequence b's lm_head row, attending to the
    cache up to its own position (causal: the rows dropped came after it or wrote nothing)."""
    lm = step.lm_head_indices
    positions = step.positions[lm]
    num_seqs = lm.shape[0]
    return step.with_(
        input_ids=step.input_ids[lm],
        positions=positions,
        slots=step.slots[lm],
        seq_lens=(positions + 1).astype(np.int32),
        q_lens=np.ones(num_seqs, dtype=np.int32),
        lm_head_indices=np.arange(num_seqs, dtype=np.int64),
    )


def verify_source(q_lens: np.ndarray, k: int, drafts_in_inputs: Optional[np.ndarray] = None) -> Optional[np.ndarray]:
    """[R] for a verification whose sequences do not all verify the k drafts made: each row's
    token in the flat ``cat(input_ids [R], drafts [B * k])``. A sequence's first row is its own
    fed token; its row j >= 1 is draft j of its k (q_lens[b] = k_b + 1 <= k + 1 rows), or, for a
    sequence of ``drafts_in_inputs`` (drafts made on the host, any number), its own input row.
    None when every sequence verifies all k MTP drafts (the model places them by a view)."""
    q = np.asarray(q_lens, dtype=np.int64)
    host = np.zeros(len(q), dtype=bool) if drafts_in_inputs is None else np.asarray(drafts_in_inputs, dtype=bool)
    if (q == k + 1).all() and not host.any():
        return None
    if (q < 1).any() or (q[~host] > k + 1).any():
        raise ValueError(f"verification rows per sequence must be 1..{k + 1}, got {q.tolist()}")
    seq, j = token_positions(np.zeros_like(q), q)  # j: row within its sequence
    own = (j == 0) | host[seq]
    return np.where(own, np.arange(len(j)), q.sum() + seq * k + j - 1).astype(np.int64)
