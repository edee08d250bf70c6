"""Per-stage MTP input tables, as in seed 000, built by the same code the plugin runs.

``python -m mindspec.plugins.mtp.trace`` prints seed 000's example: prompt A B C D, MTP = 2 (one
module reused, eagle), block size 128 so slot = position. Stages: prefill, first decode, a decode
after a miss (only the bonus token accepted) and one after a full hit (both drafts accepted).

Where this differs from seed 000's tables, on purpose:
- MTP positions: entry i (token i+1 paired with hidden state i) uses rope position i; the seed's
  tables use i+1 (its code too). RoPE is relative, so both are exact when used everywhere.
- Padding rows and, from the second MTP step on, rows before the lm_head row get slot -1 (no
  write): the seed writes them, overwriting entries computed from verified tokens with entries
  computed from draft hidden states.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mindspec.modeling.forward_metadata import ModelInputs, build_model_inputs

from . import decode_inputs as di

BLOCK = 128


@dataclass
class StageRow:
    stage: str
    module: str  # "target model", "mtp1", "mtp2", ...
    input_ids: list[str]
    slots: list[int]
    positions: list[int]
    context_length: int
    lm_head_indices: list[int]


def _names(ids, vocab: dict[int, str]) -> list[str]:
    return [vocab.get(int(t), "0") for t in ids]


def _row(stage, module, inputs: ModelInputs, ids, vocab) -> StageRow:
    return StageRow(stage, module, _names(ids, vocab), inputs.slots.tolist(), inputs.positions.tolist(),
                    int(inputs.seq_lens[0]), inputs.lm_head_indices.tolist())


def _decode_stage(stage, tokens, accepted, drafts, k, vocab) -> list[StageRow]:
    n = np.array([len(tokens)])
    layout = di.decode_layout(n, np.array([accepted]), k, "eagle")
    tables = np.array([[0]], dtype=np.int32)
    subs = di.sub_inputs([tokens], layout, tables, BLOCK, k, "eagle")
    rows, ids = [], subs[0].input_ids.copy()
    for s, sub in enumerate(subs):
        rows.append(_row(stage, f"mtp{s + 1}", sub, ids, vocab))
        ids = np.roll(ids, -1)
        ids[sub.lm_head_indices] = drafts[s]
    main = di.main_inputs(np.array([tokens[-1]]), n, tables, BLOCK, k)
    rows.append(_row(stage, "target model", main, [tokens[-1], *drafts], vocab))
    return rows


def seed_example() -> list[StageRow]:
    letters = "ABCDEFGHI"
    vocab = {i + 1: c for i, c in enumerate(letters)} | {101: "f", 102: "g"}
    tok = {c: i for i, c in vocab.items()}
    k = 2
    prompt = [tok[c] for c in "ABCD"]
    pre = build_model_inputs([prompt], [0], [[0]], BLOCK)
    rows = [_row("prefill", "target model", pre, prompt, vocab)]
    rows.append(_row("prefill", "mtp", pre, [tok[c] for c in "BCDE"], vocab))
    # first decode: E was sampled at prefill; drafts f, g; the target says F: a miss.
    rows += _decode_stage("first decode", [tok[c] for c in "ABCDE"], 1, [tok["f"], tok["g"]], k, vocab)
    # after the miss only F was accepted; drafts G, H are both right: a full hit, bonus I.
    rows += _decode_stage("decode after a miss", [tok[c] for c in "ABCDEF"], 1, [tok["G"], tok["H"]], k, vocab)
    # after the full hit G, H, I were accepted.
    rows += _decode_stage("decode after a full hit", [tok[c] for c in "ABCDEFGHI"], 3, [tok["f"], tok["g"]], k, vocab)
    return rows


def format_rows(rows: list[StageRow]) -> str:
    lines = []
    for r in rows:
        lines.append(f"[{r.stage}] {r.module}")
        lines.append(f"  input_ids       {' '.join(f'{x:>3}' for x in r.input_ids)}")
        lines.append(f"  slot            {' '.join(f'{x:>3}' for x in r.slots)}")
        lines.append(f"  position        {' '.join(f'{x:>3}' for x in r.positions)}")
        lines.append(f"  context length  {r.context_length:>3}")
        lines.append(f"  lm head indices {' '.join(f'{x:>3}' for x in r.lm_head_indices)}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(format_rows(seed_example()))
