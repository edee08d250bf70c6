"""Incremental (streaming) detokenization, vLLM style.

Decoding is done on a sliding window of token ids: ``prefix_offset`` marks where the window starts
(a few tokens of context, so decoders that treat the first token specially - e.g. SentencePiece's
leading space - behave as in a full decode) and ``read_offset`` marks the end of the text already
emitted. New text is ``decode(ids[prefix:]) - decode(ids[prefix:read])``.

Text ending in U+FFFD (an incomplete UTF-8 sequence, e.g. half of a Chinese character or emoji
split across byte-level tokens) is held back until later tokens complete it; the text before it is
emitted at once. ``flush()`` releases whatever is still held at the end, so that for byte-level
tokenizers ``text`` then equals ``tokenizer.decode(output_ids)`` exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids)
        self._num_prompt = len(self._ids)
        prefix = max(self._num_prompt - _CONTEXT_TOKENS, 0)
        if prefix < self._num_prompt and self._decode(self._ids[prefix:]).endswith(_REPLACEMENT):
            # The prompt ends inside a character: its tail is no clean context for the output.
            prefix = self._num_prompt
        self._prefix_offset = prefix
        self._read_offset = self._num_prompt
        self._held_emitted = 0  # chars past decode(ids[prefix:read]) already emitted
        self._parts: list[str] = []

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    @property
    def output_ids(self) -> list[int]:
        return self._ids[self._num_prompt :]

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def _step(self, final: bool) -> str:
        window = self._ids[self._prefix_offset :]
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(window)
        delta = new_text[len(prefix_text) :]
        stable = delta if final else delta.rstrip(_REPLACEMENT)
        out = stable[self._held_emitted :]
        if len(stable) == len(delta):
            # Everything decoded cleanly: move the window on.
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._held_emitted = 0
        else:
            self._held_emitted = max(self._held_emitted, len(stable))
        if out:
            self._parts.append(out)
        return out

    def add(self, token_ids: Sequence[int]) -> str:
        """Append output tokens; return the newly completed text (possibly empty)."""
        if not token_ids:
            return ""
        self._ids.extend(int(t) for t in token_ids)
        return self._step(final=False)

    def flush(self) -> str:
        """Release held-back text (trailing U+FFFD of an unfinished sequence) at the end of output."""
        if self._read_offset == len(self._ids):
            return ""
        return self._step(final=True)
