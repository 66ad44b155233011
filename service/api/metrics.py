"""Prometheus metrics at GET /metrics.

NOTE [ Metrics across API processes ]
The API runs as several uvicorn processes; a scrape reaches one of them. What describes the
deployment (jobs by kind and status, queue depth and wait, job durations, workers and their
busy time, store bytes) is therefore computed from Redis and the store at scrape time, the same
whichever process answers. What each process sees alone (request latency by route) is a
prometheus_client histogram; with ``PROMETHEUS_MULTIPROC_DIR`` set (``bnadapt up`` and
``bnadapt api`` set it to a fresh directory under the data directory), prometheus_client keeps
every process's values in files there and a scrape sums them.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Final

from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector
from rq import Queue, Worker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api_schemas import JobPublic
from service.records import keys
from service.records.format import text
from service.records.sync import Records
from service.records.turns import Turns
from service.store.base import Store

__all__ = ["MULTIPROC_ENV", "install_metrics"]

MULTIPROC_ENV: Final = "PROMETHEUS_MULTIPROC_DIR"
# Jobs read per scrape at most, newest ended ones first for the durations.
SCRAPE_JOBS_MAX: Final = 10_000


class _DeploymentCollector(Collector):
    """The gauges and summaries computed from Redis and the store at scrape time."""

    def __init__(self, records: Records, store: Store, queue_name: str) -> None:
        self._records = records
        self._store = store
        self._queue_name = queue_name

    def _jobs(self) -> Iterator[JobPublic]:
        client = self._records.client
        count = 0
        for name in client.scan_iter(match=keys.record("job", "*"), count=1000, _type="hash"):
            job_id = text(name).removeprefix(keys.record("job", ""))
            tenant = client.hget(text(name), "tenant_id")
            if tenant is None:
                continue
            job = self._records.get_job(text(tenant), job_id)
            if job is not None:
                yield job
                count += 1
                if count >= SCRAPE_JOBS_MAX:
                    return

    def collect(self) -> Iterator[Metric]:
        jobs = GaugeMetricFamily(
            "bnadapt_jobs", "jobs by kind and status", labels=["kind", "status"]
        )
        duration = SummaryMetricFamily(
            "bnadapt_job_duration_seconds", "ended jobs: start to end", labels=["kind", "status"]
        )
        wait = SummaryMetricFamily(
            "bnadapt_job_queue_wait_seconds", "started jobs: creation to start", labels=["kind"]
        )
        counts: dict[tuple[str, str], int] = {}
        durations: dict[tuple[str, str], list[float]] = {}
        waits: dict[str, list[float]] = {}
        oldest_queued = 0.0
        now = time.time()
        for job in self._jobs():
            key = (job.kind, job.status.value)
            counts[key] = counts.get(key, 0) + 1
            if job.started_at is not None:
                waits.setdefault(job.kind, []).append(
                    (job.started_at - job.created_at).total_seconds()
                )
                if job.finished_at is not None:
                    durations.setdefault(key, []).append(
                        (job.finished_at - job.started_at).total_seconds()
                    )
            elif job.status.value == "queued":
                oldest_queued = max(oldest_queued, now - job.created_at.timestamp())
        for (kind, status), n in sorted(counts.items()):
            jobs.add_metric([kind, status], n)
        for (kind, status), values in sorted(durations.items()):
            duration.add_metric([kind, status], len(values), sum(values))
        for kind, values in sorted(waits.items()):
            wait.add_metric([kind], len(values), sum(values))
        yield from (jobs, duration, wait)

        client = self._records.client
        # The queue's own list and its tenants' queues (NOTE [ Fair turns ]).
        names = [self._queue_name, *Turns(client).queue_names(self._queue_name)]
        depth = sum(Queue(name, connection=client, serializer="json").count for name in names)
        yield GaugeMetricFamily("bnadapt_queue_depth", "RQ jobs waiting in the queue", depth)
        yield GaugeMetricFamily(
            "bnadapt_queue_oldest_wait_seconds", "age of the oldest queued job", oldest_queued
        )
        workers = Worker.all(connection=client)
        yield GaugeMetricFamily("bnadapt_workers", "RQ workers registered", len(workers))
        yield GaugeMetricFamily(
            "bnadapt_workers_busy",
            "RQ workers running a job now",
            sum(1 for w in workers if w.get_state() == "busy"),
        )
        yield GaugeMetricFamily(
            "bnadapt_worker_busy_seconds",
            "time the registered workers spent running jobs (RQ's total_working_time)",
            sum(float(w.total_working_time or 0) for w in workers),
        )
        sizes = [obj.size for obj in self._store.objects()]
        yield GaugeMetricFamily("bnadapt_store_bytes", "bytes in the artifact store", sum(sizes))
        yield GaugeMetricFamily(
            "bnadapt_store_objects", "objects in the artifact store", len(sizes)
        )


def install_metrics(app: FastAPI) -> None:
    """The request-latency middleware and GET /metrics (NOTE [ Metrics across API
    processes ]); the deployment collector reads ``app.state`` at scrape time."""
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
    def metrics() -> Response:
        scrape = CollectorRegistry()
        if multiproc:
            MultiProcessCollector(scrape)  # type: ignore[no-untyped-call]
        else:
            scrape.register(_Registered(registry))
        scrape.register(
            _DeploymentCollector(app.state.records, app.state.store, app.state.settings.queue)
        )
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
