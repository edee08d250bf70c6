"""OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models."""
from __future__ import annotations

import json
import time
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from mindspec.engine.outputs import RequestOutput

from .errors import ApiError
from .protocol import ChatCompletionRequest, CompletionRequest
from .state import ServiceState


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(out: RequestOutput) -> dict:
    p, c = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def router(state: ServiceState) -> APIRouter:
    api = APIRouter()

    def check_model(name):
        if name not in (None, "", state.model_name):
            raise ApiError(404, f"model {name!r} does not exist; this server serves {state.model_name!r}", param="model")

    @api.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.started,
                                            "owned_by": "mindspec", "max_model_len": state.max_seq_len}]}

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest):
        check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(400, "batched prompts are not supported; send one prompt per request", param="prompt")
            prompt = prompt[0]
        params = body.sampling_params(16, logprobs=body.logprobs)
        rid = state.engine.new_request_id("cmpl")
        meta = {"id": rid, "created": int(time.time()), "model": state.model_name}
        if body.stream:
            outs = await primed(state.runner.stream(prompt, params, rid))
            return StreamingResponse(_stream_completion(outs, meta, body), media_type="text/event-stream")
        out = await state.runner.complete(prompt, params, rid)
        choice = {"index": 0, "text": out.text, "finish_reason": out.finish_reason,
                  "logprobs": _completion_logprobs(out, state) if body.logprobs is not None else None}
        return {**meta, "object": "text_completion", "choices": [choice], "usage": usage(out)}

    @api.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest):
        check_model(body.model)
        tok = state.engine.tokenizer
        if tok is None or not tok.has_chat_template:
            raise ApiError(400, "this model has no chat template; use /v1/completions")
        messages = [{"role": m.role, "content": _text(m.content)} for m in body.messages]
        prompt = tok.apply_chat_template(messages)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = body.sampling_params(max(1, state.max_seq_len - len(prompt)), logprobs=logprobs)
        rid = state.engine.new_request_id("chatcmpl")
        meta = {"id": rid, "created": int(time.time()), "model": state.model_name}
        if body.stream:
            outs = await primed(state.runner.stream(prompt, params, rid))
            return StreamingResponse(_stream_chat(outs, meta, body), media_type="text/event-stream")
        out = await state.runner.complete(prompt, params, rid)
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text}, "finish_reason": out.finish_reason,
                  "logprobs": None}
        return {**meta, "object": "chat.completion", "choices": [choice], "usage": usage(out)}

    return api


def _text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def _completion_logprobs(out: RequestOutput, state: ServiceState) -> dict:
    tok = state.engine.tokenizer
    tokens = tok.convert_ids_to_tokens(out.token_ids) if tok else [str(t) for t in out.token_ids]
    tops = out.top_logprobs or [{} for _ in out.token_ids]
    return {"tokens": tokens, "token_logprobs": out.logprobs or [],
            "top_logprobs": [{(tok.convert_ids_to_tokens([i])[0] if tok else str(i)): v for i, v in t.items()} for t in tops]}


async def _guarded(gen: AsyncIterator[str]) -> AsyncIterator[str]:
    """Errors after the stream started become one error event, then [DONE]."""
    try:
        async for chunk in gen:
            yield chunk
    except ApiError as exc:
        yield sse({"error": {"message": exc.message, "type": "invalid_request_error", "code": exc.status}})
    yield "data: [DONE]\n\n"


async def primed(outs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """Wait for the first output before answering, so a refused request still gets its 4xx."""
    first = await outs.__anext__()

    async def rest():
        try:
            yield first
            async for out in outs:
                yield out
        finally:
            await outs.aclose()

    return rest()


def _stream_completion(outs, meta, body) -> AsyncIterator[str]:
    async def gen():
        last = None
        async for out in outs:
            last = out
            if out.new_text or out.finished:
                choice = {"index": 0, "text": out.new_text, "logprobs": None, "finish_reason": out.finish_reason}
                yield sse({**meta, "object": "text_completion", "choices": [choice]})
        if body.stream_options and body.stream_options.include_usage and last is not None:
            yield sse({**meta, "object": "text_completion", "choices": [], "usage": usage(last)})

    return _guarded(gen())


def _stream_chat(outs, meta, body) -> AsyncIterator[str]:
    async def gen():
        head = {**meta, "object": "chat.completion.chunk"}
        yield sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        last = None
        async for out in outs:
            last = out
            if out.new_text or out.finished:
                delta = {"content": out.new_text} if out.new_text else {}
                yield sse({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": out.finish_reason}]})
        if body.stream_options and body.stream_options.include_usage and last is not None:
            yield sse({**head, "choices": [], "usage": usage(last)})

    return _guarded(gen())
