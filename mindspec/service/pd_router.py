"""The PD router (MindIE's coordinator role, pdRole "router"): every business route of a standard
server, each request sent through the prefill node (its first token and prompt KV, as one
hand-off) and then the decode node (which streams the rest back).

PdRouter offers what the routes and the RequestRunner use of an AsyncEngine (generate, tokenizer,
request ids, health), so routes, streaming, timeouts and metrics are the standard server's. A
node that is down, hangs or fails is one clear error for the client (HTTP 503 naming the node
and the cause); every wait is bounded by the config's timeouts: kv_link_timeout to connect,
tokenTimeout for each answer, kv_trans_timeout to send the KV.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import AsyncIterator, Optional

import httpx

from mindspec.config.mindie_config import MindieConfig
from mindspec.engine.outputs import RequestOutput
from mindspec.text_generator.sampling.params import SamplingParams

from .async_engine import Prompt, RequestError
from .pd_node import DECODE_ROUTE, PREFILL_ROUTE
from .pd_wire import output_from_line, params_to_json


@dataclass(frozen=True)
class PdTimeouts:
    link: float = 1080.0  # kv_link_timeout: connecting to a node
    transfer: float = 10.0  # kv_trans_timeout: sending a hand-off
    token: float = 600.0  # tokenTimeout: a node's next answer

    def for_httpx(self) -> httpx.Timeout:
        return httpx.Timeout(connect=self.link, read=self.token, write=self.transfer, pool=self.link)


class PdRouter:
    def __init__(self, prefill: str, decode: str, tokenizer, timeouts: PdTimeouts):
        self.prefill_url, self.decode_url = f"http://{prefill}", f"http://{decode}"
        self.tokenizer = tokenizer
        self.timeouts = timeouts
        self.healthy = True
        self._ids = itertools.count()
        self._client: Optional[httpx.AsyncClient] = None

    @classmethod
    def from_config(cls, config: MindieConfig) -> "PdRouter":
        from mindspec.text_generator.tokenizer import TokenizerError, load_tokenizer

        try:
            tokenizer = load_tokenizer(config.model.model_weight_path)
        except TokenizerError:
            tokenizer = None
        server, model = config.server, config.model
        timeouts = PdTimeouts(model.kv_link_timeout, model.kv_trans_timeout, server.token_timeout)
        return cls(server.pd_prefill_address, server.pd_decode_address, tokenizer, timeouts)

    # ---- the AsyncEngine surface ---------------------------------------------------------------
    def start(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def new_request_id(self, prefix: str = "cmpl") -> str:
        return f"{prefix}-{next(self._ids)}"

    async def generate(self, prompt: Prompt, params: SamplingParams, request_id: str,
                       share_prefix_with: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """The first token and prompt KV from the prefill node, then the decode node's stream.
        Leaving early closes the decode stream, which aborts the request there.
        ``share_prefix_with`` is accepted and ignored: n > 1 siblings are independent requests here,
        each prefilled on the prefill node (its KV would have to cross to the decode node anyway)."""
        handoff = await self._prefill(prompt, params, request_id)
        async for out in self._decode(handoff):
            yield out

    # ---- the two hops --------------------------------------------------------------------------
    async def _prefill(self, prompt: Prompt, params: SamplingParams, request_id: str) -> bytes:
        body = {"prompt": prompt, "params": params_to_json(params), "request_id": request_id}
        try:
            resp = await self._http().post(self.prefill_url + PREFILL_ROUTE, json=body)
        except httpx.HTTPError as exc:
            raise _node_error("prefill", self.prefill_url, exc, self.timeouts) from None
        if resp.status_code != 200:
            raise _refused("prefill", resp)
        return resp.content

    async def _decode(self, handoff: bytes) -> AsyncIterator[RequestOutput]:
        url = self.decode_url + DECODE_ROUTE
        try:
            async with self._http().stream("POST", url, content=handoff,
                                           headers={"content-type": "application/octet-stream"}) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    raise _refused("decode", resp)
                finished = False
                async for line in resp.aiter_lines():
                    if line:
                        out = output_from_line(line)
                        finished = out.finished
                        yield out
                if not finished:
                    raise RequestError(f"the decode node {self.decode_url} ended the stream before the request "
                                       f"finished", status=503)
        except httpx.HTTPError as exc:
            raise _node_error("decode", self.decode_url, exc, self.timeouts) from None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:  # made in the server's event loop, on first use
            self._client = httpx.AsyncClient(timeout=self.timeouts.for_httpx())
        return self._client


def _node_error(role: str, url: str, exc: httpx.HTTPError, timeouts: PdTimeouts) -> RequestError:
    if isinstance(exc, httpx.ConnectTimeout):
        why = f"no connection within kv_link_timeout={timeouts.link:g} s"
    elif isinstance(exc, httpx.WriteTimeout):
        why = f"the KV transfer took longer than kv_trans_timeout={timeouts.transfer:g} s"
    elif isinstance(exc, httpx.TimeoutException):
        why = f"no answer within tokenTimeout={timeouts.token:g} s"
    elif isinstance(exc, httpx.ConnectError):
        why = "unreachable (is it running?)"
    else:
        why = f"failed mid-request ({type(exc).__name__}: {exc})"
    return RequestError(f"the {role} node {url}: {why}", status=503)


def _refused(role: str, resp: httpx.Response) -> RequestError:
    """A node's own error answer, passed on with its status (a bad prompt stays a 400)."""
    try:
        message = resp.json()["error"]["message"]
    except (ValueError, KeyError, TypeError, json.JSONDecodeError):
        message = resp.text[:300]
    status = resp.status_code if 400 <= resp.status_code < 500 else 503
    return RequestError(f"the {role} node refused the request: {message}", status=status)
