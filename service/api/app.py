"""The HTTP API: ``create_app(settings)`` builds it; nothing is created at import time.

Run it with ``uvicorn --factory service.api.app:create_app`` or ``bnadapt api``.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, Final

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from pydantic import TypeAdapter
from rq import Queue

from api_schemas import EpochEvent, JobCreate, Problem, ProblemItem
from service.api.edge import EdgeMiddleware
from service.api.metrics import install_metrics
from service.api.offload import HeavyWork, lower_process_priority
from service.api.problems import install_problem_handlers, problem_responses
from service.api.routes import (
    architectures,
    datasets,
    direct_uploads,
    health,
    jobs,
    models,
    uploads,
)
from service.log_format import configure_logging
from service.records.aio import AsyncRecords, async_redis_client
from service.records.connection import redis_client
from service.records.sync import Records
from service.records.tenancy.quotas import AsyncTenantQuotas
from service.settings import Settings, get_settings
from service.store import open_store
from service.upkeep.housekeeping import Housekeeping
from service.upkeep.parent_death import die_with_parent

__all__ = ["create_app"]

VERSION: Final = "0.1.0"
HOUSEKEEPING_INTERVAL_S: Final = 5.0
_REF: Final = "#/components/schemas/{model}"
# Swagger UI's files (swagger-ui-dist, Apache-2.0: LICENSE and NOTICE beside them), served by
# the API itself: /docs works without the internet.
STATIC_DIR: Final = Path(__file__).resolve().parent / "static"
# The web UI: plain HTML, CSS and JavaScript, no build step (service/api/ui/).
UI_DIR: Final = Path(__file__).resolve().parent / "ui"


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    if settings.log_format == "json":
        # uvicorn configured its loggers before it called this factory (in each of its
        # processes): they now write JSON too. Text mode keeps uvicorn's lines as they are.
        configure_logging("api", "json", logging.WARNING)
    app = FastAPI(
        title="bnadapt",
        version=VERSION,
        summary="Train and BatchNorm-adapt PyTorch models with exact running statistics.",
        lifespan=partial(_lifespan, settings=settings),
        docs_url=None,
        redoc_url=None,
    )
    _add_pages(app)
    install_problem_handlers(app)
    _include_routers(app)
    # Inside the latency middleware (added by install_metrics): its 401s and 413s are timed.
    app.add_middleware(EdgeMiddleware, settings=settings)
    install_metrics(app)
    _add_problem_schema(app)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI, settings: Settings) -> AsyncIterator[None]:
    """Opens what the routes share (``app.state``: records, store, queue, the heavy-work
    threads) and the housekeeping thread for as long as the app serves, and closes them."""
    parent = multiprocessing.parent_process()
    if parent is not None and parent.pid is not None:
        # A worker of `uvicorn --workers N`: when the parent dies (even by SIGKILL), shut
        # down gracefully instead of serving the port on for nobody.
        die_with_parent(signal.SIGTERM, parent.pid)
    # Before the API's own threads start (they take the priority of the thread that starts
    # them); threads already running are lowered one by one.
    lower_process_priority(settings.api_nice)
    client = redis_client(settings.redis_url)
    records = Records(client)
    app.state.settings = settings
    app.state.records = records
    app.state.store = open_store(settings)
    app.state.heavy_work = HeavyWork(
        settings.api_copy_threads, settings.api_copy_nice, settings.api_copy_tenant_threads
    )
    app.state.queue = Queue(settings.queue, connection=client, serializer="json")
    async_client = async_redis_client(settings.redis_url)
    app.state.async_records = AsyncRecords(async_client)
    app.state.async_quotas = AsyncTenantQuotas(async_client)
    housekeeping = Housekeeping(records, app.state.store, settings, HOUSEKEEPING_INTERVAL_S)
    housekeeping.start()
    try:
        yield
    finally:
        housekeeping.stop()
        app.state.heavy_work.close()
        client.close()
        await async_client.aclose()


def _add_pages(app: FastAPI) -> None:
    """The pages for people, left out of the OpenAPI document: the web UI (``/`` and
    ``/dashboard`` lead to it) and Swagger UI at ``/docs``, both from the API's own files."""
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.mount("/ui", StaticFiles(directory=UI_DIR, html=True), name="ui")

    @app.get("/", include_in_schema=False)
    @app.get("/dashboard", include_in_schema=False)
    async def to_ui() -> RedirectResponse:
        return RedirectResponse("/ui/")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="bnadapt API",
            swagger_js_url="/static/swagger-ui/swagger-ui-bundle.js",
            swagger_css_url="/static/swagger-ui/swagger-ui.css",
            swagger_favicon_url="/static/swagger-ui/favicon-32x32.png",
            swagger_ui_parameters={"persistAuthorization": False},
        )


def _include_routers(app: FastAPI) -> None:
    """One router per resource. Every error a route can answer is in the OpenAPI document, as
    application/problem+json (422 replaces FastAPI's own, whose body is not the one the API
    sends)."""
    app.include_router(health.router, responses=problem_responses(503))
    for router in (
        architectures.router,
        models.router,
        datasets.router,
        uploads.router,
        jobs.router,
        direct_uploads.router,
    ):
        app.include_router(
            router, responses=problem_responses(400, 401, 404, 409, 413, 422, 429, 503)
        )


def _add_problem_schema(app: FastAPI) -> None:
    """Puts the ``Problem`` schema that :func:`problem_responses` refers to into the document
    (no route returns it as its model, so FastAPI would leave it out), and ``EpochEvent``, the
    data of the events stream's ``epoch`` events (NOTE [ Job events ])."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = build()
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            problem = Problem.model_json_schema(ref_template=_REF)
            problem.pop("$defs", None)  # ProblemItem: its own entry, next
            schemas.setdefault("Problem", problem)
            schemas.setdefault("ProblemItem", ProblemItem.model_json_schema(ref_template=_REF))
            schemas.setdefault("EpochEvent", EpochEvent.model_json_schema(ref_template=_REF))
            # POST /v1/jobs reads its body itself (strict parsing); its schema is the kinds'
            # union, with the discriminator, for clients and generators.
            job_create = TypeAdapter(JobCreate).json_schema(ref_template=_REF)
            for name, schema in job_create.pop("$defs", {}).items():
                schemas.setdefault(name, schema)
            schemas.setdefault("JobCreate", job_create)
            _mark_binary_files(schemas)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _mark_binary_files(node: Any) -> None:
    """Adds ``format: binary`` beside ``contentMediaType: application/octet-stream`` (how
    FastAPI describes an ``UploadFile`` form field under OpenAPI 3.1): generators that read the
    3.0 spelling only (openapi-python-client among them) otherwise take the field for text and
    send a file's bytes as a string. Both spellings are valid 3.1."""
    if isinstance(node, dict):
        if node.get("contentMediaType") == "application/octet-stream" and node.get("type") == (
            "string"
        ):
            node.setdefault("format", "binary")
        for value in node.values():
            _mark_binary_files(value)
    elif isinstance(node, list):
        for value in node:
            _mark_binary_files(value)
