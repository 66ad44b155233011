"""Which RQ queue a job waits in, and what it shows while it waits there (NOTE [ Queues by
device ] in service/settings.py, NOTE [ Fair turns ] in service/records/tenancy/turns.py)."""

from __future__ import annotations

from rq import Queue

from api_schemas import Progress, utc_now
from service.records.tenancy.turns import turn_queue
from service.settings import Settings

__all__ = ["job_queue", "tenant_queue", "waiting_progress"]


def job_queue(default: Queue, settings: Settings, device: str) -> Queue:
    """The queue of a job asking for ``device``; ``default`` (the API's queue of ``auto`` jobs)
    lends its connection to the others."""
    name = settings.job_queue(device)
    if name == default.name:
        return default
    return Queue(name, connection=default.connection, serializer="json")


def tenant_queue(
    default: Queue, settings: Settings, device: str, tenant: str, priority: int
) -> Queue:
    """The queue a job of ``tenant`` and ``priority`` asking for ``device`` waits in: its
    tenant's, in the turns of its device's queue."""
    return turn_queue(default.connection, settings.job_queue(device), tenant, priority)


def waiting_progress(device: str) -> Progress | None:
    """What a job shows until a worker takes it: for a job that asked for a device class,
    that it waits for a worker of that class."""
    device_class = device.partition(":")[0]
    if device_class == "auto":
        return None
    return Progress(
        done=0,
        total=0,
        unit="batches",
        samples_per_second=0.0,
        phase=f"waiting for a {device_class} worker",
        updated_at=utc_now(),
    )
