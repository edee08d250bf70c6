"""Prefix caching in the block manager: chained keys, reference counts, idle blocks evicted least
recently used, the chain rule of publish, reset, and no block leaked."""
import pytest

from mindspec.engine.block_manager import BlockManager
from mindspec.engine.errors import EngineError
from mindspec.engine.prefix_cache import PrefixCache, block_key
from mindspec.engine.sequence import Sequence

BS = 4


def make_bm(num_blocks=12, context=0, whole_chains=False):
    return BlockManager(num_blocks, BS, prefix_cache=PrefixCache(BS, context, whole_chains))


def seq(tokens, seq_id=0):
    return Sequence(seq_id=seq_id, prompt_token_ids=list(tokens), max_tokens=4)


def run_and_publish(bm, s):
    """Allocate a sequence's tokens, mark them computed, publish everything final."""
    bm.allocate(s)
    s.num_cached_tokens = s.num_tokens
    bm.publish(s, s.num_cached_tokens)


def test_keys_chain_parent_tokens_and_context():
    cache = PrefixCache(BS, context_tokens=2)
    toks = list(range(20))
    keys = cache.keys(toks, 3)
    assert keys[0] == block_key(None, toks[0:4], toks[4:6])
    assert keys[1] == block_key(keys[0], toks[4:8], toks[8:10])
    # same block tokens under another parent, or with other tokens after it: other keys
    other = cache.keys([99] + toks[1:], 3)
    assert other[0] != keys[0] and other[1] != keys[1]
    assert cache.keys(toks[:8] + [77] + toks[9:], 3)[1] != keys[1]  # context of block 1 differs
    assert cache.keys(toks[:8] + [77] + toks[9:], 3)[0] == keys[0]
    assert cache.full_blocks(13) == 2  # block 2 would need tokens up to 12 + 2
    with pytest.raises(ValueError, match="need"):
        cache.keys(toks[:13], 3)
    assert cache.keys(toks, 3, known=keys[:2]) == keys


def test_a_published_prefix_is_found_and_shared_with_reference_counts():
    bm = make_bm()
    a = seq(range(10))
    run_and_publish(bm, a)  # blocks 0, 1 full; block 2 partial (never cached)
    assert bm.prefix_cache.num_registered == 2
    b = seq(list(range(8)) + [50, 51, 52], seq_id=1)
    keys, blocks = bm.cached_prefix(b, b.num_tokens - 1)
    assert blocks == a.block_table[:2] and len(keys) == 2
    bm.take_cached(b, keys, blocks)
    assert [bm.ref_count(x) for x in blocks] == [2, 2]
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    with pytest.raises(EngineError, match="empty table"):
        bm.take_cached(b, keys, blocks)


def test_a_prefix_ending_mid_block_reuses_whole_blocks_only():
    bm = make_bm()
    run_and_publish(bm, seq(range(10)))
    b = seq(range(7), seq_id=1)  # positions 0..5 may be cached: block 0 only (block 1 ends at 8)
    _, blocks = bm.cached_prefix(b, b.num_tokens - 1)
    assert len(blocks) == 1
    c = seq(list(range(6)) + [9, 9, 9, 9], seq_id=2)  # differs inside block 1
    assert len(bm.cached_prefix(c, c.num_tokens - 1)[1]) == 1


def test_released_cached_blocks_stay_idle_and_are_evicted_least_recently_used_first():
    bm = make_bm(num_blocks=7)  # 6 usable
    start = bm.num_free_blocks
    a, b = seq(range(8)), seq(range(100, 108), seq_id=1)
    run_and_publish(bm, a)
    run_and_publish(bm, b)
    bm.free(a)  # a's blocks idle first (least recent), then b's
    bm.free(b)
    assert bm.num_idle_blocks == 4 and bm.num_free_blocks == start and bm.num_used_blocks == 0
    # 3 blocks: the 2 never-cached ones, then the least recently released idle block: a's last
    # (a sequence releases its blocks from the tail, so a chain's head outlives its tail)
    c = seq(range(200, 212), seq_id=2)
    bm.allocate(c)
    assert bm.prefix_cache.stats.evictions == 1
    assert len(bm.cached_prefix(seq(range(9), 3), 8)[1]) == 1  # a's block 1 evicted, block 0 still found
    assert len(bm.cached_prefix(seq(range(100, 109), 4), 8)[1]) == 2  # b's still cached
    bm.free(c)
    assert bm.num_free_blocks == start


def test_taking_an_idle_block_revives_it_and_freeing_returns_it():
    bm = make_bm()
    start = bm.num_free_blocks
    a = seq(range(9))
    run_and_publish(bm, a)
    bm.free(a)
    b = seq(range(9), seq_id=1)
    keys, blocks = bm.cached_prefix(b, 8)
    assert all(map(bm.is_idle, blocks))
    bm.take_cached(b, keys, blocks)
    assert bm.num_idle_blocks == 0 and all(bm.ref_count(x) == 1 for x in blocks)
    bm.allocate(b)
    bm.free(b)
    assert bm.num_free_blocks == start and bm.num_idle_blocks == 2


def test_publish_stops_below_the_final_positions_and_keeps_the_first_registration():
    bm = make_bm(context=1)
    a = seq(range(13))
    bm.allocate(a)
    bm.publish(a, 5)  # one block final
    assert bm.prefix_cache.num_registered == 1 and a.published_blocks == 1
    bm.publish(a, 13)  # block 2 (positions 8..11) has its context token 12
    assert bm.prefix_cache.num_registered == 3
    twin = seq(range(13), seq_id=1)  # the same tokens computed again elsewhere
    bm.allocate(twin)
    bm.publish(twin, 13)
    assert bm.prefix_cache.num_registered == 3  # a's blocks stay the ones found
    assert bm.cached_prefix(seq(range(13), 2), 12)[1] == a.block_table[:3]
    assert bm.cached_prefix(seq(range(12), 3), 11)[1] == a.block_table[:2]  # block 2's context is missing


def test_a_sequence_that_computed_a_cached_prefix_again_registers_what_follows():
    bm = make_bm()
    a = seq(range(5))
    run_and_publish(bm, a)  # block 0
    twin = seq(range(9), seq_id=1)  # computed block 0 again (side by side with a), then block 1
    run_and_publish(bm, twin)
    assert bm.prefix_cache.num_registered == 2
    keys, blocks = bm.cached_prefix(seq(range(10), 2), 9)
    assert blocks == [a.block_table[0], twin.block_table[1]]


def test_whole_chains_extend_only_through_their_own_blocks():
    """dp: a sequence that computed block 0 again (not the cached one) does not register block 1:
    every registered chain is held by sequences starting with the chain's first block."""
    bm = make_bm(whole_chains=True)
    a = seq(range(5))
    run_and_publish(bm, a)  # registers block 0 only
    twin = seq(range(9), seq_id=1)
    run_and_publish(bm, twin)  # its block 0 is a duplicate; its block 1 must not be registered
    assert bm.prefix_cache.num_registered == 1
    c = seq(range(10), seq_id=2)
    keys, blocks = bm.cached_prefix(c, 9)
    assert blocks == a.block_table[:1]
    bm.take_cached(c, keys, blocks)
    bm.allocate(c)
    c.num_cached_tokens = 10
    bm.publish(c, 10)  # extends the chain through a's block
    assert bm.prefix_cache.num_registered == 2


def test_trim_and_preemption_keep_published_blocks_consistent():
    bm = make_bm()
    start = bm.num_free_blocks
    a = seq(range(10))
    run_and_publish(bm, a)
    bm.trim(a, 6)  # rollback keeps 2 blocks
    assert a.published_blocks == 2 and len(a.block_table) == 2
    bm.free(a)  # a preemption: keys kept, table gone
    assert a.published_blocks == 0 and len(a.block_keys) == 2
    keys, blocks = bm.cached_prefix(a, a.num_tokens - 1)  # its own blocks found again
    assert len(blocks) == 2
    bm.take_cached(a, keys, blocks)
    bm.allocate(a)
    bm.free(a)
    assert bm.num_free_blocks == start


def test_reset_forgets_every_key_but_held_blocks_stay_with_their_holders():
    bm = make_bm()
    start = bm.num_free_blocks
    a, b = seq(range(9)), seq(range(50, 59), seq_id=1)
    run_and_publish(bm, a)
    run_and_publish(bm, b)
    bm.free(a)
    assert bm.reset_prefix_cache() == 4
    assert bm.num_idle_blocks == 0 and bm.prefix_cache.num_registered == 0
    assert bm.cached_prefix(seq(range(9), 2), 8)[1] == []
    assert bm.ref_count(b.block_table[0]) == 1
    bm.free(b)
    assert bm.num_free_blocks == start and bm.num_idle_blocks == 0


def test_block_sizes_must_agree_and_no_cache_means_no_hits():
    with pytest.raises(EngineError, match="prefix cache"):
        BlockManager(8, 4, prefix_cache=PrefixCache(8))
    plain = BlockManager(8, BS)
    s = seq(range(9))
    plain.allocate(s)
    plain.publish(s, 9)
    assert plain.cached_prefix(seq(range(9), 1), 8) == ([], []) and plain.reset_prefix_cache() == 0
