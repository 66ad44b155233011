"""Liveness and readiness.

NOTE [ Cheap readiness ]
Load balancers and orchestrators call /readyz often, from many places. Each API process
checks its dependencies at most once every ``BNADAPT_READY_CHECK_S`` (Redis answers, the store
takes a write of one small probe object, the same bytes every time) and answers from that
result in between, on the event loop: a probe costs no thread and no store request. The answer names
which dependency is not ready and nothing else; why (the exception, a host, a path, a bucket)
goes to the server log.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Final

import anyio.to_thread
import redis
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from service.records import keys
from service.records.sync import Records
from service.store.base import Store

router = APIRouter(tags=["health"])

log = logging.getLogger(__name__)

_PROBE: Final = b"bnadapt readiness probe\n"


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process answers."""
    return {"status": "ok"}


@dataclass
class Readiness:
    """One process's latest readiness result (NOTE [ Cheap readiness ])."""

    checks: dict[str, str] = field(default_factory=dict)
    checked_at: float = float("-inf")
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def current(self, records: Records, store: Store, every_s: float) -> dict[str, str]:
        async with self.lock:  # concurrent probes wait for one check
            if time.monotonic() - self.checked_at >= every_s:
                self.checks = await anyio.to_thread.run_sync(check_dependencies, records, store)
                self.checked_at = time.monotonic()
            return self.checks


def check_dependencies(records: Records, store: Store) -> dict[str, str]:
    """Each dependency's state in a word; the reasons go to the log."""
    checks: dict[str, str] = {}
    try:
        records.client.ping()
        checks["redis"] = "ok"
        checks["workers"] = "ok" if records.client.exists(keys.INSPECTORS_ALIVE) else "none"
    except redis.RedisError as exc:  # the answer, not an error
        log.warning("readiness: redis unreachable: %s", exc)
        checks["redis"] = "unreachable"
    try:
        store.put_bytes(_PROBE)
        checks["store"] = "ok"
    except Exception as exc:  # noqa: BLE001 - any backend's failure (S3: botocore's) is "not ready"
        log.warning("readiness: store not writable: %s", exc)
        checks["store"] = "not writable"
    return checks


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """Redis reachable and the store writable (503 otherwise), as checked at most
    ``BNADAPT_READY_CHECK_S`` ago; also says whether a worker runs, which does not affect
    readiness (jobs queue up until one starts)."""
    state = request.app.state
    readiness: Readiness | None = getattr(state, "readiness", None)
    if readiness is None:
        readiness = state.readiness = Readiness()
    checks = await readiness.current(state.records, state.store, state.settings.ready_check_s)
    ready = checks.get("redis") == "ok" and checks.get("store") == "ok"
    return JSONResponse(
        {"status": "ready" if ready else "not ready", "checks": checks},
        status_code=200 if ready else 503,
    )
