"""TGI (POST /, /generate, /generate_stream), vLLM-style (/generate with "prompt") and
MindIE-native (/infer) text-generation routes."""
from __future__ import annotations

import json
import secrets
from typing import AsyncIterator, Optional, Sequence

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from mindspec.engine.outputs import RequestOutput

from .async_engine import Prompt
from .errors import ApiError
from .fanout import primed
from .logprobs import TokenText, top_k_list
from .protocol import TgiRequest, VllmGenerateRequest
from .routes_openai import NewTokens, sse
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


def _finish_reason(out: RequestOutput) -> str:
    """TGI's names: length | eos_token | stop_sequence (a stop string; a stop token id is an
    end-of-sequence token to TGI)."""
    if out.finish_reason == "length":
        return "length"
    return "stop_sequence" if isinstance(out.stop_reason, str) else "eos_token"


class _TgiTokens:
    """TGI Token objects ({id, text, logprob, special}) for one request's tokens, in order. A
    token's text is what it adds to the text (incremental detokenization: the pieces join to
    the generated text); a special token, which the text skips, shows its own spelling."""

    def __init__(self, text: TokenText, context_ids: Sequence[int]):
        self.text = text
        self.pieces = text.pieces(context_ids)

    def tokens(self, ids: Sequence[int], logprobs: Sequence[Optional[float]], last: bool = False) -> list[dict]:
        out = []
        for token_id, lp in zip(ids, logprobs):
            special = self.text.is_special(token_id)
            piece = self.pieces.next(token_id)
            out.append({"id": token_id, "text": self.text.display(token_id) if special else piece,
                        "logprob": lp, "special": special})
        if last and out and not out[-1]["special"]:
            out[-1]["text"] += self.pieces.flush()  # an unfinished character at the very end
        return out

    def alternatives(self, top: Optional[dict[int, float]]) -> list[dict]:
        return [{"id": i, "text": shown, "logprob": v, "special": self.text.is_special(i)}
                for i, shown, v in top_k_list(self.text, top)]


class _TgiCall:
    """One TGI-style request: its engine prompt and parameters, and its answers (the non-stream
    body, the stream's events)."""

    def __init__(self, state: ServiceState, req: TgiRequest, prefix: str):
        self.state, self.req, self.params = state, req, req.parameters
        p = self.params
        sampling = p.do_sample or p.temperature not in (None, 0)
        # TGI reports the seed a sampled request used; pick one so the answer can be replayed.
        self.seed = p.seed if p.seed is not None or not sampling else secrets.randbelow(2**63)
        logprobs = p.top_n_tokens if p.top_n_tokens else (0 if p.wants_details or req.stream else None)
        self.format = p.structured_format()  # parameters.grammar
        self.sampling = p.sampling_params(self.seed, logprobs, self.format)
        self.prompt = self._prompt()
        self.request_id = state.engine.new_request_id(prefix)

    def _prompt(self) -> Prompt:
        truncate = self.params.truncate
        if truncate is None:
            return self.req.inputs
        tok = self.state.engine.tokenizer
        if tok is None:
            raise ApiError(400, "truncate needs the model's tokenizer, which this server has not loaded", param="truncate")
        return tok.encode(self.req.inputs)[-truncate:]  # TGI keeps the last `truncate` tokens

    def stream(self):
        return self.state.runner.stream(self.prompt, self.sampling, self.request_id, timeout=self.params.timeout)

    def generated_text(self, out: RequestOutput) -> str:
        return (self.req.inputs + out.text) if self.params.return_full_text else out.text

    async def answer(self) -> dict:
        """{generated_text, details?} of /generate (POST / wraps it in a list)."""
        final, prompt_lps = None, None
        with self.format.naming_errors():  # a grammar the engine cannot compile names parameters.grammar
            async for out in self.stream():
                final = out
                prompt_lps = prompt_lps or getattr(out, "prompt_logprobs", None)
        body = {"generated_text": self.generated_text(final)}
        if self.params.wants_details:
            body["details"] = self._details(final, prompt_lps)
        return body

    def _details(self, out: RequestOutput, prompt_lps: Optional[list]) -> dict:
        text, p = self.state.token_text, self.params
        ids = out.token_ids
        lps = list(out.logprobs[:len(ids)]) if out.logprobs is not None else [None] * len(ids)
        details = {"finish_reason": _finish_reason(out), "generated_tokens": len(ids), "seed": self.seed,
                   "prefill": self._prefill(out, prompt_lps) if p.decoder_input_details else [],
                   "tokens": _TgiTokens(text, out.prompt_token_ids).tokens(ids, lps, last=True)}
        if p.top_n_tokens:
            tops = out.top_logprobs or [None] * len(ids)
            alternatives = _TgiTokens(text, ())
            details["top_tokens"] = [alternatives.alternatives(t) for t in tops[:len(ids)]]
        return details

    def _prefill(self, out: RequestOutput, prompt_lps: Optional[list]) -> list[dict]:
        ids = out.prompt_token_ids
        lps = prompt_lps or [None] * len(ids)  # the first token has no logprob: nothing precedes it
        return [{"id": t["id"], "text": t["text"], "logprob": t["logprob"]}
                for t in _TgiTokens(self.state.token_text, ()).tokens(ids, lps)]

    async def events(self) -> StreamingResponse:
        with self.format.naming_errors():
            outs = await primed(self.stream())
        return StreamingResponse(self._events(outs), media_type="text/event-stream")

    async def _events(self, outs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        """One event per token, carrying its own text piece and logprob; the last one also the
        generated text and the details. An error after the start is one error event."""
        tokens, new, index = None, NewTokens(), 0
        try:
            async for out in outs:
                tokens = tokens or _TgiTokens(self.state.token_text, out.prompt_token_ids)
                ids, lps, tops = new.take(out)
                for k, token in enumerate(tokens.tokens(ids, lps, last=out.finished)):
                    last = out.finished and k == len(ids) - 1
                    index += 1
                    yield sse({"index": index, "token": token,
                               "top_tokens": tokens.alternatives(tops[k]) if self.params.top_n_tokens else None,
                               "generated_text": self.generated_text(out) if last else None,
                               "details": self._stream_details(out) if last else None})
        except ApiError as exc:
            yield sse({"error": {"message": exc.message, "type": "invalid_request_error", "code": exc.status}})
        finally:  # a client that hangs up aborts the request now, not at garbage collection
            await outs.aclose()

    def _stream_details(self, out: RequestOutput) -> dict:
        return {"finish_reason": _finish_reason(out), "generated_tokens": len(out.token_ids), "seed": self.seed,
                "input_length": len(out.prompt_token_ids)}


def router(state: ServiceState) -> APIRouter:
    api = APIRouter()

    def tgi(body: dict, prefix: str = "tgi") -> _TgiCall:
        return _TgiCall(state, _parse(TgiRequest, body), prefix)

    @api.post("/")
    async def root(request: Request):
        """TGI's root route (and MindIE's): generate or generate_stream by the body's stream; the
        non-stream answer is a list of one, as TGI's."""
        call = tgi(await _json(request))
        if call.req.stream:
            return await call.events()
        return [await call.answer()]

    @api.post("/generate")
    async def generate(request: Request):
        body = await _json(request)
        if "inputs" in body:
            call = tgi(body)
            return await (call.events() if call.req.stream else call.answer())
        if "prompt" in body:
            req = _parse(VllmGenerateRequest, body)
            fmt = req.structured_format()
            with fmt.naming_errors():
                out = await state.runner.complete(req.prompt, req.sampling_params(16, fmt=fmt),
                                                  state.engine.new_request_id("gen"))
            return {"text": [req.prompt + out.text]}
        raise ApiError(422, "body must carry 'inputs' (TGI) or 'prompt' (vLLM)")

    @api.post("/generate_stream")
    async def generate_stream(request: Request):
        return await tgi(await _json(request)).events()

    @api.post("/infer")
    async def infer(request: Request):
        """MindIE's native endpoint: {inputs, stream, parameters} -> generated_text and details."""
        call = tgi(await _json(request), "infer")
        return await (call.events() if call.req.stream else call.answer())

    return api

