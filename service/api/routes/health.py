"""Liveness and readiness."""

from __future__ import annotations

import redis
from fastapi import APIRouter
from fastapi.responses import JSONResponse

from service.api.deps import RecordsDep, StoreDep
from service.records import keys

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process answers."""
    return {"status": "ok"}


@router.get("/readyz")
def readyz(records: RecordsDep, store: StoreDep) -> JSONResponse:
    """Redis reachable and the store writable (503 otherwise); also says whether a worker
    runs, which does not affect readiness (jobs queue up until one starts)."""
    checks: dict[str, str] = {}
    try:
        records.client.ping()
        checks["redis"] = "ok"
        checks["workers"] = "ok" if records.client.exists(keys.INSPECTORS_ALIVE) else "none"
    except redis.RedisError as exc:  # the answer, not an error
        checks["redis"] = f"unreachable: {exc}"
    try:
        store.put_bytes(b"bnadapt readiness probe\n")
        checks["store"] = "ok"
    except OSError as exc:
        checks["store"] = f"not writable: {exc}"
    ready = checks.get("redis") == "ok" and checks["store"] == "ok"
    return JSONResponse(
        {"status": "ready" if ready else "not ready", "checks": checks},
        status_code=200 if ready else 503,
    )
