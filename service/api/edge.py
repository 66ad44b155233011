"""What every request passes before the app reads a byte of its body: the API key, the body
limit of its route, and how deep its JSON nests (NOTE [ Checks at the edge ]).

# NOTE [ Checks at the edge ]
FastAPI reads and parses a route's JSON body before it resolves the route's dependencies, the
API-key check among them: an anonymous caller could make the API hold a body of any size, and
a body nested 100,000 levels deep made Python's json raise RecursionError (a 500). So this
plain ASGI middleware, in front of the app, handles a request that carries a body (a
Content-Length above 0, or a chunked one) as follows, having read only its headers:

1. Under ``/v1/`` (every tenant route), the ``Authorization: Bearer`` key is checked against
   Redis (the records' lookup: the secret's hash compared in constant time). No key, or a
   wrong one: 401 with ``Connection: close``, so the server closes the connection instead of
   reading (and dropping) the rest of the body. Requests without a body are left to the
   routes' own dependency (service/api/deps.py), which reads a job and its key in one round
   trip for a status poll.
2. The route's body limit, against the declared Content-Length (413 unread), then while the
   body arrives: every route that takes JSON gets ``BNADAPT_MAX_JSON_BODY_BYTES``. The
   streaming routes (POST /v1/models the weights, POST /v1/datasets a dataset file,
   PUT /v1/uploads/{id}/parts/{n} a part) read their bodies themselves, chunk by chunk, and
   check the limits of their settings (Content-Length first) with messages that name them;
   here they only get a backstop a little above those limits.
3. A body of every other route is read here (it is small), its nesting depth measured
   without parsing it (:func:`nesting_depth`), and handed on as it was: deeper than
   ``BNADAPT_MAX_JSON_DEPTH`` is a 422 before any parser sees it.

Public routes (/healthz, /readyz, /docs, /openapi.json, the web UI and its files, /metrics with
its own credential) are not under /v1/ and need no key; they get the JSON limit like any route.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from itertools import accumulate
from typing import Final

import anyio.to_thread
import redis
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.problems import (
    REDIS_UNREACHABLE,
    ApiError,
    invalid_key,
    missing_key,
    problem_response,
)
from service.records.aio import AsyncRecords
from service.settings import Settings

__all__ = ["EdgeMiddleware", "bearer_key", "nesting_depth"]

log = logging.getLogger(__name__)

_BEARER: Final = re.compile(r"^Bearer\s+(\S+)$", re.IGNORECASE)
# Routes that need an API key: every tenant route is under /v1/.
_TENANT_PREFIX: Final = "/v1/"
# Multipart framing and a form's small fields around a streamed file.
_MULTIPART_SLACK: Final = 1024 * 1024
# What a streaming route may have received past its limit before it notices (it counts the
# body in pieces of a few MiB: NOTE [ Streamed uploads ] in service/api/transfers.py).
_STREAM_SLACK: Final = 16 * 1024 * 1024
# A body is measured in a worker thread from this size up (the event loop keeps serving).
_THREAD_SCAN_BYTES: Final = 64 * 1024

# The streaming routes (method, path) and their limits, from the settings: they read their
# bodies chunk by chunk into the store and check the same limits themselves, with messages
# naming the setting (NOTE [ Streamed uploads ] in service/api/transfers.py).
_STREAMED: Final[tuple[tuple[str, re.Pattern[str], Callable[[Settings], int]], ...]] = (
    ("POST", re.compile(r"^/v1/models/?$"), lambda s: s.max_weights_bytes + _MULTIPART_SLACK),
    ("POST", re.compile(r"^/v1/datasets/?$"), lambda s: s.max_dataset_bytes + _MULTIPART_SLACK),
    ("PUT", re.compile(r"^/v1/uploads/[^/]+/parts/[^/]+/?$"), lambda s: s.max_upload_part_bytes),
)

# Every byte but the four brackets (deleted by bytes.translate), and each bracket's step.
_NOT_BRACKETS: Final = bytes(sorted(set(range(256)) - set(b"[]{}")))
_STEP: Final = [0] * 256
for _open, _close in ((b"[", b"]"), (b"{", b"}")):
    _STEP[_open[0]], _STEP[_close[0]] = 1, -1
_ESCAPE: Final = re.compile(rb"\\.", re.DOTALL)
_STRING: Final = re.compile(rb'"[^"]*"')


def nesting_depth(body: bytes) -> int:
    """How deep the arrays and objects of a JSON text nest (0 for a scalar), without parsing
    it. Linear in the body's size: escapes go first (``\\"`` ends no string), then strings
    (brackets inside them do not nest), then the running sum of +1 per opening and -1 per
    closing bracket has its maximum taken in C (``accumulate``, ``map``, ``max``)."""
    brackets = _STRING.sub(b"", _ESCAPE.sub(b"", body)).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def bearer_key(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header; None for any other header."""
    match = None if authorization is None else _BEARER.match(authorization)
    return None if match is None else match.group(1)


def _declared_length(headers: Headers) -> int | None:
    """The body's declared size; None when it is chunked (size unknown until it ends)."""
    if "transfer-encoding" in headers:
        return None
    value = headers.get("content-length", "0")
    return int(value) if value.isdigit() else 0  # the server refuses a malformed one


class _TooLarge(HTTPException):
    """Raised from ``receive`` when a streamed body passes its route's limit: FastAPI passes
    an HTTPException from reading the body on, and the problem handlers answer it (413)."""


class EdgeMiddleware:
    """NOTE [ Checks at the edge ]. ``settings`` are the app's; the key lookup reads
    ``app.state.async_records``, which the app's lifespan creates."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self._app = app
        self._settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        declared = _declared_length(headers)
        if declared == 0:
            await self._app(scope, receive, send)
            return
        path: str = scope["path"]
        if path.startswith(_TENANT_PREFIX):
            refused = await self._check_key(scope, headers)
            if refused is not None:
                await self._refuse(scope, receive, send, refused)
                return
        limit, streamed = self._limit(scope["method"], path)
        if streamed:
            # The route checks Content-Length before it reads, and the bytes as they arrive,
            # with the message of its own setting; this is the backstop, with the slack of
            # the pieces the route gathers before it counts them.
            await self._app(scope, _counted(receive, limit + _STREAM_SLACK), send)
            return
        if declared is not None and declared > limit:
            await self._refuse(scope, receive, send, _too_large(limit, streamed))
            return
        body = await _read_body(receive, limit)
        if body is None:  # the client went away
            return
        if isinstance(body, ApiError):
            await self._refuse(scope, receive, send, body)
            return
        # A body with fewer opening brackets than the limit cannot nest deeper (most do not).
        if body.count(b"[") + body.count(b"{") > self._settings.max_json_depth:
            depth = (
                await anyio.to_thread.run_sync(nesting_depth, body)
                if len(body) >= _THREAD_SCAN_BYTES
                else nesting_depth(body)
            )
            if depth > self._settings.max_json_depth:
                await self._refuse(scope, receive, send, _too_deep(depth, self._settings))
                return
        await self._app(scope, _replay(body, receive), send)

    async def _check_key(self, scope: Scope, headers: Headers) -> ApiError | None:
        """None when the request's key is valid, else the 401 (or 503) to answer."""
        authorization = headers.get("authorization")
        if authorization is None:
            return missing_key()
        presented = bearer_key(authorization)
        if presented is None:
            return invalid_key()
        records: AsyncRecords = scope["app"].state.async_records
        try:
            tenant = await records.tenant_for_key(presented)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            log.warning("redis unreachable: %s", exc)
            return ApiError(503, REDIS_UNREACHABLE, headers={"Retry-After": "5"})
        return invalid_key() if tenant is None else None

    def _limit(self, method: str, path: str) -> tuple[int, bool]:
        """The route's body limit, and whether the route streams its body itself."""
        for streamed_method, pattern, limit in _STREAMED:
            if method == streamed_method and pattern.match(path):
                return limit(self._settings), True
        return self._settings.max_json_body_bytes, False

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, error: ApiError) -> None:
        """Answers ``error`` and closes the connection: the body that is left is never read."""
        headers = {**(error.headers or {}), "Connection": "close"}
        response = problem_response(error.status, error.detail, scope["path"], headers=headers)
        await response(scope, receive, send)


def _too_large(limit: int, streamed: bool) -> ApiError:
    setting = "its route's setting" if streamed else "BNADAPT_MAX_JSON_BODY_BYTES"
    return ApiError(
        413,
        f"the request body is larger than the limit of {limit} bytes ({setting}); send a "
        "smaller body (big files go through the upload routes: POST /v1/uploads)",
    )


def _too_deep(depth: int, settings: Settings) -> ApiError:
    return ApiError(
        422,
        f"the JSON body nests {depth} levels deep; at most {settings.max_json_depth} are "
        "accepted (BNADAPT_MAX_JSON_DEPTH): flatten it",
    )


async def _read_body(receive: Receive, limit: int) -> bytes | ApiError | None:
    """The whole body, read up to ``limit`` bytes (the 413 past it); None if the client left."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return _too_large(limit, streamed=False)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` that gives the app the body read ahead, then what the server sends next
    (a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


def _counted(receive: Receive, limit: int) -> Receive:
    """``receive`` that raises the 413 once the body passes ``limit`` bytes (a chunked body,
    or one longer than it said)."""
    size = 0

    async def counted() -> Message:
        nonlocal size
        message = await receive()
        if message["type"] == "http.request":
            size += len(message.get("body", b""))
            if size > limit:
                raise _TooLarge(413, _too_large(limit, streamed=True).detail)
        return message

    return counted
