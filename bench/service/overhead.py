"""What the service costs around the computation: per-job overhead, API throughput, and the
adaptation throughput inside a job against a bare loop.

Everything runs on this machine over loopback: a Redis-compatible server, the API under uvicorn
and a worker (``python -m workers.processes.supervisor --device cpu``), started as harness/stack.py
does. Three measurements:

1. Per-job overhead: a tiny adapt job (``digits_cnn`` width 8 on 64 digits samples) submitted
   over HTTP and polled every ``POLL_INTERVAL_S`` until it succeeded, one job at a time; the
   overhead is POST sent -> success seen, less the ``timings.compute_s`` of the job's report.
   Median over the jobs after ``WARMUP_JOBS``, broken down with the job's ``created_at``,
   ``started_at`` and ``finished_at``, RQ's ``enqueued_at`` and ``started_at``, and the
   report's timings (all clocks are this machine's). On an unlabelled dataset (the target: the
   job evaluates nothing), on a labelled one (the job then evaluates the model before and
   after, outside ``compute_s``), and on the unlabelled one through a second worker whose
   environment has ``OMP_NUM_THREADS=1`` (by default torch runs a thread per core, which then
   compete for the cores with the API, Redis and the client); the three take turns, job by
   job. Target <= 150 ms.
2. API throughput: ``CONCURRENCY`` closed-loop clients (asyncio tasks on keep-alive
   connections, in bench/service/_load.py processes) for fixed windows: status reads
   ``GET /v1/jobs/{id}`` (target >= 1,000/s and p99 <= 50 ms), then submissions
   ``POST /v1/jobs`` of the tiny job with the worker stopped, so they only queue (API +
   enqueue; target >= 300/s). One API process and ``uvicorn --workers N`` run side by side and
   take turns, window by window. The load generator shares the machine's cores with the API
   and Redis: the CPU each used over the windows is reported in cores, with that of other
   processes on the machine.
3. Adaptation throughput inside a job: ``workers.running.compute.compute`` called in this process
on an
   adapt payload (a ``resnet`` with ``in_channels`` 1 on random 1x32x32 samples; the payload's
   files in a ``LocalStore`` of our own), samples / ``compute_s``, over a bare
   ``model.train(); with torch.no_grad(): model(x)`` loop on the same samples and batch size.
   Repetitions alternate which runs first; the result is the median of the paired ratios.
   Target >= 0.95. The same job also runs through the worker, for information.

Run from the repository root: ``python -m bench.service.overhead`` prints markdown tables (about
4.5 minutes on 2 cores); ``--quick`` is a smoke run whose numbers mean little; ``--threads``
sets torch's threads for measurement 3 (default 1, see ``DEFAULT_THREADS``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
from sklearn.datasets import load_digits

from api_schemas import JobPayload, new_id
from bench.recording import Measured, add_record_options, met, spread, write_figures
from bench.service._measure import CONCURRENCY, CpuWatch, merge, run_job, run_load
from bench.service._report import (
    ADAPT_TARGET,
    OVERHEAD_TARGET_S,
    READS_P99_TARGET_S,
    READS_TARGET_PER_S,
    SUBMITS_TARGET_PER_S,
    AdaptResult,
    CpuUse,
    JobTiming,
    LoadResult,
    adapt_table,
    load_table,
    median,
    overhead_table,
    percentile,
    quartiles,
)
from bench.service.stack import BenchStack
from harness.servers import new_redis_server
from harness.stack import Client, npz_bytes
from service.store.local import LocalStore
from workers.kinds.changing import compute
from workers.models.architectures import build_model

POLL_INTERVAL_S = 0.010  # how often the client asks for the status of a tiny job
SLOW_POLL_INTERVAL_S = 0.100  # for the larger jobs of measurement 3

TINY_MODEL = ("digits_cnn", {"width": 8})
TINY_SAMPLES = 64
TINY_BATCH = 64
WARMUP_JOBS = 2
# Torch's default is a thread per core; a job's threads then share the cores with the API,
# Redis and the client: the third column of measurement 1 runs its worker with one thread.
SINGLE_THREAD = "unlabelled, worker with OMP_NUM_THREADS=1"
SINGLE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "BNADAPT_QUEUE": "bnadapt-single-thread"}
RESNET = ("resnet", {"in_channels": 1, "depth": 4, "width": 16})
IMAGE = (1, 32, 32)
SEED = 0
# Measurement 3 runs torch on one thread: on 2 shared cores, two threads wait for each other at
# every op whenever another process holds a core, and paired ratios spread from 0.6 to 1.2.
DEFAULT_THREADS = 1


@dataclasses.dataclass(frozen=True)
class Plan:
    """How long each measurement runs."""

    tiny_jobs: int  # timed tiny jobs per dataset, after WARMUP_JOBS
    api_workers: tuple[int, ...]  # uvicorn configurations, taking turns
    load_rounds: int  # turns of each configuration
    read_s: float  # per window
    submit_s: float
    load_processes: int  # generator processes sharing the CONCURRENCY clients
    adapt_pairs: int
    adapt_samples: int
    adapt_batch: int
    service_adapt_jobs: int


FULL = Plan(
    tiny_jobs=30,
    api_workers=(1, 2),
    load_rounds=2,
    read_s=5.0,
    submit_s=3.0,
    load_processes=2,
    adapt_pairs=15,
    adapt_samples=1024,
    adapt_batch=64,
    service_adapt_jobs=3,
)
QUICK = Plan(
    tiny_jobs=3,
    api_workers=(1, 2),
    load_rounds=1,
    read_s=1.0,
    submit_s=1.0,
    load_processes=2,
    adapt_pairs=2,
    adapt_samples=128,
    adapt_batch=64,
    service_adapt_jobs=1,
)


# --- 3. adaptation throughput, in this process ---------------------------------------------


def random_images(count: int) -> np.ndarray:
    return np.random.default_rng(SEED).standard_normal((count, *IMAGE), dtype=np.float32)


def resnet_weights() -> bytes:
    torch.manual_seed(SEED)
    model = build_model(*RESNET)
    return safetensors.torch.save({k: v.contiguous() for k, v in model.state_dict().items()})


def measure_adaptation(plan: Plan, root: Path) -> tuple[AdaptResult, CpuUse]:
    """Paired timings of compute() on an adapt payload and of the bare loop, see point 3."""
    store = LocalStore(root / "store")
    weights = resnet_weights()
    x = random_images(plan.adapt_samples)  # (N, 1, 32, 32)
    payload = JobPayload.model_validate(
        {
            "job_id": new_id("job"),
            "tenant_id": "tn_bench",
            "kind": "adapt",
            "model": {
                "id": new_id("mdl"),
                "architecture": RESNET[0],
                "kwargs": RESNET[1],
                "weights_sha256": store.put_bytes(weights),
            },
            "dataset": {
                "id": new_id("ds"),
                "sha256": store.put_bytes(npz_bytes(x=x)),
                "format": "npz",
            },
            "params": {"batch_size": plan.adapt_batch, "estimator": "cumulative", "device": "cpu"},
        }
    )
    bare = build_model(*RESNET)
    bare.load_state_dict(safetensors.torch.load(weights))
    bare.train()
    x_t = torch.from_numpy(x)

    def bare_pass() -> float:
        start = time.perf_counter()
        with torch.no_grad():
            for batch in x_t.split(plan.adapt_batch):  # (B, 1, 32, 32)
                bare(batch)
        return time.perf_counter() - start

    def job_pass() -> tuple[float, float]:
        timings = compute(payload, store).report.timings
        return timings.compute_s, timings.load_s

    job_pass()  # warm-up: the first calls load libraries and allocate
    bare_pass()
    watch = CpuWatch(lambda: [os.getpid()])
    compute_s, load_s, bare_s = [], [], []
    for pair in range(plan.adapt_pairs):
        if pair % 2 == 0:
            job = job_pass()
            bare_s.append(bare_pass())
        else:
            bare_s.append(bare_pass())
            job = job_pass()
        compute_s.append(job[0])
        load_s.append(job[1])
    return AdaptResult(plan.adapt_samples, compute_s, load_s, bare_s), watch.stop()


# --- the service run -----------------------------------------------------------------------


@dataclasses.dataclass
class ServiceResults:
    server: str
    tiny: dict[str, list[JobTiming]]
    tiny_cpu: CpuUse
    service_adapt: dict[str, list[JobTiming]]  # the job of measurement 3 through each worker
    loads: list[LoadResult]


def digits_npz(labels: bool) -> bytes:
    data = load_digits()
    x = (data.images[:TINY_SAMPLES] / 16.0).astype(np.float32)[:, None]  # (N, 1, 8, 8)
    y = data.target[:TINY_SAMPLES].astype(np.int64)
    return npz_bytes(x=x, y=y) if labels else npz_bytes(x=x)


def created(response: Any) -> dict[str, Any]:
    if response.status_code != 201:
        raise RuntimeError(f"expected 201, got {response.status_code}: {response.text}")
    body: dict[str, Any] = response.json()
    return body


def adapt_body(model: dict[str, Any], dataset: dict[str, Any], batch: int) -> dict[str, Any]:
    return {
        "kind": "adapt",
        "model_id": model["id"],
        "dataset_id": dataset["id"],
        "params": {"batch_size": batch, "estimator": "cumulative"},
    }


def run_service(plan: Plan, root: Path) -> ServiceResults:
    redis = new_redis_server(root / "redis")
    stacks = {n: BenchStack(root / "stack", redis, api_workers=n) for n in plan.api_workers}
    main = stacks[plan.api_workers[0]]
    # The same service with a worker whose torch runs one thread, on a queue of its own.
    single = BenchStack(root / "stack", redis, SINGLE_THREAD_ENV)

    def ours() -> list[int]:
        pids = [os.getpid(), *main.worker_pids(), *single.worker_pids(), *single.api_pids()]
        for stack in stacks.values():
            pids += stack.api_pids()
        return pids if redis.pid is None else [*pids, redis.pid]

    try:
        for stack in (main, single):
            stack.start_worker()
            stack.start_api()
        info = main.records().client.info("server")
        server = f"{info.get('server_name') or 'redis'} {info['redis_version']}"
        bench_key = main.records().create_api_key("bench")
        key = bench_key.key
        # The load windows measure throughput: the bench's tenant has no rate or jobs quota.
        for quota in ("rate_per_s", "max_active_jobs"):
            main.records().set_quota(bench_key.tenant_id, quota, 0)
        client, single_client = Client(main.url, key), Client(single.url, key)
        tiny_model = created(client.add_model(*TINY_MODEL))
        unlabelled, labelled = (
            created(client.add_dataset(digits_npz(labels))) for labels in (False, True)
        )
        runs = {
            "unlabelled (target)": (main, client, adapt_body(tiny_model, unlabelled, TINY_BATCH)),
            "labelled": (main, client, adapt_body(tiny_model, labelled, TINY_BATCH)),
            SINGLE_THREAD: (single, single_client, adapt_body(tiny_model, unlabelled, TINY_BATCH)),
        }
        tiny: dict[str, list[JobTiming]] = {name: [] for name in runs}
        watch = CpuWatch(ours)
        for job in range(WARMUP_JOBS + plan.tiny_jobs):
            for name, (stack, http, body) in runs.items():  # one job of each, in turn
                timing = run_job(stack, http, body, POLL_INTERVAL_S)
                if job >= WARMUP_JOBS:
                    tiny[name].append(timing)
        tiny_cpu = watch.stop()

        big_model = created(client.add_model(*RESNET, weights=resnet_weights()))
        big_data = created(client.add_dataset(npz_bytes(x=random_images(plan.adapt_samples))))
        big_body = adapt_body(big_model, big_data, plan.adapt_batch)
        workers = {"default threads": (main, client), "OMP_NUM_THREADS=1": (single, single_client)}
        service_adapt: dict[str, list[JobTiming]] = {name: [] for name in workers}
        for _ in range(plan.service_adapt_jobs):
            for name, (stack, http) in workers.items():
                service_adapt[name].append(run_job(stack, http, big_body, SLOW_POLL_INTERVAL_S))
        single.stop()

        read_path = f"/v1/jobs/{client.http.get('/v1/jobs').json()['items'][0]['id']}"
        submit_body = json.dumps(runs["unlabelled (target)"][2])
        main.stop_worker()  # submissions only queue; a worker would compete for the cores
        for stack in stacks.values():
            if stack.api is None:
                stack.start_api()
        requests = [
            ("GET /v1/jobs/{id}", {"path": read_path}, plan.read_s),
            (
                "POST /v1/jobs",
                {"method": "POST", "path": "/v1/jobs", "body": submit_body, "expect": 202},
                plan.submit_s,
            ),
        ]
        windows: dict[tuple[str, int], list[LoadResult]] = {}
        for _ in range(plan.load_rounds):
            for what, request, duration_s in requests:
                for n, stack in stacks.items():
                    window = run_load(
                        stack, key, what, request, duration_s, plan.load_processes, ours
                    )
                    windows.setdefault((what, n), []).append(window)
        loads = [merge(found) for found in windows.values()]
        loads.sort(key=lambda load: (load.api_processes, not load.what.startswith("GET")))
        return ServiceResults(server, tiny, tiny_cpu, service_adapt, loads)
    finally:
        for stack in (*stacks.values(), single):
            stack.stop()
        redis.stop()


# --- the report ----------------------------------------------------------------------------


def versions(server: str) -> str:
    packages = ("fastapi", "uvicorn", "rq", "redis", "httpx", "pydantic")
    found = ", ".join(f"{name} {importlib.metadata.version(name)}" for name in packages)
    return (
        f"{datetime.date.today().isoformat()}; {platform.machine()} Linux, {os.cpu_count()} "
        f"cores; Python {platform.python_version()}, torch {torch.__version__}, {found}; "
        f"server {server}"
    )


def load_windows(loads: list[LoadResult], reads: bool) -> tuple[LoadResult, LoadResult]:
    """The status reads' windows (or the submissions'): of one API process, and of the most."""
    windows = [load for load in loads if load.what.startswith("GET") == reads]
    by_processes = sorted(windows, key=lambda load: load.api_processes)
    return by_processes[0], by_processes[-1]


def figures(service: ServiceResults, adapt: AdaptResult) -> list[Measured]:
    """The records of this run: measurement 1's target column, 2's windows with the most API
    processes (the rate with one beside it), 3's paired ratio."""
    overhead_s = median([t.overhead_s for t in service.tiny["unlabelled (target)"]])
    one, reads = load_windows(service.loads, reads=True)
    p99_ms = percentile(reads.latencies_ms, 99)
    reads_goal = f">= {READS_TARGET_PER_S:,.0f}/s, p99 <= {READS_P99_TARGET_S * 1e3:.0f} ms"
    reads_met = reads.rate >= READS_TARGET_PER_S and p99_ms <= READS_P99_TARGET_S * 1e3
    one_submit, submits = load_windows(service.loads, reads=False)
    submits_met = submits.rate >= SUBMITS_TARGET_PER_S and submits.errors == 0
    low, mid, high = quartiles(adapt.ratios)
    return [
        Measured(
            "service-overhead",
            "service overhead per tiny adapt job (submit -> succeeded, less compute)",
            round(overhead_s * 1e3, 1),
            met(f"<= {OVERHEAD_TARGET_S * 1e3:.0f} ms", overhead_s <= OVERHEAD_TARGET_S),
            "ms",
        ),
        Measured(
            "service-status-reads",
            f"status reads, {CONCURRENCY} clients, {reads.api_processes} API processes "
            f"(1: {one.rate:,.0f}/s)",
            f"{reads.rate:,.0f}/s, p99 {p99_ms:.0f} ms",
            met(reads_goal, reads_met),
        ),
        Measured(
            "service-submissions",
            f"job submissions, {CONCURRENCY} clients, {submits.api_processes} API processes "
            f"(1: {one_submit.rate:,.0f}/s)",
            f"{submits.rate:,.0f}/s, {submits.errors} errors",
            met(f">= {SUBMITS_TARGET_PER_S:,.0f}/s", submits_met),
        ),
        Measured(
            "service-adapt-throughput",
            "adaptation throughput in a job / bare no-grad loop",
            spread(mid, low, high),
            met(f">= {ADAPT_TARGET:g}", mid >= ADAPT_TARGET),
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run; numbers mean little")
    parser.add_argument(
        "--threads", type=int, default=DEFAULT_THREADS, help="torch threads of measurement 3"
    )
    add_record_options(parser)
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bnadapt-bench-") as tmp:
        adapt, adapt_cpu = measure_adaptation(plan, Path(tmp) / "in-process")
        service = run_service(plan, Path(tmp) / "service")
    api = ", ".join(str(n) for n in plan.api_workers)
    lines = [
        versions(service.server),
        "",
        f"### 1. Per-job overhead ({plan.tiny_jobs} jobs one at a time after {WARMUP_JOBS} "
        f"warm-up jobs; status polled every {POLL_INTERVAL_S * 1e3:.0f} ms)",
        "",
        *overhead_table(service.tiny, service.tiny_cpu),
        "",
        f"### 2. API throughput ({CONCURRENCY} closed-loop clients in {plan.load_processes} "
        f"processes; API with {api} processes taking turns, {plan.load_rounds} windows each "
        f"of {plan.read_s:.0f} s reads and {plan.submit_s:.0f} s submissions)",
        "",
        *load_table(service.loads),
        "",
        f"### 3. Adaptation throughput ({RESNET[0]} {json.dumps(RESNET[1])}, "
        f"{plan.adapt_samples} random 1x32x32 samples, batch {plan.adapt_batch}, torch on "
        f"{args.threads} thread(s) here; median of {plan.adapt_pairs} paired ratios, quartiles "
        "in brackets)",
        "",
        *adapt_table(adapt, service.service_adapt, adapt_cpu, SLOW_POLL_INTERVAL_S),
    ]
    print("\n".join(lines))
    write_figures("bench.service.overhead", args, figures(service, adapt))


if __name__ == "__main__":
    main()
