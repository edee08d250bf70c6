import numpy as np
import pytest

from mindspec.engine.block_manager import BlockManager
from mindspec.engine.errors import EngineError
from mindspec.engine.sequence import Sequence


def _seq(n, seq_id=0):
    return Sequence(seq_id=seq_id, prompt_token_ids=list(range(n)), max_tokens=8)


def test_slots_are_block_id_times_size_plus_offset():
    bm = BlockManager(num_blocks=10, block_size=4)
    seq = _seq(9)
    bm.allocate(seq)
    assert len(seq.block_table) == 3
    expected = [seq.block_table[i // 4] * 4 + i % 4 for i in range(2, 9)]
    assert bm.slots(seq, 2, 9).tolist() == expected


def test_dummy_block_is_never_handed_out():
    bm = BlockManager(num_blocks=5, block_size=2)
    seqs = [_seq(2, i) for i in range(4)]
    for s in seqs:
        bm.allocate(s)
    assert bm.dummy_block_id == 4 and all(4 not in s.block_table for s in seqs)
    assert bm.num_free_blocks == 0 and not bm.can_allocate(_seq(1, 9))


def test_append_lookahead_trim_free_accounting():
    bm = BlockManager(num_blocks=9, block_size=4)
    seq = _seq(5)
    bm.allocate(seq, num_lookahead=3)  # 8 positions -> 2 blocks
    assert len(seq.block_table) == 2
    bm.append_slots(seq, 4)  # 9 positions -> 3 blocks
    assert len(seq.block_table) == 3
    bm.trim(seq, 5)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    bm.free(seq)
    assert bm.num_free_blocks == bm.num_usable_blocks == 8 and seq.block_table == []


def test_double_free_is_an_error():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = _seq(3)
    bm.allocate(seq)
    table = list(seq.block_table)
    bm.free(seq)
    seq.block_table = table
    with pytest.raises(EngineError, match="freed twice"):
        bm.free(seq)


def test_memory_budget():
    bm = BlockManager.from_memory_budget(mem_bytes=10 * 1152 * 64, bytes_per_token=1152, block_size=64)
    assert bm.num_blocks == 10
    with pytest.raises(EngineError, match="at least 2"):
        BlockManager.from_memory_budget(mem_bytes=1000, bytes_per_token=1152, block_size=64)
