"""TGI's own client (text_generation.Client, which posts to the root route) against a real server:
every answer parses into its pydantic models, and the details agree with the text, with the
tokenizer and with each other."""
import httpx
import pytest
from text_generation import Client
from text_generation.errors import BadRequestError
from text_generation.types import FinishReason
from transformers import AutoTokenizer

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def client(server):
    return Client(server.base, timeout=120)


@pytest.fixture(scope="module")
def hf_tok(tiny_model):
    return AutoTokenizer.from_pretrained(str(tiny_model))


def _joined(tokens) -> str:
    return "".join(t.text for t in tokens if not t.special)


def test_generate_details_tokens_join_to_the_text(client):
    r = client.generate(PROMPT, max_new_tokens=8, stop_sequences=[])
    d = r.details
    assert d.finish_reason in (FinishReason.Length, FinishReason.EndOfSequenceToken)
    assert d.generated_tokens == len(d.tokens) and 1 <= len(d.tokens) <= 8
    assert d.prefill == [] and d.best_of_sequences is None and d.seed is None  # greedy: no seed
    assert _joined(d.tokens) == r.generated_text
    assert all(t.logprob is not None and t.logprob <= 0 for t in d.tokens)


def test_generate_matches_the_generate_route(client, server):
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 8}}
    plain = httpx.post(server.base + "/generate", json=body, timeout=120).json()
    assert set(plain) == {"generated_text"}  # no details unless asked
    root = httpx.post(server.base + "/", json=body, timeout=120).json()
    assert root == [plain]  # POST / answers TGI's list of one
    assert client.generate(PROMPT, max_new_tokens=8).generated_text == plain["generated_text"]


def test_decoder_input_details_scores_every_prompt_token(client, hf_tok):
    r = client.generate(PROMPT, max_new_tokens=2, decoder_input_details=True)
    prefill = r.details.prefill
    assert [t.id for t in prefill] == hf_tok(PROMPT)["input_ids"]
    assert prefill[0].logprob is None and all(t.logprob is not None and t.logprob <= 0 for t in prefill[1:])
    assert prefill[0].text == hf_tok.bos_token
    assert "".join(t.text for t in prefill[1:]) == PROMPT


def test_top_n_tokens_rank_the_greedy_choice_first(client):
    r = client.generate(PROMPT, max_new_tokens=6, top_n_tokens=3)
    tops = r.details.top_tokens
    assert len(tops) == len(r.details.tokens)
    for token, top in zip(r.details.tokens, tops):
        assert 1 <= len(top) <= 3
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        assert top[0].id == token.id and top[0].logprob == pytest.approx(token.logprob, abs=1e-5)


def test_generate_stream_pieces_and_final_details(client):
    full = client.generate(PROMPT, max_new_tokens=10)
    events = list(client.generate_stream(PROMPT, max_new_tokens=10, top_n_tokens=2))
    assert [e.token.id for e in events] == [t.id for t in full.details.tokens]
    # each event has its own token's piece, not the whole step's text on one token
    assert [e.token.text for e in events] == [t.text for t in full.details.tokens]
    assert all(e.token.logprob is not None for e in events)
    assert all(e.generated_text is None and e.details is None for e in events[:-1])
    last = events[-1]
    assert last.generated_text == full.generated_text == _joined(e.token for e in events)
    assert last.details.generated_tokens == len(events) and last.details.finish_reason == full.details.finish_reason
    assert all(len(e.top_tokens) == 2 and e.top_tokens[0].id == e.token.id for e in events)


def test_split_characters_come_whole_with_their_last_token(client, hf_tok):
    """The tiny tokenizer splits Chinese into byte tokens: the pieces of a character's first bytes
    are empty and its last byte's piece carries the whole character."""
    prompt = "你好，世界！今天天气很好。"
    events = list(client.generate_stream(prompt, max_new_tokens=24, temperature=0.9, do_sample=True, seed=7))
    text = events[-1].generated_text
    ids = [e.token.id for e in events]
    assert text == hf_tok.decode(ids, skip_special_tokens=True)
    assert "".join(e.token.text for e in events if not e.token.special) == text
    held = [e.token.id for e in events[:-1] if e.token.text == ""]
    assert held and all("\ufffd" in hf_tok.decode([i]) for i in held)


def test_stop_sequence_and_sampling_seed(client):
    greedy = client.generate(PROMPT, max_new_tokens=8).details.tokens
    stop = next(t.text for t in greedy[1:] if t.text.strip() and "\ufffd" not in t.text)
    r = client.generate(PROMPT, max_new_tokens=8, stop_sequences=[stop])
    assert r.details.finish_reason == FinishReason.StopSequence
    sampled = client.generate(PROMPT, max_new_tokens=8, do_sample=True, temperature=1.0)
    assert isinstance(sampled.details.seed, int)  # the seed picked for it replays it
    replay = client.generate(PROMPT, max_new_tokens=8, do_sample=True, temperature=1.0, seed=sampled.details.seed)
    assert replay.generated_text == sampled.generated_text


def test_best_of_and_other_unsupported_fields_are_400_typical_p_works(client, server):
    with pytest.raises(BadRequestError, match="best_of"):
        client.generate(PROMPT, max_new_tokens=2, best_of=2, do_sample=True)
    typical = client.generate(PROMPT, max_new_tokens=8, do_sample=True, typical_p=0.5, seed=4)  # supported
    assert typical.generated_text == client.generate(PROMPT, max_new_tokens=8, do_sample=True, typical_p=0.5, seed=4).generated_text
    with pytest.raises(BadRequestError, match="watermark"):
        client.generate(PROMPT, max_new_tokens=2, watermark=True)
    r = httpx.post(server.base + "/", json={"inputs": PROMPT, "parameters": {"best_of": 3}}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"


def test_truncate_keeps_the_last_tokens(client, hf_tok):
    r = client.generate(PROMPT, max_new_tokens=1, truncate=3, decoder_input_details=True)
    assert [t.id for t in r.details.prefill] == hf_tok(PROMPT)["input_ids"][-3:]
