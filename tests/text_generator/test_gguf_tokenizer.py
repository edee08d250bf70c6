"""GGUF tokenizer metadata <-> transformers tokenizer (mindspec.text_generator.gguf_tokenizer).

The reference throughout is the shipped model's own Hugging Face tokenizer: whatever path the tokenizer
takes through GGUF metadata, it must give the same ids, the same text back and the same chat prompt.
"""

import ast
import os
from pathlib import Path

import numpy as np
import pytest
from tokenizers import decoders, pre_tokenizers
from transformers import AutoTokenizer

import mindspec
from mindspec.bench.corpus import corpus_files, read
from mindspec.modeling.gguf_file import read_metadata, write_key_values
from tests.support.tokenizer_checks import BOS, EOS, EXTRA_TEXTS, assert_same_tokenizer
from mindspec.text_generator import gguf_tokenizer as gt
from mindspec.text_generator.tokenizer import TokenizerError

gguf = pytest.importorskip("gguf")

MODEL_DIR = Path(mindspec.__file__).parent / "assets" / "default_model"
# llama.cpp's tokenizer source, fetched with its converter (scripts/llama_cpp_converter.sh, as CI does).
LLAMA_VOCAB_CPP = Path(os.environ.get("LLAMA_CPP_SRC", "/nonexistent")) / "src" / "llama-vocab.cpp"


@pytest.fixture(scope="module")
def hf():
    return AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def texts():
    return [read(p) for p in corpus_files()[1][:8]] + EXTRA_TEXTS


def write_gguf(path, metadata):
    writer = gguf.GGUFWriter(path, "deepseek2")
    write_key_values(writer, metadata)
    writer.add_tensor("tiny", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def byte_vocab(pre="gpt-2", **extra):
    """The smallest valid metadata: the 256 byte-level characters as tokens, no merges."""
    return {gt.MODEL: "gpt2", gt.PRE: pre, gt.TOKENS: sorted(pre_tokenizers.ByteLevel.alphabet()), gt.MERGES: [], **extra}


# ---- round trips -------------------------------------------------------------------------------------
def test_metadata_of_the_shipped_tokenizer(hf):
    md = gt.tokenizer_metadata(hf)
    assert md[gt.MODEL] == "gpt2" and md[gt.PRE] == "gpt-2"  # ByteLevel with the GPT-2 regex
    assert len(md[gt.TOKENS]) == len(md[gt.TOKEN_TYPE]) == 4096
    assert md[gt.TOKENS][:2] == [BOS, EOS] and md[gt.TOKEN_TYPE][:2] == [3, 3]
    assert set(md[gt.TOKEN_TYPE][2:]) == {gt.TokenType.NORMAL}
    assert md[gt.MERGES][0] == "Ġ Ġ" and len(md[gt.MERGES]) == 3838
    assert md["tokenizer.ggml.bos_token_id"] == 0 and md["tokenizer.ggml.eos_token_id"] == 1
    assert md[gt.ADD_BOS] is True and md[gt.ADD_EOS] is False
    assert md[gt.CHAT_TEMPLATE] == hf.chat_template


def test_round_trip_in_memory(hf, texts):
    assert_same_tokenizer(gt.tokenizer_from_gguf(gt.tokenizer_metadata(hf), "memory"), hf, texts)


def test_round_trip_through_a_gguf_file(hf, texts, tmp_path):
    md = gt.tokenizer_metadata(hf)
    write_gguf(tmp_path / "tok.gguf", md)
    back = read_metadata(gguf.GGUFReader(tmp_path / "tok.gguf"))
    assert back["general.architecture"] == "deepseek2"
    assert {k: back[k] for k in md} == md  # every value survives, string arrays as lists of str
    assert_same_tokenizer(gt.tokenizer_from_gguf(back, str(tmp_path / "tok.gguf")), hf, texts)


def test_padded_vocab_and_user_defined_tokens(texts):
    ref = AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)
    ref.add_tokens(["<think>"])  # not special: llama.cpp's USER_DEFINED
    md = gt.tokenizer_metadata(ref, vocab_size=4100)
    assert md[gt.TOKENS][4096:] == ["<think>", "[PAD4097]", "[PAD4098]", "[PAD4099]"]
    assert md[gt.TOKEN_TYPE][4096:] == [gt.TokenType.USER_DEFINED] + [gt.TokenType.UNUSED] * 3
    ours = gt.tokenizer_from_gguf(md, "memory")
    assert_same_tokenizer(ours, ref, texts[-3:] + ["a<think>b <think>\n<think>"])
    assert ours.convert_tokens_to_ids("[PAD4099]") == 4099


@pytest.mark.parametrize("pre", gt.known_pre_tokenizers())
def test_every_pre_tokenizer_builds_and_is_detected_back(pre):
    canonical = {"llama3": "llama-bpe", "llama-v3": "llama-bpe", "deepseek-r1-qwen": "qwen2"}.get(pre, pre)
    built = gt.tokenizer_from_gguf(byte_vocab(pre), "tiny")
    assert gt.tokenizer_metadata(built)[gt.PRE] == canonical


def test_named_chat_templates_round_trip():
    md = byte_vocab(**{gt.CHAT_TEMPLATE: "D{{ messages[0].content }}", gt.CHAT_TEMPLATES: ["tool_use"],
                       f"{gt.CHAT_TEMPLATE}.tool_use": "T{{ messages[0].content }}"})
    tok = gt.tokenizer_from_gguf(md, "tiny")
    chat = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(chat, tokenize=False) == "Dx"
    assert tok.apply_chat_template(chat, tokenize=False, chat_template="tool_use") == "Tx"
    back = gt.tokenizer_metadata(tok)
    assert {k: back[k] for k in (gt.CHAT_TEMPLATE, gt.CHAT_TEMPLATES, f"{gt.CHAT_TEMPLATE}.tool_use")} == {
        k: md[k] for k in (gt.CHAT_TEMPLATE, gt.CHAT_TEMPLATES, f"{gt.CHAT_TEMPLATE}.tool_use")}


# ---- the deepseek-v3 pre-tokenizer --------------------------------------------------------------------
# Expected pieces worked out by hand from llama.cpp's three regexes, applied in turn, each keeping both
# its matches and the text between them: (1) \p{N}{1,3}; (2) runs of CJK ideographs and kana;
# (3) an ASCII punctuation mark plus ASCII letters | an optional non-letter/punctuation/symbol
# (a space, a digit) plus letters/marks | optional space plus punctuation/symbols | newlines |
# whitespace not followed by non-space | whitespace.
DEEPSEEK_V3_SPLITS = [
    ("1234567", ["123", "456", "7"]),  # digits in groups of up to three, from the left
    ("abc123def", ["abc", "123", "def"]),
    ("abc 12345 def", ["abc", " ", "123", "45", " def"]),  # a space before a digit is left alone
    ("3.14159", ["3", ".", "141", "59"]),
    ("$100", ["$", "100"]),
    ("我爱 Python3!", ["我爱", " Python", "3", "!"]),  # the CJK run is cut off before the space
    ("こんにちは、世界！", ["こんにちは", "、", "世界", "！"]),  # CJK punctuation is not in the CJK run
    ("日本語のテキスト", ["日本語のテキスト"]),  # ideographs, hiragana and katakana make one run
    ("한국어 text", ["한국어", " text"]),  # Hangul is not in the CJK class: plain letters
    ("foo.bar(x)", ["foo", ".bar", "(x", ")"]),  # one ASCII punctuation mark joins the letters after it
    ("don't", ["don", "'t"]),
    ("a  b", ["a", " ", " b"]),  # of a space run, the last space goes with the word
    ("x\n\ny", ["x", "\n\n", "y"]),
    ("hi 👋", ["hi", " 👋"]),  # an emoji is a symbol: it takes the space before it
]


@pytest.mark.parametrize("text,pieces", DEEPSEEK_V3_SPLITS)
def test_deepseek_v3_splits(text, pieces):
    tok = gt.tokenizer_from_gguf(byte_vocab("deepseek-v3"), "tiny")
    split = tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
    assert [decoders.ByteLevel().decode([piece]) for piece, _ in split] == pieces


@pytest.mark.skipif(not LLAMA_VOCAB_CPP.is_file(), reason="LLAMA_CPP_SRC has no src/llama-vocab.cpp (scripts/llama_cpp_converter.sh)")
def test_regexes_are_llama_cpps():
    source = LLAMA_VOCAB_CPP.read_text(encoding="utf-8")

    def regexes(case, comment=False):
        block = source[source.index(f"case LLAMA_VOCAB_PRE_TYPE_{case}:"):]
        block = block[block.index("regex_exprs = {"):block.index("};")]
        lines = [line.strip() for line in block.splitlines()[1:]]
        if comment:  # the tokenizer.json original llama.cpp quotes beside its rewrite
            lines = [line.lstrip("/ ") for line in lines if line.startswith("//") and "(?i:" in line]
        # C and Python agree on the escapes these literals use (\\ \" \r \n).
        return [ast.literal_eval(line.rstrip(",")) for line in lines if line.startswith('"')]

    assert regexes("DEEPSEEK3_LLM") == list(gt._DEEPSEEK_V3)
    assert regexes("DEEPSEEK_LLM") == [*gt._DEEPSEEK_LLM, "\\p{N}+"]  # tokenizer.json: Digits
    assert regexes("DEEPSEEK_CODER") == [*gt._DEEPSEEK_CODER, "\\p{N}"]  # tokenizer.json: Digits
    assert regexes("LLAMA3", comment=True) == [gt._LLAMA3]
    assert regexes("QWEN2", comment=True) == [gt._QWEN2]


# ---- errors ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "change,words",
    [
        ({gt.MODEL: "llama"}, [gt.MODEL, "'llama'", "gpt2"]),
        ({gt.PRE: "tekken"}, [gt.PRE, "'tekken'", "deepseek-v3"]),
        ({gt.TOKENS: None}, [gt.TOKENS]),
        ({gt.MODEL: None}, [gt.MODEL]),
        ({gt.PRE: None}, [gt.PRE]),
        ({gt.MERGES: None}, [gt.MERGES]),
        ({gt.MERGES: ["Ġ zz"]}, [gt.MERGES]),  # a merge of tokens that do not exist
        ({gt.MERGES: ["nospace"]}, [gt.MERGES, "'nospace'"]),
        ({gt.TOKEN_TYPE: [1, 1]}, [gt.TOKEN_TYPE]),
        ({gt.ADD_BOS: True}, [gt.ADD_BOS, "tokenizer.ggml.bos_token_id"]),
        ({"tokenizer.ggml.eos_token_id": 999}, ["tokenizer.ggml.eos_token_id", "999"]),
    ],
)
def test_bad_metadata_is_one_clear_error(change, words):
    md = {k: v for k, v in {**byte_vocab(), **change}.items() if v is not None}
    with pytest.raises(TokenizerError) as err:
        gt.tokenizer_from_gguf(md, "/models/x.gguf")
    assert "/models/x.gguf" in str(err.value)
    for word in words:
        assert word in str(err.value)


def test_duplicate_token_is_an_error():
    md = byte_vocab()
    md[gt.TOKENS] = md[gt.TOKENS][:-1] + [md[gt.TOKENS][0]]
    with pytest.raises(TokenizerError, match="more than once"):
        gt.tokenizer_from_gguf(md, "x.gguf")


def test_unknown_pre_tokenizer_asks_for_pre():
    ref = AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    with pytest.raises(TokenizerError, match="pass `pre`"):
        gt.tokenizer_metadata(ref)
    assert gt.tokenizer_metadata(ref, pre="gpt-2")[gt.PRE] == "gpt-2"  # the caller's word is taken
