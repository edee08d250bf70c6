import dataclasses

import numpy as np
import pytest

from mindspec.modeling.forward_metadata import (
    GRID_CACHED_ROWS, GRID_CACHED_SEQS, ModelInputs, build_decode_inputs, build_model_inputs, row_grid,
    start_locations, token_positions,
)


@pytest.mark.parametrize("num_cached", [[5], [1, 17, 4, 33], [16, 16, 15]])
def test_decode_inputs_are_the_general_builders_for_one_token_each(num_cached):
    """Every decode step builds its inputs with ``build_decode_inputs``: field for field, values
    and dtypes, what ``build_model_inputs`` gives for one new token per sequence."""
    block_size = 16
    rng = np.random.default_rng(len(num_cached))
    tables = [rng.choice(100, size=c // block_size + 1, replace=False).tolist() for c in num_cached]
    tokens = rng.integers(0, 4096, size=len(num_cached)).tolist()
    fast = build_decode_inputs(tokens, num_cached, tables, block_size)
    general = build_model_inputs([[t] for t in tokens], num_cached, tables, block_size)
    for f in dataclasses.fields(general):
        a, b = getattr(fast, f.name), getattr(general, f.name)
        if isinstance(b, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b), f.name
        else:
            assert a == b, f.name
    # the slot of each new token: its position's block in its table
    assert fast.slots.tolist() == [t[c // block_size] * block_size + c % block_size for t, c in zip(tables, num_cached)]


@pytest.mark.parametrize("q_lens", [[1], [4, 4, 4], [3, 0, 5, 1], []])
def test_row_grid_gives_each_rows_sequence_and_place_once_per_row_counts(q_lens):
    """Each row's sequence and place within it; kept per row counts (whatever their dtype) and
    shared read-only, while token_positions' positions are the caller's own array."""
    seq_idx, offsets = row_grid(np.array(q_lens, dtype=np.int32))
    assert seq_idx.tolist() == [b for b, q in enumerate(q_lens) for _ in range(q)]
    assert offsets.tolist() == [j for q in q_lens for j in range(q)]
    again = row_grid(np.array(q_lens, dtype=np.int64))
    assert again[0] is seq_idx and again[1] is offsets
    assert not seq_idx.flags.writeable and not offsets.flags.writeable
    start = np.arange(len(q_lens), dtype=np.int64) * 10 + 3
    seq, positions = token_positions(start, np.array(q_lens))
    assert seq is seq_idx and positions.flags.writeable
    assert positions.tolist() == [int(s) + j for s, q in zip(start, q_lens) for j in range(q)]


def test_row_grids_of_prefills_are_not_kept():
    """A prefill's rows (a sequence of more than GRID_CACHED_ROWS) are computed each time:
    prompt lengths seldom repeat, and their grids would fill memory."""
    q_lens = np.array([GRID_CACHED_ROWS + 1, 2])
    first, again = row_grid(q_lens), row_grid(q_lens)
    assert first[0] is not again[0] and np.array_equal(first[0], again[0]) and np.array_equal(first[1], again[1])
    assert first[1].tolist() == list(range(GRID_CACHED_ROWS + 1)) + [0, 1]


def test_with_is_dataclasses_replace():
    x = build_model_inputs([[1, 2], [3]], [4, 5], [[1, 2], [3]], 16)
    ids = np.array([7, 8, 9])
    got, want = x.with_(input_ids=ids, is_prefill=True), dataclasses.replace(x, input_ids=ids, is_prefill=True)
    assert type(got) is ModelInputs and got is not x and x.input_ids is not ids
    assert vars(got).keys() == vars(want).keys() and all(vars(got)[k] is v for k, v in vars(want).items())
    with pytest.raises(TypeError, match="no field.*'tokens'"):
        x.with_(tokens=ids)


@pytest.mark.parametrize("q_lens", [[1], [4, 1, 3], [2] * (GRID_CACHED_SEQS + 1)])
def test_start_locations_are_cumulative_q_lens(q_lens):
    for dtype in (np.int32, np.int64):
        got = start_locations(np.array(q_lens, dtype=dtype))
        assert got.dtype == np.int32 and got.tolist() == [0, *np.cumsum(q_lens).tolist()]
    kept = len(q_lens) <= GRID_CACHED_SEQS  # decode steps' are kept and shared, read-only
    assert (start_locations(np.array(q_lens)) is got) == kept and got.flags.writeable != kept
