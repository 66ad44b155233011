"""Noisy neighbour: what one tenant's flood does to another tenant on a shared service.

    python -m bench.service.noisy_neighbour                  # 20 uploads of 64 MiB, 30 s phases
    python -m bench.service.noisy_neighbour --upload-mib 4 --seconds 5   # a quick look

The whole service runs as processes (harness/stack.py: Redis, one worker, the API), with the
default quotas (BNADAPT_TENANT_RATE_PER_S 50 with a burst of 100, 10 event streams, 20 open
uploads, 100 active jobs). Tenant B reads its job's status 20 times a second (within its own rate
limit) for ``--seconds``: once alone (quiet), once while tenant A

- submits adapt jobs at its rate limit (``--rate``, 50 a second: the active-jobs quota
  answers 429 once it has 100 queued or running; the client goes on at the same pace),
- holds its maximum of event streams open on its jobs, and
- uploads ``--uploads`` files of ``--upload-mib`` each, all at once, through the resumable
  upload route (parts hashed by the API as they arrive, each upload committed by a copy in
  the API's copy pool).

With ``--uploads-nice N`` A's uploads go, as the Python client sends them, to an API process of
their own at nice N (``BNADAPT_UPLOADS_URL``, ``BNADAPT_API_NICE``: what ``bnadapt up
--uploads-nice N`` runs), on the API's processor when pinned (``--uploads-processor``).

Run it on a quiet machine: another program's burst of processor time shows in B's reads
(bench/RESULTS.md names one found so). The result also carries Redis' own stalls over 10 ms
(``redis_latency``) and when B's slow reads fell (``slow_reads_at_s``, ``slow_reads_ms``).

Targets (issue 27): B's status-read p99 within 2x of the quiet run, and B's job, submitted
once A has a backlog of queued jobs, starts within one job slot: at most one of A's jobs
(the one the worker was running) starts between B's submission and B's job's start.

    python -m bench.service.noisy_neighbour --phase registrations   # issue 41's phase
    python -m bench.service.noisy_neighbour --phase registrations --uploads 2 --upload-mib 4 \
        --imports 2 --model-hidden 512 --seconds 5                # a quick look

``--phase registrations`` (bench/service/_registrations.py): tenant A completes ``--uploads``
resumable uploads and ``--imports`` dataset imports of ``--upload-mib`` each, all at once and
over and over, and registers built-in ``mlp`` models of ``--model-in-features`` x
``--model-hidden`` x ``--model-depth`` (``--model-threads`` at a time), while tenant B
registers a small ``mlp`` and a small dataset in turn (4 of each a second) and ``/healthz`` is
read 20 times a second; each timed, once alone (quiet) and once under A's load. Imports need
the store on S3: with ``--imports`` above 0 the stack's store is a SeaweedFS bucket
(harness/servers.py), in both runs. Target (issue 41): B's registrations' p50 and p99 within 2x
of the quiet run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing
import os
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import redis

from api_schemas import JobPublic
from bench.recording import Measured, add_record_options, met, write_figures
from bench.service._registrations import (
    S3Sources,
    b_registrations,
    below_everything,
    run_registration_flood,
    s3_sources,
)
from harness.servers import stop_process, wait_for
from harness.stack import REPO as STACK_REPO
from harness.stack import npz_bytes, running_stack
from service.client import ApiClientError, Client
from service.local.embedded import free_port
from service.local.up import api_command

MIB = 1024 * 1024
# Issues 27 and 41: B's latencies under A's flood over B's alone, at most this.
RATIO_TARGET = 2.0


# Each job a short adapt pass: a worker's slot turns over every second or so.
ADAPT: dict[str, Any] = {"batch_size": 16, "estimator": "cumulative", "device": "cpu"}


# B polls at 20 reads a second, within its own rate limit (50 a second by default).
READ_INTERVAL_S = 0.05


def status_reads(
    client: Client, job_id: str, seconds: float, started: list[float] | None = None
) -> list[float]:
    """Latencies (s) of status reads of ``job_id``, one every READ_INTERVAL_S (or as soon as
    the last answered, when that took longer), for ``seconds``; each read's start (wall clock,
    s) appended to ``started`` if given."""
    latencies: list[float] = []
    # What this process holds (the stack's handles, numpy, the clients) out of its garbage
    # collections: a full collection of it took some 50 ms in a read of B's, a delay of the
    # bench's client, not of the service.
    gc.collect()
    gc.freeze()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if started is not None:
            started.append(time.time())
        start = time.perf_counter()
        response = client.request("GET", f"/v1/jobs/{job_id}")
        took = time.perf_counter() - start
        latencies.append(took)
        assert response.status_code == 200, response.text
        time.sleep(max(0.0, READ_INTERVAL_S - took))
    return latencies


def percentiles(latencies: list[float]) -> dict[str, float]:
    ordered = sorted(latencies)
    return {
        "reads": len(ordered),
        "p50_ms": 1000 * statistics.median(ordered),
        "p95_ms": 1000 * ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
        "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "max_ms": 1000 * ordered[-1],
    }


class Flood:
    """Tenant A's load, each part on its own threads until :meth:`stop`."""

    def __init__(
        self,
        client: Client,
        url: str,
        key: str,
        model: str,
        data: str,
        files: list[Path],
        rate_per_s: float,
    ) -> None:
        self.client, self.url, self.key, self.rate_per_s = client, url, key, rate_per_s
        self.model, self.data, self.files = model, data, files
        self.stopping = threading.Event()
        self.jobs: list[str] = []
        self.accepted = self.refused = 0
        self.streams_open = 0
        self.uploaded_bytes = 0
        self.uploads_done = 0
        self.uploads_ended: list[float] = []  # wall clock (s)
        self.errors: list[str] = []
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def start(self, streams: int) -> None:
        self._spawn(self._submit)
        for path in self.files:
            self._spawn(self._upload, path)
        # The streams follow jobs A submitted: wait for the first.
        deadline = time.monotonic() + 30
        while not self.jobs and time.monotonic() < deadline:
            time.sleep(0.05)
        for i in range(streams):
            self._spawn(self._stream, i)

    def _spawn(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self.threads.append(thread)

    def _submit(self) -> None:
        body = {
            "kind": "adapt",
            "model_id": self.model,
            "dataset_id": self.data,
            "params": ADAPT,
        }
        http = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=60
        )
        interval = 1.0 / self.rate_per_s
        next_at = time.monotonic()
        while not self.stopping.is_set():
            # At the rate limit: one submission every 1 / rate seconds, as a client that
            # keeps to its limit floods.
            next_at += interval
            time.sleep(max(0.0, next_at - time.monotonic()))
            response = http.post("/v1/jobs", json=body)
            with self.lock:
                if response.status_code == 202:
                    self.accepted += 1
                    self.jobs.append(response.json()["id"])
                elif response.status_code == 429:
                    self.refused += 1
                else:
                    self.errors.append(f"submit {response.status_code}: {response.text[:200]}")
        http.close()

    def _stream(self, index: int) -> None:
        job_id = self.jobs[index % len(self.jobs)]
        headers = {"Authorization": f"Bearer {self.key}"}
        try:
            with httpx.stream(
                "GET", f"{self.url}/v1/jobs/{job_id}/events", headers=headers, timeout=None
            ) as response:
                if response.status_code != 200:
                    with self.lock:
                        self.errors.append(f"stream {response.status_code}")
                    return
                with self.lock:
                    self.streams_open += 1
                for _ in response.iter_lines():
                    if self.stopping.is_set():
                        break
        except httpx.HTTPError as exc:
            with self.lock:
                self.errors.append(f"stream {type(exc).__name__}")

    def _upload(self, path: Path) -> None:
        try:
            # A floods at its rate limit: its uploads wait their turns in the same bucket.
            self.client.upload_dataset(path, retries=60)
        except ApiClientError as exc:
            with self.lock:
                self.errors.append(f"upload {exc.status}: {exc.detail[:200]}")
            return
        with self.lock:
            self.uploads_done += 1
            self.uploads_ended.append(time.time())
            self.uploaded_bytes += path.stat().st_size

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=120)


def run_flood(
    url: str,
    key: str,
    model: str,
    data: str,
    files: list[Path],
    args: argparse.Namespace,
    stop: Any,
    figures: Any,
) -> None:
    """Tenant A's process: the flood until ``stop`` is set, then its figures on ``figures``."""
    if args.a_nice:
        # A's client on a machine of its own, as it would be: on this one it then takes only
        # the processor time the service and B leave (its uploads hash every part, twice).
        below_everything(args.a_nice)
    if args.pin:
        os.sched_setaffinity(0, {1})  # A's client beside the worker, off the API's core
    flood = Flood(Client(url, key, timeout_s=600), url, key, model, data, files, args.rate)
    flood.start(args.streams)
    stop.wait()
    flood.stop()
    figures.put(
        {
            "accepted": flood.accepted,
            "refused": flood.refused,
            "streams_open": flood.streams_open,
            "uploads_done": flood.uploads_done,
            "uploaded_bytes": flood.uploaded_bytes,
            "uploads_ended": flood.uploads_ended,
            "errors": flood.errors,
        }
    )


def _tree(root: int) -> list[int]:
    """``root`` and its live descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def cpu_seconds(roots: dict[str, int]) -> dict[str, float]:
    """Processor time (user + system, s) used so far by each named process with its
    descendants, and by this process alone (``bench_and_b``: B's reads, the bench)."""
    tick = os.sysconf("SC_CLK_TCK")
    used = {}
    for name, root in roots.items():
        total = 0
        for pid in _tree(root):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            # Its own time, and that of its children it has waited for (a job's process).
            total += sum(int(value) for value in fields[11:15])
        used[name] = total / tick
    own = os.times()
    used["bench_and_b"] = own.user + own.system
    return used


def pin(root: int, processor: int) -> None:
    """Every thread of ``root`` and of its descendants on ``processor``: a thread's affinity is
    its own, and threads started before this call keep theirs unless set one by one."""
    for pid in _tree(root):
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError):  # a thread that ended meanwhile
                    os.sched_setaffinity(int(task.name), {processor})


def pin_machines(stack: Any) -> None:
    """The deployment's machines on this one: the API, Redis and B on processor 0; the worker
    (and its jobs, forked later) on processor 1, where A's client goes too (``run_flood``)."""
    assert stack.api is not None
    assert stack.worker is not None
    for root in (stack.api.pid, stack.redis.pid, os.getpid()):
        pin(root, 0)
    pin(stack.worker.pid, 1)


def write_upload(path: Path, mib: int, seed: int) -> None:
    """An npz of ``mib`` MiB of random uint8 images (N, 3, 32, 32)."""
    n = max(1, mib * MIB // (3 * 32 * 32))
    x = np.random.default_rng(seed).integers(0, 256, size=(n, 3, 32, 32), dtype=np.uint8)
    np.savez(path, x=x)


def uploads_overrides(args: argparse.Namespace) -> dict[str, str]:
    """With ``--uploads-nice``: the uploads' bytes to an API process of their own (NOTE
    [ Upload bytes in processes of their own ] in service/api/routes/uploads.py), started by
    :func:`start_uploads_api` on this port."""
    if args.uploads_nice is None:
        return {}
    return {"BNADAPT_UPLOADS_URL": f"http://127.0.0.1:{free_port()}"}


def start_uploads_api(
    args: argparse.Namespace, stack: Any, overrides: dict[str, str], cleanup: contextlib.ExitStack
) -> subprocess.Popen[bytes] | None:
    """The uploads' API process that ``overrides`` names (None without ``--uploads-nice``),
    at its nice value, answering."""
    if args.uploads_nice is None:
        return None
    url = overrides["BNADAPT_UPLOADS_URL"]
    uploads_api = subprocess.Popen(
        api_command("127.0.0.1", int(url.rsplit(":", 1)[1])),
        env={**stack.env, "BNADAPT_API_NICE": str(args.uploads_nice)},
        cwd=STACK_REPO,
    )
    cleanup.callback(stop_process, uploads_api)
    wait_for(lambda: _answers(f"{url}/healthz"), timeout_s=60, what="the uploads' API")
    return uploads_api


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    files = []
    for i in range(args.uploads):
        path = work / f"upload_{i}.npz"
        write_upload(path, args.upload_mib, i)
        files.append(path)
    digits = np.random.default_rng(0).integers(0, 256, size=(256, 1, 8, 8), dtype=np.uint8)
    overrides = uploads_overrides(args)
    with (
        running_stack(
            work / "stack", env_overrides=overrides, api_processes=args.api_processes
        ) as stack,
        contextlib.ExitStack() as cleanup,
    ):
        records = stack.records()
        key_a, key_b = records.create_api_key("a").key, records.create_api_key("b").key
        a, b = Client(stack.url, key_a, timeout_s=600), Client(stack.url, key_b, timeout_s=600)
        model_a = a.add_model("digits_cnn", {"width": 8})
        model_b = b.add_model("digits_cnn", {"width": 8})
        data_a = a.add_dataset(_npz(work / "a.npz", digits))
        data_b = b.add_dataset(_npz(work / "b.npz", digits))
        uploads_api = start_uploads_api(args, stack, overrides, cleanup)
        if args.pin:
            pin_machines(stack)
            if uploads_api is not None:
                pin(uploads_api.pid, args.uploads_processor)
        server = redis.Redis.from_url(stack.redis.url)
        cleanup.callback(server.close)
        # Redis' own stalls over 10 ms (LATENCY LATEST: its append-only file's writes and
        # fsyncs, slow commands), to tell them from the API's.
        server.config_set("latency-monitor-threshold", 10)
        first = b.submit("adapt", model_b.id, data_b.id, ADAPT)
        b.wait(first.id)

        quiet = percentiles(status_reads(b, first.id, args.seconds))
        print("quiet", json.dumps(quiet), flush=True)

        # A's load runs in a process of its own: its upload threads' work in this one
        # (hashing, sending) would otherwise delay B's reads here, not in the service.
        context = multiprocessing.get_context("fork")
        stop, figures = context.Event(), context.Queue()
        flood_process = context.Process(
            target=run_flood,
            args=(stack.url, key_a, model_a.id, data_a.id, files, args, stop, figures),
        )
        flood_started = time.time()
        flood_process.start()
        assert stack.api is not None
        assert stack.worker is not None
        assert flood_process.pid is not None
        processes = {
            "api": stack.api.pid,
            "worker": stack.worker.pid,
            "a_client": flood_process.pid,
        }
        cpu_before = cpu_seconds(processes)
        time.sleep(args.backlog_s)  # A's backlog builds up
        noisy_reads: list[float] = []
        read_at: list[float] = []
        reader = threading.Thread(
            target=lambda: noisy_reads.extend(status_reads(b, first.id, args.seconds, read_at))
        )
        reader.start()
        submitted = time.time()
        job_b = b.submit("adapt", model_b.id, data_b.id, ADAPT)
        ended_b = b.wait(job_b.id)
        reader.join()
        cpu_noisy = {
            name: round(after - cpu_before[name], 1)
            for name, after in cpu_seconds(processes).items()
        }
        noisy_wall_s = time.time() - submitted + args.backlog_s
        stop.set()
        flood: dict[str, Any] = figures.get(timeout=300)
        flood_process.join(timeout=60)
        noisy = percentiles(noisy_reads)
        print("noisy", json.dumps(noisy), flush=True)
        assert ended_b.started_at is not None
        b_started = ended_b.started_at.timestamp()
        a_started_between = 0
        a_queued_at_b = 0
        for job in all_jobs(a):
            if job.created_at.timestamp() <= submitted and (
                job.started_at is None or job.started_at.timestamp() > submitted
            ):
                a_queued_at_b += 1
            if job.started_at is not None and submitted < job.started_at.timestamp() < b_started:
                a_started_between += 1
        slow = 0.002 * quiet["p99_ms"]
        slow_reads = [(at, r) for at, r in zip(read_at, noisy_reads, strict=True) if r > slow]
        ended = flood["uploads_ended"]
        result = {
            "quiet": quiet,
            "noisy": noisy,
            "p99_ratio": noisy["p99_ms"] / quiet["p99_ms"],
            # How many of B's reads took more than twice the quiet p99 (the p99 is the
            # len(noisy_reads) // 100-th slowest read).
            "reads_over_2x_quiet_p99": len(slow_reads),
            # When (s after A's flood began) those reads started, and when A's uploads ended:
            # which part of the flood they met; and how long each took.
            "slow_reads_at_s": [round(at - flood_started, 2) for at, _ in slow_reads],
            "slow_reads_ms": [round(r * 1000, 1) for _, r in slow_reads],
            "flood_started_at": flood_started,
            "uploads_ended_at_s": [
                round(min(ended, default=flood_started) - flood_started, 1),
                round(max(ended, default=flood_started) - flood_started, 1),
            ],
            "a_accepted": flood["accepted"],
            "a_refused_429": flood["refused"],
            "a_streams_open": flood["streams_open"],
            "a_uploads_done": flood["uploads_done"],
            "a_uploaded_mib": flood["uploaded_bytes"] / MIB,
            "a_errors": flood["errors"][:5],
            "a_queued_when_b_submitted": a_queued_at_b,
            "a_jobs_started_before_b": a_started_between,
            "b_wait_s": b_started - submitted,
            "load_average": os.getloadavg()[0],
            # Where the processor went while A flooded (s, over noisy_wall_s of 2 cores).
            "cpu_s": cpu_noisy,
            "noisy_wall_s": round(noisy_wall_s, 1),
            # Redis: fsyncs of its append-only file it had to delay (the disk busy), and its
            # stalls over 10 ms by kind: [kind, latest at, latest ms, most ms].
            "redis_aof_delayed_fsync": server.info("persistence")["aof_delayed_fsync"],
            "redis_latency": [
                [str(kind, "ascii") if isinstance(kind, bytes) else kind, at, latest, most]
                for kind, at, latest, most in server.execute_command("LATENCY", "LATEST")
            ],
        }
        print(json.dumps(result, indent=2), flush=True)
        return result


def run_registrations(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The registrations phase (bench/service/_registrations.py): B's registrations and
    /healthz alone, then under A's heavy registrations; their figures and ratios."""
    files = []
    for i in range(args.uploads + args.imports):
        path = work / f"upload_{i}.npz"
        write_upload(path, args.upload_mib, i)
        files.append(path)
    small = _npz(
        work / "small.npz", np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32)
    )
    model_kwargs = {
        "in_features": args.model_in_features,
        "hidden": args.model_hidden,
        "depth": args.model_depth,
    }
    with contextlib.ExitStack() as cleanup:
        s3: S3Sources | None = None
        if args.imports:
            s3 = cleanup.enter_context(s3_sources(work, files[args.uploads :]))
        overrides = {**(s3.env if s3 is not None else {}), **uploads_overrides(args)}
        stack = cleanup.enter_context(
            running_stack(work / "stack", env_overrides=overrides, api_processes=args.api_processes)
        )
        uploads_api = start_uploads_api(args, stack, overrides, cleanup)
        records = stack.records()
        key_a, key_b = records.create_api_key("a"), records.create_api_key("b")
        if s3 is not None:
            records.allow_import(key_a.tenant_id, s3.prefix)
        b = Client(stack.url, key_b.key, timeout_s=600)
        if args.pin:
            pin_machines(stack)
            if uploads_api is not None:
                pin(uploads_api.pid, args.uploads_processor)
        b.add_model("mlp", {"in_features": 16, "hidden": 16, "depth": 1})  # warm: first build
        b.add_dataset(small)

        gc.collect()
        gc.freeze()
        quiet = b_registrations(b, stack.url, small, args.seconds).figures()
        print("quiet", json.dumps(quiet), flush=True)

        context = multiprocessing.get_context("fork")
        stop, figures = context.Event(), context.Queue()
        flood_process = context.Process(
            target=run_registration_flood,
            args=(
                stack.url,
                key_a.key,
                files[: args.uploads],
                s3.sources if s3 is not None else [],
                model_kwargs,
                args.model_threads,
                args.pin,
                args.a_nice,
                stop,
                figures,
            ),
        )
        flood_process.start()
        time.sleep(args.backlog_s)  # A's uploads under way, its first imports and builds
        noisy = b_registrations(b, stack.url, small, args.seconds).figures()
        stop.set()
        flood: dict[str, Any] = figures.get(timeout=600)
        flood_process.join(timeout=60)
        print("noisy", json.dumps(noisy), flush=True)
        result: dict[str, Any] = {"quiet": quiet, "noisy": noisy, "a": flood}
        for kind in ("model", "dataset", "healthz"):
            for at in ("p50_ms", "p99_ms"):
                result[f"{kind}_{at.removesuffix('_ms')}_ratio"] = noisy[kind][at] / quiet[kind][at]
        result["load_average"] = os.getloadavg()[0]
        result["store"] = "s3" if s3 is not None else "local"
        print(json.dumps(result, indent=2), flush=True)
        return result


def registrations_table(found: dict[str, Any]) -> str:
    """The registrations phase's figures as a row of bench/RESULTS.md."""

    def cell(kind: str) -> str:
        quiet, noisy = found["quiet"][kind], found["noisy"][kind]
        return (
            f"{quiet['p50_ms']:.1f} / {noisy['p50_ms']:.1f} ms "
            f"(**{found[f'{kind}_p50_ratio']:.2f}**), {quiet['p99_ms']:.1f} / "
            f"{noisy['p99_ms']:.1f} ms (**{found[f'{kind}_p99_ratio']:.2f}**)"
        )

    done = found["a"]["done"]
    return (
        "| B's model registration p50, p99 quiet / noisy (ratios; target <= 2) | B's dataset "
        "registration p50, p99 (target <= 2) | /healthz p50, p99 | A: uploads / imports / "
        "models done, 429 / errors | B's errors (quiet, noisy) |\n"
        "|---|---|---|---|---|\n"
        f"| {cell('model')} | {cell('dataset')} | {cell('healthz')} "
        f"| {done['uploads']} / {done['imports']} / {done['models']}, "
        f"{found['a']['refused_429']} / {found['a']['error_count']} "
        f"| {found['quiet']['error_count']}, {found['noisy']['error_count']} |"
    )


def registrations_figure(found: dict[str, Any]) -> Measured:
    ratios = [found[f"{kind}_{at}_ratio"] for kind in ("dataset", "model") for at in ("p50", "p99")]
    value = "datasets {:.2f}, {:.2f}; models {:.2f}, {:.2f}".format(*ratios)
    return Measured(
        "noisy-neighbour-registrations",
        "B's registrations during A's uploads / B alone, p50; p99",
        value,
        met(f"<= {RATIO_TARGET:g}", max(ratios) <= RATIO_TARGET),
    )


def reads_figure(found: dict[str, Any]) -> Measured:
    ratio = found["p99_ratio"]
    return Measured(
        "noisy-neighbour-reads",
        "B's status-read p99 during A's flood / B alone",
        f"{ratio:.2f}",
        met(f"<= {RATIO_TARGET:g}", ratio <= RATIO_TARGET),
    )


def all_jobs(client: Client) -> list[JobPublic]:
    """Every job of the client's tenant, a page of 100 at a time (within its rate limit)."""
    jobs: list[JobPublic] = []
    token: str | None = None
    while True:
        try:
            page = client.jobs(page_size=100, page_token=token)
        except ApiClientError as exc:
            if exc.status != 429:
                raise
            time.sleep(1.0)  # the flood spent the tenant's bucket: it refills
            continue
        jobs += page.items
        token = page.next_page_token
        if token is None:
            return jobs
        time.sleep(READ_INTERVAL_S)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _npz(path: Path, x: np.ndarray) -> Path:
    path.write_bytes(npz_bytes(x=x))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--backlog-s", type=float, default=3.0)
    parser.add_argument("--uploads", type=int, default=20)
    parser.add_argument("--upload-mib", type=int, default=64)
    parser.add_argument("--streams", type=int, default=10)
    parser.add_argument(
        "--a-nice",
        type=int,
        default=0,
        help="run A's client this much below everything else (19: as if on its own machine)",
    )
    parser.add_argument("--api-processes", type=int, default=1, help="uvicorn processes of the API")
    parser.add_argument(
        "--uploads-nice",
        type=int,
        default=None,
        help="an API process of its own for the uploads' bytes (BNADAPT_UPLOADS_URL), run at "
        "this nice value (BNADAPT_API_NICE), as `bnadapt up --uploads-nice` runs it",
    )
    parser.add_argument(
        "--uploads-processor",
        type=int,
        default=0,
        help="with --pin and --uploads-nice: the processor of the uploads' API process (0, the "
        "API's; 1, that of the worker and A's client: as on a machine of its own)",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="one processor for the API, Redis and B, the other for the worker and A's client: "
        "the API on a machine of its own, as deployed (needs 2 processors)",
    )
    parser.add_argument(
        "--rate", type=float, default=50.0, help="A's submissions a second (its rate limit)"
    )
    parser.add_argument(
        "--phase",
        choices=("reads", "registrations"),
        default="reads",
        help="reads: B's status reads under A's jobs, streams and uploads (issue 27); "
        "registrations: B's small registrations under A's large uploads, imports and models "
        "(issue 41)",
    )
    parser.add_argument(
        "--imports",
        type=int,
        default=4,
        help="registrations: A's imports at once, each of --upload-mib (0: no S3 store)",
    )
    parser.add_argument("--model-in-features", type=int, default=4096)
    parser.add_argument("--model-hidden", type=int, default=4096)
    parser.add_argument("--model-depth", type=int, default=4)
    parser.add_argument(
        "--model-threads", type=int, default=1, help="registrations: A's models at once"
    )
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    add_record_options(parser)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="noisy_bench_", dir=args.dir))
    try:
        if args.phase == "registrations":
            found = run_registrations(args, work)
            print(registrations_table(found))
            write_figures("bench.service.noisy_neighbour", args, [registrations_figure(found)])
            return
        found = run(args, work)
        print(
            "| B's status p99 quiet / noisy (ratio; target <= 2) | A's jobs started between B's "
            "submission and its start (target <= 1) | A: accepted / 429 / streams / uploads |\n"
            "|---|---|---|\n"
            f"| {found['quiet']['p99_ms']:.1f} / {found['noisy']['p99_ms']:.1f} ms "
            f"(**{found['p99_ratio']:.2f}**) | **{found['a_jobs_started_before_b']}** "
            f"({found['a_queued_when_b_submitted']} queued; B waited {found['b_wait_s']:.1f} s) "
            f"| {found['a_accepted']} / {found['a_refused_429']} / {found['a_streams_open']} / "
            f"{found['a_uploads_done']} of {found['a_uploaded_mib']:.0f} MiB |"
        )
        write_figures("bench.service.noisy_neighbour", args, [reads_figure(found)])
    finally:
        import shutil

        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
