"""RequestState.output: what each step's RequestOutput carries."""
from mindspec.engine.request_state import RequestState
from mindspec.engine.sequence import Sequence


def test_outputs_carry_the_prompt_copied_once_and_the_tokens_so_far():
    """The prompt ids are copied once per request (a long prompt is not copied at every step),
    again only when admission replaced them (truncation); the output ids are each step's own."""
    seq = Sequence(seq_id=0, prompt_token_ids=[5, 6, 7, 8], max_tokens=4)
    state = RequestState("r0", seq, prompt=None, detokenizer=None, stop_matcher=None)
    first = state.output([])
    seq.output_token_ids.append(9)
    second = state.output([9])
    assert first.prompt_token_ids == [5, 6, 7, 8] and second.prompt_token_ids is first.prompt_token_ids
    assert first.prompt_token_ids is not seq.prompt_token_ids
    assert first.token_ids == [] and second.token_ids == [9] and second.new_token_ids == [9]
    seq.prompt_token_ids = [7, 8]  # truncated to its last two tokens
    assert state.output([]).prompt_token_ids == [7, 8]
