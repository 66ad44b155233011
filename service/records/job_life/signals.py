"""What a running job's process and the rest of the service tell each other through Redis:
the job's heartbeat (``keys.job_heartbeat``: its process lives), its progress
(``keys.job_progress``, what ``GET /v1/jobs/{id}`` shows) and its cancel flag
(``keys.job_cancel``, polled by the job's loop) and a train job's validated epochs
(``keys.job_epochs``, the events stream's ``epoch`` events: NOTE [ Job events ] in
service/api/routes/jobs.py). The reaper reads the heartbeats (NOTE [ Heartbeat bound ] in
service/upkeep/reaper.py)."""

from __future__ import annotations

from api_schemas import EpochEvent, Progress
from service.records import keys
from service.records.base import RedisRecords

__all__ = ["JobSignals"]


class JobSignals(RedisRecords):
    """Heartbeats, progress and cancel requests of running jobs (of a sharded job's children
    too, under their RQ ids)."""

    def beat(self, job_id: str, ttl_s: float) -> None:
        self.client.set(keys.job_heartbeat(job_id), "1", px=int(ttl_s * 1000))

    def heartbeat_alive(self, job_id: str) -> bool:
        return bool(self.client.exists(keys.job_heartbeat(job_id)))

    def write_progress(self, job_id: str, progress: Progress) -> None:
        self.client.set(keys.job_progress(job_id), progress.model_dump_json())

    def publish_epoch(self, job_id: str, event: EpochEvent) -> None:
        self.client.hset(keys.job_epochs(job_id), str(event.epoch), event.model_dump_json())

    def request_cancel(self, job_id: str) -> None:
        self.client.set(keys.job_cancel(job_id), "1")

    def cancel_requested(self, job_id: str) -> bool:
        return bool(self.client.exists(keys.job_cancel(job_id)))
