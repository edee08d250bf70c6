"""Async scheduling: patch a decode step's MTP inputs once the step before it is known
(MindIE's ``fill_in_model_result``; seed 000, "叠加异步调度时的模型输入参数更新").

The host built the inputs while the previous step ran, laying out each sequence still in that
step ("pending", up to P = pending[b] new tokens) as if all P were accepted: n + P tokens,
``last_accepted = P``, placeholders for the P tokens. When that step accepted c <= P tokens
(d = P - c rejected):
- main inputs: positions and seq_lens move back by d, slots follow the positions, the fed token
  is the newest accepted one (the plugin manager patches that placeholder);
- drafter inputs: the window start (n - a - 1 - h) and the row counts do not depend on c, so only
  the rows of the accepted tokens get their ids, the P - c rows after them become padding (id 0,
  slot -1), and the lm_head row moves back by d (eagle's later steps write at the new lm row);
- hidden states are gathered afterwards from the plugin's cache, which that step updated.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from mindspec.modeling.forward_metadata import ModelInputs, slots_for
from mindspec.text_generator.step import StepInputs

from .decode_inputs import DecodeLayout


def fill(inputs: StepInputs, pending: np.ndarray, accepted: list[list[int]], k: int, mode: str) -> DecodeLayout:
    """Patch ``inputs`` in place (new arrays, never shared ones); returns the final layout."""
    layout: DecodeLayout = inputs.extra["mtp_layout"]
    hit = np.flatnonzero(pending > 0)
    if len(hit) == 0:
        return layout
    count = np.array([len(accepted[b]) for b in hit], dtype=np.int64)
    if (count < 1).any() or (count > pending[hit]).any():
        raise ValueError(f"accepted counts {count.tolist()} outside 1..{pending[hit].tolist()}")
    back = np.zeros(len(pending), dtype=np.int64)
    back[hit] = pending[hit] - count
    inputs.model_inputs = _fill_main(inputs.model_inputs, back, k)
    last_accepted = layout.last_accepted.copy()
    last_accepted[hit] = count
    final = replace(layout, num_tokens=layout.num_tokens - back, last_accepted=last_accepted,
                    sub_lm_rows=layout.sub_lm_rows - back)
    inputs.sub_model_inputs = _fill_sub(inputs.sub_model_inputs, layout, final, hit, accepted, mode)
    return final


def _fill_main(main: ModelInputs, back: np.ndarray, k: int) -> ModelInputs:
    seq_idx = np.repeat(np.arange(len(back)), k + 1)
    positions = main.positions - back[seq_idx]
    return main.with_(
        input_ids=main.input_ids.copy(),  # the manager writes the fed token into it
        positions=positions,
        slots=slots_for(main.block_tables, seq_idx, positions, main.block_size),
        seq_lens=(main.seq_lens - back).astype(np.int32),
    )


def _fill_sub(steps: list[ModelInputs], placeholder: DecodeLayout, final: DecodeLayout, hit: np.ndarray,
              accepted: list[list[int]], mode: str) -> list[ModelInputs]:
    q_lens = final.sub_q_lens.astype(np.int64)
    first = np.cumsum(q_lens) - q_lens + final.history  # flat row of each sequence's first new entry
    token_rows = np.concatenate([first[b] + np.arange(len(accepted[b])) for b in hit])
    tokens = np.concatenate([np.asarray(accepted[b], dtype=np.int64) for b in hit])
    dropped = np.concatenate([first[b] + np.arange(len(accepted[b]), placeholder.last_accepted[b]) for b in hit])
    dropped = dropped.astype(np.int64)
    lm = final.sub_lm_rows
    seq_of_lm = np.arange(len(lm))
    out = []
    for s, step in enumerate(steps):
        if s and step is steps[s - 1]:  # MTP Vanilla's later steps: step 0's inputs again
            out.append(out[-1])
            continue
        ids, slots = step.input_ids, step.slots
        if s == 0:
            ids = ids.copy()
            ids[token_rows] = tokens
            ids[dropped] = 0
        if mode == "eagle" and s > 0:  # only the lm_head row writes: at its new place
            slots = np.full_like(slots, -1)
            slots[lm] = slots_for(step.block_tables, seq_of_lm, step.positions[lm], step.block_size)
        else:
            slots = slots.copy()
            slots[dropped] = -1
        out.append(step.with_(input_ids=ids, slots=slots, lm_head_indices=lm))
    return out
