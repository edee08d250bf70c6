"""Per-request sampling parameters (MindIE / vLLM / OpenAI names) and their validation."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
_MAX_SEED = 2**63
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values: [-100, 100]
STRUCTURED_FIELDS = ("json_schema", "json_object", "regex", "grammar", "choice")


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the field and the bad value."""

    def __init__(self, name: str, value, rule: str):
        self.field = name
        self.value = value
        super().__init__(f"invalid sampling parameter {name}={value!r}: {rule}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _normalize_logit_bias(bias: dict) -> dict:
    """Token ids given as decimal strings (JSON object keys) become ints, values floats; anything
    else is left as it is for _valid_logit_bias to reject."""
    out = {}
    for key, value in bias.items():
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            key = int(key)
        out[key] = float(value) if _is_number(value) else value
    return out


def _valid_logit_bias(bias) -> bool:
    return isinstance(bias, dict) and all(
        _is_int(t) and t >= 0 and _is_number(v) and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS
        for t, v in bias.items()
    )


@dataclass
class SamplingParams:
    """Sampling parameters of one request.

    temperature 0 means greedy; top_k 0 or -1 and top_p 1 switch those filters off; min_p 0 is off.
    typical_p < 1 is locally typical sampling (Meister et al.; HF's TypicalLogitsWarper, TGI's
    typical_p): keep the tokens whose surprisal is closest to the entropy, up to typical_p mass.
    Penalties follow vLLM: repetition (HF rule, prompt + output tokens), frequency and presence
    (output tokens only). `seed` makes the request's tokens depend only on (seed, output position).
    min_tokens keeps stop_token_ids and EOS (unless ignore_eos) from being sampled too early.
    `logprobs` asks for the top-n log-probabilities of every output position (0..20).
    `logit_bias` maps token ids to a value in [-100, 100] added to their logits before any
    sampling or greedy choice (with the penalties, so speculative verification sees it too);
    the engine checks the ids against the vocabulary.
    `prompt_logprobs` asks for the log-probability of every prompt token under the model (0: the
    prompt token's only, k: also the top-k). With it, max_tokens may be 0 (score the prompt only).
    Structured output (at most one): `json_schema` (a JSON schema, dict or JSON text),
    `json_object` (any JSON object), `regex`, `grammar` (EBNF, xgrammar's dialect of GBNF) or
    `choice` (one of these strings). Every token is then drawn from the logits masked to what the
    format allows next, and the output ends (EOS) when the format is complete, even with ignore_eos.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None
    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None

    def __post_init__(self):
        self._normalize()
        self._validate()

    def _normalize(self):
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop) if isinstance(self.stop, (list, tuple)) else self.stop
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        if _is_number(self.temperature):
            self.temperature = float(self.temperature)
        if _is_number(self.top_p):
            self.top_p = float(self.top_p)
        if _is_number(self.min_p):
            self.min_p = float(self.min_p)
        if _is_number(self.typical_p):
            self.typical_p = float(self.typical_p)
        if isinstance(self.logit_bias, dict):
            self.logit_bias = _normalize_logit_bias(self.logit_bias)

    def _validate(self):
        def bad(name, rule):
            raise SamplingParamsError(name, getattr(self, name), rule)

        if not _is_number(self.temperature) or self.temperature < 0:
            bad("temperature", "must be a finite number >= 0 (0 = greedy)")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            bad("top_k", "must be an int >= 1, or 0 / -1 to disable")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not _is_number(self.typical_p) or not 0.0 < self.typical_p <= 1.0:
            bad("typical_p", "must be in (0, 1] (1 = off)")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", "must be a finite number > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                bad(name, "must be in [-2, 2]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < _MAX_SEED):
            bad("seed", "must be None or an int in [0, 2**63)")
        if self.prompt_logprobs is not None and (
            not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            bad("prompt_logprobs", f"must be None or an int in [0, {MAX_LOGPROBS}]")
        # max_tokens 0 only scores the prompt (OpenAI echo), which needs prompt_logprobs.
        min_max_tokens = 0 if self.prompt_logprobs is not None else 1
        if not _is_int(self.max_tokens) or self.max_tokens < min_max_tokens:
            bad("max_tokens", "must be an int >= 1 (>= 0 with prompt_logprobs)")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            bad("min_tokens", "must be an int >= 0")
        if self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a non-empty str or a list of non-empty str")
        if not isinstance(self.stop_token_ids, list) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            bad("stop_token_ids", "must be a list of ints >= 0")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "must be a bool")
        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            bad("logprobs", f"must be None or an int in [0, {MAX_LOGPROBS}]")
        if not isinstance(self.skip_special_tokens, bool):
            bad("skip_special_tokens", "must be a bool")
        if self.logit_bias is not None and not _valid_logit_bias(self.logit_bias):
            bad("logit_bias", f"must be None or a dict of token id (int >= 0) to a number in "
                              f"[{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        self._validate_structured(bad)

    def _validate_structured(self, bad):
        asked = [name for name in STRUCTURED_FIELDS if getattr(self, name) not in (None, False)]
        if len(asked) > 1:
            bad(asked[1], f"only one structured output format per request, {asked[0]} is set too")
        if not isinstance(self.json_object, bool):
            bad("json_object", "must be a bool")
        if self.json_schema is not None:
            schema = self.json_schema
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    bad("json_schema", f"is not valid JSON: {exc.msg} at character {exc.pos}")
            if not isinstance(schema, (dict, bool)):
                bad("json_schema", "must be a JSON schema: an object (or its JSON text)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                bad(name, "must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            bad("choice", "must be a non-empty list of non-empty strings")

    @property
    def has_structured(self) -> bool:
        return (self.json_schema is not None or self.json_object or self.regex is not None or self.grammar is not None
                or self.choice is not None)

    @property
    def structured(self) -> "tuple[str, str] | None":
        """(field, canonical text) of the structured output format, or None: the grammar cache's key."""
        if self.json_schema is not None:
            schema = self.json_schema if isinstance(self.json_schema, str) else json.dumps(self.json_schema)
            return "json_schema", schema
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        if self.grammar is not None:
            return "grammar", self.grammar
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def tokens_only(self) -> bool:
        """Nothing changes the logits and nothing is asked besides the token: no penalty, bias,
        min_tokens ban, format or log-probabilities."""
        return (not self.has_penalties and not self.logit_bias and self.min_tokens == 0
                and self.logprobs is None and not self.has_structured)

    @property
    def plain_greedy(self) -> bool:
        """The token is the logits' argmax and nothing else is asked (the sampler's fast path)."""
        return self.greedy and self.tokens_only

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
