"""One RQ worker process: takes jobs from the queue and runs each in a forked child.

torch and the job code are imported here, before the first fork, so each job starts in
milliseconds instead of re-importing torch; nothing here runs a torch op or touches CUDA,
which would not survive the fork (a CUDA context created before fork is unusable in the
child).
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import socket
import threading
import time
from collections.abc import Iterable
from typing import Any, Final

import redis
import torch
from redis import Redis
from rq import Queue, Worker
from rq.exceptions import DequeueTimeout
from rq.executions import Execution
from rq.job import Job
from rq.registry import StartedJobRegistry
from rq.worker import WorkerStatus

from api_schemas import JobStatus
from service.log_format import configure_logging
from service.records.connection import redis_client
from service.records.job_life.capacity import WorkerMemory
from service.records.job_life.dequeues import DequeueHolds
from service.records.sync import Records
from service.records.tenancy.turns import Turns
from service.settings import DEVICE_CLASSES, Settings, get_settings
from service.store import open_store
from service.upkeep.parent_death import SUPERVISOR_PID_ENV, die_with_supervisor
from service.upkeep.reaper import heartbeat_key_ttl_s
from workers.faults import stop_at
from workers.models.architectures import registry
from workers.running.capacity import (
    PUBLISH_INTERVAL_S,
    PUBLISH_TTL_S,
    killed_for_its_own_reasons,
    offered_memory,
    oom_kills,
)
from workers.running.job import load_runners
from workers.running.loading import WORKER_DEVICE_ENV
from workers.sharding.jobs import fail_killed_child

__all__ = ["TurnQueue", "main"]

log = logging.getLogger(__name__)


# What a job function returned as its "status" for which RQ's "Job OK" line is true; for any
# other (canceled, failed elsewhere, queued again) the line names the status instead.
_OK_OUTCOMES = frozenset({"succeeded", "running", "done", "skipped"})

# How often the worker refreshes what it holds (NOTE [ Dequeued and lost ]).
HOLDS_BEAT_S: Final = 0.5
# An idle worker looks for work at least this often besides when a bell rings (NOTE [ Fair
# turns ]): jobs that RQ itself puts back in a queue (a sharded job's children once their
# dependencies end, RQ's retries) ring none.
TURN_POLL_S: Final = 1.0


class TurnQueue(Queue):
    """RQ's queue, but a worker's dequeue takes the next job by the tenants' turns of its
    device queues (NOTE [ Fair turns ] in service/records/tenancy/turns.py) instead of popping the
    queues' own lists in order."""

    @classmethod
    def dequeue_any(
        cls,
        queues: Iterable[Queue],
        timeout: int | None,
        connection: Redis,
        job_class: type[Job] | None = None,
        serializer: Any = None,
        death_penalty_class: Any = None,
    ) -> tuple[Job, Queue] | None:
        bases = [queue.name for queue in queues]
        turns = Turns(connection)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            taken = turns.take(bases)
            if taken is None:
                if deadline is None:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DequeueTimeout(timeout, [queue.key for queue in queues])
                turns.wait(bases, min(left, TURN_POLL_S))
                continue
            name, rq_id = taken
            found = cls._fetch_dequeued_job(
                connection,
                f"{cls.redis_queue_namespace_prefix}{name}",
                rq_id,
                job_class=job_class,
                serializer=serializer,
                death_penalty_class=death_penalty_class,
            )
            if found is not None:  # else its RQ job is gone: take the next
                return found


class _Worker(Worker):
    """RQ's worker, which records the job it took from its queue until it is done with it
    (NOTE [ Dequeued and lost ] in service/upkeep/reaper.py), and whose log says how a bnadapt
    job ended: RQ logs "Job OK" whenever the function returned, which for a canceled job read
    as if it had succeeded."""

    outcome: str | None = None
    oom_kills_before: int | None = None
    records: Records
    holds: DequeueHolds
    holds_ttl_s: float
    _held: str | None = None
    _held_lock: threading.Lock

    def __init__(self, *args: Any, records: Records, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.records = records

    def handle_work_horse_killed(
        self, job: Job, pid: int, status: int, usage: resource.struct_rusage
    ) -> None:
        """The job's process died without raising (out of memory, a signal): fails the record
        now rather than when the reaper notices the missing heartbeat."""
        super().handle_work_horse_killed(job, pid, status, usage)  # type: ignore[no-untyped-call]
        how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"status {status}"
        error = (
            f"the job's process died ({how}; max RSS {usage.ru_maxrss} KiB); it may have run "
            "out of memory: try a smaller batch_size, or a machine with more memory"
        )
        if fail_killed_child(self.records, job.func_name, job.args, error, job.retries_left):
            return
        # Queued too: the process may die after the fork, before it marks itself running.
        # The RQ id is the job id's, or that of a later attempt (NOTE [ Job attempts ]).
        job_id = str(job.args[0]["job_id"]) if job.args else job.id
        own = killed_for_its_own_reasons(status, job.started_at, job.timeout, self.oom_kills_before)
        if own is not None:  # killed for memory or its timeout: not retried
            self.records.mark_finished(job_id, JobStatus.FAILED, error=own)
            return
        self.records.interrupt(job_id, (JobStatus.QUEUED, JobStatus.RUNNING), error, rq_id=job.id)

    def start_holds(self, holds: DequeueHolds, ttl_s: float) -> None:
        """Starts the thread that keeps ``keys.rq_worker_holds`` of this worker alive (over
        a client of its own: the forked job processes inherit the main thread's)."""
        self.holds = holds
        self.holds_ttl_s = ttl_s
        self._held_lock = threading.Lock()
        holds.beat(self.name, None, ttl_s)
        threading.Thread(target=self._beat_holds, name="rq-worker-holds", daemon=True).start()

    def _beat_holds(self) -> None:
        failing = False
        while True:
            try:
                with self._held_lock:
                    self.holds.beat(self.name, self._held, self.holds_ttl_s)
                failing = False
            except Exception:  # Redis away: the next beat tries again; logged once an outage
                log.warning(
                    "could not refresh what worker %s holds", self.name, exc_info=not failing
                )
                failing = True
            time.sleep(HOLDS_BEAT_S)

    def dequeue_job_and_maintain_ttl(
        self, timeout: int | None, max_idle_time: int | None = None
    ) -> tuple[Job, Queue] | None:
        result = super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
        if result is not None:
            stop_at("taken", result[0].id)  # for tests (workers/faults.py)
            with self._held_lock:
                self._held = result[0].id
                self.holds.hold(self.name, result[0].id, self.holds_ttl_s)
            stop_at("held", result[0].id)
        return result

    def clean_registries(self) -> None:
        # RQ's maintenance cleans the registries of the queues a worker serves; its jobs run
        # from the tenants' queues of those (NOTE [ Fair turns ]), whose registries (finished,
        # failed, started...) would otherwise grow without end: they are cleaned alike.
        serving = self.queues
        turns = Turns(self.connection)
        owned = [name for queue in serving for name in turns.queue_names(queue.name)]
        self.queues = [
            *serving,
            *(TurnQueue(name, connection=self.connection, serializer="json") for name in owned),
        ]
        try:
            super().clean_registries()  # type: ignore[no-untyped-call]  # RQ: untyped
        finally:
            self.queues = serving

    def prepare_execution(self, job: Job) -> Execution:
        execution = super().prepare_execution(job)
        stop_at("execution", job.id)
        return execution

    def execute_job(self, job: Job, queue: Queue) -> None:
        self.oom_kills_before = oom_kills()  # to tell an out-of-memory kill (capacity.py)
        try:
            super().execute_job(job, queue)
        finally:
            with self._held_lock:
                self._held = None
                self.holds.release(self.name, job.id, self.holds_ttl_s)

    def handle_job_success(
        self,
        job: Job,
        queue: Queue,
        started_job_registry: StartedJobRegistry,
        execution: Execution,
    ) -> None:
        # RQ logs "Job OK" right after this returns, in the job's process (forked for this one
        # job: the outcome never outlives it). The return value is read back from the result
        # RQ just saved, RQ's public way to it; only a log line depends on it, so a failed
        # read leaves the line as RQ wrote it rather than failing a job that succeeded.
        super().handle_job_success(job, queue, started_job_registry, execution)
        try:
            returned = job.return_value()
        except redis.RedisError:
            returned = None
        status = returned.get("status") if isinstance(returned, dict) else None
        self.outcome = None if status is None else str(status)


class _OutcomeFilter(logging.Filter):
    def __init__(self, worker: _Worker) -> None:
        super().__init__()
        self._worker = worker

    def filter(self, record: logging.LogRecord) -> bool:
        outcome = self._worker.outcome
        if (
            outcome is not None
            and outcome not in _OK_OUTCOMES
            and isinstance(record.args, tuple)
            and any("Job OK" in str(arg) for arg in record.args)
        ):
            record.args = tuple(
                f"job ended {outcome}" if "Job OK" in str(arg) else arg for arg in record.args
            )
        return True


# When its supervisor dies the worker gets SIGTERM (die_with_supervisor) and RQ's warm shutdown
# tears it down: it registers its death and leaves its pub/sub channel. That teardown was seen
# to hang past a minute once in the test suite's kills, after "unsubscribing from channel"
# (the handler raises StopRequested wherever the main thread is, a Redis call included). An
# orphan must end all the same: once its supervisor is gone and it has been idle this long,
# it exits (the reaper handles what it leaves, as for any lost worker).
ORPHAN_GRACE_S: Final = 15.0


def _end_when_orphaned(worker: Worker, supervisor_pid: int) -> None:
    """Daemon thread: exit once the supervisor is gone and ``worker`` idle for ORPHAN_GRACE_S
    (a job at hand is finished first, as the warm shutdown does)."""
    idle_since: float | None = None
    while True:
        time.sleep(1.0)
        if os.getppid() == supervisor_pid:
            continue
        if worker.get_state() == WorkerStatus.BUSY:
            idle_since = None
            continue
        idle_since = idle_since if idle_since is not None else time.monotonic()
        if time.monotonic() - idle_since >= ORPHAN_GRACE_S:
            log.warning("supervisor gone and shutdown not done in %.0f s: exiting", ORPHAN_GRACE_S)
            logging.shutdown()
            os._exit(1)


def _publish_memory(published: WorkerMemory, queues: list[str], name: str, memory: int) -> None:
    """Daemon thread: keeps this worker's memory published for its queues while it lives."""
    while True:
        try:
            published.publish(queues, name, memory, PUBLISH_TTL_S)
        except Exception:  # Redis away: the next round tries again
            log.warning("could not publish worker %s's memory", name, exc_info=True)
        time.sleep(PUBLISH_INTERVAL_S)


def main() -> None:
    args = _arguments()
    die_with_supervisor()  # `bnadapt worker` killed: finish the job at hand, then exit
    os.environ[WORKER_DEVICE_ENV] = args.device
    settings = get_settings()
    configure_logging("worker", settings.log_format)
    client = redis_client(settings.redis_url)
    records = Records(client)
    _load_before_forks(settings)
    names = _queue_names(settings, args.device_class or args.device.partition(":")[0])
    worker = _Worker(
        [TurnQueue(name, connection=client, serializer="json") for name in names],
        name=f"bnadapt-{socket.gethostname()}-{os.getpid()}",
        connection=client,
        serializer="json",
        queue_class=TurnQueue,
        records=records,
    )
    worker.log.addFilter(_OutcomeFilter(worker))
    memory = offered_memory(settings.worker_memory_bytes, args.device)
    if memory is not None:  # NOTE [ Activation estimate ] in service/jobs/submission.py
        threading.Thread(
            target=_publish_memory,
            args=(WorkerMemory(redis_client(settings.redis_url)), names, worker.name, memory),
            name="rq-worker-memory",
            daemon=True,
        ).start()
    worker.start_holds(
        DequeueHolds(redis_client(settings.redis_url)),
        heartbeat_key_ttl_s(settings.heartbeat_timeout_s),  # NOTE [ Heartbeat bound ]
    )
    supervisor = os.environ.get(SUPERVISOR_PID_ENV)
    if supervisor is not None:
        threading.Thread(
            target=_end_when_orphaned, args=(worker, int(supervisor)), daemon=True
        ).start()
    worker.work(burst=args.burst, logging_level="INFO")


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Run one bnadapt RQ worker.")
    parser.add_argument("--device", default=os.environ.get(WORKER_DEVICE_ENV, "auto"))
    parser.add_argument(
        "--device-class",
        choices=DEVICE_CLASSES,
        default=None,
        help="serve the jobs that ask for this device class besides `auto` ones (default: "
        "from --device; `auto` there serves only `auto` jobs)",
    )
    parser.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    return parser.parse_args()


def _load_before_forks(settings: Settings) -> None:
    """What every forked job would otherwise build for itself, built once here and
    inherited: no torch op runs, no model is built, no connection is opened."""
    if settings.worker_threads is not None:
        torch.set_num_threads(settings.worker_threads)  # a setting, no op: survives the fork
    # Scanning the architectures' entry points is part of each job's load time otherwise
    # (bench/history/2026-12-02-service.md, "Architecture registry").
    registry()
    load_runners()  # likewise the job kinds' modules, and torch with them
    # Likewise the store's clients (on S3, boto3's model and the job's client): no request, no
    # connection to inherit.
    open_store(settings).warm_up()


def _queue_names(settings: Settings, device_class: str) -> list[str]:
    """NOTE [ Queues by device ] in service/settings.py: first the jobs that need this class,
    then those that run anywhere."""
    names = [settings.queue]
    if device_class in DEVICE_CLASSES:
        names.insert(0, settings.job_queue(device_class))
    return names


if __name__ == "__main__":
    main()
