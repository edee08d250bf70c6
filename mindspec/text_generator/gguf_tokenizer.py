"""Byte-level BPE tokenizers to and from GGUF metadata.

A GGUF file (llama.cpp's format) has no ``tokenizer.json``: its tokenizer travels as ``tokenizer.ggml.*``
key/values (token list, token types, merges, special ids, a pre-tokenizer *name*). mindspec runs a GGUF
model without its Hugging Face directory, so :func:`tokenizer_from_gguf` rebuilds a ``transformers``
tokenizer from those keys; mindspec's converter writes GGUF files that llama.cpp must read, so
:func:`tokenizer_metadata` produces the same keys and values llama.cpp's own converter
(``convert_hf_to_gguf.py``: ``_set_vocab_gpt2`` + ``gguf.SpecialVocab``) writes.

Only byte-level BPE (``tokenizer.ggml.model = "gpt2"``, what every DeepSeek model uses) is handled.
The pre-tokenizer name is the one thing that cannot be read back as data: each name we accept maps to the
pre-tokenizer Hugging Face's own ``tokenizer.json`` declares for that family (see ``_PRE_TOKENIZERS``);
a name we do not know is an error rather than a guess, since a wrong split gives wrong ids silently.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from transformers import PreTrainedTokenizerFast

from .tokenizer import TokenizerError


class TokenType(enum.IntEnum):
    """``gguf.TokenType``, repeated so that reading a tokenizer does not need the ``gguf`` package."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# GGUF keys (gguf.Keys.Tokenizer).
MODEL = "tokenizer.ggml.model"
PRE = "tokenizer.ggml.pre"
TOKENS = "tokenizer.ggml.tokens"
TOKEN_TYPE = "tokenizer.ggml.token_type"
MERGES = "tokenizer.ggml.merges"
ADD_BOS = "tokenizer.ggml.add_bos_token"
ADD_EOS = "tokenizer.ggml.add_eos_token"
CHAT_TEMPLATE = "tokenizer.chat_template"
CHAT_TEMPLATES = "tokenizer.chat_templates"  # names of the extra templates, each at CHAT_TEMPLATE.<name>
# Hugging Face special-token attribute -> GGUF id key, in gguf.SpecialVocab's order ("seperator" is
# how gguf spells it).
SPECIAL_ID_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
    "sep": "tokenizer.ggml.seperator_token_id",
    "pad": "tokenizer.ggml.padding_token_id",
    "cls": "tokenizer.ggml.cls_token_id",
    "mask": "tokenizer.ggml.mask_token_id",
}


# ---- pre-tokenizers ---------------------------------------------------------------------------------
# The regexes are llama.cpp's (src/llama-vocab.cpp, the LLAMA_VOCAB_PRE_TYPE_* cases of
# llm_tokenizer_bpe), laid out the way each family's own Hugging Face tokenizer.json lays them out:
# one isolated Split per regex, then ByteLevel with its own regex off. Where the two differ we follow
# the tokenizer.json, since that is what the model was trained with:
#  - llama-bpe and qwen2: llama.cpp rewrites the case-insensitive group (?i:'s|...) as '[sS]|...
#    because its regex engine lacks (?i:); tokenizer.json keeps (?i:), and so do we (llama.cpp quotes it
#    in a comment beside its rewrite).
#  - deepseek-llm and deepseek-coder: tokenizer.json ends with Digits(individual_digits=True) where
#    llama.cpp has \p{N}+ (llm) or \p{N} (coder); the same cut for coder, and for llm the same ids as
#    long as no merge joins two digits, which DeepSeek-LLM's vocabulary has none of.
#  - qwen2: tokenizer.json also declares an NFC normalizer (llama.cpp applies none).
# gpt-2 is plain ByteLevel with its built-in GPT-2 regex, as in GPT-2's tokenizer.json (llama.cpp's
# copy of that regex lacks the final |\s+, which only matters for whitespace that it then keeps as its
# own piece anyway).

_LLAMA3 = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
_QWEN2 = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
# Non-ASCII characters are written as escapes: several in these classes (U+1F7D, U+212A, ...) are
# ones Unicode normalization replaces, so a copy through an editor or a terminal can change them.
_DEEPSEEK_LLM_LETTERS = (
    "\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
    "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
    "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
    "\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"  # [一-龥ࠀ-一가-퟿]+
_DEEPSEEK_LLM = (
    "[\r\n]",
    "\\s?[A-Za-z" + _DEEPSEEK_LLM_LETTERS + "]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",  # fullwidth !-/ :-~, quotes, 　、。
    "\\s+$",
    _DEEPSEEK_CJK,
)
_DEEPSEEK_CODER = (
    "[\r\n]",
    "\\s?\\p{L}+",
    "\\s?\\p{P}+",
    _DEEPSEEK_CJK,
)
_DEEPSEEK_V3 = (
    "\\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",  # [一-龥぀-ゟ゠-ヿ]+: CJK ideographs, hiragana, katakana
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+"
    "| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
)


@dataclass(frozen=True)
class _PreTokenizer:
    """How one ``tokenizer.ggml.pre`` value splits text before BPE."""

    splits: tuple[str, ...] = ()  # regexes, each an isolated Split, in order
    digits: bool = False  # then Digits(individual_digits=True)
    gpt2_regex: bool = False  # ByteLevel's own GPT-2 regex instead of any splits
    trim_offsets: bool = True  # offsets only, but kept as tokenizer.json has it
    nfc: bool = False
    ignore_merges: bool = False  # BPE takes a whole piece that is in the vocabulary as one token
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token

    def build(self) -> tuple[pre_tokenizers.PreTokenizer, normalizers.Normalizer | None]:
        def byte_level(use_regex: bool) -> pre_tokenizers.ByteLevel:
            return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=self.trim_offsets, use_regex=use_regex)

        if self.gpt2_regex:
            return byte_level(True), None
        steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in self.splits]
        if self.digits:
            steps.append(pre_tokenizers.Digits(individual_digits=True))
        steps.append(byte_level(False))
        return pre_tokenizers.Sequence(steps), normalizers.NFC() if self.nfc else None


_LLAMA3_PRE = _PreTokenizer(splits=(_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_PRE = _PreTokenizer(splits=(_QWEN2,), trim_offsets=False, nfc=True)
# Canonical name first: detection (tokenizer_metadata) reports the first name of a match.
_PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    "gpt-2": _PreTokenizer(gpt2_regex=True),
    "deepseek-v3": _PreTokenizer(splits=_DEEPSEEK_V3),
    "deepseek-llm": _PreTokenizer(splits=_DEEPSEEK_LLM, digits=True),
    "deepseek-coder": _PreTokenizer(splits=_DEEPSEEK_CODER, digits=True),
    "llama-bpe": _LLAMA3_PRE,
    "qwen2": _QWEN2_PRE,
    # Other names llama.cpp gives the same two tokenizers.
    "llama3": _LLAMA3_PRE,
    "llama-v3": _LLAMA3_PRE,
    "deepseek-r1-qwen": _QWEN2_PRE,
}


def known_pre_tokenizers() -> list[str]:
    return list(_PRE_TOKENIZERS)


# ---- GGUF -> tokenizer ------------------------------------------------------------------------------
def read_metadata(reader: Any) -> dict[str, Any]:
    """A ``gguf.GGUFReader``'s key/values as plain Python values (str, int, float, bool, lists; string
    arrays as lists of str), the ``GGUF.*`` header fields left out."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def tokenizer_from_gguf(metadata: Mapping[str, Any], where: str) -> PreTrainedTokenizerFast:
    """The tokenizer a GGUF file's metadata describes. ``where`` (the file) goes into every error."""
    model = _require(metadata, MODEL, str, where)
    if model != "gpt2":
        raise TokenizerError(
            f"{where}: {MODEL} = {model!r} is not supported; mindspec reads only byte-level BPE "
            f"tokenizers ('gpt2') from GGUF files"
        )
    pre_name = _require(metadata, PRE, str, where)
    pre = _PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise TokenizerError(
            f"{where}: {PRE} = {pre_name!r} is not a pre-tokenizer mindspec knows "
            f"(it knows {', '.join(_PRE_TOKENIZERS)})"
        )
    tokens = _require(metadata, TOKENS, list, where)
    if not all(isinstance(t, str) for t in tokens):
        raise TokenizerError(f"{where}: {TOKENS} should be a list of strings")
    types = _token_types(metadata, len(tokens), where)
    backend = _backend(tokens, _require(metadata, MERGES, list, where), pre, where)
    _add_special_and_user_tokens(backend, tokens, types)
    ids = _special_ids(metadata, len(tokens), where)
    add_bos = bool(metadata.get(ADD_BOS, pre.add_bos and "bos" in ids))
    add_eos = bool(metadata.get(ADD_EOS, False))
    backend.post_processor = _post_processor(tokens, ids, add_bos, add_eos, where)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        **{f"{typ}_token": tokens[i] for typ, i in ids.items()},
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        # GGUF has no key for it, and mindspec never cleans up (it is not prefix-stable).
        clean_up_tokenization_spaces=False,
        chat_template=_chat_template(metadata, where),
    )


def _require(metadata: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    if key not in metadata:
        raise TokenizerError(f"{where}: the GGUF metadata has no {key}, so it describes no usable tokenizer")
    value = metadata[key]
    if not isinstance(value, kind):
        raise TokenizerError(f"{where}: {key} should be a {kind.__name__}, not {type(value).__name__}")
    return value


def _token_types(metadata: Mapping[str, Any], n_tokens: int, where: str) -> list[int]:
    types = metadata.get(TOKEN_TYPE)
    if types is None:
        return [TokenType.NORMAL] * n_tokens
    if not isinstance(types, list) or len(types) != n_tokens:
        raise TokenizerError(f"{where}: {TOKEN_TYPE} should list one type for each of the {n_tokens} tokens")
    return types


def _backend(tokens: list[str], merges: list[str], pre: _PreTokenizer, where: str) -> BackendTokenizer:
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        # Two ids for one string cannot both survive as a vocabulary: refuse rather than drop one.
        seen: set[str] = set()
        dup = next(t for t in tokens if t in seen or seen.add(t))
        raise TokenizerError(f"{where}: {TOKENS} has {dup!r} more than once")
    pairs = [_merge(m, where) for m in merges]
    try:
        bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre.ignore_merges)
    except Exception as exc:  # tokenizers rejects a merge whose parts are not in the vocabulary
        raise TokenizerError(f"{where}: {MERGES} do not fit {TOKENS}: {exc}") from exc
    backend = BackendTokenizer(bpe)
    backend.pre_tokenizer, normalizer = pre.build()
    if normalizer is not None:
        backend.normalizer = normalizer
    backend.decoder = decoders.ByteLevel()
    return backend


def _merge(merge: str, where: str) -> tuple[str, str]:
    # As llama.cpp splits it: at the first space after the first character.
    cut = merge.find(" ", 1) if isinstance(merge, str) else -1
    if cut < 0:
        raise TokenizerError(f"{where}: {MERGES} entry {merge!r} is not two tokens separated by a space")
    return merge[:cut], merge[cut + 1:]


def _add_special_and_user_tokens(backend: BackendTokenizer, tokens: list[str], types: list[int]) -> None:
    # llama.cpp matches CONTROL, USER_DEFINED and UNKNOWN tokens whole in the text before any
    # splitting; added tokens are how `tokenizers` does the same. They keep their ids (already in the
    # vocabulary) and are matched raw (normalized=False), as llama.cpp assumes they are pre-normalized.
    special = {TokenType.CONTROL, TokenType.UNKNOWN}
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in special]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == TokenType.USER_DEFINED]
    )


def _special_ids(metadata: Mapping[str, Any], n_tokens: int, where: str) -> dict[str, int]:
    ids = {}
    for typ, key in SPECIAL_ID_KEYS.items():
        value = metadata.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < n_tokens:
            raise TokenizerError(f"{where}: {key} = {value!r} is not a token id (there are {n_tokens} tokens)")
        ids[typ] = value
    return ids


def _post_processor(tokens: list[str], ids: dict[str, int], add_bos: bool, add_eos: bool, where: str):
    """BOS before / EOS after each sequence, as the TemplateProcessing of Hugging Face's DeepSeek (and
    Llama) tokenizers does it; the same layout transformers' update_post_processor builds."""
    for typ, add, key in (("bos", add_bos, ADD_BOS), ("eos", add_eos, ADD_EOS)):
        if add and typ not in ids:
            raise TokenizerError(f"{where}: {key} is true but the file has no {SPECIAL_ID_KEYS[typ]}")
    first = [tokens[ids["bos"]]] if add_bos else []
    last = [tokens[ids["eos"]]] if add_eos else []

    def template(*seqs: str) -> str:
        return " ".join(f"{p}:{n}" for n, seq in enumerate(seqs) for p in (*first, f"${seq}", *last))

    specials = [(tokens[ids[typ]], ids[typ]) for typ, add in (("bos", add_bos), ("eos", add_eos)) if add]
    try:
        return processors.TemplateProcessing(single=template("A"), pair=template("A", "B"), special_tokens=specials)
    except Exception as exc:  # the template syntax cannot name a token with a space or ':' in it
        raise TokenizerError(f"{where}: cannot add BOS/EOS tokens {[t for t, _ in specials]}: {exc}") from exc


def _chat_template(metadata: Mapping[str, Any], where: str) -> str | dict[str, str] | None:
    default = metadata.get(CHAT_TEMPLATE)
    names = metadata.get(CHAT_TEMPLATES) or []
    if not names:
        return default
    # Named templates, as gguf.GGUFWriter.add_chat_template stores a list of {name, template}.
    named = {name: metadata.get(f"{CHAT_TEMPLATE}.{name}") for name in names}
    missing = [n for n, t in named.items() if not isinstance(t, str)]
    if missing:
        raise TokenizerError(f"{where}: {CHAT_TEMPLATES} names {missing} but the file has no such template")
    return {**({"default": default} if default is not None else {}), **named}


# ---- tokenizer -> GGUF ------------------------------------------------------------------------------
def tokenizer_metadata(hf_tokenizer: Any, pre: str | None = None, *, vocab_size: int | None = None) -> dict[str, Any]:
    """The ``tokenizer.*`` GGUF key/values for a byte-level BPE ``transformers`` tokenizer, as
    llama.cpp's convert_hf_to_gguf.py writes them. ``pre``: the ``tokenizer.ggml.pre`` name, detected
    when left out (only from a pre-tokenizer identical to one in ``_PRE_TOKENIZERS``). ``vocab_size``:
    the model's embedding rows (config.json's vocab_size, what llama.cpp uses); ids with no token are
    padded as ``[PAD<id>]``; default: just past the highest id."""
    spec = json.loads(hf_tokenizer.backend_tokenizer.to_str())
    if spec["model"]["type"] != "BPE" or not _is_byte_level(spec):
        raise TokenizerError("only byte-level BPE tokenizers can be written to GGUF by mindspec")
    tokens, types = _token_lists(hf_tokenizer, vocab_size)
    metadata: dict[str, Any] = {
        MODEL: "gpt2",
        PRE: pre or _detect_pre(spec),
        TOKENS: tokens,
        TOKEN_TYPE: types,
        MERGES: _merge_strings(spec["model"]["merges"]),
    }
    for typ, key in SPECIAL_ID_KEYS.items():
        token_id = getattr(hf_tokenizer, f"{typ}_token_id", None)
        if isinstance(token_id, int) and 0 <= token_id < len(tokens):
            metadata[key] = token_id
    metadata[ADD_BOS], metadata[ADD_EOS] = _adds_bos_eos(hf_tokenizer)
    metadata.update(_chat_template_metadata(getattr(hf_tokenizer, "chat_template", None)))
    return metadata


def _is_byte_level(spec: dict) -> bool:
    decoder = spec.get("decoder") or {}
    decoders_ = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(d.get("type") == "ByteLevel" for d in decoders_)


def _detect_pre(spec: dict) -> str:
    found = _canonical_pre(spec["pre_tokenizer"], spec.get("normalizer"), spec["model"].get("ignore_merges", False))
    for name, pre in _PRE_TOKENIZERS.items():
        pre_tokenizer, normalizer = pre.build()
        model = BackendTokenizer(models.BPE())
        model.pre_tokenizer = pre_tokenizer
        if normalizer is not None:
            model.normalizer = normalizer
        ours = json.loads(model.to_str())
        if _canonical_pre(ours["pre_tokenizer"], ours.get("normalizer"), pre.ignore_merges) == found:
            return name
    raise TokenizerError(
        "cannot tell which llama.cpp pre-tokenizer this tokenizer's pre-tokenizer is "
        f"({json.dumps(spec['pre_tokenizer'], ensure_ascii=False)[:200]}); pass `pre` "
        f"(the tokenizer.ggml.pre name, e.g. one of {', '.join(_PRE_TOKENIZERS)})"
    )


def _canonical_pre(pre_tokenizer: Any, normalizer: Any, ignore_merges: bool) -> str:
    """What decides the ids, as comparable text: trim_offsets only moves offsets, and an empty
    normalizer Sequence is no normalizer."""

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k != "trim_offsets"}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    if normalizer == {"type": "Sequence", "normalizers": []}:
        normalizer = None
    return json.dumps([strip(pre_tokenizer), normalizer, bool(ignore_merges)], sort_keys=True)


def _token_lists(hf_tokenizer: Any, vocab_size: int | None) -> tuple[list[str], list[int]]:
    # Mirrors convert_hf_to_gguf.py's get_vocab_base (TextModel).
    vocab = hf_tokenizer.get_vocab()
    size = max(vocab.values()) + 1 if vocab_size is None else vocab_size
    if max(vocab.values()) >= size:
        raise TokenizerError(f"the tokenizer has id {max(vocab.values())}, past vocab_size {size}")
    by_id = {i: token for token, i in vocab.items()}
    added = hf_tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(size):
        if i not in by_id:
            token, ty = f"[PAD{i}]", TokenType.UNUSED
        elif i in added:
            token, ty = _added_entry(hf_tokenizer, added[i])
        else:
            token, ty = by_id[i], TokenType.NORMAL
        tokens.append(token)
        types.append(int(ty))
    return tokens, types


def _added_entry(hf_tokenizer: Any, added: AddedToken) -> tuple[str, TokenType]:
    token = added.content
    if not added.normalized:
        # llama.cpp assumes added tokens are pre-normalized: its converter stores what the tokenizer
        # decodes the token back to.
        token = hf_tokenizer.decode(hf_tokenizer.encode(token, add_special_tokens=False))
    if added.special or _looks_special(token):
        return token, TokenType.CONTROL
    # The converter's pre-normalization of SentencePiece spaces (for Gemma), applied to every model.
    return token.replace("\u2581", " "), TokenType.USER_DEFINED


def _looks_special(token: str) -> bool:
    # convert_hf_to_gguf.py's does_token_look_special: added tokens some models fail to mark special.
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<｜") and token.endswith("｜>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def _merge_strings(merges: list) -> list[str]:
    # gguf.SpecialVocab: tokenizer.json's [a, b] pairs become "a b", a space inside a part written
    # as its byte-level stand-in (U+0120) so that the one separating space stays unambiguous.
    if merges and isinstance(merges[0], str):
        return list(merges)
    return [" ".join(part.replace(" ", "\u0120") for part in pair) for pair in merges]


def _adds_bos_eos(hf_tokenizer: Any) -> tuple[bool, bool]:
    """Whether encoding adds BOS in front / EOS behind, read off what the tokenizer does rather than its
    flags (a tokenizer.json post-processor adds them whatever tokenizer_config.json says)."""
    plain = hf_tokenizer.encode("a", add_special_tokens=False)
    full = hf_tokenizer.encode("a", add_special_tokens=True)
    at = next((k for k in range(len(full) - len(plain) + 1) if full[k:k + len(plain)] == plain), None)
    if at is None:
        raise TokenizerError("the tokenizer's special tokens change the text's own ids; GGUF cannot express that")
    before, after = full[:at], full[at + len(plain):]
    bos, eos = hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id
    if before not in ([], [bos]) or after not in ([], [eos]):
        raise TokenizerError(
            f"the tokenizer adds {before} before and {after} after the text; GGUF can only say "
            "'add BOS' and 'add EOS'"
        )
    return before == [bos], after == [eos]


def _chat_template_metadata(template: str | Mapping[str, str] | None) -> dict[str, Any]:
    if template is None:
        return {}
    if isinstance(template, str):
        return {CHAT_TEMPLATE: template}
    named = {name: t for name, t in template.items() if name != "default"}
    metadata: dict[str, Any] = {f"{CHAT_TEMPLATE}.{name}": t for name, t in named.items()}
    if named:
        metadata[CHAT_TEMPLATES] = list(named)
    if "default" in template:
        metadata[CHAT_TEMPLATE] = template["default"]
    return metadata
