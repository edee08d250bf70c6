"""The structured output fields of the HTTP APIs, as SamplingParams' fields.

OpenAI's ``response_format``, vLLM's ``guided_*`` and ``structured_outputs``, TGI's
``parameters.grammar`` and the tool-call schemas each become one of SamplingParams'
json_schema / json_object / regex / grammar / choice. The request field a format came from is
kept, so an error about it (JSON text that does not parse, a schema or regex the engine cannot
compile) names the field the user sent, not the engine's name for it.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from .errors import ApiError


@dataclass
class StructuredFormat:
    """The one structured output format of a request, if any."""

    field: Optional[str] = None  # SamplingParams' field: json_schema, json_object, regex, grammar, choice
    value: Any = None
    param: Optional[str] = None  # the request field it came from, as errors name it

    def set(self, field: str, value: Any, param: str) -> None:
        if self.field is not None:
            raise ApiError(400, f"{param} asks for a structured output format and so does {self.param}: "
                                f"send at most one", param=param)
        self.field, self.value, self.param = field, value, param

    def values(self) -> dict:
        """The SamplingParams keyword of the format ({} without one)."""
        return {self.field: self.value} if self.field else {}

    def renamed(self, exc: ApiError) -> ApiError:
        """``exc`` naming the request field where it is about the format: SamplingParams' "invalid
        sampling parameter json_schema=..." and the engine's "invalid json_schema: ..." (its
        StructuredOutputError, which reaches the service as a message only)."""
        if self.field is None:
            return exc
        if exc.param != self.field and not exc.message.startswith(f"invalid {self.field}:"):
            return exc
        return ApiError(exc.status, exc.message.replace(self.field, self.param, 1), param=self.param)

    @contextmanager
    def naming_errors(self) -> Iterator[None]:
        try:
            yield
        except ApiError as exc:
            raise self.renamed(exc) from None


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


def add_response_format(fmt: StructuredFormat, spec: Any, param: str = "response_format") -> None:
    """OpenAI's {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema",
    "strict"}}; TGI's chat route also takes its grammar types ({"type": "json" | "regex", "value"})."""
    if spec is None:
        return
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "text":
        return
    if kind == "json_schema":
        inner = spec.get("json_schema")
        if not isinstance(inner, dict):
            raise _bad(param, 'type "json_schema" needs a "json_schema" object ({"name": ..., "schema": {...}})')
        schema = inner.get("schema")
        # OpenAI makes "schema" optional: without one, any JSON object
        fmt.set(*(("json_object", True) if schema is None else ("json_schema", schema)), param)
    elif kind in ("json_object", "json", "regex"):
        add_tgi_grammar(fmt, spec, param)
    else:
        raise _bad(param, f'type must be "text", "json_object" or "json_schema", got {kind!r}')


def add_tgi_grammar(fmt: StructuredFormat, spec: Any, param: str = "parameters.grammar") -> None:
    """TGI's {"type": "json" | "json_object" | "regex", "value": ...}: json's value is a schema (an
    object or its JSON text); json_object is TGI's alias of json, and any JSON object without a value."""
    if spec is None:
        return
    if not isinstance(spec, dict) or spec.get("type") not in ("json", "json_object", "regex"):
        raise _bad(param, 'must be {"type": "json" | "json_object" | "regex", "value": ...}')
    kind, value = spec["type"], spec.get("value")
    if kind == "regex":
        fmt.set("regex", value, param)
    elif kind == "json_object" and value is None:
        fmt.set("json_object", True, param)
    elif value is None:
        raise _bad(param, 'type "json" needs a "value": the JSON schema')
    else:
        fmt.set("json_schema", value, param)


# vLLM's guided_* extras and the keys of its newer structured_outputs object
GUIDED_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
_STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                       "json_object": "json_object"}


def add_guided(fmt: StructuredFormat, body: Any) -> None:
    for name, field in GUIDED_FIELDS.items():
        value = getattr(body, name, None)
        if value is not None:
            fmt.set(field, value, name)
    add_structured_outputs(fmt, getattr(body, "structured_outputs", None))


def add_structured_outputs(fmt: StructuredFormat, spec: Optional[dict]) -> None:
    """vLLM's {"json" | "regex" | "choice" | "grammar" | "json_object": ...}; its switches
    (disable_any_whitespace, ...) change nothing here (output is compact JSON already); any other
    key (structural_tag, whitespace_pattern) is not implemented and says so."""
    for key, value in (spec or {}).items():
        param = f"structured_outputs.{key}"
        if key in _STRUCTURED_OUTPUTS:
            if value not in (None, False):
                fmt.set(_STRUCTURED_OUTPUTS[key], value, param)
        elif not key.startswith("disable_") and value is not None:
            raise ApiError(400, f"{param} is not supported by this server", param=param)
