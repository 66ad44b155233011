"""Prometheus metrics at GET /metrics.

NOTE [ Metrics across API processes ]
The API runs as several uvicorn processes; a scrape reaches one of them. What describes the
deployment (jobs by kind and status, queue depth and wait, job durations, workers and their
busy time, store bytes) is therefore computed from Redis and the store, the same whichever
process answers. What each process sees alone (request latency by route) is a
prometheus_client histogram; with ``PROMETHEUS_MULTIPROC_DIR`` set (``bnadapt up`` and
``bnadapt api`` set it to a fresh directory under the data directory), prometheus_client keeps
every process's values in files there and a scrape sums them.

NOTE [ Cheap scrapes ]
Computing the deployment's figures reads up to SCRAPE_JOBS_MAX job records and lists the whole
store (a LIST of the bucket on S3): far too much for every scrape, which anyone could trigger.
So the figures are a snapshot in Redis (SNAPSHOT_KEY), recomputed at most every
``BNADAPT_METRICS_REFRESH_S`` by one API process of the deployment (whichever takes the
REFRESH_LOCK_KEY lease first), in a thread, while scrapes answer the snapshot they find:
a scrape costs one Redis read and no thread. Only the first scrape of a deployment waits for
the computation. ``bnadapt_metrics_snapshot_age_seconds`` says how old the figures are.

A scrape needs its own credential, never a tenant's key: ``Authorization: Bearer
<BNADAPT_METRICS_TOKEN>`` (compared in constant time). With no token set, only an API that
listens on loopback alone answers, and only clients on this machine (a loopback address, as
uvicorn sees them after proxy headers). A loopback peer alone proves nothing once the API
listens beyond loopback: a reverse proxy on the same machine that sends no X-Forwarded-For
makes every client one. Whether the API listens on loopback alone is what ``BNADAPT_API_HOST``
says (``bnadapt up`` and ``bnadapt api`` set it to their --host) and, where the kernel's socket
table can be read (Linux), what this process's listening sockets show: either one naming
another address, or neither saying anything, needs the token.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import os
import time
from collections.abc import Iterator
from typing import Any, Final

import anyio.to_thread
import redis.asyncio
from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from rq import Queue, Worker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api_schemas import JobPublic
from service.api.problems import ApiError
from service.records import keys
from service.records.format import text
from service.records.sync import Records
from service.records.tenancy.turns import Turns
from service.settings import Settings
from service.sockets import sockets_of
from service.store.base import Store

__all__ = ["MULTIPROC_ENV", "compute_figures", "install_metrics"]

log = logging.getLogger(__name__)

MULTIPROC_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"
# Jobs read per computation at most, newest ended ones first for the durations.
SCRAPE_JOBS_MAX: Final = 10_000
# The deployment's figures (JSON) and the lease of the process recomputing them.
SNAPSHOT_KEY: Final = f"{keys.PREFIX}:metrics:snapshot"
REFRESH_LOCK_KEY: Final = f"{keys.PREFIX}:metrics:refresh"
# A process that died computing gives up the lease after this long at most.
REFRESH_LEASE_S: Final = 300


def _jobs(records: Records) -> Iterator[JobPublic]:
    client = records.client
    count = 0
    for name in client.scan_iter(match=keys.record("job", "*"), count=1000, _type="hash"):
        job_id = text(name).removeprefix(keys.record("job", ""))
        tenant = client.hget(text(name), "tenant_id")
        if tenant is None:
            continue
        job = records.get_job(text(tenant), job_id)
        if job is not None:
            yield job
            count += 1
            if count >= SCRAPE_JOBS_MAX:
                return


def compute_figures(records: Records, store: Store, queue_name: str) -> dict[str, Any]:
    """The deployment's figures, as JSON: the expensive part (NOTE [ Cheap scrapes ])."""
    counts: dict[tuple[str, str], int] = {}
    durations: dict[tuple[str, str], list[float]] = {}
    waits: dict[str, list[float]] = {}
    oldest_queued = 0.0
    now = time.time()
    for job in _jobs(records):
        key = (job.kind, job.status.value)
        counts[key] = counts.get(key, 0) + 1
        if job.started_at is not None:
            waits.setdefault(job.kind, []).append((job.started_at - job.created_at).total_seconds())
            if job.finished_at is not None:
                durations.setdefault(key, []).append(
                    (job.finished_at - job.started_at).total_seconds()
                )
        elif job.status.value == "queued":
            oldest_queued = max(oldest_queued, now - job.created_at.timestamp())
    client = records.client
    workers = Worker.all(connection=client)
    sizes = [obj.size for obj in store.objects()]
    return {
        "computed_at": now,
        "jobs": [[kind, status, n] for (kind, status), n in sorted(counts.items())],
        "durations": [[k, s, len(v), sum(v)] for (k, s), v in sorted(durations.items())],
        "waits": [[kind, len(v), sum(v)] for kind, v in sorted(waits.items())],
        # The queue's own list and its tenants' queues (NOTE [ Fair turns ]).
        "queue_depth": sum(
            Queue(name, connection=client, serializer="json").count
            for name in [queue_name, *Turns(client).queue_names(queue_name)]
        ),
        "oldest_queued_s": oldest_queued,
        "workers": len(workers),
        "workers_busy": sum(1 for w in workers if w.get_state() == "busy"),
        "worker_busy_s": sum(float(w.total_working_time or 0) for w in workers),
        "store_bytes": sum(sizes),
        "store_objects": len(sizes),
    }


class _SnapshotCollector(Collector):
    """The deployment's figures of a snapshot, as metric families."""

    def __init__(self, figures: dict[str, Any]) -> None:
        self._figures = figures

    def collect(self) -> Iterator[Metric]:
        f = self._figures
        jobs = GaugeMetricFamily(
            "bnadapt_jobs", "jobs by kind and status", labels=["kind", "status"]
        )
        for kind, status, n in f["jobs"]:
            jobs.add_metric([kind, status], n)
        duration = SummaryMetricFamily(
            "bnadapt_job_duration_seconds", "ended jobs: start to end", labels=["kind", "status"]
        )
        for kind, status, count, total in f["durations"]:
            duration.add_metric([kind, status], count, total)
        wait = SummaryMetricFamily(
            "bnadapt_job_queue_wait_seconds", "started jobs: creation to start", labels=["kind"]
        )
        for kind, count, total in f["waits"]:
            wait.add_metric([kind], count, total)
        yield from (jobs, duration, wait)
        for name, doc, value in (
            ("bnadapt_queue_depth", "RQ jobs waiting in the queue", f["queue_depth"]),
            (
                "bnadapt_queue_oldest_wait_seconds",
                "age of the oldest queued job",
                f["oldest_queued_s"],
            ),
            ("bnadapt_workers", "RQ workers registered", f["workers"]),
            ("bnadapt_workers_busy", "RQ workers running a job now", f["workers_busy"]),
            (
                "bnadapt_worker_busy_seconds",
                "time the registered workers spent running jobs (RQ's total_working_time)",
                f["worker_busy_s"],
            ),
            ("bnadapt_store_bytes", "bytes in the artifact store", f["store_bytes"]),
            ("bnadapt_store_objects", "objects in the artifact store", f["store_objects"]),
            (
                "bnadapt_metrics_snapshot_age_seconds",
                "how long ago the figures above were computed (NOTE [ Cheap scrapes ])",
                max(0.0, time.time() - f["computed_at"]),
            ),
        ):
            yield GaugeMetricFamily(name, doc, value)


class _Snapshots:
    """Reads the deployment's snapshot and has it recomputed when stale (NOTE [ Cheap
    scrapes ])."""

    def __init__(
        self, records: Records, client: redis.asyncio.Redis, store: Store, settings: Settings
    ) -> None:
        self._records = records
        self._client = client
        self._store = store
        self._settings = settings
        self._refreshing: asyncio.Future[dict[str, Any]] | None = None

    async def current(self) -> dict[str, Any] | None:
        raw = await self._client.get(SNAPSHOT_KEY)
        figures: dict[str, Any] | None = None if raw is None else json.loads(raw)
        stale = (
            figures is None
            or time.time() - figures["computed_at"] >= self._settings.metrics_refresh_s
        )
        if stale and await self._client.set(REFRESH_LOCK_KEY, "1", nx=True, ex=REFRESH_LEASE_S):
            # Kept on self: the event loop holds tasks only weakly.
            self._refreshing = asyncio.ensure_future(anyio.to_thread.run_sync(self._refresh))
            self._refreshing.add_done_callback(_log_failure)
            if figures is None:  # the deployment's first scrape waits for it
                with contextlib.suppress(Exception):  # logged: the scrape answers without
                    figures = await self._refreshing
        return figures

    def _refresh(self) -> dict[str, Any]:
        client = self._records.client
        try:
            figures = compute_figures(self._records, self._store, self._settings.queue)
            client.set(SNAPSHOT_KEY, json.dumps(figures))
            return figures
        finally:
            client.delete(REFRESH_LOCK_KEY)


def _log_failure(refresh: asyncio.Future[dict[str, Any]]) -> None:
    if not refresh.cancelled() and (exc := refresh.exception()) is not None:
        log.warning("the deployment's metrics could not be computed: %r", exc)


def listening_addresses(port: int) -> list[str]:
    """The local addresses of this process's TCP sockets that listen on ``port``; none where
    the kernel's socket table cannot be read (not Linux)."""
    return [
        str(found.address)
        for found in sockets_of([os.getpid()])
        if found.listening and found.port == port
    ]


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def beyond_loopback(settings: Settings, port: int) -> str | None:
    """Why this API, listening on ``port``, may listen beyond loopback, as the 403 of a scrape
    without a token says it; None when it listens on loopback alone (NOTE [ Cheap scrapes ])."""
    if settings.api_host is not None and not _is_loopback(settings.api_host):
        return f"it listens on {settings.api_host}"
    observed = listening_addresses(port)
    if observed:
        beyond = sorted({address for address in observed if not _is_loopback(address)})
        return f"it listens on {', '.join(beyond)}" if beyond else None
    if settings.api_host is None:
        return "neither BNADAPT_API_HOST nor its sockets say where it listens"
    return None


def _check_scraper(request: Request, settings: Settings) -> None:
    """The scraper's credential (NOTE [ Cheap scrapes ]); 401 or 403 otherwise."""
    if settings.metrics_token is not None:
        expected = f"Bearer {settings.metrics_token.get_secret_value()}".encode()
        presented = request.headers.get("authorization", "").encode("utf-8", "replace")
        if not hmac.compare_digest(presented, expected):
            raise ApiError(
                401,
                "GET /metrics needs 'Authorization: Bearer <token>' with the token of "
                "BNADAPT_METRICS_TOKEN (an API key is not one)",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return
    # The port the request came in on names the listening socket (its address may be a
    # wildcard one, where the connection's own is loopback); what it listens on stays so.
    server = request.scope.get("server")
    port = int(server[1]) if server and server[1] is not None else 0
    state = request.app.state
    known: dict[int, str | None] | None = getattr(state, "metrics_listening", None)
    if known is None:
        known = state.metrics_listening = {}
    if port not in known:
        known[port] = beyond_loopback(settings, port)
    if known[port] is not None:
        raise ApiError(
            403,
            "GET /metrics needs BNADAPT_METRICS_TOKEN: this API may listen beyond loopback "
            f"({known[port]}), where a client on this machine may be a proxy "
            "for anyone; set BNADAPT_METRICS_TOKEN on the API and send it as "
            "'Authorization: Bearer <token>'",
        )
    host = request.client.host if request.client is not None else ""
    if not _is_loopback(host):
        raise ApiError(
            403,
            "GET /metrics answers only clients on this machine while BNADAPT_METRICS_TOKEN is "
            "not set; set it on the API and send it as 'Authorization: Bearer <token>'",
        )


def install_metrics(app: FastAPI) -> None:
    """The request-latency middleware and GET /metrics (NOTE [ Metrics across API
    processes ], NOTE [ Cheap scrapes ]); the snapshots read ``app.state`` at scrape time."""
    registry = CollectorRegistry()
    multiproc = bool(os.environ.get(MULTIPROC_ENV))
    latency = Histogram(
        "bnadapt_http_request_duration_seconds",
        "API request latency by route",
        ["method", "route", "status"],
        registry=None if multiproc else registry,
    )

    app.add_middleware(_LatencyMiddleware, latency=latency)

    @app.get("/metrics", include_in_schema=False)
    async def metrics(request: Request) -> Response:
        state = request.app.state
        _check_scraper(request, state.settings)
        snapshots: _Snapshots | None = getattr(state, "metric_snapshots", None)
        if snapshots is None:
            snapshots = state.metric_snapshots = _Snapshots(
                state.records, state.async_records.client, state.store, state.settings
            )
        scrape = CollectorRegistry()
        if multiproc:
            MultiProcessCollector(scrape)  # type: ignore[no-untyped-call]
        else:
            scrape.register(_Registered(registry))
        figures = await snapshots.current()
        if figures is not None:
            scrape.register(_SnapshotCollector(figures))
        return Response(generate_latest(scrape), media_type=CONTENT_TYPE_LATEST)


class _LatencyMiddleware:
    """Observes each HTTP request's latency, to its response's first message, by method, route
    template and status. A plain ASGI middleware: Starlette's ``BaseHTTPMiddleware`` (what
    ``@app.middleware`` builds) runs every request in a task group behind a stream and cost
    the API about a third of its status reads per second."""

    def __init__(self, app: ASGIApp, latency: Histogram) -> None:
        self._app = app
        self._latency = latency

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        start = time.perf_counter()
        observed = False

        def observe(status: int) -> None:
            nonlocal observed
            observed = True
            route = scope.get("route")  # set by the router once it matched
            path = getattr(route, "path", None) or "unmatched"
            self._latency.labels(scope["method"], path, str(status)).observe(
                time.perf_counter() - start
            )

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start" and not observed:
                observe(int(message["status"]))
            await send(message)

        try:
            await self._app(scope, receive, timed_send)
        finally:
            if not observed:  # raised before answering: the server answers 500
                observe(500)


class _Registered(Collector):
    """This process's own metrics, inside a scrape's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        yield from self._registry.collect()
