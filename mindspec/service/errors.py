"""Errors the service returns: OpenAI-style objects, never a traceback."""
from __future__ import annotations

from typing import Optional

from fastapi.responses import JSONResponse

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "method_not_allowed", 408: "timeout", 413: "request_too_large", 422: "invalid_request_error",
               503: "service_unavailable", 500: "internal_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_body(status: int, message: str, param: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": status}}


def error_response(status: int, message: str, param: Optional[str] = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)
