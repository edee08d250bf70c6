"""The official openai client against a real server: completions and chat with logprobs (text
pieces, bytes, text_offset), echo, n > 1, lists of prompts, logit_bias, models.retrieve and the
400s of unsupported fields. Expected token ids come from the TGI route's details and expected
strings from the model's own Hugging Face tokenizer."""
import re
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

CHINESE = "你好，世界！今天天气很好。"  # the tiny tokenizer splits these characters into byte tokens
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", timeout=120)


@pytest.fixture(scope="module")
def hf_tok(tiny_model):
    return AutoTokenizer.from_pretrained(str(tiny_model))


def greedy_ids(server, prompt: str, n: int) -> tuple[list[int], list[float]]:
    """The greedy continuation's token ids and logprobs, read from the TGI route's details."""
    body = {"inputs": prompt, "parameters": {"max_new_tokens": n, "ignore_eos": True, "details": True}}
    tokens = httpx.post(server.base + "/generate", json=body, timeout=120).json()["details"]["tokens"]
    return [t["id"] for t in tokens], [t["logprob"] for t in tokens]


def raw_bytes(token: str) -> bytes:
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in re.findall(r"\\x([0-9a-f]{2})", token))
    return token.encode()


def check_offsets(text: str, tokens: list[str], offsets: list[int], start: int = 0):
    assert offsets == sorted(offsets) and offsets[0] == start
    for token, offset in zip(tokens, offsets):
        if not token.startswith("bytes:") and not token.startswith("<｜"):
            assert text[offset:offset + len(token)] == token, (token, offset)


def test_completion_logprobs_are_text_pieces(client, server, hf_tok):
    ids, lps = greedy_ids(server, CHINESE, 16)
    out = client.completions.create(model="tiny", prompt=CHINESE, max_tokens=16, logprobs=3, **GREEDY)
    choice = out.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) == out.usage.completion_tokens == 16
    for token, token_id in zip(lp.tokens, ids):
        alone = hf_tok.decode([token_id])
        assert token == alone if "\ufffd" not in alone else token.startswith("bytes:\\x")
    assert any(t.startswith("bytes:") for t in lp.tokens)  # the test saw split characters
    assert b"".join(raw_bytes(t) for t in lp.tokens).decode("utf-8", errors="replace") == choice.text
    assert choice.text == hf_tok.decode(ids)
    check_offsets(choice.text, lp.tokens, lp.text_offset)
    assert lp.token_logprobs == pytest.approx(lps, abs=1e-5)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and top[token] == pytest.approx(logprob) and max(top.values()) == top[token]


def test_streamed_completion_chunks_carry_their_logprobs(client):
    kw = dict(model="tiny", prompt=CHINESE, max_tokens=16, logprobs=2, **GREEDY)
    full = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    assert "".join(c.text for c in chunks) == full.text
    assert chunks[-1].finish_reason == "length"
    joined = {k: [v for c in chunks if c.logprobs for v in getattr(c.logprobs, k)]
              for k in ("tokens", "token_logprobs", "text_offset", "top_logprobs")}
    assert joined["tokens"] == full.logprobs.tokens and joined["text_offset"] == full.logprobs.text_offset
    assert [list(t) for t in joined["top_logprobs"]] == [list(t) for t in full.logprobs.top_logprobs]
    # another run of the same tokens: equal up to float noise of batch shapes
    assert joined["token_logprobs"] == pytest.approx(full.logprobs.token_logprobs, abs=1e-4)


def test_n_choices(client):
    kw = dict(model="tiny", prompt="def f(x):", max_tokens=8, extra_body={"ignore_eos": True})
    greedy = client.completions.create(n=2, temperature=0, **kw)
    single = client.completions.create(temperature=0, **kw).choices[0].text
    assert [c.index for c in greedy.choices] == [0, 1] and {c.text for c in greedy.choices} == {single}
    assert greedy.usage.completion_tokens == 16 and greedy.usage.prompt_tokens == client.completions.create(
        temperature=0, **kw).usage.prompt_tokens
    sampled = client.completions.create(n=2, temperature=1.0, seed=5, **kw)
    # sibling i samples with seed + i: each matches the single request with its seed
    for i, choice in enumerate(sampled.choices):
        assert choice.text == client.completions.create(temperature=1.0, seed=5 + i, **kw).choices[0].text
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(n=2, temperature=1.0, seed=5, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {c.index: c.text for c in sampled.choices}


def test_list_of_prompts_with_n(client, hf_tok):
    prompts = ["def f(x):", "import os"]
    kw = dict(model="tiny", max_tokens=6, **GREEDY)
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    for prompt_arg in (prompts, [hf_tok(p)["input_ids"] for p in prompts]):
        out = client.completions.create(prompt=prompt_arg, n=2, **kw)
        assert [c.index for c in out.choices] == [0, 1, 2, 3]
        assert [c.text for c in out.choices] == [a.choices[0].text for a in alone for _ in range(2)]
        assert out.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
        assert out.usage.completion_tokens == 4 * 6


def test_echo(client, server, hf_tok):
    prompt = "def add(a, b):"
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, **GREEDY).choices[0].text
    echoed = client.completions.create(model="tiny", prompt=prompt, max_tokens=5, echo=True, logprobs=1, **GREEDY)
    choice = echoed.choices[0]
    assert choice.text == prompt + plain
    prompt_ids = hf_tok(prompt)["input_ids"]
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt_ids) + 5
    assert lp.tokens[0] == hf_tok.bos_token and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    check_offsets(choice.text, lp.tokens, lp.text_offset)
    assert lp.text_offset[len(prompt_ids)] == len(prompt)
    only = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True)
    assert only.choices[0].text == prompt and only.usage.completion_tokens == 0


def test_echo_scores_a_continuation_as_it_was_generated(client, server, hf_tok):
    """Teacher-forced prompt logprobs of a greedy continuation equal the logprobs it was
    generated with."""
    prompt = "for i in range(10):"
    ids, lps = greedy_ids(server, prompt, 6)
    whole = hf_tok(prompt)["input_ids"] + ids
    out = client.completions.create(model="tiny", prompt=whole, max_tokens=0, echo=True, logprobs=0)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs[-6:] == pytest.approx(lps, abs=1e-3)
    assert out.choices[0].text == hf_tok.decode(whole, skip_special_tokens=True)


def test_logit_bias_forces_a_token(client, hf_tok):
    forced = hf_tok.convert_tokens_to_ids("Q")
    out = client.completions.create(model="tiny", prompt="x = ", max_tokens=5, temperature=1.0,
                                    logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert out.choices[0].text == "QQQQQ"
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == "QQQ"


def test_vllm_extras_min_tokens_and_skip_special_tokens(client, server, hf_tok):
    """vLLM's sampling extras, sent as the openai client sends them (extra_body), take effect."""
    first = greedy_ids(server, "x = ", 1)[0][0]
    kw = dict(model="tiny", prompt="x = ", max_tokens=6, temperature=0)
    stopped = client.completions.create(**kw, extra_body={"stop_token_ids": [first]})
    held = client.completions.create(**kw, extra_body={"stop_token_ids": [first], "min_tokens": 4})
    assert stopped.usage.completion_tokens == 1 and held.usage.completion_tokens >= 4
    special = hf_tok.bos_token_id
    kw = dict(model="tiny", prompt="x = ", max_tokens=2, logit_bias={str(special): 100})
    hidden = client.completions.create(**kw, extra_body={"ignore_eos": True})
    shown = client.completions.create(**kw, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert hidden.choices[0].text == "" and shown.choices[0].text == hf_tok.bos_token * 2


def test_chat_logprobs_and_n(client):
    messages = [{"role": "user", "content": CHINESE}]
    kw = dict(model="tiny", messages=messages, max_tokens=10, logprobs=True, top_logprobs=2, **GREEDY)
    out = client.chat.completions.create(**kw)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 10
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace") == out.choices[0].message.content
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob) and e.top_logprobs[1].logprob <= e.logprob
        if not e.token.startswith("bytes:"):
            assert bytes(e.bytes) == e.token.encode()
    streamed = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    entries = [e for c in streamed if c.logprobs for e in c.logprobs.content]
    assert [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in entries] == \
        [(e.token, e.bytes, [t.token for t in e.top_logprobs]) for e in content]
    # the same tokens' logprobs from another run: equal up to float noise of batch shapes
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in content], abs=1e-4)
    two = client.chat.completions.create(n=2, **kw)
    assert [c.index for c in two.choices] == [0, 1]
    assert all(c.message.content == out.choices[0].message.content for c in two.choices)
    assert two.usage.completion_tokens == 20 and two.usage.prompt_tokens == out.usage.prompt_tokens


def test_models_retrieve(client):
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4")
    assert err.value.body["param"] == "model"


@pytest.mark.parametrize("field, kwargs", [
    ("suffix", dict(suffix="}")),
    ("best_of", dict(best_of=3)),
    ("use_beam_search", dict(extra_body={"use_beam_search": True})),
    ("n", dict(n=129)),
])
def test_unsupported_completion_fields_are_named(client, field, kwargs):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="a", max_tokens=2, **kwargs)
    assert err.value.body["param"] == field and field in err.value.body["message"]


def test_unsupported_chat_fields_are_named(client):
    functions = [{"name": "f", "parameters": {"type": "object", "properties": {}}}]  # OpenAI's old spelling of tools
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], functions=functions)
    assert err.value.body["param"] == "functions"
    assert client.completions.create(model="tiny", prompt="a", max_tokens=2, best_of=2, n=2).choices[1].index == 1


def test_hanging_up_on_n_choices_aborts_them_all(client, server):
    aborted = server.metric("mindspec_requests_total", status="aborted")
    stream = client.completions.create(model="tiny", prompt="while True:", n=2, max_tokens=400, temperature=1.0,
                                       stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            stream.close()
            break
    deadline = time.monotonic() + 60  # the engine loop sees the hang-up on its next pass
    while server.metric("mindspec_requests_total", status="aborted") != aborted + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metric("mindspec_requests_total", status="aborted") == aborted + 2
    assert server.metric("mindspec_kv_blocks_used") == 0 and server.healthy()
