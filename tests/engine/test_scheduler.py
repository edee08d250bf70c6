import numpy as np
import pytest

from mindspec.engine.block_manager import BlockManager
from mindspec.engine.errors import EngineError, RequestRejected
from mindspec.engine.scheduler import Scheduler, SchedulerConfig, SeqUpdate
from mindspec.engine.sequence import FinishReason, Sequence, SequenceStatus


def _sched(num_blocks=64, block_size=4, **cfg):
    return Scheduler(SchedulerConfig(**cfg), BlockManager(num_blocks, block_size))


def _seq(seq_id, n, max_tokens=8, arrival=None):
    seq = Sequence(seq_id=seq_id, prompt_token_ids=[1] * n, max_tokens=max_tokens)
    seq.arrival_time = float(seq_id) if arrival is None else arrival
    return seq


def never_stop(seq, token):
    return None


def _ids(seqs):
    return [q.seq_id for q in seqs]


def test_nothing_to_do():
    s = _sched()
    assert s.schedule() is None and not s.has_unfinished() and s.num_waiting == s.num_running == 0


def test_prefill_limits():
    s = _sched(max_batch_size=5, max_prefill_batch_size=3, max_prefill_tokens=20)
    for i in range(6):
        s.add(_seq(i, 8))
    first = s.schedule()
    assert first.is_prefill and _ids(first.seqs) == [0, 1]  # 3 x 8 > 20 tokens
    second = s.schedule()
    assert second.is_prefill and _ids(second.seqs) == [2, 3]
    third = s.schedule()
    assert _ids(third.seqs) == [4]  # max_batch_size 5
    assert s.num_running == 5 and s.num_waiting == 1
    decode = s.schedule()
    assert not decode.is_prefill and _ids(decode.seqs) == [0, 1, 2, 3, 4]


def test_max_prefill_batch_size():
    s = _sched(max_prefill_batch_size=3, max_prefill_tokens=1000)
    for i in range(7):
        s.add(_seq(i, 2))
    assert [len(s.schedule().seqs) for _ in range(3)] == [3, 3, 1]


def test_prompt_longer_than_max_prefill_tokens_runs_alone():
    s = _sched(max_prefill_tokens=10, max_input_token_len=30)
    s.add(_seq(0, 25))
    s.add(_seq(1, 2))
    assert _ids(s.schedule().seqs) == [0]
    assert _ids(s.schedule().seqs) == [1]


def test_fcfs_head_blocks_when_it_does_not_fit():
    s = _sched(num_blocks=5, block_size=4)  # 4 usable blocks
    s.add(_seq(0, 8, max_tokens=2))
    assert _ids(s.schedule().seqs) == [0]  # 2 blocks
    s.add(_seq(1, 12))  # needs 3: must wait
    s.add(_seq(2, 1))  # would fit, but FCFS keeps it behind seq 1
    batch = s.schedule()
    assert not batch.is_prefill and _ids(batch.seqs) == [0]


def test_over_long_prompt_is_rejected_or_truncated():
    s = _sched(max_input_token_len=16, max_seq_len=64)
    with pytest.raises(RequestRejected, match=r"17 tokens, more than maxInputTokenLen=16"):
        s.add(_seq(0, 17))
    with pytest.raises(RequestRejected, match="empty"):
        s.add(Sequence(seq_id=1, prompt_token_ids=[], max_tokens=4))
    assert s.num_waiting == 0
    for mode in ("left", 1):  # MindIE 1: cut from the left, keep the last tokens
        left = _sched(max_input_token_len=4, truncation=mode)
        seq = Sequence(seq_id=2, prompt_token_ids=[1, 2, 3, 4, 5, 6], max_tokens=4)
        left.add(seq)
        assert seq.prompt_token_ids == [3, 4, 5, 6] and left.num_waiting == 1
    for mode in ("right", -1, True):  # MindIE -1/true: cut from the right
        right = _sched(max_input_token_len=4, truncation=mode)
        seq = Sequence(seq_id=3, prompt_token_ids=[1, 2, 3, 4, 5, 6], max_tokens=4)
        right.add(seq)
        assert seq.prompt_token_ids == [1, 2, 3, 4]
    assert SchedulerConfig(truncation=False).truncation == SchedulerConfig(truncation=0).truncation == "reject"
    with pytest.raises(EngineError, match="truncation"):
        SchedulerConfig(truncation="middle")


def test_effective_input_limit_and_max_tokens_clipping():
    s = _sched(num_blocks=200, max_input_token_len=100, max_seq_len=20, max_iter_times=7)
    with pytest.raises(RequestRejected, match="maxInputTokenLen=19"):  # min(100, 20 - 1)
        s.add(_seq(0, 20))
    seq = _seq(1, 15, max_tokens=50)
    s.add(seq)
    assert seq.max_tokens == 5  # max_seq_len 20 - 15
    seq = _seq(2, 3, max_tokens=50)
    s.add(seq)
    assert seq.max_tokens == 7  # max_iter_times
    seq = _seq(3, 3, max_tokens=2)
    s.add(seq)
    assert seq.max_tokens == 2


def test_prompt_larger_than_the_whole_cache_is_rejected():
    s = _sched(num_blocks=4, block_size=4)  # 3 usable blocks = 12 tokens
    with pytest.raises(RequestRejected, match="13 tokens but the whole KV cache holds 12"):
        s.add(_seq(0, 13))
    fits = _seq(1, 12, max_tokens=50)
    s.add(fits)
    assert fits.max_tokens == 1  # its one token comes from prefill, no decode KV needed
    with_drafts = _sched(num_blocks=4, block_size=4, num_lookahead_tokens=3)
    with pytest.raises(RequestRejected, match="draft positions"):
        with_drafts.add(_seq(0, 10))
    seq = _seq(1, 5, max_tokens=50)
    with_drafts.add(seq)
    assert seq.max_tokens == 5  # last decode at 9 tokens + 3 drafts = 12 positions


def test_block_size_must_agree():
    with pytest.raises(EngineError, match="block_size=128"):
        Scheduler(SchedulerConfig(block_size=128), BlockManager(8, 4))
    s = _sched(block_size=4)
    assert s.config.block_size == 4


def test_preemption_is_lifo_and_recomputes():
    s = _sched(num_blocks=7, block_size=4)  # 6 usable blocks
    for i in range(3):
        s.add(_seq(i, 8, max_tokens=20))  # 2 blocks each
    batch = s.schedule()
    assert len(batch.seqs) == 3
    s.postprocess(batch, [[5], [5], [5]], never_stop)  # 9 tokens each: decode needs a 3rd block
    batch = s.schedule()
    # the newest (seq 2) is preempted; its 2 blocks let seqs 0 and 1 grow
    assert _ids(batch.seqs) == [0, 1] and _ids(s.waiting) == [2]
    preempted = s.waiting[0]
    assert preempted.status is SequenceStatus.WAITING and preempted.num_preemptions == 1
    assert preempted.block_table == [] and preempted.num_cached_tokens == 0 and preempted.output_token_ids == [5]
    # seqs 0 and 1 finish; seq 2 is re-admitted and recomputes prompt + its output token
    s.postprocess(batch, [[6], [6]], lambda q, t: FinishReason.STOP)
    again = s.schedule()
    assert again.is_prefill and _ids(again.seqs) == [2] and len(preempted.block_table) == 3
    s.postprocess(again, [[7]], never_stop)
    assert preempted.num_cached_tokens == 9 and preempted.token_ids == [1] * 8 + [5, 7]


def test_preemption_victim_is_newest_arrival_not_last_admitted():
    s = _sched(num_blocks=7, block_size=4)  # 6 usable blocks
    new, old = _seq(1, 4, max_tokens=30, arrival=2.0), _seq(0, 4, max_tokens=30, arrival=1.0)
    blocker = _seq(2, 15, max_tokens=30, arrival=0.5)  # oldest of all; 4 blocks
    s.add(new)
    s.postprocess(s.schedule(), [[9]], never_stop)  # the newer one happens to be admitted first
    s.add(old)
    s.add(blocker)
    s.postprocess(s.schedule(), [[9], [9]], never_stop)
    assert _ids(s.running) == [1, 0, 2] and s.block_manager.num_free_blocks == 0
    batch = s.schedule()  # old and new need a second block, none free: the newest arrival goes
    assert _ids(batch.seqs) == [2, 0] and _ids(s.waiting) == [1] and new.num_preemptions == 1


def test_newest_sequence_preempts_itself_and_waits():
    s = _sched(num_blocks=4, block_size=4)  # 3 usable blocks
    a, b = _seq(0, 4, max_tokens=20), _seq(1, 4, max_tokens=20)
    s.add(a)
    s.add(b)
    s.postprocess(s.schedule(), [[2], [2]], never_stop)  # 5 tokens each: each needs 2 blocks
    batch = s.schedule()
    assert _ids(batch.seqs) == [0] and _ids(s.waiting) == [1] and b.num_preemptions == 1
    s.postprocess(batch, [[3]], never_stop)
    batch = s.schedule()  # b cannot come back yet: a decodes alone, nothing crashes
    assert not batch.is_prefill and _ids(batch.seqs) == [0]


def test_lookahead_reserved_at_prefill_and_decode():
    s = _sched(num_blocks=20, block_size=4, num_lookahead_tokens=3)
    s.add(_seq(0, 4, max_tokens=20))
    batch = s.schedule()
    seq = batch.seqs[0]
    assert len(seq.block_table) == 2  # 4 tokens + 3 drafts
    s.postprocess(batch, [[9]], never_stop)
    assert seq.num_cached_tokens == 4
    for accepted in ([1, 2, 3], [4, 5, 6, 7], [8]):
        batch = s.schedule()
        assert not batch.is_prefill
        assert len(seq.block_table) * 4 >= seq.num_tokens + 3
        s.postprocess(batch, [accepted], never_stop)
        assert seq.num_cached_tokens == seq.num_tokens - 1


def test_postprocess_stops_early_and_frees():
    s = _sched()
    a, b, c = _seq(0, 3, max_tokens=10), _seq(1, 3, max_tokens=2), _seq(2, 3, max_tokens=10)
    for q in (a, b, c):
        s.add(q)
    s.postprocess(s.schedule(), [[4], [4], [4]], never_stop)
    batch = s.schedule()
    free_before = s.block_manager.num_free_blocks

    def stop_on_99(seq, token):
        return "stop" if token == 99 else None

    updates = s.postprocess(batch, [[7, 99, 8], [5, 6, 7], [1, 2]], stop_on_99)
    assert all(isinstance(u, SeqUpdate) for u in updates)
    (sa, ta, fa), (sb, tb, fb), (sc, tc, fc) = updates
    assert (sa, ta, fa) == (a, [7, 99], True) and a.finish_reason is FinishReason.STOP
    assert (tb, fb) == ([5], True) and b.finish_reason is FinishReason.LENGTH and b.num_output_tokens == 2
    assert (tc, fc) == ([1, 2], False) and c.num_cached_tokens == 5
    assert a.block_table == [] and b.block_table == [] and _ids(s.running) == [2]
    assert s.block_manager.num_free_blocks == free_before + 2


class _Counted(list):
    """A list that counts whole scans (membership tests, removals, comprehensions)."""
    scans = 0

    def __contains__(self, item):
        _Counted.scans += 1
        return super().__contains__(item)

    def remove(self, item):
        _Counted.scans += 1
        super().remove(item)

    def __iter__(self):
        _Counted.scans += 1
        return super().__iter__()


def test_a_finishing_batch_scans_no_queue_per_sequence():
    """With many requests queued, each finishing sequence used to scan the waiting queue (and the
    running list) for itself: ~1 ms each with 100k queued. A batch now finishes with one pass."""
    s = _sched(num_blocks=400, max_batch_size=64, max_prefill_batch_size=64)
    for i in range(200):
        s.add(_seq(i, 3, max_tokens=1))
    batch = s.schedule()
    assert len(batch.seqs) == 64 and s.num_waiting == 136

    class NoScan(type(s.waiting)):
        def __contains__(self, item):
            raise AssertionError("the waiting queue was scanned for a running sequence")

        def remove(self, item):
            raise AssertionError("the waiting queue was scanned for a running sequence")

    s.waiting = NoScan(s.waiting)
    s.running = _Counted(s.running)
    _Counted.scans = 0
    updates = s.postprocess(batch, [[5]] * 64, never_stop)
    assert all(u.finished for u in updates) and s.num_running == 0
    assert _Counted.scans <= 1
    assert s.block_manager.num_free_blocks == s.block_manager.num_usable_blocks


def test_abort_frees_blocks():
    s = _sched()
    s.add(_seq(0, 9))
    s.add(_seq(1, 9))
    s.schedule()
    s.add(_seq(2, 3))
    assert s.abort(0).finish_reason is FinishReason.ABORT
    assert s.abort(2).finish_reason is FinishReason.ABORT  # still waiting
    assert s.abort(42) is None
    batch = s.schedule()
    assert s.abort(1) is not None  # between schedule and postprocess
    (seq, tokens, finished), = s.postprocess(batch, [[5]], never_stop)
    assert tokens == [] and finished and seq.output_token_ids == []
    assert s.block_manager.num_free_blocks == s.block_manager.num_usable_blocks and not s.has_unfinished()


def test_prefill_yields_one_token():
    s = _sched()
    s.add(_seq(0, 3))
    with pytest.raises(EngineError, match="one token"):
        s.postprocess(s.schedule(), [[1, 2]], never_stop)
    with pytest.raises(EngineError, match="2 token lists for a batch of 0"):
        s.postprocess(batch_of([], prefill=False), [[1], [2]], never_stop)


def batch_of(seqs, prefill):
    from mindspec.engine.scheduler import ScheduledBatch
    return ScheduledBatch(seqs, is_prefill=prefill)


@pytest.mark.parametrize("lookahead", [0, 2])
def test_thousand_requests_no_leak_no_double_ownership(lookahead):
    rng = np.random.default_rng(lookahead)
    bs = 4
    s = _sched(num_blocks=40, block_size=bs, max_batch_size=16, max_prefill_batch_size=6,
               max_prefill_tokens=64, num_lookahead_tokens=lookahead, max_seq_len=64)
    seqs = [_seq(i, int(rng.integers(1, 40)), max_tokens=int(rng.integers(1, 40))) for i in range(1000)]
    pending = list(seqs)
    bm = s.block_manager

    def stop(seq, token):
        return FinishReason.STOP if token == 0 else None

    steps = 0
    while pending or s.has_unfinished():
        for _ in range(int(rng.integers(0, 4))):
            if pending:
                s.add(pending.pop(0))
        batch = s.schedule()
        if batch is None:
            assert not s.has_unfinished()
            continue
        owned = [b for q in s.running for b in q.block_table]
        assert len(owned) == len(set(owned)), "a block owned twice"
        assert bm.dummy_block_id not in owned
        assert len(owned) + bm.num_free_blocks == bm.num_usable_blocks
        assert all(not q.block_table for q in s.waiting)
        assert len(s.running) <= 16
        if batch.is_prefill:
            assert len(batch.seqs) <= 6
            assert len(batch.seqs) == 1 or sum(q.num_tokens for q in batch.seqs) <= 64
        for q in batch.seqs:
            assert len(q.block_table) * bs >= q.num_tokens + lookahead
            if not batch.is_prefill:
                assert q.num_cached_tokens == q.num_tokens - 1
                bm.slots(q, q.num_cached_tokens, q.num_tokens + lookahead)  # addressable
        n_max = 1 if batch.is_prefill else lookahead + 1  # accepted: 1 at prefill, 1..K+1 at decode
        tokens = [rng.integers(0, 50, int(rng.integers(1, n_max + 1))).tolist() for _ in batch.seqs]
        s.postprocess(batch, tokens, stop)
        steps += 1
        assert steps < 100_000
    assert bm.num_free_blocks == bm.num_usable_blocks
    assert all(q.is_finished and q.block_table == [] for q in seqs)
    assert all(1 <= q.num_output_tokens <= q.max_tokens for q in seqs)
    assert all(q.num_tokens <= 64 for q in seqs)
    assert {q.finish_reason for q in seqs} == {FinishReason.STOP, FinishReason.LENGTH}
    assert any(q.num_preemptions for q in seqs)


# ---- supplementary checks -------------------------------------------------------------------


def test_max_batch_size_caps_running_across_steps():
    s = _sched(max_batch_size=3, max_prefill_batch_size=10, max_prefill_tokens=1000)
    for i in range(5):
        s.add(_seq(i, 2, max_tokens=3))
    batch = s.schedule()
    assert batch.is_prefill and _ids(batch.seqs) == [0, 1, 2] and s.num_waiting == 2
    s.postprocess(batch, [[1], [1], [1]], never_stop)
    batch = s.schedule()  # full: decode, no prefill
    assert not batch.is_prefill and _ids(batch.seqs) == [0, 1, 2]
    s.postprocess(batch, [[1], [1], [1]], lambda q, t: FinishReason.STOP if q.seq_id == 1 else None)
    batch = s.schedule()  # one slot opened
    assert batch.is_prefill and _ids(batch.seqs) == [3] and s.num_running == 3


def test_max_prefill_tokens_packs_until_the_budget():
    s = _sched(max_prefill_tokens=10, max_prefill_batch_size=50)
    for i, n in enumerate([4, 6, 1, 3, 11, 2]):
        s.add(_seq(i, n))
    assert _ids(s.schedule().seqs) == [0, 1]  # 4 + 6 == 10 fits exactly; + 1 does not
    assert _ids(s.schedule().seqs) == [2, 3]  # 1 + 3, then 11 would overflow
    assert _ids(s.schedule().seqs) == [4]  # 11 > 10 alone
    assert _ids(s.schedule().seqs) == [5]


def test_rejection_message_names_the_limit_and_nothing_is_queued():
    s = _sched(max_input_token_len=8, max_seq_len=100)
    with pytest.raises(RequestRejected) as info:
        s.add(_seq(0, 9))
    msg = str(info.value)
    assert "maxInputTokenLen=8" in msg and "9 tokens" in msg and "maxSeqLen-1=99" in msg
    assert s.num_waiting == 0 and not s.has_unfinished()
    ok = _seq(1, 8)  # exactly at the limit is accepted
    s.add(ok)
    assert s.num_waiting == 1


def test_truncation_uses_the_effective_limit():
    # maxSeqLen - 1 = 5 is tighter than maxInputTokenLen = 100
    for mode, expected in [("left", [5, 6, 7, 8, 9]), ("right", [1, 2, 3, 4, 5])]:
        s = _sched(max_input_token_len=100, max_seq_len=6, truncation=mode)
        seq = Sequence(seq_id=0, prompt_token_ids=list(range(1, 10)), max_tokens=10)
        s.add(seq)
        assert seq.prompt_token_ids == expected and seq.max_tokens == 1  # 6 - 5
    s = _sched(max_input_token_len=100, max_seq_len=6)
    with pytest.raises(RequestRejected, match="maxInputTokenLen=5"):
        s.add(Sequence(seq_id=0, prompt_token_ids=list(range(1, 7)), max_tokens=10))
    # a prompt within the limit is left alone whatever the mode
    s = _sched(max_input_token_len=4, truncation="left")
    seq = Sequence(seq_id=1, prompt_token_ids=[7, 8, 9, 10], max_tokens=1)
    s.add(seq)
    assert seq.prompt_token_ids == [7, 8, 9, 10]


def test_truncated_prompt_runs_to_completion():
    s = _sched(max_input_token_len=6, max_seq_len=10, truncation="left")
    seq = Sequence(seq_id=0, prompt_token_ids=list(range(20)), max_tokens=100)
    s.add(seq)
    assert seq.prompt_token_ids == list(range(14, 20)) and seq.max_tokens == 4
    while s.has_unfinished():
        batch = s.schedule()
        s.postprocess(batch, [[1] for _ in batch.seqs], never_stop)
    assert seq.num_output_tokens == 4 and seq.num_tokens == 10 and seq.finish_reason is FinishReason.LENGTH


def test_max_tokens_clip_order():
    s = _sched(num_blocks=500, max_seq_len=100, max_iter_times=30, max_input_token_len=99)
    cases = [(10, 50, 30), (80, 50, 20), (99, 50, 1), (10, 5, 5), (10, 0, 1), (10, -3, 1)]
    for i, (n, asked, got) in enumerate(cases):
        seq = _seq(i, n, max_tokens=asked)
        s.add(seq)
        assert seq.max_tokens == got, (n, asked)


def test_prompt_only_sequence_finishes_at_its_prefill_without_a_token():
    s = _sched(num_blocks=20)
    scoring = _seq(0, 6, max_tokens=0)
    scoring.prompt_only = True
    other = _seq(1, 6, max_tokens=0)  # max_tokens 0 without prompt_only is still clipped to 1
    s.add(scoring)
    s.add(other)
    assert (scoring.max_tokens, other.max_tokens) == (0, 1)
    batch = s.schedule()
    assert batch.is_prefill and batch.seqs == [scoring, other]
    updates = s.postprocess(batch, [[5], [5]], never_stop)
    assert [(u.new_token_ids, u.finished) for u in updates] == [([], True), ([5], True)]
    assert scoring.output_token_ids == [] and scoring.finish_reason.value == "length"
    assert s.block_manager.num_free_blocks == s.block_manager.num_usable_blocks
    assert not s.has_unfinished()


def test_config_validation():
    for name in ("max_batch_size", "max_prefill_batch_size", "max_prefill_tokens", "max_input_token_len",
                 "max_iter_times"):
        with pytest.raises(EngineError, match=name):
            SchedulerConfig(**{name: 0})
    with pytest.raises(EngineError, match="max_seq_len"):
        SchedulerConfig(max_seq_len=1)
    with pytest.raises(EngineError, match="num_lookahead_tokens"):
        SchedulerConfig(num_lookahead_tokens=-1)
    with pytest.raises(EngineError, match="truncation"):
        SchedulerConfig(truncation=2)
    for bad in (-0.1, float("nan")):
        with pytest.raises(EngineError, match="waiting_served_ratio"):
            SchedulerConfig(waiting_served_ratio=bad)
    with pytest.raises(EngineError, match="max_waiting_steps"):
        SchedulerConfig(max_waiting_steps=-1)
    assert SchedulerConfig(max_input_token_len=4096, max_seq_len=2048).effective_max_input_len == 2047
    assert SchedulerConfig(max_input_token_len=100, max_seq_len=2048).effective_max_input_len == 100


def test_prefill_comes_before_decode():
    s = _sched()
    a = _seq(0, 3, max_tokens=10)
    s.add(a)
    first = s.schedule()
    assert first.is_prefill and first.seqs == [a]
    s.postprocess(first, [[1]], never_stop)
    b, c = _seq(1, 3, max_tokens=10), _seq(2, 5, max_tokens=10)
    s.add(b)
    s.add(c)
    batch = s.schedule()  # a is running, but the newcomers prefill first and a waits a step
    assert batch.is_prefill and _ids(batch.seqs) == [1, 2]
    assert a.num_output_tokens == 1
    s.postprocess(batch, [[1], [1]], never_stop)
    batch = s.schedule()
    assert not batch.is_prefill and _ids(batch.seqs) == [0, 1, 2]
    # every decode row has exactly one uncached token (its newest), prefill rows none cached
    assert all(q.num_cached_tokens == q.num_tokens - 1 for q in batch.seqs)


def test_multiple_victims_in_one_step_are_newest_first_and_requeued_oldest_first():
    s = _sched(num_blocks=7, block_size=4)  # 6 usable blocks
    a = _seq(0, 8, max_tokens=30)  # 2 blocks
    b, c, d = (_seq(i, 4, max_tokens=30) for i in (1, 2, 3))  # 1 block each
    for q in (a, b, c, d):
        s.add(q)
    batch = s.schedule()
    assert _ids(batch.seqs) == [0, 1, 2, 3] and s.block_manager.num_free_blocks == 1
    s.postprocess(batch, [[10], [11], [12], [13]], never_stop)  # everyone needs one more block
    batch = s.schedule()
    # a takes the free block; b preempts d (the newest); c finds nothing and preempts itself
    assert not batch.is_prefill and _ids(batch.seqs) == [0, 1]
    assert _ids(s.waiting) == [2, 3]
    assert (c.num_preemptions, d.num_preemptions, a.num_preemptions, b.num_preemptions) == (1, 1, 0, 0)
    for q in (c, d):
        assert q.status is SequenceStatus.WAITING and q.block_table == [] and q.num_cached_tokens == 0
    assert c.output_token_ids == [12] and d.output_token_ids == [13]
    # a and b finish; c and d are re-prefilled with prompt + outputs, keeping their outputs
    s.postprocess(batch, [[1], [1]], lambda q, t: FinishReason.STOP)
    batch = s.schedule()
    assert batch.is_prefill and _ids(batch.seqs) == [2, 3]
    assert [q.num_tokens for q in batch.seqs] == [5, 5]
    s.postprocess(batch, [[20], [21]], never_stop)
    assert c.token_ids == [1] * 4 + [12, 20] and d.token_ids == [1] * 4 + [13, 21]
    assert c.num_cached_tokens == d.num_cached_tokens == 5
    assert c.status is SequenceStatus.RUNNING


def test_preempted_sequence_is_readmitted_before_newer_arrivals():
    s = _sched(num_blocks=4, block_size=4)  # 3 usable blocks
    a, b = _seq(0, 4, max_tokens=20), _seq(1, 4, max_tokens=20)
    s.add(a)
    s.add(b)
    s.postprocess(s.schedule(), [[2], [2]], never_stop)
    batch = s.schedule()  # b is preempted
    assert _ids(s.waiting) == [1]
    late = _seq(5, 1, max_tokens=20)
    s.add(late)
    assert _ids(s.waiting) == [1, 5]
    s.postprocess(batch, [[3]], lambda q, t: FinishReason.STOP)  # a finishes, everything is free
    batch = s.schedule()
    assert batch.is_prefill and _ids(batch.seqs) == [1, 5]
    assert b.token_ids == [1] * 4 + [2]


def test_lookahead_reserves_blocks_at_prefill_and_every_decode():
    bs, k = 4, 3
    s = _sched(num_blocks=60, block_size=bs, num_lookahead_tokens=k)  # no preemption
    for i, n in enumerate([1, 4, 5, 8]):
        s.add(_seq(i, n, max_tokens=25))
    batch = s.schedule()
    for q in batch.seqs:
        assert len(q.block_table) == -(-(q.num_tokens + k) // bs)
    s.postprocess(batch, [[1]] * len(batch.seqs), never_stop)
    rng = np.random.default_rng(3)
    while s.has_unfinished():
        batch = s.schedule()
        assert not batch.is_prefill
        for q in batch.seqs:
            assert len(q.block_table) * bs >= q.num_tokens + k
            s.block_manager.slots(q, q.num_cached_tokens, q.num_tokens + k)
            assert q.num_preemptions == 0
        s.postprocess(batch, [[1] * int(rng.integers(1, k + 2)) for _ in batch.seqs], never_stop)


def test_lookahead_can_make_a_fresh_prompt_wait():
    s = _sched(num_blocks=4, block_size=4, num_lookahead_tokens=4)  # 3 usable blocks = 12 positions
    a = _seq(0, 4, max_tokens=2)
    s.add(a)
    s.add(_seq(1, 4, max_tokens=2))
    batch = s.schedule()
    # 4 tokens + 4 drafts = 2 blocks each: only one fits
    assert _ids(batch.seqs) == [0] and len(a.block_table) == 2 and s.num_waiting == 1


def test_abort_frees_running_and_waiting_and_is_idempotent():
    s = _sched(num_blocks=9, block_size=4)
    bm = s.block_manager
    for i in range(3):
        s.add(_seq(i, 6, max_tokens=10))
    batch = s.schedule()
    s.postprocess(batch, [[1]] * 3, never_stop)
    assert bm.num_free_blocks == 8 - 6
    seq = s.abort(1)
    assert seq.is_finished and seq.finish_reason is FinishReason.ABORT and seq.block_table == []
    assert bm.num_free_blocks == 4 and _ids(s.running) == [0, 2]
    assert s.abort(1) is None  # already gone
    batch = s.schedule()
    s.abort(0)
    s.abort(2)
    updates = s.postprocess(batch, [[5], [5]], never_stop)
    assert [u.finished for u in updates] == [True, True] and all(u.new_token_ids == [] for u in updates)
    assert bm.num_free_blocks == bm.num_usable_blocks and not s.has_unfinished()


def test_finish_reason_strings_from_the_stop_callback():
    s = _sched()
    s.add(_seq(0, 2, max_tokens=5))
    batch = s.schedule()
    (seq, toks, done), = s.postprocess(batch, [[3]], lambda q, t: "stop")
    assert done and seq.finish_reason is FinishReason.STOP and toks == [3]


def _drive(rng, s, seqs, *, lookahead, abort_prob=0.0, max_batch=None, max_prefill_batch=None,
           max_prefill_tokens=None):
    """Run ``seqs`` to completion through schedule()/postprocess(), checking invariants each step."""
    bm, bs = s.block_manager, s.block_manager.block_size
    pending = list(seqs)
    added = []

    def stop(seq, token):
        return FinishReason.STOP if rng.random() < 0.02 else None

    steps = 0
    while pending or s.has_unfinished():
        for _ in range(int(rng.integers(0, 5))):
            if pending:
                seq = pending.pop(0)
                s.add(seq)
                added.append(seq)
        batch = s.schedule()
        if batch is None:
            assert not s.has_unfinished()
            continue
        owners = {}
        for q in s.running:
            assert q.status is SequenceStatus.RUNNING
            for b in q.block_table:
                assert b not in owners, f"block {b} owned by {owners[b]} and {q.seq_id}"
                owners[b] = q.seq_id
        assert bm.dummy_block_id not in owners
        assert len(owners) == bm.num_used_blocks
        assert bm.num_used_blocks + bm.num_free_blocks == bm.num_usable_blocks
        assert all(not q.block_table and q.status is SequenceStatus.WAITING for q in s.waiting)
        assert max_batch is None or s.num_running <= max_batch
        if batch.is_prefill:
            assert max_prefill_batch is None or len(batch.seqs) <= max_prefill_batch
            assert (max_prefill_tokens is None or len(batch.seqs) == 1
                    or sum(q.num_tokens for q in batch.seqs) <= max_prefill_tokens)
            assert all(q.num_cached_tokens == 0 for q in batch.seqs)
        else:
            assert set(map(id, batch.seqs)) == set(map(id, s.running))
            for q in batch.seqs:
                assert len(q.block_table) * bs >= q.num_tokens + lookahead
                assert q.num_cached_tokens == q.num_tokens - 1
        if abort_prob and s.running and rng.random() < abort_prob:
            s.abort(s.running[int(rng.integers(s.num_running))].seq_id)  # between schedule and postprocess
        if abort_prob and s.waiting and rng.random() < abort_prob:
            s.abort(s.waiting[int(rng.integers(s.num_waiting))].seq_id)
        if batch.is_prefill:
            tokens = [[int(rng.integers(0, 100))] for _ in batch.seqs]
        else:  # like speculative decoding: the last token plus 0..lookahead accepted drafts
            tokens = [rng.integers(0, 100, int(rng.integers(1, lookahead + 2))).tolist() for _ in batch.seqs]
        before = {id(q): list(q.output_token_ids) for q in batch.seqs}
        updates = s.postprocess(batch, tokens, stop)
        for (q, new, finished), toks in zip(updates, tokens):
            assert new == toks[: len(new)]
            assert q.output_token_ids == before[id(q)] + new  # outputs survive preemption: only ever grow
            assert finished == q.is_finished
            if finished:
                assert q.block_table == [] and q not in s.running
        steps += 1
        assert steps < 200_000
    return added


@pytest.mark.parametrize("lookahead,abort_prob", [(0, 0.0), (1, 0.0), (3, 0.0), (3, 0.05)])
def test_thousand_requests_drain_cleanly(lookahead, abort_prob):
    rng = np.random.default_rng(100 + lookahead + int(abort_prob * 100))
    s = _sched(num_blocks=33, block_size=4, max_batch_size=12, max_prefill_batch_size=5,
               max_prefill_tokens=48, num_lookahead_tokens=lookahead, max_seq_len=80,
               max_input_token_len=60, max_iter_times=50, truncation="left")
    seqs = [Sequence(seq_id=i, prompt_token_ids=rng.integers(1, 100, int(rng.integers(1, 70))).tolist(),
                     max_tokens=int(rng.integers(1, 60))) for i in range(1000)]
    asked = {q.seq_id: q.max_tokens for q in seqs}
    added = _drive(rng, s, seqs, lookahead=lookahead, abort_prob=abort_prob, max_batch=12,
                   max_prefill_batch=5, max_prefill_tokens=48)
    bm = s.block_manager
    assert len(added) == 1000
    assert bm.num_free_blocks == bm.num_usable_blocks == 32 and bm.num_used_blocks == 0
    assert s.num_waiting == 0 and s.num_running == 0 and not s.has_unfinished()
    for q in seqs:
        assert q.is_finished and q.block_table == [] and q.num_cached_tokens == 0
        assert q.num_output_tokens <= q.max_tokens <= min(asked[q.seq_id], 50)
        assert q.num_prompt_tokens <= 60 and q.num_tokens <= 80
        if q.finish_reason is FinishReason.LENGTH:
            assert q.num_output_tokens == q.max_tokens
        if q.finish_reason is not FinishReason.ABORT:
            assert q.num_output_tokens >= 1
    reasons = {q.finish_reason for q in seqs}
    assert {FinishReason.STOP, FinishReason.LENGTH} <= reasons
    assert (FinishReason.ABORT in reasons) == bool(abort_prob)
    assert any(q.num_preemptions for q in seqs)


def test_add_prefilled_skips_prefill_and_decodes_next():
    s = _sched(num_blocks=9, block_size=4, num_lookahead_tokens=2)
    seq = Sequence(seq_id=0, prompt_token_ids=[1] * 6, max_tokens=5, output_token_ids=[42])
    s.add_prefilled(seq)
    assert seq.status is SequenceStatus.RUNNING and s.num_waiting == 0 and s.running == [seq]
    assert seq.num_cached_tokens == 6 and len(seq.block_table) == 2  # covers its 7 tokens
    batch = s.schedule()
    assert not batch.is_prefill and batch.seqs == [seq]
    assert len(seq.block_table) * 4 >= seq.num_tokens + 2
    s.postprocess(batch, [[1, 2]], never_stop)
    assert seq.num_cached_tokens == 8 and seq.output_token_ids == [42, 1, 2]
    big = Sequence(seq_id=1, prompt_token_ids=[1] * 28, max_tokens=5, output_token_ids=[3])
    with pytest.raises(RequestRejected, match="needs 8 more KV blocks, 5 free"):
        s.add_prefilled(big)
    assert s.num_waiting == 0 and s.running == [seq] and big.block_table == []


def test_add_prefilled_respects_max_batch_size():
    s = _sched(num_blocks=64, block_size=4, max_batch_size=2)
    for i in range(3):
        seq = Sequence(seq_id=i, prompt_token_ids=[1] * 3, max_tokens=5, output_token_ids=[7])
        try:
            s.add_prefilled(seq)
        except RequestRejected:
            pass
    assert s.num_running <= 2
    batch = s.schedule()
    assert len(batch.seqs) <= 2


def test_add_prefilled_refuses_without_side_effects():
    from mindspec.engine.errors import CapacityExceeded
    s = _sched(num_blocks=4, block_size=4, max_batch_size=2, max_input_token_len=8, truncation="left")
    a = Sequence(seq_id=0, prompt_token_ids=[1] * 7, max_tokens=5, output_token_ids=[7])
    s.add_prefilled(a)  # 2 of 3 blocks
    big = Sequence(seq_id=1, prompt_token_ids=[1] * 7, max_tokens=5, output_token_ids=[7])
    with pytest.raises(CapacityExceeded, match="needs 2 more KV blocks, 1 free"):
        s.add_prefilled(big)
    assert big.block_table == [] and s.num_running == 1 and s.block_manager.num_free_blocks == 1
    small = Sequence(seq_id=2, prompt_token_ids=[1] * 3, max_tokens=5, output_token_ids=[7])
    s.add_prefilled(small)
    with pytest.raises(CapacityExceeded, match="maxBatchSize=2"):
        s.add_prefilled(Sequence(seq_id=3, prompt_token_ids=[1], max_tokens=5, output_token_ids=[7]))
    # the handed-off KV is that of the whole prompt: never truncated, even with truncation on
    long = Sequence(seq_id=4, prompt_token_ids=[1] * 9, max_tokens=5, output_token_ids=[7])
    with pytest.raises(RequestRejected, match="maxInputTokenLen=8"):
        s.add_prefilled(long)
    assert len(long.prompt_token_ids) == 9


# ---- prefill batching (TGI's waiting_served_ratio / max_waiting_tokens) ------------------------
def _running(s, n, max_tokens=100):
    """n sequences prefilled (one batch) and running."""
    for i in range(n):
        s.add(_seq(i, 4, max_tokens=max_tokens))
    batch = s.schedule()
    assert batch.is_prefill and len(batch.seqs) == n
    s.postprocess(batch, [[1]] * n, never_stop)
    return batch.seqs


def _decode(s, finish=()):
    """One decode step, in which the sequences with ids in ``finish`` stop."""
    batch = s.schedule()
    assert not batch.is_prefill
    s.postprocess(batch, [[1]] * len(batch.seqs), lambda q, t: FinishReason.STOP if q.seq_id in finish else None)
    return batch


def test_small_prefill_waits_while_others_decode_until_max_waiting_steps():
    s = _sched(max_batch_size=8, waiting_served_ratio=0.5, max_waiting_steps=4)
    _running(s, 8)
    for i in range(8, 12):
        s.add(_seq(i, 4))
    _decode(s, finish={0})  # decode step 1; then 7 run and 1 seat: 1 < floor(0.5 * 7) = 3
    kinds = []
    while not (batch := s.schedule()).is_prefill:
        kinds.append(s.decode_steps_since_prefill)
        s.postprocess(batch, [[1]] * len(batch.seqs), never_stop)
    assert kinds == [2, 3, 4]  # held for decode steps 2..4, released after the 4th
    assert _ids(batch.seqs) == [8] and s.decode_steps_since_prefill == 0 and s.num_waiting == 3


def test_prefill_goes_at_once_when_the_group_is_big_enough():
    s = _sched(max_batch_size=8, waiting_served_ratio=0.5, max_waiting_steps=100)
    _running(s, 8)
    for i in range(8, 12):
        s.add(_seq(i, 4))
    _decode(s, finish={0, 1})  # 6 run, 2 seats: 2 < floor(0.5 * 6) = 3, held
    _decode(s, finish={2})  # 5 run, 3 seats: 3 >= floor(2.5) = 2
    batch = s.schedule()
    assert batch.is_prefill and _ids(batch.seqs) == [8, 9, 10]


def test_prefill_is_never_held_when_nothing_runs_or_the_ratio_is_zero():
    s = _sched(max_batch_size=8, waiting_served_ratio=100.0, max_waiting_steps=100)
    s.add(_seq(0, 4))
    assert s.schedule().is_prefill  # nothing runs: a lone prompt starts at once
    off = _sched(max_batch_size=8, waiting_served_ratio=0.0)
    _running(off, 8)
    off.add(_seq(8, 4))
    _decode(off, finish={0})
    assert _ids(off.schedule().seqs) == [8]  # prefill first, as without batching


def test_a_decode_scheduled_ahead_counts_as_a_decode_step():
    s = _sched(max_batch_size=4, waiting_served_ratio=1.0, max_waiting_steps=2)
    _running(s, 4)
    s.add(_seq(4, 4))
    for step in (1, 2):
        batch = s.schedule_ahead({q.seq_id: 1 for q in s.running})
        assert not batch.is_prefill and s.decode_steps_since_prefill == step
        s.postprocess(batch, [[1]] * len(batch.seqs), lambda q, t: FinishReason.STOP if q.seq_id == 0 else None)
    # 3 run, 1 seat < floor(1.0 * 3), but two decode steps have passed: the prefill goes
    batch = s.schedule_ahead({q.seq_id: 1 for q in s.running})
    assert batch.is_prefill and _ids(batch.seqs) == [4]
