import numpy as np
import pytest

from mindspec.engine.block_manager import BlockManager
from mindspec.engine.errors import EngineError
from mindspec.engine.sequence import Sequence


def _seq(n, seq_id=0):
    return Sequence(seq_id=seq_id, prompt_token_ids=list(range(n)), max_tokens=8)


def test_slots_are_block_id_times_size_plus_offset():
    bm = BlockManager(num_blocks=10, block_size=4)
    other = _seq(3, 1)
    bm.allocate(other)  # so seq's blocks are not 0, 1, 2
    seq = _seq(9)
    bm.allocate(seq)
    assert len(seq.block_table) == 3
    expected = [seq.block_table[i // 4] * 4 + i % 4 for i in range(2, 9)]
    slots = bm.slots(seq, 2, 9)
    assert slots.dtype == np.int64 and slots.tolist() == expected
    assert bm.slots(seq, 4, 4).tolist() == []
    with pytest.raises(EngineError, match="outside"):
        bm.slots(seq, 0, 13)  # 3 blocks cover 12 positions


def test_dummy_block_is_never_handed_out():
    bm = BlockManager(num_blocks=5, block_size=2)
    assert bm.dummy_block_id == 4 and bm.num_usable_blocks == 4
    seqs = [_seq(2, i) for i in range(4)]
    for s in seqs:
        bm.allocate(s)
    assert all(4 not in s.block_table for s in seqs)
    assert bm.num_free_blocks == 0 and not bm.can_allocate(_seq(1, 9))
    with pytest.raises(EngineError, match="more block"):
        bm.allocate(_seq(1, 9))
    assert bm.dummy_slots(3).tolist() == [8, 9, 8]
    plain = BlockManager(num_blocks=3, block_size=2, reserve_dummy_block=False)
    assert plain.dummy_block_id is None and plain.num_usable_blocks == 3


def test_append_lookahead_trim_free_accounting():
    bm = BlockManager(num_blocks=9, block_size=4)
    seq = _seq(5)
    assert bm.can_allocate(seq, num_lookahead=3)
    bm.allocate(seq, num_lookahead=3)  # 8 positions -> 2 blocks
    assert len(seq.block_table) == 2
    assert bm.can_append(seq, 3) and bm.can_append(seq, 4)
    bm.append_slots(seq, 3)  # still 8 positions: nothing new
    assert len(seq.block_table) == 2
    bm.append_slots(seq, 4)  # 9 positions -> 3 blocks
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    seq.num_cached_tokens = 9
    bm.trim(seq, 5)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6 and seq.num_cached_tokens == 5
    bm.trim(seq, 8)  # nothing to trim
    assert len(seq.block_table) == 2
    bm.free(seq)
    assert bm.num_free_blocks == bm.num_usable_blocks == 8 and seq.block_table == [] and seq.num_cached_tokens == 0
    assert bm.blocks_for_tokens(0) == 0 and bm.blocks_for_tokens(9) == 3


def test_can_append_false_when_out_of_blocks():
    bm = BlockManager(num_blocks=3, block_size=4)  # 2 usable
    seq = _seq(8)
    bm.allocate(seq)
    assert bm.can_append(seq, 0) and not bm.can_append(seq, 1)


def test_double_free_and_foreign_blocks_are_errors():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = _seq(3)
    bm.allocate(seq)
    table = list(seq.block_table)
    bm.free(seq)
    seq.block_table = table
    with pytest.raises(EngineError, match="freed twice"):
        bm.free(seq)
    free_before = bm.num_free_blocks
    a = _seq(8, 1)
    bm.allocate(a)
    forged = _seq(1, 2)
    forged.block_table = [a.block_table[0], bm.dummy_block_id]  # dummy never allocated
    with pytest.raises(EngineError, match="dummy"):
        bm.free(forged)
    assert a.block_table and bm.num_free_blocks == free_before - 2  # nothing was half-released
    dup = _seq(1, 3)
    dup.block_table = [a.block_table[0], a.block_table[0]]
    with pytest.raises(EngineError, match="twice"):
        bm.free(dup)
    bm.free(a)
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_memory_budget():
    bm = BlockManager.from_memory_budget(mem_bytes=10 * 1152 * 64 + 5, bytes_per_token=1152, block_size=64)
    assert bm.num_blocks == 10 and bm.num_usable_blocks == 9 and bm.block_size == 64
    with pytest.raises(EngineError, match="1000 bytes holds 0 block"):
        BlockManager.from_memory_budget(mem_bytes=1000, bytes_per_token=1152, block_size=64)


def test_freed_blocks_are_reused():
    bm = BlockManager(num_blocks=6, block_size=2)
    seqs = [_seq(2, i) for i in range(5)]
    for s in seqs:
        bm.allocate(s)
    owned = sorted(b for s in seqs for b in s.block_table)
    assert owned == [0, 1, 2, 3, 4]
    bm.free(seqs[2])
    new = _seq(2, 9)
    bm.allocate(new)
    assert new.block_table == [2]


# ---- supplementary checks -------------------------------------------------------------------


def _plain_slots(table, block_size, start, end):
    out = []
    for pos in range(start, end):
        block = table[pos // block_size]
        out.append(block * block_size + pos % block_size)
    return out


def test_slots_match_a_plain_loop_on_fragmented_tables():
    rng = np.random.default_rng(0)
    bs = 3
    bm = BlockManager(num_blocks=40, block_size=bs)
    live = []
    for i in range(60):  # interleave allocations and frees so tables are not contiguous
        if live and rng.random() < 0.4:
            bm.free(live.pop(int(rng.integers(len(live)))))
        n = int(rng.integers(1, 12))
        seq = _seq(n, i)
        if bm.can_allocate(seq, 2):
            bm.allocate(seq, 2)
            live.append(seq)
    assert any(q.block_table != sorted(q.block_table) or
               any(b - a != 1 for a, b in zip(q.block_table, q.block_table[1:])) for q in live)
    every = []
    for q in live:
        covered = len(q.block_table) * bs
        assert covered >= q.num_tokens + 2
        assert bm.slots(q, 0, covered).tolist() == _plain_slots(q.block_table, bs, 0, covered)
        for _ in range(5):
            start = int(rng.integers(0, covered + 1))
            end = int(rng.integers(start, covered + 1))
            assert bm.slots(q, start, end).tolist() == _plain_slots(q.block_table, bs, start, end)
        every.extend(bm.slots(q, 0, covered).tolist())
    assert len(every) == len(set(every)), "two sequences share a slot"
    dummy = set(range(bm.dummy_block_id * bs, (bm.dummy_block_id + 1) * bs))
    assert not dummy & set(every)


def test_slots_rejects_bad_ranges():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = _seq(5)
    bm.allocate(seq)  # 2 blocks: 8 positions
    for start, end in [(-1, 2), (3, 2), (0, 9), (9, 9)]:
        with pytest.raises(EngineError, match="outside"):
            bm.slots(seq, start, end)
    assert bm.slots(seq, 8, 8).tolist() == []
    assert bm.slots(seq, 0, 8).tolist() == _plain_slots(seq.block_table, 4, 0, 8)


def test_lookahead_positions_are_covered_and_addressable():
    bs = 4
    for n in range(1, 13):
        for k in range(0, 6):
            bm = BlockManager(num_blocks=12, block_size=bs)
            seq = _seq(n)
            bm.allocate(seq, num_lookahead=k)
            assert len(seq.block_table) == -(-(n + k) // bs)
            slots = bm.slots(seq, 0, n + k)
            assert len(set(slots.tolist())) == n + k
            assert bm.dummy_block_id not in seq.block_table
            # one decode step later: the newest token plus k drafts
            seq.append_token(1)
            bm.append_slots(seq, k)
            assert len(seq.block_table) * bs >= seq.num_tokens + k
            bm.slots(seq, seq.num_tokens - 1, seq.num_tokens + k)


def test_dummy_block_never_handed_out_under_churn():
    rng = np.random.default_rng(1)
    bm = BlockManager(num_blocks=7, block_size=2)
    live = []
    for i in range(500):
        seq = _seq(int(rng.integers(1, 8)), i)
        if bm.can_allocate(seq):
            bm.allocate(seq)
            live.append(seq)
        elif live:
            bm.free(live.pop(int(rng.integers(len(live)))))
        owned = [b for q in live for b in q.block_table]
        assert bm.dummy_block_id not in owned
        assert len(owned) == len(set(owned)) == bm.num_used_blocks
        assert bm.num_used_blocks + bm.num_free_blocks == bm.num_usable_blocks == 6
    for q in live:
        bm.free(q)
    assert bm.num_free_blocks == 6 and bm.num_used_blocks == 0


def test_constructor_limits():
    with pytest.raises(EngineError, match="block_size must be >= 1"):
        BlockManager(num_blocks=4, block_size=0)
    with pytest.raises(EngineError, match="reserved for dummy"):
        BlockManager(num_blocks=1, block_size=4)
    one = BlockManager(num_blocks=1, block_size=4, reserve_dummy_block=False)
    assert one.num_usable_blocks == 1
    with pytest.raises(EngineError, match="no dummy block"):
        one.dummy_slots(2)
    with pytest.raises(EngineError, match="at least 1"):
        BlockManager(num_blocks=0, block_size=4, reserve_dummy_block=False)


def test_ensure_is_all_or_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)  # 3 usable
    seq = _seq(4)
    bm.allocate(seq)
    other = _seq(4, 1)
    bm.allocate(other)
    table, free = list(seq.block_table), bm.num_free_blocks
    assert not bm.can_append(seq, 9)  # 13 positions: 4 blocks, only 1 more free
    with pytest.raises(EngineError, match="needs 3 more block"):
        bm.append_slots(seq, 9)
    assert seq.block_table == table and bm.num_free_blocks == free == 1
    bm.ensure(seq, 3)  # never shrinks
    assert seq.block_table == table


def test_trim_edges_and_reuse():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = _seq(10)
    bm.allocate(seq)  # 3 blocks
    with pytest.raises(EngineError, match="-1 tokens"):
        bm.trim(seq, -1)
    tail = seq.block_table[1:]
    bm.trim(seq, 4)
    assert len(seq.block_table) == 1 and bm.num_free_blocks == 7 - 1
    # trimmed blocks are free exactly once: freeing the sequence returns just the rest
    bm.free(seq)
    assert bm.num_free_blocks == bm.num_usable_blocks == 7
    again = _seq(12, 1)
    bm.allocate(again)
    assert set(tail) <= set(again.block_table)  # freed blocks are reused first
    bm.trim(again, 0)
    assert again.block_table == [] and bm.num_free_blocks == 7
    with pytest.raises(EngineError, match="freed twice"):
        forged = _seq(1, 2)
        forged.block_table = tail[:1]
        bm.free(forged)


def test_trim_clips_cached_tokens_even_when_no_block_is_released():
    bm = BlockManager(num_blocks=10, block_size=4)
    seq = _seq(7)
    bm.allocate(seq)  # 2 blocks cover 8 positions
    seq.num_cached_tokens = 7
    bm.trim(seq, 5)  # roll back 2 rejected drafts: still 2 blocks
    assert len(seq.block_table) == 2
    assert seq.num_cached_tokens == 5


def test_memory_budget_boundaries():
    # exactly 2 blocks is the minimum; one byte less is an error naming the numbers
    bm = BlockManager.from_memory_budget(mem_bytes=2 * 16 * 8, bytes_per_token=16, block_size=8)
    assert bm.num_blocks == 2 and bm.num_usable_blocks == 1 and bm.dummy_block_id == 1
    with pytest.raises(EngineError, match=r"255 bytes holds 1 block\(s\) of 8 tokens x 16 bytes per token \(128 bytes per block\)"):
        BlockManager.from_memory_budget(mem_bytes=2 * 16 * 8 - 1, bytes_per_token=16, block_size=8)
    for bpt, bs in [(0, 8), (16, 0), (-1, 8)]:
        with pytest.raises(EngineError, match="must be >= 1"):
            BlockManager.from_memory_budget(mem_bytes=10**9, bytes_per_token=bpt, block_size=bs)
    plain = BlockManager.from_memory_budget(mem_bytes=3 * 16 * 8, bytes_per_token=16, block_size=8,
                                            reserve_dummy_block=False)
    assert plain.num_blocks == plain.num_usable_blocks == 3 and plain.dummy_block_id is None
    big = BlockManager.from_memory_budget(mem_bytes=64 * 2**30, bytes_per_token=70272, block_size=128)
    assert big.num_blocks == 64 * 2**30 // (70272 * 128) and big.num_usable_blocks == big.num_blocks - 1


def test_shared_blocks_are_freed_by_their_last_owner_whichever_goes_first():
    for parent_first in (True, False):
        bm = BlockManager(num_blocks=20, block_size=4)
        parent, child, grandchild = _seq(14, 0), _seq(14, 1), _seq(14, 2)
        bm.allocate(parent, 3)  # 17 positions: 5 blocks
        bm.share(child, parent, 3)
        bm.allocate(child, 3)
        bm.share(grandchild, child, 2)
        bm.allocate(grandchild)
        shared = parent.block_table[:3]
        assert child.block_table[:3] == shared and grandchild.block_table[:2] == shared[:2]
        assert [bm.ref_count(b) for b in shared] == [3, 3, 2]
        assert len(set(child.block_table[3:]) & set(parent.block_table)) == 0
        # 5 + 2 + 2 distinct blocks instead of 5 + 5 + 4
        assert bm.num_used_blocks == 9 and bm.num_free_blocks == 19 - 9
        first, second = (parent, child) if parent_first else (child, parent)
        bm.free(first)
        assert [bm.ref_count(b) for b in shared] == [2, 2, 1]
        assert bm.num_used_blocks == 7  # only first's own two tail blocks came back
        bm.free(second)
        assert bm.num_used_blocks == 4 and [bm.ref_count(b) for b in shared] == [1, 1, 0]
        bm.free(grandchild)
        assert bm.num_used_blocks == 0 and bm.num_free_blocks == bm.num_usable_blocks == 19
        with pytest.raises(EngineError, match="freed twice"):
            bm.free(Sequence(seq_id=5, prompt_token_ids=[1], max_tokens=1, block_table=[shared[0]]))


def test_share_needs_an_empty_table_and_blocks_the_owner_has():
    bm = BlockManager(num_blocks=10, block_size=4)
    parent, child = _seq(8, 0), _seq(8, 1)
    bm.allocate(parent)
    bm.allocate(child)
    with pytest.raises(EngineError, match="empty table"):
        bm.share(child, parent, 1)
    with pytest.raises(EngineError, match="cannot share 3"):
        bm.share(_seq(8, 2), parent, 3)
    assert bm.num_used_blocks == 4 and all(bm.ref_count(b) == 1 for b in parent.block_table)
