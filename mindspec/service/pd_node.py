"""The PD routes of a prefill node and a decode node (MindIE inferMode "dmi"), served on the
node's interCommPort, and what they do inside the engine thread.

    POST /v1/pd/prefill  (prefill node) JSON {prompt, params, request_id}
        -> application/octet-stream: the hand-off (first token + prompt KV of the main model and
           the MTP modules; mindspec.distributed.pd_transfer)
    POST /v1/pd/decode   (decode node) body: a hand-off whose metadata carries params, request_id
        -> application/x-ndjson: one RequestOutput per line (the first carries the first token)

Both run through the node's AsyncEngine like any request: prefills of concurrent hand-offs are
batched, and the node's tokenTimeout / e2eTimeout bound them. The decode node's MTP plugin runs
with pd_role "decode": zero hidden states stand in for the prefill node's, and the first MTP
step writes to the reserved block so the transferred MTP KV is never overwritten.
"""
from __future__ import annotations

import json
from dataclasses import replace

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from mindspec.distributed.errors import HandoffError
from mindspec.distributed.pd_transfer import check_fits, decode_handoff, encode_handoff
from mindspec.engine.outputs import PrefillHandoff, RequestOutput

from .errors import ApiError
from .pd_wire import output_to_line, params_from_json
from .fanout import primed
from .state import ServiceState

PREFILL_ROUTE = "/v1/pd/prefill"
DECODE_ROUTE = "/v1/pd/decode"


# ---- inside the engine thread --------------------------------------------------------------------
def start_handoff(engine, prompt, params, request_id: str):
    """Prefill node: the request stops after its first token and its prompt KV is captured
    (LLMEngine.prefill_for_handoff, queued with the other requests instead of run alone)."""
    state = engine.add_request(prompt, replace(params, max_tokens=1, stop=[], min_tokens=0), request_id)
    state.export_kv = True
    return state


def adopt(engine, handoff: PrefillHandoff, params, request_id: str) -> RequestOutput:
    """Decode node: take over a request prefilled elsewhere; -> the output of its first token."""
    model = engine.model_wrapper.model
    check_fits(handoff, len(engine.model_wrapper.caches), model.cfg.kv_lora_rank + model.cfg.qk_rope_head_dim,
               model.cfg.vocab_size)
    state = engine.add_prefilled_request(handoff, params, request_id)
    if state.seq.is_finished:  # the first token already ended it (EOS, a stop, max_tokens 1)
        state.finish_text()
        engine.requests.pop(state.seq.seq_id, None)
    return state.output([handoff.first_token_id])


# ---- routes ---------------------------------------------------------------------------------------
def prefill_routes(state: ServiceState) -> APIRouter:
    api = APIRouter()

    @api.post(PREFILL_ROUTE)
    async def prefill(request: Request):
        body = await _json_body(request)
        prompt, params, rid = body.get("prompt"), _params(body.get("params")), str(body.get("request_id") or "")
        if not isinstance(prompt, (str, list)) or not prompt:
            raise ApiError(400, "prompt must be a non-empty string or list of token ids", param="prompt")
        rid = rid or state.engine.new_request_id("pd")
        box = {}

        def add(engine):
            box["state"] = start_handoff(engine, prompt, params, rid)

        async for _ in state.runner.stream(prompt, params, rid, add=add):
            pass
        handoff = box["state"].handoff
        if handoff is None:  # finished without a prefill step (cannot happen unless aborted)
            raise ApiError(503, "the prefill node finished the request without capturing its KV")
        data = encode_handoff(handoff, {"params": body.get("params"), "request_id": rid})
        return Response(data, media_type="application/octet-stream")

    return api


def decode_routes(state: ServiceState) -> APIRouter:
    api = APIRouter()

    @api.post(DECODE_ROUTE)
    async def decode(request: Request):
        try:
            handoff, extra = decode_handoff(await request.body())
        except HandoffError as exc:
            raise ApiError(exc.http_status, str(exc)) from None
        params, rid = _params(extra.get("params")), str(extra.get("request_id") or state.engine.new_request_id("pd"))
        outs = await primed(state.runner.stream(handoff.prompt_token_ids, params, rid,
                                                add=lambda engine: adopt(engine, handoff, params, rid)))

        async def lines():
            async for out in outs:
                yield output_to_line(out)

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    return api


def inter_comm_app(state: ServiceState, role: str) -> FastAPI:
    """The app on interCommPort: the role's PD route, plus health (for the router's probes)."""
    from .app import _install_error_handlers

    app = FastAPI(docs_url=None, redoc_url=None)
    app.include_router(prefill_routes(state) if role == "prefill" else decode_routes(state))

    @app.get("/health")
    async def health():
        return {"status": "healthy" if state.engine.healthy else "unhealthy", "role": role}

    _install_error_handlers(app)
    return app


async def _json_body(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    return body


def _params(data):
    try:
        return params_from_json(data if data is not None else {})
    except (TypeError, ValueError) as exc:
        raise ApiError(400, str(exc), param="params") from None
