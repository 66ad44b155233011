"""Measurements 1 and 2 of bench/service/overhead.py: one job over HTTP, one window of load, and
the CPU the machine and the benchmark's own processes use meanwhile."""

from __future__ import annotations

import dataclasses
import datetime
import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from bench import REPO
from bench.service._report import CpuUse, JobTiming, LoadResult
from bench.service.stack import BenchStack, cpu_seconds, machine_busy_seconds
from harness.stack import Client

__all__ = ["CONCURRENCY", "CpuWatch", "merge", "run_job", "run_load"]

CONCURRENCY = 16
LOAD_WARMUP_S = 2.0  # clients connect and send untimed requests before a window opens
GENERATOR_START_S = 1.5  # a generator process's own start (imports httpx)
TERMINAL = ("succeeded", "failed", "canceled")


class CpuWatch:
    """The CPU the machine, and the processes ``ours()`` lists, use from now until ``stop``."""

    def __init__(self, ours: Callable[[], list[int]]) -> None:
        self._ours = ours
        self._start = time.perf_counter()
        self._machine = machine_busy_seconds()
        self._pids = {pid: cpu_seconds([pid]) for pid in ours()}

    def stop(self) -> CpuUse:
        ours = 0.0
        for pid in set(self._pids) | set(self._ours()):
            now = cpu_seconds([pid])
            if now > 0:  # a process that exited meanwhile counts nothing
                ours += now - self._pids.get(pid, 0.0)
        return CpuUse(
            time.perf_counter() - self._start, machine_busy_seconds() - self._machine, ours
        )


def _timestamp(value: str | bytes) -> float:
    text = value.decode() if isinstance(value, bytes) else value
    parsed = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    return parsed.timestamp()


def run_job(stack: BenchStack, client: Client, body: dict[str, Any], poll_s: float) -> JobTiming:
    start = time.perf_counter()
    response = client.submit(body)
    submitted = time.perf_counter()
    if response.status_code != 202:
        raise RuntimeError(f"submit answered {response.status_code}: {response.text}")
    job_id = response.json()["id"]
    while True:
        job = client.http.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in TERMINAL:
            seen, seen_wall = time.perf_counter(), time.time()
            break
        time.sleep(poll_s)
    if job["status"] != "succeeded":
        raise RuntimeError(f"job {job_id} ended {job['status']}: {job['error']}")
    timings = client.http.get(f"/v1/jobs/{job_id}/report").json()["timings"]
    created, started, finished = (
        _timestamp(job[name]) for name in ("created_at", "started_at", "finished_at")
    )
    # RQ's own record of the job (kept for RQ_RESULT_TTL_S).
    rq_enqueued, rq_started = (
        _timestamp(value)
        for value in stack.records().client.hmget(f"rq:job:{job_id}", "enqueued_at", "started_at")
    )
    return JobTiming(
        total_s=seen - start,
        submit_s=submitted - start,
        enqueue_s=rq_enqueued - created,
        dequeue_s=rq_started - rq_enqueued,
        start_s=started - rq_started,
        run_s=finished - started,
        observed_s=seen_wall - finished,
        compute_s=timings["compute_s"],
        load_s=timings["load_s"],
        job_total_s=timings["total_s"],
    )


def run_load(
    stack: BenchStack,
    key: str,
    what: str,
    request: dict[str, Any],
    duration_s: float,
    processes: int,
    ours: Callable[[], list[int]],
) -> LoadResult:
    """One window of CONCURRENCY clients split over ``processes`` generators, see point 2."""
    start_at = time.time() + GENERATOR_START_S + LOAD_WARMUP_S
    tasks = [CONCURRENCY // processes + (i < CONCURRENCY % processes) for i in range(processes)]
    options = [f"--{name}={value}" for name, value in request.items()]
    generators = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.service._load",
                f"--url={stack.url}",
                f"--key={key}",
                f"--tasks={n}",
                f"--start-at={start_at}",
                f"--duration-s={duration_s}",
                *options,
            ],
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        for n in tasks
    ]
    assert stack.redis.pid is not None
    api_pids, redis_pids = stack.api_pids(), [stack.redis.pid]
    time.sleep(max(start_at - time.time(), 0.0))
    watch = CpuWatch(ours)
    api_cpu, redis_cpu = cpu_seconds(api_pids), cpu_seconds(redis_pids)
    time.sleep(max(start_at + duration_s - time.time(), 0.0))
    api_cpu, redis_cpu = cpu_seconds(api_pids) - api_cpu, cpu_seconds(redis_pids) - redis_cpu
    machine = watch.stop()
    results = []
    for generator in generators:
        out, _ = generator.communicate()
        if generator.returncode != 0:
            raise RuntimeError(f"a load generator exited with {generator.returncode}")
        results.append(json.loads(out.splitlines()[-1]))
    for result in results:
        if result["first_errors"]:
            print(f"{what}: unexpected answers, e.g. {result['first_errors']}", file=sys.stderr)
    clients_cpu = sum(r["cpu_s"] for r in results)
    machine = dataclasses.replace(machine, ours_s=machine.ours_s + clients_cpu)
    return LoadResult(
        api_processes=stack.api_workers,
        what=what,
        completed=sum(r["completed"] for r in results),
        errors=sum(r["errors"] for r in results),
        latencies_ms=[ms for r in results for ms in r["latencies_ms"]],
        window_s=max(r["window_s"] for r in results),
        cores={
            "API": api_cpu / duration_s,
            "Redis": redis_cpu / duration_s,
            "clients": clients_cpu / duration_s,
        },
        others_cores=machine.others_cores,
    )


def merge(windows: list[LoadResult]) -> LoadResult:
    """The windows of one configuration as one: rates over the summed time, all latencies."""
    total_s = sum(w.window_s for w in windows)

    def weighted(value: Callable[[LoadResult], float]) -> float:
        return sum(value(w) * w.window_s for w in windows) / total_s

    return dataclasses.replace(
        windows[0],
        completed=sum(w.completed for w in windows),
        errors=sum(w.errors for w in windows),
        latencies_ms=[ms for w in windows for ms in w.latencies_ms],
        window_s=total_s,
        cores={name: weighted(lambda w, n=name: w.cores[n]) for name in windows[0].cores},
        others_cores=weighted(lambda w: w.others_cores),
    )
