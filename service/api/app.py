"""The HTTP API: ``create_app(settings)`` builds it; nothing is created at import time.

Run it with ``uvicorn --factory service.api.app:create_app`` or ``bnadapt api``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Final

from fastapi import FastAPI
from rq import Queue

from service.api.problems import install_problem_handlers
from service.api.routes import architectures, datasets, health, jobs, models, uploads
from service.records.aio import AsyncRecords, async_redis_client
from service.records.connection import redis_client
from service.records.sync import Records
from service.settings import Settings, get_settings
from service.store import open_store
from service.upkeep.housekeeping import Housekeeping

__all__ = ["create_app"]

VERSION: Final = "0.1.0"
HOUSEKEEPING_INTERVAL_S: Final = 5.0


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = redis_client(settings.redis_url)
        records = Records(client)
        app.state.settings = settings
        app.state.records = records
        app.state.store = open_store(settings)
        app.state.queue = Queue(settings.queue, connection=client, serializer="json")
        async_client = async_redis_client(settings.redis_url)
        app.state.async_records = AsyncRecords(async_client)
        housekeeping = Housekeeping(records, app.state.store, settings, HOUSEKEEPING_INTERVAL_S)
        housekeeping.start()
        try:
            yield
        finally:
            housekeeping.stop()
            client.close()
            await async_client.aclose()

    app = FastAPI(
        title="bnadapt",
        version=VERSION,
        summary="Train and BatchNorm-adapt PyTorch models with exact running statistics.",
        lifespan=lifespan,
    )
    install_problem_handlers(app)
    for router in (
        health.router,
        architectures.router,
        models.router,
        datasets.router,
        jobs.router,
        uploads.router,
    ):
        app.include_router(router)
    return app
