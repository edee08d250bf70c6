"""OpenAI tool calls on /v1/chat/completions: the request's tools and tool_choice, the format a
choice is generated under, and the tool calls read back out of its text (whole, or as stream deltas).

tool_choice "none": tools go to the chat template only. A named function: the arguments are
generated under its parameters schema. "required": a JSON array of {"name", "parameters"}
objects, one per call (vLLM's approach). "auto": free text, in which DeepSeek's tool-call
markers, if the model writes them, become tool calls:

    V3:   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    V3.1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

The parser reads the decoded text: it sees the markers where the tokenizer does not count them
as special tokens (skip_special_tokens drops those).
"""
from __future__ import annotations

import functools
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from mindspec.plugins.structured_output.grammars import schema_error

from .errors import ApiError
from .structured_request import StructuredFormat

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_V3_BODY = re.compile(r"(?P<name>[^\n]+)\n```(?:json)?\n(?P<args>.*)\n```\s*", re.DOTALL)
ANY_OBJECT = {"type": "object"}


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")  # strict and the like travel on to the chat template
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


class Tool(BaseModel):
    type: str
    function: FunctionDef


ToolChoice = Union[str, dict[str, Any], None]


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")

    def message(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def head(self, index: int) -> dict:
        """The first stream delta of the call: who it calls, no arguments yet."""
        return {"tool_calls": [{"index": index, "id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": ""}}]}


def arguments_delta(index: int, piece: str) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": piece}}]}


def call_deltas(calls: list[ToolCall]) -> list[dict]:
    """Whole calls as stream deltas: each one's head, then all its arguments."""
    out = []
    for i, call in enumerate(calls):
        out += [call.head(i), arguments_delta(i, call.arguments)]
    return out


@dataclass
class ToolPlan:
    """What a chat request asks of its tools. ``mode``: none | auto | required | named."""

    tools: list[Tool] = field(default_factory=list)
    mode: str = "none"
    name: Optional[str] = None  # the function of mode "named"
    parallel: bool = True  # parallel_tool_calls: false allows one call (mode "required")

    def template_tools(self) -> Optional[list[dict]]:
        """The tools as the chat template takes them (OpenAI's shape), or None without any."""
        return [t.model_dump(exclude_none=True) for t in self.tools] or None

    def parameters(self, name: str) -> dict:
        fn = next(t.function for t in self.tools if t.function.name == name)
        return fn.parameters or ANY_OBJECT

    def constrain(self, fmt: StructuredFormat) -> None:
        """The format a named or required choice is generated under."""
        if self.mode == "named":
            fmt.set("json_schema", self.parameters(self.name), "tool_choice")
        elif self.mode == "required":
            fmt.set("json_schema", self.required_schema(), "tool_choice")

    def required_schema(self) -> dict:
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                   "parameters": self.parameters(t.function.name)},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema

    def parse(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        """(content, tool calls) of a choice's whole text. Text that does not hold calls (a
        required array cut short, malformed markers) is content."""
        if self.mode == "named":
            return None, [ToolCall(self.name, text)]
        if self.mode == "required":
            return parse_required(text)
        if self.mode == "auto":
            return parse_deepseek(text)
        return text, []

    def reply(self, text: str, finish_reason: Optional[str]) -> tuple[dict, Optional[str]]:
        """The choice's message and finish_reason."""
        content, calls = self.parse(text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.message() for c in calls]
        return message, finish_reason_of(calls, finish_reason)

    def reader(self) -> "ToolStream":
        return ToolStream(self)


def finish_reason_of(calls: list[ToolCall], finish_reason: Optional[str]) -> Optional[str]:
    """"tool_calls" where generation ended on its own with calls; "length" and the like stay."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def parse_required(text: str) -> tuple[Optional[str], list[ToolCall]]:
    try:
        items = json.loads(text)
        calls = [ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]
    except (ValueError, TypeError, KeyError):
        return text, []
    return (None, calls) if calls else (text, [])


def parse_deepseek(text: str) -> tuple[Optional[str], list[ToolCall]]:
    """DeepSeek V3 / V3.1 tool calls: the text before the calls block is the content (None where
    empty); text after the block's end marker is dropped (the model ends its turn there). A call
    that is unterminated or lacks its separator, or a block without its end marker, leaves the
    whole text as content."""
    start = text.find(CALLS_BEGIN)
    if start < 0:
        return text, []
    rest, calls = text[start + len(CALLS_BEGIN):].lstrip(), []
    while rest.startswith(CALL_BEGIN):
        end = rest.find(CALL_END)
        call = _deepseek_call(rest[len(CALL_BEGIN):end]) if end >= 0 else None
        if call is None:
            return text, []
        calls.append(call)
        rest = rest[end + len(CALL_END):].lstrip()
    if not calls or not rest.startswith(CALLS_END):
        return text, []
    return text[:start] or None, calls


def _deepseek_call(body: str) -> Optional[ToolCall]:
    head, sep, args = body.partition(SEP)
    if not sep:
        return None
    v3 = _V3_BODY.fullmatch(args)
    if v3 is not None:  # V3: "function" (the call's type) before the separator, the name after
        return ToolCall(v3["name"].strip(), v3["args"].strip())
    return ToolCall(head.strip(), args.strip()) if head.strip() else None


class ToolStream:
    """One streamed choice's deltas. Content streams as it comes, up to where tool calls could
    begin; a named function's arguments stream as they are generated; "required" and "auto"
    calls are sent whole when the choice ends (a required array is not calls until it parses)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.sent = ""  # text sent so far: content, or a named call's arguments
        self.call: Optional[ToolCall] = ToolCall(plan.name, "") if plan.mode == "named" else None
        self.started = False  # the named call's head delta is out

    def update(self, text: str) -> list[dict]:
        """Deltas for the choice's text so far."""
        if self.call is not None:
            deltas = [] if self.started else [self.call.head(0)]
            self.started = True
            piece, self.sent = text[len(self.sent):], text
            return deltas + ([arguments_delta(0, piece)] if piece else [])
        safe = self._content_so_far(text)
        piece, self.sent = safe[len(self.sent):], safe
        return [{"content": piece}] if piece else []

    def finish(self, text: str, finish_reason: Optional[str]) -> tuple[list[dict], Optional[str]]:
        """The last deltas and the choice's finish_reason, from its whole text."""
        if self.call is not None:
            return self.update(text), finish_reason_of([self.call], finish_reason)
        content, calls = self.plan.parse(text)
        rest = (content or "")[len(self.sent):] if calls else text[len(self.sent):]
        deltas = [{"content": rest}] if rest else []
        return deltas + call_deltas(calls), finish_reason_of(calls, finish_reason)

    def _content_so_far(self, text: str) -> str:
        """The part of the text that is content whatever comes next."""
        if self.plan.mode == "required":
            return ""
        if self.plan.mode != "auto":
            return text
        start = text.find(CALLS_BEGIN)
        if start >= 0:
            return text[:start]
        # hold back an end that may be the start of the marker
        for k in range(min(len(text), len(CALLS_BEGIN) - 1), 0, -1):
            if CALLS_BEGIN.startswith(text[-k:]):
                return text[:-k]
        return text


# ---- the request's tools and tool_choice ------------------------------------------------------

def tool_plan(tools: Optional[list[Tool]], tool_choice: ToolChoice, parallel: Optional[bool]) -> ToolPlan:
    """Checks tools and tool_choice (400s naming the field) and says what they ask for."""
    tools = tools or []
    names = []
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise ApiError(400, f"tools[{i}].type must be \"function\", got {tool.type!r}", param="tools")
        if tool.function.name in names:
            raise ApiError(400, f"tools[{i}]: a second function named {tool.function.name!r}", param="tools")
        names.append(tool.function.name)
    mode, name = _choice(tool_choice, bool(tools))
    if name is not None and name not in names:
        raise ApiError(400, f"tool_choice names function {name!r}, which is not among the tools {names}",
                       param="tool_choice")
    if mode != "none" and not tools:
        raise ApiError(400, f"tool_choice {tool_choice!r} needs tools", param="tool_choice")
    return ToolPlan(tools, mode, name, parallel is not False)


def _choice(tool_choice: ToolChoice, has_tools: bool) -> tuple[str, Optional[str]]:
    if tool_choice is None:
        return ("auto" if has_tools else "none"), None
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, None
    if isinstance(tool_choice, str):  # TGI's client sends the function's name
        return "named", tool_choice
    fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                            '"function": {"name": ...}}', param="tool_choice")
    return "named", fn["name"]


def check_schemas(plan: ToolPlan) -> None:
    """Every tool's parameters must be a JSON schema the grammar engine takes, whatever the mode
    (auto never compiles them, and a broken tool is the client's to fix). Blocking: xgrammar's
    first import takes seconds, so the routes run this in a thread."""
    for i, tool in enumerate(plan.tools):
        params = tool.function.parameters
        if params:
            error = _schema_error(json.dumps(params, sort_keys=True))
            if error:
                raise ApiError(400, f"invalid tools[{i}].function.parameters: {error}", param="tools")


@functools.lru_cache(maxsize=256)
def _schema_error(schema: str) -> Optional[str]:
    return schema_error(schema)
