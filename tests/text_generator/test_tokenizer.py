import json

import pytest

from mindspec.text_generator.tokenizer import Tokenizer, TokenizerError, load_tokenizer
from tests.support.tokenizers import BOS_TOKEN, EOS_TOKEN, make_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir)


def test_make_tokenizer_is_deterministic_and_sized(tok_dir, tmp_path):
    other = make_tokenizer(tmp_path / "again")
    assert (other / "tokenizer.json").read_text() == (tok_dir / "tokenizer.json").read_text()
    config = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert "chat_template" in config
    assert load_tokenizer(make_tokenizer(tmp_path / "big", vocab_size=300)).vocab_size == 300


def test_load_basic_properties(tok):
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 256
    assert tok.bos_token_id == 0
    assert tok.eos_token_id == 1
    assert tok.eos_token_ids == {1}
    assert tok.convert_ids_to_tokens([0, 1]) == [BOS_TOKEN, EOS_TOKEN]


def test_encode_decode_roundtrip(tok):
    text = "Hello, world! 你好，世界 😀🚀 def f(x):\n    return x"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == BOS_TOKEN + text


def test_multibyte_characters_split_across_tokens(tok):
    # The tiny vocabulary cannot hold whole emoji, so they span several byte-level tokens.
    ids = tok.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1
    assert tok.decode(ids) == "🚀"


def test_chat_template(tok):
    assert tok.has_chat_template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    ids = tok.apply_chat_template(messages)
    assert ids[0] == tok.bos_token_id
    assert ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids, skip_special_tokens=False) == (
        BOS_TOKEN + "Be brief.<｜User｜>What is 2 + 2?<｜Assistant｜>"
    )


def test_no_chat_template_raises(tmp_path):
    tok = load_tokenizer(make_tokenizer(tmp_path, chat_template=False))
    assert not tok.has_chat_template
    with pytest.raises(TokenizerError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(("value", "expected"), [(7, {1, 7}), ([1, 5, 9], {1, 5, 9}), (None, {1})])
def test_eos_ids_from_generation_config(tmp_path, value, expected):
    make_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": value}))
    assert load_tokenizer(tmp_path).eos_token_ids == expected


def test_bad_generation_config_eos(tmp_path):
    make_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(TokenizerError, match="eos_token_id"):
        load_tokenizer(tmp_path)


def test_missing_tokenizer_raises(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerError, match=str(tmp_path)):
        load_tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    assert issubclass(TokenizerError, ValueError)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_through_the_backend_equals_transformers_decode(skip_special_tokens):
    """The shipped model's fast tokenizer decodes through its ``tokenizers`` backend (what
    transformers' decode forwards to): the same text for any ids, special tokens included."""
    import random

    from mindspec.config.defaults import default_model_dir

    tok = load_tokenizer(default_model_dir())
    hf = tok.hf_tokenizer
    assert tok._backend_decode is not None  # the path this test is about
    rng = random.Random(0)
    special = sorted(hf.all_special_ids)
    for n in (0, 1, 2, 5, 40):
        for _ in range(25):
            ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(hf.vocab_size) for _ in range(n)]
            want = hf.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
            assert tok.decode(ids, skip_special_tokens=skip_special_tokens) == want


def test_a_tokenizer_whose_decode_is_its_own_keeps_it(tok_dir):
    """A tokenizer class that overrides decode (custom code) is called as it is."""
    from transformers import AutoTokenizer

    base = type(AutoTokenizer.from_pretrained(str(tok_dir)))
    custom = type("Custom", (base,), {"decode": lambda self, ids, **kw: "custom"})
    tok = Tokenizer(custom.from_pretrained(str(tok_dir)))
    assert tok._backend_decode is None and tok.decode([2, 3]) == "custom"
