"""The MTP plugin's host inputs of a decode step (plugins/mtp/decode_inputs.py) against
row-by-row references."""
import numpy as np
import pytest

from mindspec.plugins.mtp import decode_inputs as di

BLOCK_SIZE = 4


@pytest.mark.parametrize("counts,k", [([0], 3), ([3, 1, 2], 3), ([2, 2], 4)])
def test_verify_grid_is_each_sequences_rows_its_last_repeated(counts, k):
    grid = di.verify_grid(np.array(counts), k)
    first = np.cumsum([c + 1 for c in counts]) - [c + 1 for c in counts]
    assert grid.tolist() == [[int(f) + min(j, c) for j in range(k + 1)] for f, c in zip(first, counts)]
    assert di.verify_grid(np.array(counts, dtype=np.int32), k) is grid and not grid.flags.writeable


@pytest.mark.parametrize("mode", ["vanilla", "eagle"])
def test_window_rows_and_sub_inputs_follow_the_layout_row_by_row(mode):
    """Row i of sequence b's window is MTP entry start[b] + i, valid (fed the token after it,
    written to its slot) for its first h + a rows; Vanilla's later steps share step 0's rows and
    one array of zero tokens, Eagle's have rows of their own."""
    k = 3
    num_tokens, last_accepted = np.array([9, 14, 5]), np.array([1, 4, 2])
    tokens = [list(range(100 * b, 100 * b + n)) for b, n in enumerate(num_tokens)]
    tables = np.array([[3, 7, 1, 0, 0], [2, 5, 6, 8, 0], [4, 9, 0, 0, 0]], dtype=np.int32)
    layout = di.decode_layout(num_tokens, last_accepted, k, mode)
    seq_idx, entries, valid = layout.window_rows
    assert di.hidden_rows(layout)[0] is seq_idx
    want_seq, want_entry, want_valid = [], [], []
    for b, q in enumerate(layout.sub_q_lens):
        for i in range(q):
            want_seq.append(b)
            want_entry.append(int(layout.start[b]) + i)
            want_valid.append(i < layout.history[b] + layout.last_accepted[b])
    assert seq_idx.tolist() == want_seq and entries.tolist() == want_entry and valid.tolist() == want_valid
    steps = di.sub_inputs(tokens, layout, tables, BLOCK_SIZE, k, mode)
    first = steps[0]
    for r, (b, e, v) in enumerate(zip(want_seq, want_entry, want_valid)):
        assert first.input_ids[r] == (tokens[b][e + 1] if v else 0)  # entry i carries token i + 1
        assert first.slots[r] == (tables[b, e // BLOCK_SIZE] * BLOCK_SIZE + e % BLOCK_SIZE if v else -1)
    if mode == "vanilla":
        assert all(s is first for s in steps)  # later steps' tokens are rolled in on the device
    else:
        assert [s.positions.tolist() for s in steps] == [(first.positions + s).tolist() for s in range(k)]
