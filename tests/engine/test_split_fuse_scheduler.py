"""SplitFuse scheduling, host side: decode rows first, prefill chunks within split_chunk_tokens,
a final chunk of at least lookahead + 1 rows, chunks before the last yielding no token, and
prefilling sequences that abort or finish leaving no block behind."""
import pytest

from mindspec.engine.block_manager import BlockManager
from mindspec.engine.errors import EngineError
from mindspec.engine.scheduler import Scheduler, SchedulerConfig, chunk_tokens
from mindspec.engine.sequence import Sequence
from mindspec.text_generator.step import StepBatch


def sched(num_blocks=64, block_size=4, **cfg):
    return Scheduler(SchedulerConfig(split_fuse=True, **cfg), BlockManager(num_blocks, block_size))


def seq(seq_id, n, max_tokens=8):
    s = Sequence(seq_id=seq_id, prompt_token_ids=list(range(1, n + 1)), max_tokens=max_tokens)
    s.arrival_time = float(seq_id)
    return s


def never_stop(seq, token):
    return None


def run(s, batch, token=7):
    """Post-process a step: one token for every sequence that yields one."""
    tokens = [[] if batch.is_mixed and c and not batch.completes_prefill(b) else [token]
              for b, c in enumerate(batch.chunks or [0] * len(batch.seqs))]
    return s.postprocess(batch, tokens, never_stop)


@pytest.mark.parametrize("remaining, budget, lookahead, whole, want", [
    (10, 16, 3, False, 10),  # fits: all of it
    (30, 16, 3, False, 16),  # a chunk, 14 left
    (18, 16, 3, False, 14),  # 16 would leave 2 < lookahead + 1: leave 4
    (4, 2, 3, False, 0),  # nothing fits without leaving too few
    (30, 16, 0, False, 16),
    (30, 16, 3, True, 0),  # all or nothing
])
def test_chunk_tokens(remaining, budget, lookahead, whole, want):
    assert chunk_tokens(remaining, budget, lookahead, whole) == want


def test_a_long_prompt_is_prefilled_in_chunks_beside_the_decoding_sequences():
    s = sched(split_chunk_tokens=12, num_lookahead_tokens=2)
    s.add(seq(0, 5))
    first = s.schedule()  # nothing decodes yet: a chunk step with one whole prompt
    assert first.chunks == [5] and first.completes_prefill(0)
    run(s, first)
    s.add(seq(1, 30))
    chunks = []
    while s.prefilling or s.waiting:
        batch = s.schedule()
        assert batch.is_mixed and batch.seqs[0].seq_id == 0 and batch.chunks[0] == 0  # decode row first
        assert sum(batch.chunks) + batch.chunks.count(0) <= 12
        chunks.append(batch.chunks[1])
        updates = run(s, batch)
        assert updates[1].new_token_ids == ([] if s.prefilling else [7])
    assert chunks == [11, 11, 8]  # 11 = 12 less the decode row; the last one keeps >= 3 rows
    assert [q.seq_id for q in s.running] == [0, 1]
    after = s.schedule()  # both decode: a plain decode step with drafts' room again
    assert not after.is_mixed and not after.is_prefill and len(after.seqs) == 2


def test_new_prompts_fill_what_the_chunks_leave():
    s = sched(split_chunk_tokens=20)
    for i, n in enumerate((6, 5, 30, 4)):
        s.add(seq(i, n))
    batch = s.schedule()
    # 6 + 5 fit, 30 is chunked to the 9 left; the fourth waits (the budget is spent)
    assert [q.seq_id for q in batch.seqs] == [0, 1, 2] and batch.chunks == [6, 5, 9]
    assert s.num_waiting == 1 and len(s.prefilling) == 3
    run(s, batch)
    assert [q.seq_id for q in s.prefilling] == [2] and [q.seq_id for q in s.running] == [0, 1]
    nxt = s.schedule()  # 2 decode rows, sequence 2's next 18 rows; sequence 3 still waits
    assert [q.seq_id for q in nxt.seqs] == [0, 1, 2] and nxt.chunks == [0, 0, 18]


def test_split_start_batch_size_keeps_whole_prefills_until_enough_sequences_run():
    s = sched(split_chunk_tokens=8, split_start_batch_size=2)
    s.add(seq(0, 20))
    first = s.schedule()
    assert first.is_prefill and not first.is_mixed  # one running would be < 2: a whole prefill
    run(s, first)
    s.add(seq(1, 20))
    second = s.schedule()
    assert second.is_prefill  # still one running before it
    run(s, second)
    s.add(seq(2, 20))
    third = s.schedule()
    assert third.is_mixed and third.chunks == [0, 0, 6]


def test_abort_and_finish_of_prefilling_sequences_free_their_blocks():
    s = sched(split_chunk_tokens=8)
    bm = s.block_manager
    start = bm.num_free_blocks
    s.add(seq(0, 30))
    batch = s.schedule()
    run(s, batch)
    assert s.prefilling and bm.num_free_blocks < start
    s.abort(0)
    assert not s.prefilling and not s.has_unfinished() and bm.num_free_blocks == start
    s.add(seq(1, 12, max_tokens=1))
    while s.has_unfinished():
        run(s, s.schedule())
    assert bm.num_free_blocks == start and bm.num_used_blocks == 0


def test_a_chunk_before_the_last_must_yield_no_token():
    s = sched(split_chunk_tokens=8)
    s.add(seq(0, 30))
    batch = s.schedule()
    with pytest.raises(EngineError, match="yields no token"):
        s.postprocess(batch, [[5]], never_stop)


def test_step_batch_tells_chunks_and_prefill_ends():
    a, b, c = seq(0, 4), seq(1, 10), seq(2, 10)
    a.append_token(3)
    a.num_cached_tokens = 4
    c.num_cached_tokens = 6
    batch = StepBatch([a, b, c], False, 4, chunks=[0, 5, 4])
    assert batch.is_mixed and batch.chunk_rows().tolist() == [False, True, True]
    assert batch.prefill_ends().tolist() == [False, False, True]


def test_split_fuse_settings_are_checked():
    with pytest.raises(EngineError, match="split_chunk_tokens"):
        SchedulerConfig(split_fuse=True, split_chunk_tokens=0)
