"""TGI (/generate, /generate_stream), vLLM-style (/generate with "prompt") and MindIE-native
(/infer) text-generation routes."""
from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from .errors import ApiError
from .protocol import TgiRequest, VllmGenerateRequest
from .routes_openai import primed, sse
from .state import ServiceState


async def _json(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def _parse(model, body: dict):
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise ApiError(422, f"{where}: {first['msg']}", param=where) from None


def router(state: ServiceState) -> APIRouter:
    api = APIRouter()

    def details(out, req: TgiRequest) -> dict | None:
        if not req.parameters.details:
            return None
        return {"finish_reason": {"length": "length", "stop": "eos_token"}.get(out.finish_reason, out.finish_reason),
                "generated_tokens": len(out.token_ids), "seed": req.parameters.seed}

    async def tgi(req: TgiRequest) -> dict:
        out = await state.runner.complete(req.inputs, req.parameters.sampling_params(), state.engine.new_request_id("tgi"))
        text = (req.inputs + out.text) if req.parameters.return_full_text else out.text
        return {"generated_text": text, **({"details": details(out, req)} if req.parameters.details else {})}

    async def tgi_stream(req: TgiRequest) -> StreamingResponse:
        outs = await primed(state.runner.stream(req.inputs, req.parameters.sampling_params(), state.engine.new_request_id("tgi")))
        tok = state.engine.tokenizer

        async def events():
            async for out in outs:
                for i, token in enumerate(out.new_token_ids):
                    last = out.finished and i == len(out.new_token_ids) - 1
                    text = out.new_text if i == len(out.new_token_ids) - 1 else ""
                    yield sse({"token": {"id": token, "text": text, "logprob": None,
                                         "special": bool(tok and token in tok.all_special_ids)},
                               "generated_text": out.text if last else None,
                               "details": details(out, req) if last else None})

        return StreamingResponse(events(), media_type="text/event-stream")

    @api.post("/generate")
    async def generate(request: Request):
        body = await _json(request)
        if "inputs" in body:
            req = _parse(TgiRequest, body)
            return await (tgi_stream(req) if req.stream else tgi(req))
        if "prompt" in body:
            req = _parse(VllmGenerateRequest, body)
            out = await state.runner.complete(req.prompt, req.sampling_params(16), state.engine.new_request_id("gen"))
            return {"text": [req.prompt + out.text]}
        raise ApiError(422, "body must carry 'inputs' (TGI) or 'prompt' (vLLM)")

    @api.post("/generate_stream")
    async def generate_stream(request: Request):
        return await tgi_stream(_parse(TgiRequest, await _json(request)))

    @api.post("/infer")
    async def infer(request: Request):
        """MindIE's native endpoint: {inputs, stream, parameters} -> generated_text and details."""
        req = _parse(TgiRequest, await _json(request))
        if req.stream:
            return await tgi_stream(req)
        out = await state.runner.complete(req.inputs, req.parameters.sampling_params(), state.engine.new_request_id("infer"))
        return {"generated_text": out.text, "details": {"finish_reason": out.finish_reason,
                                                        "generated_tokens": len(out.token_ids), "seed": req.parameters.seed}}

    return api
