import numpy as np
import pytest

from mindspec.engine.block_manager import BlockManager
from mindspec.engine.errors import RequestRejected
from mindspec.engine.scheduler import Scheduler, SchedulerConfig
from mindspec.engine.sequence import FinishReason, Sequence


def _sched(num_blocks=64, block_size=4, **cfg):
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size))


def _seq(seq_id, n, max_tokens=8):
    return Sequence(seq_id=seq_id, prompt_token_ids=[1] * n, max_tokens=max_tokens)


def never_stop(seq, token):
    return None


def test_prefill_limits():
    s = _sched(max_batch_size=5, max_prefill_batch_size=3, max_prefill_tokens=20)
    for i in range(6):
        s.add(_seq(i, 8))
    first = s.schedule()
    assert first.is_prefill and [q.seq_id for q in first.seqs] == [0, 1]  # 3 x 8 > 20 tokens
    second = s.schedule()
    assert second.is_prefill and [q.seq_id for q in second.seqs] == [2, 3]
    third = s.schedule()
    assert [q.seq_id for q in third.seqs] == [4]  # max_batch_size 5
    assert not s.schedule().is_prefill


def test_prompt_longer_than_max_prefill_tokens_runs_alone():
    s = _sched(max_prefill_tokens=10, max_input_token_len=30)
    s.add(_seq(0, 25))
    s.add(_seq(1, 2))
    assert [q.seq_id for q in s.schedule().seqs] == [0]


def test_over_long_prompt_is_rejected_or_truncated():
    s = _sched(max_input_token_len=16, max_seq_len=64)
    with pytest.raises(RequestRejected, match="maxInputTokenLen=16"):
        s.add(_seq(0, 17))
    with pytest.raises(RequestRejected, match="empty"):
        s.add(Sequence(seq_id=1, prompt_token_ids=[], max_tokens=4))
    left = _sched(max_input_token_len=4, truncation="left")
    seq = Sequence(seq_id=2, prompt_token_ids=[1, 2, 3, 4, 5, 6], max_tokens=4)
    left.add(seq)
    assert seq.prompt_token_ids == [3, 4, 5, 6]
    right = _sched(max_input_token_len=4, truncation="right")
    seq = Sequence(seq_id=3, prompt_token_ids=[1, 2, 3, 4, 5, 6], max_tokens=4)
    right.add(seq)
    assert seq.prompt_token_ids == [1, 2, 3, 4]


def test_effective_input_limit_and_max_tokens_clipping():
    s = _sched(num_blocks=200, max_input_token_len=100, max_seq_len=20, max_iter_times=7)
    with pytest.raises(RequestRejected, match="19"):  # min(100, 20 - 1)
        s.add(_seq(0, 20))
    seq = _seq(1, 15, max_tokens=50)
    s.add(seq)
    assert seq.max_tokens == 5  # max_seq_len 20 - 15
    seq = _seq(2, 3, max_tokens=50)
    s.add(seq)
    assert seq.max_tokens == 7  # max_iter_times


def test_prompt_larger_than_the_whole_cache_is_rejected():
    s = _sched(num_blocks=4, block_size=4)  # 3 usable blocks = 12 tokens
    with pytest.raises(RequestRejected, match="KV cache"):
        s.add(_seq(0, 12))


def test_preemption_is_lifo_and_recomputes():
    s = _sched(num_blocks=7, block_size=4)  # 6 usable blocks
    for i in range(3):
        s.add(_seq(i, 8, max_tokens=20))  # 2 blocks each
    batch = s.schedule()
    assert len(batch.seqs) == 3
    s.postprocess(batch, [[5], [5], [5]], never_stop)  # 9 tokens each: decode needs a 3rd block
    batch = s.schedule()
    # the newest (seq 2) is preempted; its 2 blocks let seqs 0 and 1 grow
    assert [q.seq_id for q in batch.seqs] == [0, 1]
    assert [q.seq_id for q in s.waiting] == [2]
    preempted = s.waiting[0]
    assert preempted.num_preemptions == 1 and preempted.block_table == [] and preempted.output_token_ids == [5]


def test_lookahead_reserves_decode_blocks():
    s = _sched(num_blocks=20, block_size=4, num_lookahead_tokens=3)
    s.add(_seq(0, 4))
    batch = s.schedule()
    s.postprocess(batch, [[9]], never_stop)
    s.schedule()
    seq = batch.seqs[0]
    assert len(seq.block_table) * 4 >= seq.num_tokens + 3


def test_abort_frees_blocks():
    s = _sched()
    s.add(_seq(0, 9))
    s.schedule()
    assert s.abort(0).finish_reason is FinishReason.ABORT
    assert s.block_manager.num_free_blocks == s.block_manager.num_usable_blocks and not s.has_unfinished()


def test_thousand_requests_no_leak_no_double_ownership():
    rng = np.random.default_rng(0)
    s = _sched(num_blocks=40, block_size=4, max_batch_size=16, max_prefill_batch_size=6,
               max_prefill_tokens=64, num_lookahead_tokens=2, max_seq_len=64)
    seqs = [_seq(i, int(rng.integers(1, 30)), max_tokens=int(rng.integers(1, 30))) for i in range(1000)]
    pending = list(seqs)

    def stop(seq, token):
        return FinishReason.STOP if token == 0 else None

    steps = 0
    while pending or s.has_unfinished():
        for _ in range(int(rng.integers(0, 4))):
            if pending:
                s.add(pending.pop(0))
        batch = s.schedule()
        if batch is None:
            continue
        owned = [b for q in s.running for b in q.block_table]
        assert len(owned) == len(set(owned)), "a block owned twice"
        if not batch.is_prefill:
            assert all(len(q.block_table) * 4 >= q.num_tokens + 2 for q in batch.seqs)
        tokens = [rng.integers(0, 50, int(rng.integers(1, 4))).tolist() for _ in batch.seqs]
        s.postprocess(batch, tokens, stop)
        steps += 1
    bm = s.block_manager
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert all(q.is_finished for q in seqs)
    assert all(q.num_output_tokens <= q.max_tokens for q in seqs)
    assert any(q.num_preemptions for q in seqs)
