"""Every error the API answers, as RFC 9457 problem details, mapped in one place: the
refusals of the layer under the routes (:class:`~service.errors.RefusedError`, which knows no
HTTP), the HTTP layer's own (:class:`ApiError`), the framework's, and the unexpected."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import redis
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from api_schemas import Problem, ProblemItem
from service.errors import RefusedError

__all__ = [
    "REDIS_UNREACHABLE",
    "ApiError",
    "install_problem_handlers",
    "invalid_key",
    "missing_key",
    "problem_items",
    "problem_response",
    "problem_responses",
    "refuse_other_methods",
]

log = logging.getLogger(__name__)

_TITLES = {
    400: "Bad request",
    401: "Unauthorized",
    404: "Not found",
    405: "Method not allowed",
    409: "Conflict",
    413: "Payload too large",
    415: "Unsupported media type",
    422: "Unprocessable content",
    429: "Too many requests",
    500: "Internal server error",
    503: "Service unavailable",
}


def problem_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries for error statuses, each a problem+json body: for a
    router's ``responses=``, so that the document lists every status a route can answer."""
    return {
        status: {
            "description": _TITLES[status],
            "content": {
                "application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}
            },
        }
        for status in statuses
    }


class ApiError(RefusedError):
    """What the HTTP layer itself refuses (the routes, the edge, the transfers): any status,
    and the headers it answers with (``Allow``, ``WWW-Authenticate``, ``Retry-After``)."""

    def __init__(
        self,
        status: int,
        detail: str,
        *,
        errors: Sequence[ProblemItem] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(detail, errors=errors)
        self.status = status
        self.headers = headers


_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def refuse_other_methods(router: APIRouter, path: str, allowed: str, what: str) -> None:
    """Answers 405 (``Allow: <allowed>``) to every other method on ``path``, an action such as
    ``/{job_id}:cancel``. Without it, ``GET /v1/jobs/abc:cancel`` would reach
    ``GET /v1/jobs/{job_id}`` with the id ``abc:cancel`` (Starlette's path parameters match the
    colon) and answer 422."""

    def wrong_method(request: Request) -> None:
        raise ApiError(
            405,
            f"{request.method} is not allowed on {what}; send {allowed}",
            headers={"Allow": allowed},
        )

    others = [method for method in _METHODS if method != allowed]
    router.api_route(path, methods=others, include_in_schema=False)(wrong_method)


_UNAUTHORIZED = {"WWW-Authenticate": "Bearer"}


def missing_key() -> ApiError:
    """The 401 of a request without an ``Authorization`` header."""
    return ApiError(
        401,
        "no API key: send 'Authorization: Bearer <key>' (create one with `bnadapt keys create`)",
        headers=_UNAUTHORIZED,
    )


def invalid_key() -> ApiError:
    """The 401 of a key that is malformed, unknown or revoked (one answer for all three)."""
    return ApiError(
        401, "the API key is not valid; check it or create a new one", headers=_UNAUTHORIZED
    )


REDIS_UNREACHABLE = (
    "the record store (Redis) is unreachable; retry shortly, and if it persists check "
    "that Redis runs and BNADAPT_REDIS_URL points at it"
)


def problem_items(errors: Sequence[Any]) -> list[ProblemItem]:
    """pydantic's error list as problem items (loc and msg only: no input echoed back)."""
    return [
        ProblemItem(loc=[p if isinstance(p, int) else str(p) for p in e["loc"]], msg=e["msg"])
        for e in errors
    ]


def problem_response(
    status: int,
    detail: str | None,
    instance: str,
    errors: list[ProblemItem] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """The one error body, for ``instance`` (the request's path); also what the edge
    middleware (service/api/edge.py) answers before the app sees a request."""
    body = Problem(
        title=_TITLES.get(status, "Error"),
        status=status,
        detail=detail,
        instance=instance,
        errors=errors,
    )
    return JSONResponse(
        body.model_dump(exclude_none=True),
        status_code=status,
        media_type="application/problem+json",
        headers=headers,
    )


def _response(
    request: Request,
    status: int,
    detail: str | None,
    errors: list[ProblemItem] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return problem_response(status, detail, request.url.path, errors, headers)


def _refusal_headers(refusal: RefusedError) -> dict[str, str] | None:
    """The HTTP layer's own headers of an :class:`ApiError`, and ``Retry-After`` where the
    refusal says when to try again."""
    headers = dict(refusal.headers or {}) if isinstance(refusal, ApiError) else {}
    if refusal.retry_after_s is not None:
        headers["Retry-After"] = str(refusal.retry_after_s)
    return headers or None


def _summary(errors: list[ProblemItem]) -> str:
    parts = [f"{'.'.join(str(p) for p in e.loc)}: {e.msg}" for e in errors[:5]]
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return "invalid request: " + "; ".join(parts) + more


def _allowed_methods(request: Request) -> list[str]:
    """The methods of every documented route on the request's path."""
    methods: set[str] = set()
    for route in request.app.routes:
        if isinstance(route, APIRoute) and not route.include_in_schema:
            continue
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return sorted(methods - {"HEAD"})


def install_problem_handlers(app: FastAPI) -> None:
    async def refused(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RefusedError)
        return _response(request, exc.status, exc.detail, exc.errors, _refusal_headers(exc))

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError | ValidationError)
        items = problem_items(exc.errors())
        return _response(request, 422, _summary(items), items)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        detail = exc.detail if isinstance(exc.detail, str) else None
        if exc.status_code == 413:
            detail = f"{detail or 'request body too large'}; the limits are settings"
        headers = dict(exc.headers) if exc.headers else None
        if exc.status_code == 405:
            # Starlette names the methods of the first route on the path only.
            allowed = _allowed_methods(request)
            headers = {**(headers or {}), "Allow": ", ".join(allowed)}
            detail = f"{request.method} is not allowed here; use {' or '.join(allowed)}"
        return _response(request, exc.status_code, detail, headers=headers)

    async def redis_down(request: Request, exc: Exception) -> JSONResponse:
        log.warning("redis unreachable: %s", exc)
        return _response(request, 503, REDIS_UNREACHABLE, headers={"Retry-After": "5"})

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return _response(request, 500, "internal error; it was logged on the server")

    # Every refusal, ApiError, InvalidPageTokenError (422) and QuotaExceededError (429)
    # among them: the handler of the nearest class in an exception's MRO answers it.
    app.add_exception_handler(RefusedError, refused)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(ValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(redis.ConnectionError, redis_down)
    app.add_exception_handler(redis.TimeoutError, redis_down)
    app.add_exception_handler(Exception, unexpected)
