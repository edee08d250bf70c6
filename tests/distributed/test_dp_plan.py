"""The dp split on the host: ownership, each rank's rows, lm_head re-basing, padding, dummies.

Expected values are written out by hand or read from the global batch directly (never from the
code under test)."""
import numpy as np
import pytest

from mindspec.distributed import dp_plan
from mindspec.modeling.draft_rows import verify_source
from mindspec.modeling.forward_metadata import ModelInputs, build_model_inputs

BLOCK = 4
DUMMY = 99  # the reserved block


def _batch(q_lens, cached, lm_head_indices=None, first_block=0):
    """Sequences with distinct blocks; token ids encode (sequence, row) so rows can be traced."""
    tokens = [[1000 * b + i for i in range(q)] for b, q in enumerate(q_lens)]
    tables, nxt = [], first_block
    for q, c in zip(q_lens, cached):
        n = -(-(q + c) // BLOCK)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    return build_model_inputs(tokens, cached, tables, BLOCK, lm_head_indices)


def _dummy_rows(inputs: ModelInputs, start: int) -> np.ndarray:
    return np.arange(start, inputs.num_tokens)


# ---- seed 000 / MindIE's worked example -----------------------------------------------------------
def test_lm_head_local_dp_of_mindie_example():
    """4 dp ranks, K = 3 (L = 4 drafter rows per request), last-output lengths [4, 2, 1, 3]: the
    drafter lm_head rows are start + last - 1 = [3, 5, 8, 14]; dp0 holds requests 0 and 1 -> [3, 5]."""
    k = 3
    sub = _batch([k + 1] * 4, [20, 30, 12, 25], lm_head_indices=np.array([3, 5, 8, 14]))
    owners = np.array([0, 0, 1, 2])
    assert dp_plan.lm_head_local_dp(sub, owners, 0).tolist() == [3, 5]
    assert dp_plan.lm_head_local_dp(sub, owners, 1).tolist() == [0]  # request 2 alone: row 0 + 1 - 1
    assert dp_plan.lm_head_local_dp(sub, owners, 2).tolist() == [2]  # request 3: row 0 + 3 - 1
    assert dp_plan.lm_head_local_dp(sub, owners, 3).tolist() == []


def test_idle_rank_of_mindie_example_runs_dummies_with_lm_row_zero():
    k = 3
    main = _batch([k + 1] * 4, [20, 30, 12, 25], lm_head_indices=np.arange(16))
    sub = _batch([k + 1] * 4, [20, 30, 12, 25], lm_head_indices=np.array([3, 5, 8, 14]))
    owners = np.array([0, 0, 1, 2])
    shard = dp_plan.shard(main, [sub], owners, 3, 4, DUMMY, BLOCK)
    # dp0 has 2 requests: every rank runs 2 * (K + 1) main rows; the idle rank's are dummies
    assert shard.main.num_tokens == 2 * (k + 1) and shard.main.num_seqs == 2
    assert (shard.main.slots // BLOCK == DUMMY).all() and (shard.main.block_tables == DUMMY).all()
    assert shard.subs[0].lm_head_indices.tolist() == [0, 4]  # MindIE: a dummy rank gets [0]
    assert shard.hidden_rows.tolist() == [] and shard.num_sub_pad == 2 * (k + 1)


# ---- plain forwards (prefill, decode without drafts) ----------------------------------------------
@pytest.mark.parametrize("dp", [2, 3])
@pytest.mark.parametrize("prefill", [True, False])
def test_plain_shard_keeps_rows_rebases_lm_and_pads_to_one_count(dp, prefill):
    rng = np.random.default_rng(dp)
    q_lens = rng.integers(1, 9, 7).tolist() if prefill else [1] * 7
    cached = [0] * 7 if prefill else rng.integers(1, 20, 7).tolist()
    batch = _batch(q_lens, cached)
    owners = np.array([0, 1, 0, 0, 1, 0, 1]) if dp == 2 else np.array([0, 2, 0, 0, 2, 0, 2])
    shards = [dp_plan.shard(batch, None, owners, r, dp, DUMMY, BLOCK) for r in range(dp)]
    assert len({s.main.num_tokens for s in shards}) == 1  # one token count on every rank
    for r, s in enumerate(shards):
        seqs = np.flatnonzero(owners == r)
        rows = np.concatenate([np.arange(batch.q_start_loc[b], batch.q_start_loc[b + 1]) for b in seqs]) \
            if len(seqs) else np.zeros(0, np.int64)
        n = len(rows)
        local = s.main
        # real rows first, as in the global batch
        for field in ("input_ids", "positions", "slots"):
            assert np.array_equal(getattr(local, field)[:n], getattr(batch, field)[rows])
        assert np.array_equal(local.seq_lens[: len(seqs)], batch.seq_lens[seqs])
        assert np.array_equal(local.block_tables[: len(seqs), : batch.block_tables.shape[1]], batch.block_tables[seqs])
        # the lm rows of this rank's sequences point at the same tokens locally
        mine = [i for i, row in enumerate(batch.lm_head_indices) if row in set(rows.tolist())]
        assert np.array_equal(local.input_ids[local.lm_head_indices[: len(mine)]], batch.input_ids[batch.lm_head_indices[mine]])
        assert s.rows[r].lm_rows.tolist() == mine
        # padding: dummy sequences on the reserved block, after the real ones, one lm row each
        pad = _dummy_rows(local, n)
        assert (local.slots[pad] // BLOCK == DUMMY).all()
        assert (local.block_tables[len(seqs):] == DUMMY).all()
        assert len(local.lm_head_indices) == len(mine) + (local.num_seqs - len(seqs))
        assert local.is_prefill == batch.is_prefill
    if dp == 3:  # rank 1 holds nothing: it runs one dummy sequence, as long as the others
        idle = shards[1].main
        assert idle.num_seqs == 1 and idle.num_tokens == shards[0].main.num_tokens


def test_ranks_already_equal_get_no_padding():
    batch = _batch([3, 3], [0, 0])
    shards = [dp_plan.shard(batch, None, np.array([0, 1]), r, 2, DUMMY, BLOCK) for r in range(2)]
    assert [s.main.num_tokens for s in shards] == [3, 3] and [s.main.num_seqs for s in shards] == [1, 1]


# ---- MTP decode ----------------------------------------------------------------------------------
def test_speculative_shard_equalises_main_and_drafter_rows():
    k = 2
    num_seqs = 5
    cached = [10, 7, 21, 4, 15]
    main = _batch([k + 1] * num_seqs, cached, lm_head_indices=np.arange(num_seqs * (k + 1)))
    sub_q = [3, 5, 3, 4, 3]  # history + max(accepted, K + 1) per sequence
    sub_lm = np.cumsum(sub_q) - np.array(sub_q) + np.array([0, 3, 1, 2, 0])
    subs = [_batch(sub_q, [c - 3 for c in cached], lm_head_indices=sub_lm) for _ in range(k)]
    owners = np.array([0, 0, 0, 1, 1])
    shards = [dp_plan.shard(main, subs, owners, r, 2, DUMMY, BLOCK) for r in range(2)]
    assert [s.main.num_tokens for s in shards] == [3 * (k + 1)] * 2
    assert len({s.subs[0].num_tokens for s in shards}) == 1
    for r, s in enumerate(shards):
        assert len(s.subs[0].lm_head_indices) == s.main.num_seqs  # one drafter lm row per main sequence
        assert all(len(step.input_ids) == s.subs[0].num_tokens for step in s.subs)
        seqs = np.flatnonzero(owners == r)
        starts = np.cumsum(sub_q) - np.array(sub_q)
        expected_hidden = np.concatenate([np.arange(starts[b], starts[b] + sub_q[b]) for b in seqs])
        assert s.hidden_rows.tolist() == expected_hidden.tolist()
        assert s.num_sub_pad == s.subs[0].num_tokens - len(expected_hidden)
        local_lm = s.subs[0].lm_head_indices[: len(seqs)]
        assert np.array_equal(s.subs[0].input_ids[local_lm], subs[0].input_ids[sub_lm[seqs]])
    # rank 1 (2 sequences) got one dummy sequence of K + 1 rows; its drafter row is the dummy's first
    one = shards[1]
    assert one.main.num_seqs == 3 and (one.main.slots[2 * (k + 1):] // BLOCK == DUMMY).all()
    assert one.subs[0].lm_head_indices[2] == sum(sub_q[b] for b in (3, 4))


def test_speculative_shard_with_ragged_rows_equalises_main_rows_with_a_dummy_of_its_own_rows():
    """Sequences verifying unequal numbers of drafts (suffix drafts on the host, fewer MTP drafts):
    ranks get equal drafter lm rows as before, then a main-only dummy (rows feeding their own
    token, no logits row, no drafter entry) brings the main rows to one count."""
    k = 2
    q = [3, 9, 1, 3, 2]  # sequence 1 verifies 8 suffix drafts, 2 none, 4 one
    cached = [10, 7, 21, 4, 15]
    main = _batch(q, cached, lm_head_indices=np.arange(sum(q)))
    main.drafts_in_inputs = np.array([False, True, False, False, False])
    sub_q = [3, 3, 4, 3, 3]
    subs = [_batch(sub_q, [c - 3 for c in cached], lm_head_indices=np.cumsum(sub_q) - 1) for _ in range(k)]
    owners = np.array([0, 0, 0, 1, 1])
    shards = [dp_plan.shard(main, subs, owners, r, 2, DUMMY, BLOCK) for r in range(2)]
    assert [s.main.num_tokens for s in shards] == [3 + 9 + 1] * 2
    assert len({s.subs[0].num_tokens for s in shards}) == 1
    zero, one = shards[0].main, shards[1].main
    assert zero.q_lens.tolist() == [3, 9, 1] and zero.drafts_in_inputs.tolist() == [False, True, False]
    # rank 1: its two sequences, a dummy of K + 1 rows with a drafter entry, then 13 - 8 own rows
    assert one.q_lens.tolist() == [3, 2, k + 1, 5] and one.drafts_in_inputs.tolist() == [False, False, False, True]
    assert len(shards[1].subs[0].lm_head_indices) == 3  # drafter lm rows: real sequences and the dummy
    assert one.lm_head_indices.tolist() == list(range(3 + 2 + k + 1))  # the main-only dummy has no logits row
    assert (one.slots[5:] // BLOCK == DUMMY).all()
    source = verify_source(one.q_lens, k, one.drafts_in_inputs)
    assert source[-5:].tolist() == list(range(8, 13))  # its own rows
    assert source[:8].max() < one.num_tokens + 3 * k  # the rest read the three drafter sequences' drafts


def test_uniform_speculative_shards_keep_the_drafts_view():
    """K + 1 rows everywhere: no flags, no main-only dummy (the model places drafts by a view)."""
    k = 2
    main = _batch([k + 1] * 3, [5, 6, 7], lm_head_indices=np.arange(3 * (k + 1)))
    subs = [_batch([3, 3, 3], [2, 3, 4], lm_head_indices=np.array([2, 5, 8])) for _ in range(k)]
    shards = [dp_plan.shard(main, subs, np.array([0, 0, 1]), r, 2, DUMMY, BLOCK) for r in range(2)]
    assert all(s.main.drafts_in_inputs is None for s in shards)
    assert all(verify_source(s.main.q_lens, k, s.main.drafts_in_inputs) is None for s in shards)


# ---- ownership -----------------------------------------------------------------------------------
def test_owners_are_sticky_balanced_and_reassigned_when_a_block_is_reused():
    a = dp_plan.DpAssigner(2)
    prefill = _batch([5, 2, 7, 3, 1], [0] * 5)
    assert a.assign(prefill).tolist() == [0, 1, 0, 1, 0]
    first_blocks = prefill.block_tables[:, 0].tolist()
    # decode of a subset in another order: the same owners
    decode = _batch([1, 1, 1], [9, 6, 8], first_block=0)
    decode.block_tables[:, 0] = [first_blocks[2], first_blocks[4], first_blocks[1]]
    decode.seq_lens[:] = [10, 7, 9]
    assert a.assign(decode).tolist() == [0, 0, 1]
    # a new sequence whose first block was sequence 2's (now finished) is placed by load (rank 1)
    new = _batch([4], [0])
    new.block_tables[0, 0] = first_blocks[2]
    assert a.assign(new).tolist() == [1]
    # a sequence with cached context that no rank has seen (a PD hand-off): least-loaded rank
    handoff = _batch([1], [12])
    handoff.block_tables[0, 0] = 77
    handoff.seq_lens[:] = [13]
    assert a.assign(handoff).tolist() == [0]
