"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import AsyncIterator, Optional, Sequence

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from mindspec.engine.outputs import RequestOutput
from mindspec.text_generator.sampling.params import SamplingParams
from mindspec.text_generator.tokenizer import TokenizerError

from .async_engine import Prompt
from .errors import ApiError
from .fanout import primed_fan_in
from .logprobs import CompletionLogprobs, chat_logprobs
from .protocol import ChatCompletionRequest, CompletionRequest
from .state import ServiceState
from .structured_request import StructuredFormat
from .tool_calls import ToolPlan, ToolStream, check_schemas

_SEED_SPACE = 2**63


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def summed_usage(outs: Sequence[RequestOutput], n: int) -> dict:
    """OpenAI counts each prompt once and every choice's completion: siblings share a prompt."""
    p = sum(len(out.prompt_token_ids) for out in outs[::n])
    c = sum(len(out.token_ids) for out in outs)
    cached = sum(out.num_cached_tokens for out in outs[::n])
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


class NewTokens:
    """The tokens (and their logprobs) of a request's outputs not yet passed on. The engine's
    logprob lists grow after an output is built, so they are cut by token count, not length."""

    def __init__(self):
        self.seen = 0

    def take(self, out: RequestOutput) -> tuple[list[int], list[Optional[float]], list[Optional[dict]]]:
        end = len(out.token_ids)
        ids = out.token_ids[self.seen:end]
        lps = list(out.logprobs[self.seen:end]) if out.logprobs is not None else [None] * len(ids)
        tops = list(out.top_logprobs[self.seen:end]) if out.top_logprobs else [None] * len(ids)
        self.seen = end
        return ids, lps, tops


async def fan_out(state: ServiceState, prompts: Sequence[Prompt], params: SamplingParams, n: int,
                  request_id: str) -> AsyncIterator[tuple[int, RequestOutput]]:
    """n engine requests per prompt, choice index prompt_idx * n + i; the siblings of a prompt
    reuse the first one's prompt KV. With a seed, sibling i samples with seed + i (one seed for
    all would give n copies of one sample)."""
    streams = []
    for p, prompt in enumerate(prompts):
        first = None
        for i in range(n):
            rid = request_id if len(prompts) * n == 1 else f"{request_id}-{p * n + i}"
            sibling = params
            if params.seed is not None and i:
                sibling = dataclasses.replace(params, seed=(params.seed + i) % _SEED_SPACE)
            streams.append(state.runner.stream(prompt, sibling, rid, share_prefix_with=first))
            first = first or rid
    return await primed_fan_in(streams)


def router(state: ServiceState) -> APIRouter:
    api = APIRouter()

    def check_model(name):
        if name not in (None, "", state.model_name):
            raise ApiError(404, f"model {name!r} does not exist; this server serves {state.model_name!r}", param="model")

    def model_card() -> dict:
        return {"id": state.model_name, "object": "model", "created": state.started, "owned_by": "mindspec",
                "max_model_len": state.max_seq_len}

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != state.model_name:
            raise ApiError(404, f"model {model_id!r} does not exist; this server serves {state.model_name!r}", param="model")
        return model_card()

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest):
        check_model(body.model)
        body.check_supported()
        prompts = body.prompts()
        fmt = body.structured_format()
        params = _completion_params(body, fmt)
        rid = state.engine.new_request_id("cmpl")
        meta = {"id": rid, "created": int(time.time()), "model": state.model_name, "object": "text_completion"}
        with fmt.naming_errors():  # a format the engine cannot compile names the field it came from
            merged = await fan_out(state, prompts, params, body.n, rid)
        choices = [_CompletionChoice(state, body, prompts[k // body.n], k) for k in range(len(prompts) * body.n)]
        if body.stream:
            return StreamingResponse(_stream_completion(merged, choices, meta, body), media_type="text/event-stream")
        await _feed(merged, choices)
        return {**meta, "choices": [c.final() for c in choices],
                "usage": summed_usage([c.last for c in choices], body.n)}

    @api.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest):
        check_model(body.model)
        body.check_supported()
        plan = body.tool_plan()
        fmt = body.chat_format(plan)
        if plan.tools:
            await asyncio.to_thread(check_schemas, plan)
        tok = state.engine.tokenizer
        if tok is None or not tok.has_chat_template:
            raise ApiError(400, "this model has no chat template; use /v1/completions")
        messages = [m.template_dict() for m in body.messages]
        tools = {"tools": plan.template_tools()} if plan.tools else {}  # templates that know tools render them
        try:
            prompt = tok.apply_chat_template(messages, **tools)
        except TokenizerError as exc:  # the template refused these messages (e.g. a role it raises on)
            raise ApiError(400, str(exc), param="messages") from None
        params = body.sampling_params(max(1, state.max_seq_len - len(prompt)), logprobs=body.logprobs_k(), fmt=fmt)
        rid = state.engine.new_request_id("chatcmpl")
        meta = {"id": rid, "created": int(time.time()), "model": state.model_name}
        with fmt.naming_errors():
            merged = await fan_out(state, [prompt], params, body.n, rid)
        choices = [_ChatChoice(state, body, i, plan) for i in range(body.n)]
        if body.stream:
            return StreamingResponse(_stream_chat(merged, choices, meta, body), media_type="text/event-stream")
        await _feed(merged, choices)
        return {**meta, "object": "chat.completion", "choices": [c.final() for c in choices],
                "usage": summed_usage([c.last for c in choices], body.n)}

    return api


async def _feed(merged, choices) -> None:
    """Every output to its choice (a non-streaming answer); the requests end with it either way."""
    try:
        async for index, out in merged:
            choices[index].add(out)
    finally:
        await merged.aclose()


def _completion_params(body: CompletionRequest, fmt: StructuredFormat) -> SamplingParams:
    """echo with logprobs scores the prompt too; echo with max_tokens 0 only returns the prompt,
    which the engine allows for a prompt-scoring request."""
    max_tokens = next((v for v in (body.max_completion_tokens, body.max_tokens) if v is not None), 16)
    prompt_logprobs = None
    if body.echo and body.logprobs is not None:
        prompt_logprobs = body.logprobs
    elif body.echo and max_tokens == 0:
        prompt_logprobs = 0
    return body.sampling_params(16, logprobs=body.logprobs, prompt_logprobs=prompt_logprobs, fmt=fmt)


class _CompletionChoice:
    """One /v1/completions choice, fed its request's outputs: the text and logprobs each output
    adds (a stream chunk) and the whole choice at the end. The first output also brings the
    echoed prompt."""

    def __init__(self, state: ServiceState, body: CompletionRequest, prompt: Prompt, index: int):
        self.state, self.body, self.prompt, self.index = state, body, prompt, index
        self.tokens = NewTokens()
        self.logprobs: Optional[CompletionLogprobs] = None
        self.parts: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        self.last: Optional[RequestOutput] = None
        self.echo_text = ""

    def add(self, out: RequestOutput) -> dict:
        """The chunk for this output: {text, logprobs or None}."""
        text, logprobs = "", None
        if self.last is None:
            text, logprobs = self._start(out)
        self.last = out
        text += out.new_text
        if self.logprobs is not None:
            part = self.logprobs.add(*self.tokens.take(out))
            logprobs = _join(logprobs, part) if logprobs else part
            _join(self.parts, part)
        return {"text": text, "logprobs": logprobs}

    def _start(self, out: RequestOutput) -> tuple[str, Optional[dict]]:
        body, text = self.body, self.state.token_text
        if body.echo:
            self.echo_text = self.prompt if isinstance(self.prompt, str) else _decode(self.state, out.prompt_token_ids)
        if body.logprobs is None:
            return self.echo_text, None
        if not body.echo:
            self.logprobs = CompletionLogprobs(text, out.prompt_token_ids)
            return "", None
        # The echoed prompt's tokens go through the same reader, so offsets run on into the output.
        self.logprobs = CompletionLogprobs(text)
        lps = getattr(out, "prompt_logprobs", None) or [None] * len(out.prompt_token_ids)
        tops = getattr(out, "prompt_top_logprobs", None) or [None] * len(out.prompt_token_ids)
        part = self.logprobs.add(out.prompt_token_ids, lps, tops)
        _join(self.parts, part)
        return self.echo_text, part

    def final(self) -> dict:
        out = self.last
        return {"index": self.index, "text": self.echo_text + out.text, "finish_reason": out.finish_reason,
                "logprobs": self.parts if self.logprobs is not None else None}


def _join(into: dict, part: dict) -> dict:
    for key, values in part.items():
        into[key].extend(values)
    return into


def _decode(state: ServiceState, ids: list[int]) -> str:
    tok = state.engine.tokenizer
    return tok.decode(ids) if tok is not None else ""


class _ChatChoice:
    """One chat choice, fed its request's outputs; with tools, its text may become tool calls
    (``plan``), which a stream sends as tool-call deltas (``reader``)."""

    def __init__(self, state: ServiceState, body: ChatCompletionRequest, index: int, plan: ToolPlan):
        self.state, self.body, self.index, self.plan = state, body, index, plan
        self.tokens = NewTokens()
        self.content: list[dict] = []
        self.last: Optional[RequestOutput] = None
        self.reader: Optional[ToolStream] = plan.reader() if plan.mode != "none" else None

    def deltas(self, out: RequestOutput) -> tuple[list[dict], Optional[str]]:
        """The stream deltas of this output and the choice's finish_reason (None until it ends)."""
        if self.reader is None:
            return ([{"content": out.new_text}] if out.new_text else []), out.finish_reason
        if out.finished:
            return self.reader.finish(out.text, out.finish_reason)
        return self.reader.update(out.text), None

    def add(self, out: RequestOutput) -> Optional[dict]:
        """This output's logprobs ({"content": [...]}), or None without logprobs."""
        self.last = out
        if not self.body.logprobs:
            return None
        ids, lps, tops = self.tokens.take(out)
        entries = chat_logprobs(self.state.token_text, ids, lps, tops, self.body.top_logprobs or 0)
        self.content.extend(entries)
        return {"content": entries}

    def final(self) -> dict:
        message, finish_reason = self.plan.reply(self.last.text, self.last.finish_reason)
        return {"index": self.index, "message": message, "finish_reason": finish_reason,
                "logprobs": {"content": self.content} if self.body.logprobs else None}


async def _guarded(gen: AsyncIterator[str]) -> AsyncIterator[str]:
    """Errors after the stream started become one error event, then [DONE]."""
    try:
        async for chunk in gen:
            yield chunk
    except ApiError as exc:
        yield sse({"error": {"message": exc.message, "type": "invalid_request_error", "code": exc.status}})
    yield "data: [DONE]\n\n"


def _stream_completion(merged, choices: list[_CompletionChoice], meta: dict, body: CompletionRequest) -> AsyncIterator[str]:
    async def gen():
        try:
            async for index, out in merged:
                chunk = choices[index].add(out)
                if chunk["text"] or chunk["logprobs"] or out.finished:
                    yield sse({**meta, "choices": [{"index": index, **chunk, "finish_reason": out.finish_reason}]})
        finally:  # a client that hangs up aborts every choice's request now, not at garbage collection
            await merged.aclose()
        if body.stream_options and body.stream_options.include_usage:
            yield sse({**meta, "choices": [], "usage": summed_usage([c.last for c in choices], body.n)})

    return _guarded(gen())


def _stream_chat(merged, choices: list[_ChatChoice], meta: dict, body: ChatCompletionRequest) -> AsyncIterator[str]:
    async def gen():
        head = {**meta, "object": "chat.completion.chunk"}
        for c in choices:  # a choice that can only be tool calls has null content, as OpenAI's
            content = None if c.plan.mode in ("named", "required") else ""
            yield sse({**head, "choices": [{"index": c.index, "delta": {"role": "assistant", "content": content},
                                            "logprobs": None, "finish_reason": None}]})
        try:
            async for index, out in merged:
                logprobs = choices[index].add(out)
                deltas, finish_reason = choices[index].deltas(out)
                if not deltas and (out.finished or (logprobs and logprobs["content"])):
                    deltas = [{}]
                for k, delta in enumerate(deltas):  # the output's logprobs on its first chunk, the end on its last
                    last = k == len(deltas) - 1
                    yield sse({**head, "choices": [{"index": index, "delta": delta,
                                                    "logprobs": logprobs if k == 0 else None,
                                                    "finish_reason": finish_reason if last else None}]})
        finally:
            await merged.aclose()
        if body.stream_options and body.stream_options.include_usage:
            yield sse({**head, "choices": [], "usage": summed_usage([c.last for c in choices], body.n)})

    return _guarded(gen())
