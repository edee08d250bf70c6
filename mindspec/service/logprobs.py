"""Token text for the routes' logprobs and TGI token lists.

Two views of a token:
- its *display* string, the token on its own: its bytes decoded, or ``bytes:\\xNN...`` when they are
  not whole UTF-8 (part of a character split across byte-level tokens; OpenAI and vLLM write it so),
  or the special token's own spelling;
- its *piece*, what it adds to the returned text: incremental detokenization of the request's
  tokens, so the pieces join to the text (a split character comes whole with its last token).

Offsets into the returned text (OpenAI's text_offset) come from the pieces, so they stay consistent
with the text the client got, whatever the display says.
"""
from __future__ import annotations

import re
from functools import lru_cache
from typing import Optional, Sequence

from mindspec.text_generator.detokenizer import IncrementalDetokenizer

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte-fallback tokens


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE's printable alphabet back to bytes (the inverse of bytes_to_unicode)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def bytes_label(raw: bytes) -> str:
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TokenText:
    """Display strings and bytes of token ids for one tokenizer (None: ids spelled token_id:N)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.special = frozenset(tokenizer.all_special_ids) if tokenizer is not None else frozenset()
        self._display: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}

    def raw_bytes(self, token_id: int) -> bytes:
        if token_id not in self._bytes:
            self._bytes[token_id] = self._compute_bytes(token_id)
        return self._bytes[token_id]

    def _compute_bytes(self, token_id: int) -> bytes:
        if self.tok is None:
            return f"token_id:{token_id}".encode()
        text = self.tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode()
        # The token alone is not whole UTF-8: read its bytes from its vocabulary spelling.
        spelling = self.tok.convert_ids_to_tokens([token_id])[0]
        fallback = _BYTE_FALLBACK.fullmatch(spelling)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        decoder = _byte_decoder()
        if all(c in decoder for c in spelling):
            return bytes(decoder[c] for c in spelling)
        return text.encode()

    def display(self, token_id: int) -> str:
        if token_id not in self._display:
            self._display[token_id] = self._compute_display(token_id)
        return self._display[token_id]

    def _compute_display(self, token_id: int) -> str:
        if self.tok is None:
            return f"token_id:{token_id}"
        if token_id in self.special:
            return self.tok.convert_ids_to_tokens([token_id])[0]
        raw = self.raw_bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return bytes_label(raw)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special

    def pieces(self, context_ids: Sequence[int] = ()) -> "Pieces":
        return Pieces(self, context_ids)


class Pieces:
    """Per-token pieces of the returned text, one token at a time (special tokens add nothing,
    as the text skips them). ``context_ids``: the tokens before the first one read (the prompt)."""

    def __init__(self, text: TokenText, context_ids: Sequence[int] = ()):
        self.text = text
        self._detok = IncrementalDetokenizer(text.tok, context_ids) if text.tok is not None else None

    def next(self, token_id: int) -> str:
        if self._detok is None:
            return ""
        return self._detok.add([token_id])

    def flush(self) -> str:
        """What is still held back (an unfinished character) once the output ended."""
        return self._detok.flush() if self._detok is not None else ""


def _top_items(top: Optional[dict[int, float]]) -> list[tuple[int, float]]:
    return sorted((top or {}).items(), key=lambda kv: -kv[1])


class CompletionLogprobs:
    """OpenAI /v1/completions ``logprobs`` for one choice, built as tokens arrive (streaming
    chunks carry their own tokens' part). ``offset``: characters of returned text before the
    first token read (the echoed prompt's length when the prompt is not read through ``add``)."""

    def __init__(self, text: TokenText, context_ids: Sequence[int] = (), offset: int = 0):
        self.text = text
        self.pieces = text.pieces(context_ids)
        self.offset = offset

    def add(self, token_ids: Sequence[int], logprobs: Sequence[Optional[float]],
            tops: Sequence[Optional[dict[int, float]]]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, lp, top in zip(token_ids, logprobs, tops):
            shown = self.text.display(token_id)
            piece = self.pieces.next(token_id)
            out["tokens"].append(shown)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(self._top(token_id, lp, top))
            out["text_offset"].append(self._start(token_id, shown, piece))
            self.offset += len(piece)
        return out

    def _start(self, token_id: int, shown: str, piece: str) -> int:
        """Where the token's text starts: a piece may carry a character completed from earlier
        tokens before the token's own text, so a whole token starts at the end of its piece."""
        if shown and not self.text.is_special(token_id) and not shown.startswith("bytes:") and piece.endswith(shown):
            return self.offset + len(piece) - len(shown)
        return self.offset

    def _top(self, token_id: int, lp: Optional[float], top: Optional[dict[int, float]]) -> Optional[dict[str, float]]:
        """The top-k alternatives and, like vLLM, the chosen token itself (so logprobs=0 still
        names it). None where there is no logprob (a prompt's first token)."""
        if lp is None:
            return None
        shown = {self.text.display(i): v for i, v in _top_items(top)}
        shown.setdefault(self.text.display(token_id), lp)
        return shown


def chat_logprobs(text: TokenText, token_ids: Sequence[int], logprobs: Sequence[float],
                  tops: Sequence[Optional[dict[int, float]]], k: int) -> list[dict]:
    """OpenAI chat ``logprobs.content`` entries: token, logprob, bytes, top_logprobs (k of them)."""

    def entry(token_id: int, lp: float) -> dict:
        return {"token": text.display(token_id), "logprob": lp, "bytes": list(text.raw_bytes(token_id))}

    return [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in _top_items(top)[:k]]}
            for t, lp, top in zip(token_ids, logprobs, tops)]


def top_k_list(text: TokenText, top: Optional[dict[int, float]]) -> list[tuple[int, str, float]]:
    """(id, display, logprob) of a position's alternatives, most likely first."""
    return [(i, text.display(i), v) for i, v in _top_items(top)]
