from mindspec.engine.sequence import FinishReason, Sequence, SequenceStatus


def test_token_bookkeeping():
    seq = Sequence(seq_id=3, prompt_token_ids=[5, 6, 7], max_tokens=4)
    assert seq.status is SequenceStatus.WAITING and not seq.is_finished
    assert (seq.num_tokens, seq.num_prompt_tokens, seq.num_output_tokens, seq.last_token_id) == (3, 3, 0, 7)
    seq.append_token(9)
    seq.append_token(10)
    assert seq.token_ids == [5, 6, 7, 9, 10] and seq.prompt_token_ids == [5, 6, 7]
    assert (seq.num_tokens, seq.num_output_tokens, seq.last_token_id) == (5, 2, 10)
    seq.status = SequenceStatus.FINISHED
    assert seq.is_finished


def test_num_blocks_needed_is_ceil_division():
    seq = Sequence(seq_id=0, prompt_token_ids=[1], max_tokens=1)
    assert [seq.num_blocks_needed(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert Sequence.num_blocks_needed(129, 128) == 2


def test_finish_reason_values_are_strings():
    assert [r.value for r in FinishReason] == ["stop", "length", "abort"]
    assert FinishReason.LENGTH == "length" and FinishReason("stop") is FinishReason.STOP


def test_sequences_compare_by_identity_and_have_their_own_state():
    a = Sequence(seq_id=0, prompt_token_ids=[1], max_tokens=1)
    b = Sequence(seq_id=0, prompt_token_ids=[1], max_tokens=1)
    assert a != b and a.extra is not b.extra and a.block_table is not b.block_table


def test_tokens_from_is_the_tail_of_token_ids_at_every_start():
    seq = Sequence(seq_id=0, prompt_token_ids=[5, 6, 7], max_tokens=8)
    for out in ([], [8], [8, 9, 10]):
        seq.output_token_ids = list(out)
        for start in range(seq.num_tokens + 2):
            assert seq.tokens_from(start) == seq.token_ids[start:], (out, start)
    tail = seq.tokens_from(4)
    tail.append(99)  # a new list: the sequence's own tokens are untouched
    assert seq.output_token_ids == [8, 9, 10]
