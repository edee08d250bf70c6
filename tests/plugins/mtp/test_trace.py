"""Seed 000's worked example (prompt A B C D, MTP = 2), stage by stage. Target-model rows equal
the seed's tables; MTP rows differ by the documented position convention (i, not i+1) and by
slot -1 where mindspec does not write."""
from mindspec.plugins.mtp.trace import format_rows, seed_example


def _table(rows, stage, module):
    (row,) = [r for r in rows if r.stage == stage and r.module == module]
    return row.input_ids, row.slots, row.positions, row.context_length, row.lm_head_indices


def test_seed_example_tables():
    rows = seed_example()
    assert _table(rows, "prefill", "target model") == (list("ABCD"), [0, 1, 2, 3], [0, 1, 2, 3], 4, [3])
    assert _table(rows, "prefill", "mtp") == (list("BCDE"), [0, 1, 2, 3], [0, 1, 2, 3], 4, [3])
    # first decode: seed mtp1 = E00, slots 3 4 5, positions 4 5 6, context 6, lm 0
    assert _table(rows, "first decode", "mtp1") == (["E", "0", "0"], [3, -1, -1], [3, 4, 5], 6, [0])
    # seed mtp2 = f00, slots 4 5 6, positions 5 6 7, context 7; the row after lm holds roll debris
    ids, slots, pos, ctx, lm = _table(rows, "first decode", "mtp2")
    assert (ids[0], slots, pos, ctx, lm) == ("f", [4, -1, -1], [4, 5, 6], 7, [0])
    assert _table(rows, "first decode", "target model") == (["E", "f", "g"], [4, 5, 6], [4, 5, 6], 7, [0, 1, 2])
    # after a miss: seed mtp1 = F00 slots 4 5 6 positions 5 6 7 context 7; target F G H at 5 6 7
    assert _table(rows, "decode after a miss", "mtp1") == (["F", "0", "0"], [4, -1, -1], [4, 5, 6], 7, [0])
    assert _table(rows, "decode after a miss", "mtp2")[1:] == ([5, -1, -1], [5, 6, 7], 8, [0])
    assert _table(rows, "decode after a miss", "target model") == (["F", "G", "H"], [5, 6, 7], [5, 6, 7], 8, [0, 1, 2])
    # after a full hit all three accepted entries are rewritten from verified hidden states
    assert _table(rows, "decode after a full hit", "mtp1") == (["G", "H", "I"], [5, 6, 7], [5, 6, 7], 8, [2])
    assert _table(rows, "decode after a full hit", "mtp2") == (["H", "I", "f"], [-1, -1, 8], [6, 7, 8], 9, [2])
    assert _table(rows, "decode after a full hit", "target model")[1:] == ([8, 9, 10], [8, 9, 10], 11, [0, 1, 2])
    assert "context length" in format_rows(rows)
