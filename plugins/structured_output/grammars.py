"""Compiled grammars for structured output, on xgrammar: one compiler per tokenizer, and
compiled grammars cached by format (a schema sent by many requests compiles once).

JSON schemas compile to compact JSON (no free whitespace: ", " and ": " separators, as
``json.dumps``): a model free to add whitespace may add it for ever, and whitespace carries no
data. ``json_object`` is the schema ``{"type": "object"}``.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any, Optional, Sequence

CACHED_GRAMMARS = 256


class StructuredOutputError(ValueError):
    """A structured output format cannot be compiled; ``field`` names the request field."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"invalid {field}: {message}")


class GrammarCompilerCache:
    """xgrammar's tokenizer info and compiler for one vocabulary, and an LRU of compiled grammars
    keyed by ``SamplingParams.structured``. Thread safe: the service compiles at admission."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], max_threads: int = 2):
        import xgrammar as xgr  # 3 s to import: only once a request asks for a format

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads)
        self._compiled: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, key: tuple[str, str]):
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        compiled = self._compile(*key)
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, key: tuple[str, str]):
        return self._xgr.GrammarMatcher(self.compile(key))

    def _json_ebnf(self, schema: str) -> str:
        """The schema's grammar as EBNF, compact, with bounded strings' characters fixed."""
        ebnf = str(self._xgr.Grammar.from_json_schema(schema, any_whitespace=False))
        return ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR)

    def _compile(self, field: str, text: str):
        c = self.compiler
        try:
            if field in ("json_schema", "json_object"):
                return c.compile_grammar(self._json_ebnf(text if field == "json_schema" else '{"type": "object"}'))
            if field == "regex":
                return c.compile_regex(text)
            if field == "choice":
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in json.loads(text)))
            return c.compile_grammar(text)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar reports bad input as these
            raise StructuredOutputError(field, xgrammar_message(exc)) from None


# xgrammar (0.2.8) writes the characters of a length-bounded JSON string as this class, which lets
# control characters through (JSON strings forbid U+0000..U+001F unescaped); its unbounded
# strings exclude them.
_BOUNDED_STRING_CHAR = r'([^\"\\\r\n])'
_JSON_STRING_CHAR = r'([^\0-\x1f\"\\\r\n])'


def schema_error(schema: str) -> Optional[str]:
    """Why xgrammar cannot take this JSON schema (text), or None: a check without a tokenizer."""
    import xgrammar as xgr

    try:
        xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    except (RuntimeError, ValueError, TypeError) as exc:
        return xgrammar_message(exc)
    return None


def xgrammar_message(exc: Exception) -> str:
    """xgrammar's message without its log prefix ("[08:38:42] /project/cpp/x.cc:83: ")."""
    text = (str(exc).strip() or type(exc).__name__).splitlines()[0]
    text = re.sub(r"^\[[0-9:]+\] \S+:\d+: ", "", text)
    return text if len(text) < 400 else text[:400] + "..."
