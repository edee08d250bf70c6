"""The ASGI apps: business routes, management (health) and metrics, one app per distinct port."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import routes_openai, routes_text
from .errors import ApiError, error_body, error_response
from .state import ServiceState

logger = logging.getLogger(__name__)


# Probes and scrapes stay reachable when the ports are merged with the business port.
UNGUARDED = {"/health", "/v2/health/live", "/v2/health/ready", "/metrics"}


class Protection:
    """ASGI middleware for the business port: API key, body size and connection limits."""

    def __init__(self, app, state: ServiceState, max_body_bytes: int, max_links: int):
        self.app, self.state = app, state
        self.max_body, self.max_links = max_body_bytes, max_links
        self.active = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path", "") in UNGUARDED:
            return await self.app(scope, receive, send)
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        if self.state.api_key and headers.get("authorization") != f"Bearer {self.state.api_key}":
            return await _reject(send, 401, "missing or wrong API key (Authorization: Bearer ...)")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return await _reject(send, 413, f"request body of {length} bytes exceeds maxRequestLength ({self.max_body} bytes)")
        if self.active >= self.max_links:
            return await _reject(send, 503, f"too many concurrent requests (maxLinkNum={self.max_links})")
        self.active += 1
        try:
            await self.app(scope, _limited(receive, self.max_body), send)
        finally:
            self.active -= 1


class _BodyTooLarge(Exception):
    pass


def _limited(receive, limit: int):
    seen = 0

    async def wrapped():
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _BodyTooLarge()
        return message

    return wrapped


async def _reject(send, status: int, message: str) -> None:
    import json

    body = json.dumps(error_body(status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        """Unknown routes (404) and wrong methods (405) answer with the error object every other
        error has, not FastAPI's {"detail": ...}."""
        if exc.status_code == 404:
            message = f"no route {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        response = error_response(exc.status_code, message)
        response.headers.update(exc.headers or {})  # 405 names the allowed methods (Allow)
        return response

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"] if x != "body")
        if first["type"] == "json_invalid":
            message = "request body is not valid JSON"
        elif not where:
            message = "request body must be a JSON object"
        else:
            message = f"{where}: {first['msg']}"
        return error_response(400, message, param=where or None)

    @app.exception_handler(_BodyTooLarge)
    async def too_large(_: Request, exc: _BodyTooLarge):
        return error_response(413, "request body exceeds maxRequestLength")

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception):
        logger.exception("unhandled error")
        return error_response(500, f"internal error ({type(exc).__name__})")


def business_app(state: ServiceState) -> FastAPI:
    app = FastAPI(title="mindspec", docs_url=None, redoc_url=None)
    app.include_router(routes_openai.router(state))
    app.include_router(routes_text.router(state))
    _add_health_routes(app, state)  # probes that only know the serving port (TGI, vLLM, k8s)
    _install_error_handlers(app)
    return app


def management_app(state: ServiceState) -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None)
    _add_health_routes(app, state)
    _add_cache_routes(app, state)
    _install_error_handlers(app)
    return app


def _add_cache_routes(app: FastAPI, state: ServiceState) -> None:
    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """Forget every cached prefix block (vLLM's route; here on the management port)."""
        engine = getattr(state.engine, "engine", None)  # a PD router runs no model
        if engine is None:
            return error_response(400, "this node runs no model (PD router): reset the prefix cache on the "
                                       "prefill and decode nodes")
        if not engine.prefix_caching:
            return error_response(400, "prefix caching is off: enable it with plugin_type \"prefix_cache\" "
                                       "in ModelConfig.plugin_params (or LLM(enable_prefix_caching=True))")

        def reset(engine) -> int:  # on the engine thread, between steps
            blocks = engine.reset_prefix_cache()
            if state.metrics is not None:
                state.metrics.observe_engine(engine)
            return blocks

        return {"status": "ok", "forgotten_blocks": await state.engine.call(reset)}


def _add_health_routes(app: FastAPI, state: ServiceState) -> None:
    @app.get("/health")
    async def health():
        if state.engine.healthy:
            return {"status": "healthy"}
        return JSONResponse({"status": "unhealthy"}, status_code=500)

    @app.get("/v2/health/live")
    async def live():
        return {"status": "live"}

    @app.get("/v2/health/ready")
    async def ready():
        if state.engine.healthy:
            return {"status": "ready"}
        return JSONResponse({"status": "not ready"}, status_code=503)


def metrics_app(state: ServiceState) -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None)

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    _install_error_handlers(app)
    return app


def apps_by_port(state: ServiceState, port: int, management_port: int, metrics_port: int,
                 max_body_bytes: int, max_links: int) -> dict[int, object]:
    """Ports that share a number share one server (MindIE merges them the same way)."""
    routes: dict[int, list[FastAPI]] = {}
    for p, app in ((port, business_app(state)), (management_port, management_app(state)), (metrics_port, metrics_app(state))):
        routes.setdefault(p, []).append(app)
    merged = {}
    for p, group in routes.items():
        app = group[0]
        for other in group[1:]:
            app.router.routes.extend(other.router.routes)
        merged[p] = Protection(app, state, max_body_bytes, max_links) if p == port else app
    return merged
