"""Thin wrapper over a Hugging Face tokenizer loaded from a local model directory."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Callable, Optional

# Files any of which means "there is a tokenizer here" for AutoTokenizer.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
)


class TokenizerError(ValueError):
    """The tokenizer cannot be loaded or cannot do what was asked."""


def _backend_decode(hf_tokenizer: Any) -> Optional[Callable[..., str]]:
    """A fast tokenizer's ``tokenizers`` decode, where transformers' ``decode`` only forwards to
    it (neither ``decode`` nor ``_decode`` overridden; without clean-up it adds nothing): ~1 us
    a call against ~3.3, and incremental detokenization decodes twice per generated token."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return None
    backend = getattr(hf_tokenizer, "_tokenizer", None)
    cls = type(hf_tokenizer)
    if (backend is None or not isinstance(hf_tokenizer, PreTrainedTokenizerFast)
            or cls._decode is not PreTrainedTokenizerFast._decode or cls.decode is not PreTrainedTokenizerBase.decode):
        return None
    return backend.decode


class Tokenizer:
    """The operations the text generator needs, over a ``transformers`` tokenizer."""

    def __init__(self, hf_tokenizer: Any, extra_eos_token_ids: Iterable[int] = ()) -> None:
        self._tok = hf_tokenizer
        eos: set[int] = set()
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        eos.update(int(i) for i in extra_eos_token_ids)
        self._eos_token_ids = frozenset(eos)
        self._backend_decode = _backend_decode(hf_tokenizer)

    @property
    def hf_tokenizer(self) -> Any:
        return self._tok

    # ---- ids <-> text ------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # No clean-up of tokenization spaces: it is not prefix-stable, so incremental
        # detokenization could never reproduce it.
        if self._backend_decode is not None:
            return self._backend_decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self._tok.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def convert_ids_to_tokens(self, ids: Sequence[int], skip_special_tokens: bool = False) -> list[str]:
        return self._tok.convert_ids_to_tokens(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        return self._tok.convert_tokens_to_string(list(tokens))

    # ---- chat --------------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def render_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if not self.has_chat_template:
            raise TokenizerError("this tokenizer has no chat template")
        try:
            return self._tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except Exception as exc:  # jinja errors, template-raised exceptions
            raise TokenizerError(f"cannot apply the chat template: {exc}") from exc

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
        """Prompt token ids for ``messages``; the template itself supplies any BOS token."""
        text = self.render_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    # ---- special ids / sizes -----------------------------------------------------------------
    @property
    def eos_token_ids(self) -> set[int]:
        return set(self._eos_token_ids)

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self._tok.bos_token_id

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return len(self._tok)

    @property
    def all_special_ids(self) -> list[int]:
        return list(self._tok.all_special_ids)


def _generation_config_eos_ids(model_dir: Path) -> list[int]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise TokenizerError(f"{path}: eos_token_id must be an int or a list of ints, got {value!r}")
    return values


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load the tokenizer of a local model directory (no remote code, no downloads), or the one a
    GGUF file carries in its metadata."""
    model_dir = Path(model_dir)
    if model_dir.suffix == ".gguf":
        return _gguf_tokenizer(model_dir)
    if not model_dir.is_dir():
        raise TokenizerError(f"model directory {model_dir} does not exist")
    if not any((model_dir / name).is_file() for name in _TOKENIZER_FILES):
        raise TokenizerError(
            f"no tokenizer found in {model_dir} (expected one of: {', '.join(_TOKENIZER_FILES)})"
        )
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False, local_files_only=True)
    except Exception as exc:
        raise TokenizerError(f"cannot load the tokenizer in {model_dir}: {exc}") from exc
    return Tokenizer(hf, extra_eos_token_ids=_generation_config_eos_ids(model_dir))


def _gguf_tokenizer(path: Path) -> Tokenizer:
    from mindspec.modeling.errors import CheckpointError
    from mindspec.modeling.gguf_loader import open_gguf

    from .gguf_tokenizer import tokenizer_from_gguf

    try:
        metadata = open_gguf(path).metadata
    except CheckpointError as exc:
        raise TokenizerError(str(exc)) from exc
    return Tokenizer(tokenizer_from_gguf(metadata, path.name))
