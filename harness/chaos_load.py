"""Chaos under load: a stream of jobs submitted with Idempotency-Keys while processes of every
kind are killed at random moments (harness/chaos.py runs one job per fault instead). Used by
bench/service/chaos.py ``--jobs`` (large N) and tests/e2e/chaos/test_chaos.py (small N).

Kill kinds (SIGKILL unless said otherwise):

- ``job``: a job's process at a random moment of its run;
- ``job-fork``: a job's process within a millisecond or so of RQ forking it, before the job
  can mark itself running (the fork window);
- ``rq-worker``: an RQ worker process (its job process dies with it; the supervisor starts a
  new RQ worker);
- ``supervisor``: a worker's supervisor alone (its RQ worker finishes the job in hand and
  exits; a new supervisor is started);
- ``worker-tree``: a whole worker (supervisor, RQ worker, inspector and job process at once:
  a machine lost), then a new one;
- ``api``: the API while submissions stream in; the submitters retry every unanswered
  submission with the same Idempotency-Key, and re-send answered ones, which must name the
  same job;
- ``redis``: the Redis-compatible server, restarted on the same AOF after ``OUTAGE_S``.

The verdict (:class:`LoadTally`): every key names one job (0 duplicated), every answered key's
job exists (0 lost), every job ended (0 stuck) succeeded with exactly one model, and for each
interrupted attempt the seconds from the kill before it to the attempt's end.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Final

import httpx

from api_schemas import JobStatus
from harness.answers import created
from harness.digits import digits_npz
from harness.stack import Client, Stack
from service.client import Client as ApiClient
from service.local.embedded import RedisServer
from service.records import keys
from service.records.job_life.shards import ShardRecords

__all__ = ["KILL_KINDS", "LoadTally", "run_load_chaos"]

KILL_KINDS: Final = ("job", "job-fork", "rq-worker", "supervisor", "worker-tree", "api")
OUTAGE_S: Final = 3.0
TERMINAL: Final = frozenset({"succeeded", "failed", "canceled"})


@dataclass
class LoadTally:
    jobs: int = 0
    kills: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    stuck: list[str] = field(default_factory=list)
    model_problems: list[str] = field(default_factory=list)
    interrupted_jobs: int = 0
    retries: int = 0
    resent_same_key: int = 0
    # Runs of sharded jobs' children beyond the first (NOTE [ Retried children ]).
    child_reruns: int = 0
    # Seconds from a kill to the end of an attempt it interrupted, per kill kind.
    seconds_to_attempt_end: dict[str, list[float]] = field(default_factory=dict)
    # Seconds from the kill to the interrupted job's terminal status (its rerun included).
    seconds_to_terminal: dict[str, list[float]] = field(default_factory=dict)
    # Redis kills: seconds from the kill until the restarted server answered (the outage), and
    # from then to the end of each attempt the kill interrupted (the bound there is T, NOTE
    # [ Heartbeat bound ]: heartbeats lost to an outage count only a TTL after Redis is back).
    redis_outage_s: list[float] = field(default_factory=list)
    seconds_after_redis_back: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    wall_s: float = 0.0


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(p) for p in f.read().split()]
    except (FileNotFoundError, ProcessLookupError):
        pass
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def _kill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


class _Chaos:
    def __init__(self, stack: Stack, jobs: int, kills: int, redis_kills: int, seed: int) -> None:
        self.stack = stack
        self.n_jobs = jobs
        self.rng = random.Random(seed)
        schedule = [KILL_KINDS[i % len(KILL_KINDS)] for i in range(kills)]
        self.rng.shuffle(schedule)
        # Redis kills spread over the run, between the others.
        for i in range(redis_kills):
            schedule.insert((i + 1) * len(schedule) // (redis_kills + 1), "redis")
        self.schedule = schedule
        self.tally = LoadTally(jobs=jobs)
        self.kill_times: list[tuple[float, str]] = []  # (wall time, kind)
        self.redis_back: dict[float, float] = {}  # a Redis kill's wall time -> when it answered
        self.answered: dict[str, str] = {}  # Idempotency-Key -> job id
        self.lock = threading.Lock()
        self.done_submitting = threading.Event()
        self.api_lock = threading.Lock()  # held while the API is down for a restart
        self.submitted = 0

    # --- workers -----------------------------------------------------------------------------

    def _workers(self) -> list[int]:
        procs = [self.stack.worker, *self.stack.more_workers]
        return [p.pid for p in procs if p is not None]

    def _rq_worker(self, supervisor: int) -> int | None:
        for child in _children(supervisor):
            if "workers.processes.rq_worker" in _cmdline(child):
                return child
        return None

    def _replace_worker(self, supervisor: int) -> None:
        """The supervisor ``supervisor`` is dead: wait for it and start a new worker in its
        place."""
        if self.stack.worker is not None and self.stack.worker.pid == supervisor:
            self.stack.worker.wait()
            self.stack.worker = self.stack._spawn_worker()
        else:
            for i, proc in enumerate(self.stack.more_workers):
                if proc.pid == supervisor:
                    proc.wait()
                    self.stack.more_workers[i] = self.stack._spawn_worker()

    def _busy_horse(self, timeout_s: float = 60) -> tuple[int, int] | None:
        """(supervisor, job process) of a worker running a job."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.done_submitting.is_set():
            sups = self._workers()
            self.rng.shuffle(sups)
            for sup in sups:
                rq = self._rq_worker(sup)
                if rq is not None:
                    horses = _children(rq)
                    if horses:
                        return sup, horses[0]
            time.sleep(0.01)
        return None

    # --- kills -------------------------------------------------------------------------------

    def _record(self, kind: str) -> None:
        print(f"{time.strftime('%H:%M:%S')} kill {kind} at job {self.submitted}", flush=True)
        with self.lock:
            self.kill_times.append((time.time(), kind))
            self.tally.kills[kind] += 1

    def kill(self, kind: str) -> bool:
        if kind == "job":
            found = self._busy_horse()
            if found is None:
                return False
            # A random moment of its run: the jobs here live 0.1-1 s, so a short wait (a
            # longer one often found the job ended, and the kill kind went missing).
            time.sleep(self.rng.uniform(0, 0.05))
            if _kill(found[1]):
                self._record(kind)
                return True
            return False
        if kind == "job-fork":
            sups = self._workers()
            rqs = [r for r in (self._rq_worker(s) for s in sups) if r is not None]
            before = {r: set(_children(r)) for r in rqs}
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not self.done_submitting.is_set():
                for r in rqs:
                    new = [c for c in _children(r) if c not in before[r]]
                    if new and _kill(new[0]):
                        self._record(kind)
                        return True
                    before[r] |= set(new)
                time.sleep(0.0005)
            return False
        if kind == "rq-worker":
            found = self._busy_horse()
            sups = self._workers()
            rq = self._rq_worker(found[0] if found else self.rng.choice(sups))
            if rq is not None and _kill(rq):
                self._record(kind)
                return True
            return False
        if kind == "supervisor":
            found = self._busy_horse()
            sup = found[0] if found else self.rng.choice(self._workers())
            if _kill(sup):
                self._record(kind)
                self._replace_worker(sup)
                return True
            return False
        if kind == "worker-tree":
            found = self._busy_horse()
            sup = found[0] if found else self.rng.choice(self._workers())
            horses = [h for r in [self._rq_worker(sup)] if r is not None for h in _children(r)]
            os.killpg(sup, signal.SIGKILL)
            for horse in horses:  # RQ's job process runs in a session of its own
                _kill(horse)
            self._record(kind)
            self._replace_worker(sup)
            return True
        if kind == "api":
            with self.api_lock:
                assert self.stack.api is not None
                _kill(self.stack.api.pid)
                self._record(kind)
                self.stack.api.wait()
                self.stack.api = None
                time.sleep(self.rng.uniform(0, 1))
                self.stack.start_api(timeout_s=120)
            return True
        if kind == "redis":
            port, password = self.stack.redis.port, self.stack.redis.password
            self.stack.redis.kill()
            self._record(kind)
            time.sleep(OUTAGE_S)
            self.stack.redis = RedisServer(
                self.stack.data_dir / "redis", port=port, password=password
            )
            self.stack.redis.start()  # returns once the server answers
            with self.lock:
                self.redis_back[self.kill_times[-1][0]] = time.time()
            return True
        raise ValueError(f"unknown kill kind {kind!r}")

    def killer(self) -> None:
        for index, kind in enumerate(self.schedule):
            # Kill number i once about (i + 1) / (K + 1) of the jobs were submitted.
            due = (index + 1) * self.n_jobs // (len(self.schedule) + 1)
            while self.submitted < due and not self.done_submitting.is_set():
                time.sleep(0.05)
            for _ in range(50):  # a kind that found nothing to kill tries again
                try:
                    if self.kill(kind):
                        break
                except Exception as exc:  # noqa: BLE001 - kept in the tally, the run goes on
                    self.tally.problems.append(f"kill {kind}: {exc!r}")
                    break
                if self.done_submitting.is_set():
                    break
        # Every worker alive at the end.
        for sup in self._workers():
            if not Path(f"/proc/{sup}").exists():
                self._replace_worker(sup)

    # --- submissions -------------------------------------------------------------------------

    def _post(self, api: ApiClient, body: dict[str, Any], key: str) -> str:
        """Submits until answered; returns the job id. Reads raw statuses: a 409 (the key's
        first submission still in flight) or a 5xx while the API restarts is sent again."""
        while True:
            try:
                with self.api_lock:
                    pass  # wait while the API restarts
                response = api.request(
                    "POST", "/v1/jobs", json=body, headers={"Idempotency-Key": key}
                )
            except httpx.HTTPError:
                time.sleep(0.2)
                continue
            if response.status_code in (200, 201, 202):
                return str(response.json()["id"])
            if response.status_code in (409, 503) or response.status_code >= 500:
                if response.status_code >= 500 and response.status_code != 503:
                    self.tally.problems.append(f"{key}: {response.status_code} {response.text}")
                time.sleep(0.2)
                continue
            raise AssertionError(f"{key}: {response.status_code} {response.text}")

    def _status(self, api: ApiClient, job_id: str) -> str | None:
        try:
            response = api.request("GET", f"/v1/jobs/{job_id}")
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        return str(response.json()["status"])

    def submitter(self, api: ApiClient, bodies: list[dict[str, Any]], window: int) -> None:
        ids: list[str] = []
        for i in range(self.n_jobs):
            if i >= window:  # at most `window` jobs queued or running
                old = ids[i - window]
                while self._status(api, old) not in TERMINAL:
                    time.sleep(0.1)
            key = f"chaos-{i}"
            job_id = self._post(api, bodies[i % len(bodies)], key)
            self._answer(key, job_id)
            ids.append(job_id)
            self.submitted = i + 1
            if i % 50 == 49:
                print(f"{time.strftime('%H:%M:%S')} {i + 1} jobs submitted", flush=True)
            if i % 10 == 9:  # a retried submission of an answered key: the same job
                index = self.rng.randrange(i + 1)
                again = f"chaos-{index}"
                self._answer(again, self._post(api, bodies[index % len(bodies)], again))
                self.tally.resent_same_key += 1
        self.done_submitting.set()

    def _answer(self, key: str, job_id: str) -> None:
        with self.lock:
            if key in self.answered and self.answered[key] != job_id:
                self.tally.duplicated.append(f"{key}: {self.answered[key]} and {job_id}")
            self.answered.setdefault(key, job_id)


def _bodies(stack: Stack, tenant: str, sharded: bool) -> tuple[Client, str, list[dict[str, Any]]]:
    """The client, its tenant's id, and the bodies the jobs cycle through."""
    key = stack.records().create_api_key(tenant)
    client = Client(stack.url, key.key)
    model = created(client.add_model("digits_cnn", {"width": 8}))
    # Small jobs, so that many run: adapt on unlabelled data (no measuring before and after),
    # train on a few labelled batches.
    unlabelled = created(client.add_dataset(digits_npz(n=128, labels=False)))
    labelled = created(client.add_dataset(digits_npz(n=64)))
    adapt = {
        "kind": "adapt",
        "model_id": model["id"],
        "dataset_id": unlabelled["id"],
        "params": {"batch_size": 32},
    }
    train = {
        "kind": "train",
        "model_id": model["id"],
        "dataset_id": labelled["id"],
        "params": {"epochs": 1, "batch_size": 32},
    }
    bodies: list[dict[str, Any]] = [adapt, adapt, adapt, adapt, train]
    if sharded:
        bodies.append({**adapt, "params": {"batch_size": 32, "shards": 2}})
    return client, key.tenant_id, bodies


def _wall(moment: datetime | str | None) -> float | None:
    if moment is None:
        return None
    if isinstance(moment, str):
        moment = datetime.fromisoformat(moment)
    return moment.timestamp()


def run_load_chaos(
    stack: Stack,
    jobs: int,
    kills: int,
    redis_kills: int = 3,
    seed: int = 0,
    window: int = 6,
    sharded: bool = False,
    end_timeout_s: float = 600,
) -> LoadTally:
    """Submits ``jobs`` jobs (at most ``window`` unfinished at once) while ``kills`` kills
    spread over :data:`KILL_KINDS` and ``redis_kills`` Redis kills happen, then checks every
    job (see the module's docstring)."""
    client, tenant, bodies = _bodies(stack, f"chaos-load-{seed}", sharded)
    chaos = _Chaos(stack, jobs, kills, redis_kills, seed)
    started = time.monotonic()
    killer = threading.Thread(target=chaos.killer, daemon=True)
    killer.start()
    chaos.submitter(client.api, bodies, window)
    killer.join()
    tally = chaos.tally

    # Every job ends.
    records = stack.records()
    deadline = time.monotonic() + end_timeout_s
    job_ids = sorted(set(chaos.answered.values()))
    pending = set(job_ids)
    while pending and time.monotonic() < deadline:
        for job_id in list(pending):
            job = records.get_job(tenant, job_id)
            if job is not None and job.status.value in TERMINAL:
                pending.discard(job_id)
        time.sleep(0.5)
    tally.wall_s = time.monotonic() - started
    tally.stuck = sorted(pending)

    # No job beside those the keys named (a key answered twice with two jobs is counted above;
    # a job no key names would be a submission whose retry made a second job).
    indexed = {
        m.decode().split(":", 1)[1]
        for m in records.client.zrange(keys.tenant_index(tenant, "job"), 0, -1)
    }
    extra = indexed - set(job_ids)
    tally.duplicated += [f"job {j} named by no key" for j in sorted(extra)]
    models: Counter[str] = Counter()
    for member in records.client.zrange(keys.tenant_index(tenant, "model"), 0, -1):
        model = records.get_model(tenant, member.decode().split(":", 1)[1])
        if model is not None and model.job_id is not None:
            models[model.job_id] += 1

    kill_times = sorted(chaos.kill_times)
    tally.redis_outage_s = [back - at for at, back in sorted(chaos.redis_back.items())]
    for job_id in job_ids:
        job = records.get_job(tenant, job_id)
        if job is None:
            tally.lost.append(job_id)
            continue
        tally.outcomes[job.status.value] += 1
        if job.status is JobStatus.SUCCEEDED and models[job_id] != 1:
            tally.model_problems.append(f"{job_id}: {models[job_id]} models")
        if job.status is not JobStatus.SUCCEEDED:
            tally.problems.append(f"{job_id} {job.status.value}: {job.error}")
        runs = ShardRecords(records.client).runs(job_id)
        tally.child_reruns += sum(n - 1 for n in runs.values())
        if job.attempts:
            tally.interrupted_jobs += 1
            tally.retries += len(job.attempts)
        finished = _wall(job.finished_at)
        for attempt in job.attempts:
            ended = _wall(attempt.ended_at)
            assert ended is not None
            before = [(t, k) for t, k in kill_times if t <= ended]
            if not before:
                continue
            at, kind = before[-1]
            tally.seconds_to_attempt_end.setdefault(kind, []).append(ended - at)
            if kind == "redis" and at in chaos.redis_back:
                tally.seconds_after_redis_back.append(ended - chaos.redis_back[at])
            if finished is not None:
                tally.seconds_to_terminal.setdefault(kind, []).append(finished - at)
    return tally
