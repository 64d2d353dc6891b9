"""The one error envelope, `{"error": {"message", "type", "param", "code"}}`, and the table
that maps domain errors to HTTP statuses. A 500 is always a bug."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from backfill.api.protocol import ErrorResponse
from backfill.jobs.errors import (
    Conflict,
    DomainError,
    Forbidden,
    InvalidRequest,
    NotFound,
    TooLarge,
    Unauthorized,
    error_body,
)
from backfill.storage.db import is_transient as is_transient_database_error
from backfill.storage.fleet_models import FleetUnavailable
from backfill.storage.objects import is_transient as is_transient_store_error

log = logging.getLogger("backfill.api")

STATUS_OF: dict[type[DomainError], int] = {
    InvalidRequest: 400,
    Unauthorized: 401,
    Forbidden: 403,
    NotFound: 404,
    Conflict: 409,
    TooLarge: 413,
}


_DESCRIPTIONS = {
    400: "The request is invalid.",
    401: "The API key is missing, unknown or revoked.",
    403: "The route needs an admin API key.",
    404: "No such object for this key, or no such route.",
    409: "The object's state does not allow it (cancelling a finished batch).",
    413: "The body or the file is larger than allowed.",
    429: "Too many requests.",
    500: "A bug: the server had an error while processing the request.",
    503: "The inference fleet, the database or the object store is briefly unavailable: retry.",
}

# The statuses every route may answer with, in the one envelope; routers add 403 or 503 where they apply.
COMMON_ERRORS = (400, 401, 404, 409, 413, 429, 500, 503)


def error_responses(*statuses: int) -> dict[int | str, dict[str, object]]:
    """`responses=` for a router: the error envelope for each status, so the OpenAPI document says it."""
    return {status: {"model": ErrorResponse, "description": _DESCRIPTIONS[status]} for status in statuses}


def envelope(
    status: int, message: str, *, type_: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(
        status_code=status,
        content=error_body(message, type_=type_, param=param, code=code),
        headers={"WWW-Authenticate": "Bearer"} if status == 401 else None,
    )


def _wire_ids(request: Request, exc: DomainError) -> str:
    """The domain names a row by its raw id; the client sent the wire id (`batch_...`, `file-...`)
    in the path parameter the error is about: say it back as the client knows it."""
    wire = request.path_params.get(exc.param or "")
    if not isinstance(wire, str) or wire in exc.message:
        return exc.message
    for prefix in ("batch_", "file-", "upload_"):
        if wire.startswith(prefix) and len(wire) > len(prefix):
            return exc.message.replace(wire[len(prefix) :], wire)
    return exc.message


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(DomainError)
    async def _domain(request: Request, exc: DomainError) -> JSONResponse:
        status = next((s for cls, s in STATUS_OF.items() if isinstance(exc, cls)), 400)
        return envelope(status, _wire_ids(request, exc), type_=exc.type, param=exc.param, code=exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        param = ".".join(loc) or None
        message = f"Invalid value for '{param}': {first.get('msg', 'invalid')}." if param else str(first.get("msg"))
        return envelope(400, message, type_="invalid_request_error", param=param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        else:
            message = str(exc.detail)
        return envelope(exc.status_code, message, type_="invalid_request_error", code=None)

    @app.exception_handler(FleetUnavailable)
    async def _fleet(_: Request, exc: FleetUnavailable) -> JSONResponse:
        return envelope(
            503, f"The inference fleet is unavailable: {exc}", type_="server_error", code="fleet_unavailable"
        )

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        # The database or the object store away for a moment is an outage, not a bug: the
        # client may retry (the OpenAI SDK retries a 503 by itself), and nothing was half-done,
        # since every write is a transaction or lands at a deterministic key.
        if is_transient_database_error(exc) or is_transient_store_error(exc):
            log.warning("a request met an outage: %s", exc.__class__.__name__)
            response = envelope(
                503, "The service is briefly unavailable; retry the request.", type_="server_error", code="unavailable"
            )
            response.headers["Retry-After"] = "1"
            return response
        log.exception("unhandled error")
        return envelope(500, "The server had an error while processing your request.", type_="server_error")
