import random

import pytest

from mindspec.text_generator.detokenizer import IncrementalDetokenizer
from mindspec.text_generator.tokenizer import load_tokenizer
from tests.support.tokenizers import make_tokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "你好，世界！今天天气很好。",
    "深度求索 🚀🎉 emoji 😀😃😄 mixed 世界 text 👍❤️",
    "def fibonacci(n: int) -> int:\n    return n if n < 2 else fibonacci(n - 1)\n",
    "🌍🤖🔥☕💻🌅",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(make_tokenizer(tmp_path_factory.mktemp("tok")))


def chunked(ids, rng, max_chunk):
    i = 0
    while i < len(ids):
        k = rng.randint(1, max_chunk)
        yield ids[i : i + k]
        i += k


def stream(tok, prompt, ids, rng, max_chunk, skip=True):
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    pieces = [detok.add(chunk) for chunk in chunked(ids, rng, max_chunk)]
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.text
    return detok, pieces


@pytest.mark.parametrize("max_chunk", [1, 4])
@pytest.mark.parametrize("text", TEXTS)
def test_text_streams_to_full_decode(tok, text, max_chunk):
    prompt = tok.encode("User: 你好 😀")
    ids = tok.encode(text, add_special_tokens=False)
    detok, pieces = stream(tok, prompt, ids, random.Random(0), max_chunk)
    assert detok.text == tok.decode(ids) == text
    assert pieces[-1] == ""  # complete characters: nothing was left for flush()
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("seed", range(40))
def test_random_ids_equal_full_decode(tok, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 80))]
    prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 12))]
    for skip in (True, False):
        for max_chunk in (1, 2, 4):
            detok, _ = stream(tok, prompt, ids, rng, max_chunk, skip=skip)
            assert detok.text == tok.decode(ids, skip_special_tokens=skip)
            assert detok.output_ids == ids


@pytest.mark.parametrize("seed", range(20))
def test_random_text_ids_equal_full_decode(tok, seed):
    rng = random.Random(1000 + seed)
    pool = "".join(TEXTS)
    text = "".join(rng.choice(pool) for _ in range(rng.randint(1, 60)))
    ids = tok.encode(text, add_special_tokens=False)
    ids.insert(rng.randint(0, len(ids)), tok.eos_token_id)  # a special token somewhere
    for skip in (True, False):
        detok, pieces = stream(tok, tok.encode("prompt"), ids, rng, rng.randint(1, 4), skip=skip)
        assert detok.text == tok.decode(ids, skip_special_tokens=skip)
        assert pieces[-1] == ""


def test_holds_back_incomplete_multibyte_char(tok):
    ids = tok.encode("ab🚀", add_special_tokens=False)
    emoji_ids = tok.encode("🚀", add_special_tokens=False)
    assert len(emoji_ids) > 1 and ids[-len(emoji_ids) :] == emoji_ids
    detok = IncrementalDetokenizer(tok, tok.encode("hi"))
    assert detok.add(ids[: -len(emoji_ids)]) == "ab"
    for token in emoji_ids[:-1]:
        assert detok.add([token]) == ""  # partial emoji bytes are not emitted
    assert detok.text == "ab"
    assert detok.add(emoji_ids[-1:]) == "🚀"
    assert detok.text == "ab🚀"


def test_emits_text_before_incomplete_char_in_same_chunk(tok):
    emoji_ids = tok.encode("🚀", add_special_tokens=False)
    x_ids = tok.encode("xy", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add(x_ids + emoji_ids[:1]) == "xy"
    assert detok.add(emoji_ids[1:]) == "🚀"


def test_flush_releases_unfinished_sequence(tok):
    emoji_ids = tok.encode("😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add(emoji_ids[:-1]) == ""
    tail = detok.flush()
    assert tail and set(tail) <= {"\ufffd", " "}
    assert detok.text == tok.decode(emoji_ids[:-1])
    assert detok.flush() == ""


def test_special_tokens(tok):
    ids = tok.encode("ok", add_special_tokens=False) + [tok.eos_token_id]
    assert IncrementalDetokenizer(tok, []).add(ids) == "ok"
    assert IncrementalDetokenizer(tok, [], skip_special_tokens=False).add(ids) == "ok<｜end▁of▁sentence｜>"


def test_empty_add(tok):
    detok = IncrementalDetokenizer(tok, [1, 2, 3])
    assert detok.add([]) == ""
    assert detok.text == "" and detok.flush() == ""
