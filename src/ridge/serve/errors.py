"""How the server refuses: before a route runs (auth, content type, size), in OpenAI's error envelope
whatever raised, and as the OpenAPI schema documents it.

Plain ASGI middleware, not Starlette's BaseHTTPMiddleware, which relays every streamed chunk through an
extra task and memory stream (docs/notes/server-hardening.md).
"""

from __future__ import annotations

import hmac
import json
import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ridge.serve.protocol import RequestError

log = logging.getLogger("ridge")


class BearerAuth:
    """Every path but `open_paths` needs `Authorization: Bearer <api_key>`, else 401."""

    def __init__(self, app, api_key: str, open_paths: set[str]) -> None:
        self.app, self.wanted, self.open_paths = app, f"Bearer {api_key}".encode(), open_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths \
                and not hmac.compare_digest(dict(scope.get("headers") or []).get(b"authorization", b""), self.wanted):
            error = RequestError("invalid or missing API key (Authorization: Bearer ...)", None, 401,
                                 "AuthenticationError")
            await send_json(send, 401, error.body())
            return
        await self.app(scope, receive, send)


class JsonOnly:
    """A body sent as something other than JSON gets 415 (a body with no Content-Type is read as JSON,
    as FastAPI does)."""

    def __init__(self, app, binary_paths: set[str] = frozenset()) -> None:
        self.app, self.binary_paths = app, binary_paths

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] == "http" and scope["method"] in ("POST", "PUT", "PATCH")
                and scope["path"] not in self.binary_paths):
            declared = dict(scope.get("headers") or []).get(b"content-type")
            if declared is not None:
                media = declared.split(b";")[0].strip().lower()
                if media != b"application/json" and not media.endswith(b"+json"):
                    error = RequestError(f"Content-Type: {declared.decode('latin-1')!r} is not accepted; send "
                                         "application/json", "Content-Type", 415, "UnsupportedMediaTypeError")
                    await send_json(send, 415, error.body())
                    return
        await self.app(scope, receive, send)


class BodyLimit:
    """A request body over max_bytes gets 413 before the route reads it whole."""

    def __init__(self, app, max_bytes: int, unlimited_paths: set[str] = frozenset()) -> None:
        self.app, self.max_bytes, self.unlimited_paths = app, max_bytes, unlimited_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.unlimited_paths:
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(send)
            return
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise _TooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:
            await self._reject(send)

    async def _reject(self, send) -> None:
        await send_json(send, 413, RequestError(f"request body: larger than the limit of {self.max_bytes} bytes",
                                                None, 413, "RequestTooLargeError").body())


class _TooLarge(Exception):
    pass


async def send_json(send, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


# Which refusals each kind of route can give, as the OpenAPI schema states them (FastAPI's default
# documents 422 for a bad body; this server answers 400).
_STATUSES = {
    400: "a field is missing, of the wrong type, or over its limit (`param` names it)",
    401: "the API key is missing or wrong (with --api-key)",
    404: "no such model (`param`: model)",
    413: "the body is larger than --max-body-bytes",
    415: "the body is not sent as application/json",
    429: "the server's queue is full (--max-waiting, --max-queued-tokens)",
    500: "the engine failed on this request; the server serves on",
    503: "the engine is restarting (Retry-After says when to retry), dead, or the server is shutting down",
}
_GENERATE = (400, 401, 404, 413, 415, 429, 500, 503)
_POST = (400, 401, 404, 413, 415, 500)
_GET = (401, 500)


def document_errors(app: FastAPI) -> None:
    """Replace FastAPI's OpenAPI schema with one whose routes list the statuses they really answer."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            components.pop(unused, None)
        components["ErrorResponse"] = {
            "type": "object", "required": ["error"],
            "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
                "message": {"type": "string"}, "type": {"type": "string"},
                "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}}}
        reference = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
        for path, operations in schema.get("paths", {}).items():
            for method, operation in operations.items():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                statuses = (503,) if path == "/health" else _GENERATE if path.startswith("/v1/") and method == "post" \
                    else _POST if method == "post" else _GET
                for status in statuses:
                    responses[str(status)] = {"description": _STATUSES[status], **reference}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def answer_errors_in_the_envelope(app: FastAPI) -> None:
    """Every error a route or Starlette raises answers in OpenAI's envelope: ridge's RequestError as it is,
    pydantic's validation errors as a 400 naming the field, Starlette's own (404, 405, a body that is not
    UTF-8) with their status, anything else as a 500 whose traceback stays in the log."""

    @app.exception_handler(RequestError)
    async def request_error(_: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":  # its loc is the character where parsing stopped
            error = (first.get("ctx") or {}).get("error", "")
            return JSONResponse(RequestError(f"body: not valid JSON ({error} at character {first['loc'][-1]})",
                                             None).body(), status_code=400)
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = str(first.get("msg")).removeprefix("Value error, ")
        named = re.match(r"([a-z_.]+): ", message)  # a check over several fields names the one it refuses first
        if named and (param is None or named.group(1).startswith(param)):
            param, message = message.split(": ", 1)
        return JSONResponse(RequestError(f"{param or 'body'}: {message}", param).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        """Starlette's own errors (no such route, wrong method, a body that is not UTF-8 or nests too deep)."""
        names = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowedError"}
        message = "body: not valid JSON (not UTF-8, or nested too deeply)" if exc.status_code == 400 else exc.detail
        if exc.status_code == 404 and exc.detail == "Not Found":  # no such route (not a route's own 404)
            served = sorted({f"{method} {route.path}" for route in request.app.routes
                             if route.path not in ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")
                             for method in getattr(route, "methods", ()) - {"HEAD"}})
            message = (f"{request.method} {request.url.path}: no such endpoint on this server (it serves text, "
                       f"embeddings and scores; no images or audio); it answers {', '.join(served)}")
        return JSONResponse(RequestError(str(message), None, exc.status_code,
                                         names.get(exc.status_code, "HTTPError")).body(),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("ridge: internal error")  # the traceback stays in the server's log
        return JSONResponse(RequestError("internal server error", None, 500, "InternalServerError").body(),
                            status_code=500)
