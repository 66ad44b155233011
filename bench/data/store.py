"""The S3 store against boto3 alone and against the local store, on one SeaweedFS server.

1. Throughput of one object of ``--mib`` MiB, against boto3's own managed transfers
   (``upload_fileobj`` / ``download_file``, boto3's defaults: 8 MiB parts, 10 threads) of the
   same bytes to the same server in the same run. ``--pairs`` rounds; in each, every service
   transfer and its boto3 baseline run one right after the other (the pair sees the same
   load), the first of the two alternating between rounds; each round writes new keys and
   reads into an empty cache. Reported per measure: the median over the pairs of the ratio
   service throughput / boto3 throughput, with its spread (min-max), and the median CPU
   seconds of this process (all threads: the client side) and of the S3 server's process.
   The store uses ``--part-mib`` and ``--in-flight`` (default: the settings' defaults).
   - write, digest announced: ``S3Store.writer(sha256=...)`` in 1 MiB chunks, what the
     dataset upload route does when the client sends ``X-Content-SHA256`` (the CLI and the
     Python client do) and what a worker's ``put_bytes`` does: parts go straight to the
     content key;
   - write, digest unknown: ``S3Store.writer()`` (the bytes go to the cache file, then that
     file to the content key once the digest is known);
   - write through the API: ``--http-mib`` MiB as one part of a resumable upload, raw body
     with ``X-Content-SHA256``, on the S3 stack of part 3 (the API's streamed upload and the
     store write; the dataset checks of a registration are not part of it);
   - read: ``S3Store.local_path`` on a machine with an empty cache (what a worker does).
2. The second job on the same inputs: GetObject requests and bytes a second ``local_path`` of
   the same object sends to the bucket (a botocore event counts them).
3. Per-job overhead: a whole small adapt job (one CPU worker, the API over HTTP) on the S3
   store against the local store, ``--jobs`` jobs each after a warm-up job, both stacks
   running and jobs submitted in turn (the same load on both). A job's time is the
   service's own, from its record: created to finished (the client's poll interval would
   otherwise round every job up).

    .venv/bin/python -m bench.data.store [--mib 1024] [--pairs 3] [--jobs 8] [--http-mib 1024]
        [--part-mib N] [--in-flight N]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

from bench.recording import Measured, add_record_options, met, spread, write_figures
from harness.digits import digits_npz
from harness.servers import S3Server, new_redis_server, new_s3_server
from harness.stack import Client, running_stack
from service.records.connection import redis_client
from service.settings import Settings
from service.store.cache import ObjectCache
from service.store.s3 import S3Store

MIB = 1024 * 1024
# The service's transfers, throughput against boto3's alone: at least this.
THROUGHPUT_TARGET = 0.8
# A small adapt job's time on the S3 store against the local store: at most this.
SMALL_JOB_TARGET = 1.5


class Cost(NamedTuple):
    """One transfer: wall seconds, CPU seconds of this process (all its threads: the client
    side) and of the S3 server's process."""

    wall_s: float
    client_cpu_s: float
    server_cpu_s: float


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _process_cpu_s(pid: int) -> float:
    # /proc/PID/stat fields 14 and 15 (utime, stime) in clock ticks; the name (field 2) may
    # hold spaces, so count from its closing parenthesis.
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measured(server_pid: int, transfer: Callable[[], object]) -> Cost:
    wall, cpu, server = time.perf_counter(), _cpu_s(), _process_cpu_s(server_pid)
    transfer()
    return Cost(time.perf_counter() - wall, _cpu_s() - cpu, _process_cpu_s(server_pid) - server)


# (label, service measure, boto3 measure) in the order they are reported.
MEASURES: tuple[tuple[str, str, str], ...] = (
    ("write, digest announced", "service_up", "boto_up"),
    ("write, digest unknown", "service_up_unknown", "boto_up_unknown"),
    ("read, empty cache", "service_down", "boto_down"),
)


def throughput(
    server: S3Server, root: Path, mib: int, pairs: int, part_mib: int, in_flight: int
) -> tuple[dict[str, list[Cost]], dict[str, float]]:
    """``pairs`` rounds of each measure of :data:`MEASURES`, the service's and boto3's
    transfer of the same bytes one right after the other (the first of the two alternates
    between rounds); every round writes new keys and reads into an empty cache. Also the
    GetObject requests of the measured ``local_path`` and of a second one of the same object
    (the last round's)."""
    redis = new_redis_server(root / "redis")
    assert server.process is not None
    pid = server.process.pid
    try:
        bucket = server.new_bucket()
        client = redis_client(redis.url)
        source = root / "object.bin"
        with source.open("wb") as file:
            for _ in range(mib):
                file.write(os.urandom(MIB))
        digest = hashlib.sha256()
        with source.open("rb") as reading:
            while chunk := reading.read(MIB):
                digest.update(chunk)
        sha256 = digest.hexdigest()
        boto = server.client()
        costs: dict[str, list[Cost]] = {name: [] for _, a, b in MEASURES for name in (a, b)}
        cache: dict[str, float] = {}  # the last round's first and second local_path

        def store(prefix: str, cache: str, cache_bytes: int = 0) -> S3Store:
            return S3Store(
                bucket,
                prefix,
                ObjectCache(root / cache, cache_bytes),
                client,
                part_bytes=part_mib * MIB,
                parts_in_flight=in_flight,
            )

        def boto_upload(key: str) -> None:
            with source.open("rb") as file:
                boto.upload_fileobj(file, bucket, key)

        def service_write(target: S3Store, announced: str | None) -> None:
            with target.writer(sha256=announced) as writer, source.open("rb") as file:
                while chunk := file.read(MIB):
                    writer.write(chunk)
            target.cache.discard(writer.sha256)

        def run_round(round_: int) -> None:
            plain, svc, unk = f"plain{round_}/object.bin", f"svc{round_}/", f"unk{round_}/"
            read_cache = f"read{round_}"
            # Made, with their clients, before the clock starts, like boto3's client.
            announced, unknown = store(svc, "a"), store(unk, "u")
            reader = store(svc, read_cache, 4 * mib * MIB)
            for made in (announced, unknown, reader):
                assert made.client is not None
            gets: list[int] = []  # content-length of each GetObject the reader sends
            reader.client.meta.events.register(
                "after-call.s3.GetObject",
                lambda http_response, **_: gets.append(
                    int(http_response.headers.get("content-length", 0))
                ),
            )
            runs: list[tuple[str, Callable[[], object], str, Callable[[], object]]] = [
                (
                    "service_up",
                    lambda: service_write(announced, sha256),
                    "boto_up",
                    lambda: boto_upload(plain),
                ),
                (
                    "service_up_unknown",
                    lambda: service_write(unknown, None),
                    "boto_up_unknown",
                    lambda: boto_upload(plain + ".2"),
                ),
                (
                    "service_down",
                    lambda: reader.local_path(sha256),
                    "boto_down",
                    lambda: boto.download_file(bucket, plain, str(root / "plain.bin")),
                ),
            ]
            for service_name, service_run, boto_name, boto_run in runs:
                order = [(service_name, service_run), (boto_name, boto_run)]
                for name, run in order if round_ % 2 else order[::-1]:
                    costs[name].append(measured(pid, run))
            # The second job on the same inputs: what a second local_path asks of the bucket.
            first_gets, first_bytes = len(gets), sum(gets)
            start = time.perf_counter()
            reader.local_path(sha256)
            cache.update(
                first_gets=first_gets,
                first_bytes=first_bytes,
                second_gets=len(gets) - first_gets,
                second_bytes=sum(gets) - first_bytes,
                second_s=time.perf_counter() - start,
            )
            (root / "plain.bin").unlink()
            shutil.rmtree(root / read_cache)
            for key in (plain, plain + ".2", f"{svc}objects/{sha256}", f"{unk}objects/{sha256}"):
                boto.delete_object(Bucket=bucket, Key=key)

        for round_ in range(pairs):
            run_round(round_)

        source.unlink()
        return costs, cache
    finally:
        redis.stop()


def _stamp(record: dict[str, Any], field: str) -> float:
    return datetime.fromisoformat(str(record[field]).replace("Z", "+00:00")).timestamp()


def job_seconds(
    root: Path, s3_env: dict[str, str], jobs: int, http_mib: int, boto: Any
) -> tuple[list[float], list[float], dict[str, float]]:
    """Seconds from created to finished of ``jobs`` small adapt jobs on a local-store stack
    and on an S3 stack, both running, submitted in turn (local, S3, local, ...) so that both
    see the same load; with ``http_mib``, also a file of that size uploaded through the S3
    stack's API against boto3 (``boto``) in the same run."""
    single = {"BNADAPT_WORKER_THREADS": "1"}
    with (
        running_stack(root / "local", single) as local_stack,
        running_stack(root / "s3stack", {**s3_env, **single}) as s3_stack,
    ):
        transfer: dict[str, float] = {}
        if http_mib:
            transfer = http_upload(root, s3_stack.client("bench"), boto, s3_env, http_mib)
        runs: list[tuple[Client, dict[str, Any], list[float]]] = []
        for stack in (local_stack, s3_stack):
            client: Client = stack.client("bench")
            model = client.add_model("digits_cnn", {"width": 8}).json()
            dataset = client.add_dataset(digits_npz(n=512)).json()
            body: dict[str, Any] = {
                "kind": "adapt",
                "model_id": model["id"],
                "dataset_id": dataset["id"],
                "params": {"batch_size": 128},
            }
            runs.append((client, body, []))
        for round_ in range(jobs + 1):  # the first round warms the workers and their caches
            for client, body, times in runs:
                job = client.submit(body).json()
                record = client.wait(job["id"], timeout_s=300)
                assert record["status"] == "succeeded", record
                if round_:
                    times.append(_stamp(record, "finished_at") - _stamp(record, "created_at"))
        return runs[0][2], runs[1][2], transfer


def http_upload(
    root: Path, client: Client, boto: Any, env: dict[str, str], mib: int
) -> dict[str, float]:
    """``mib`` MiB of random bytes sent as one part of a resumable upload (``PUT
    /v1/uploads/{id}/parts/1``, raw body, with ``X-Content-SHA256``: the API's streamed upload
    and the store write, no dataset checks), against boto3's ``upload_fileobj`` of the same
    file to the same bucket."""
    path = root / "big.bin"
    with path.open("wb") as file:
        for _ in range(mib):
            file.write(os.urandom(MIB))
    size = path.stat().st_size
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(MIB):
            digest.update(chunk)
    bucket = env["BNADAPT_STORE_URL"].removeprefix("s3://").partition("/")[0]
    start = time.perf_counter()
    with path.open("rb") as file:
        boto.upload_fileobj(file, bucket, "plain/big.bin")
    boto_s = time.perf_counter() - start
    upload = client.http.post("/v1/uploads", json={"name": "big", "size_bytes": size}).json()
    start = time.perf_counter()
    with path.open("rb") as file:
        response = client.http.put(
            f"/v1/uploads/{upload['id']}/parts/1",
            content=file,
            headers={
                "Content-Type": "application/octet-stream",
                "Content-Length": str(size),
                "X-Content-SHA256": digest.hexdigest(),
            },
            timeout=3600,
        )
    api_s = time.perf_counter() - start
    assert response.status_code < 300, response.text
    path.unlink()
    return {"http_up": size / api_s, "http_boto_up": size / boto_s, "http_bytes": size}


def pair_ratios(costs: dict[str, list[Cost]], way: str, base: str) -> list[float]:
    """Service throughput over boto3's, pair by pair, in ascending order."""
    return sorted(b.wall_s / s.wall_s for s, b in zip(costs[way], costs[base], strict=True))


def size_text(mib: int) -> str:
    return f"{mib / 1024:g} GiB" if mib >= 1024 else f"{mib} MiB"


def throughput_figures(costs: dict[str, list[Cost]], mib: int) -> list[Measured]:
    """The records of part 1's store transfers: the median ratio with its spread (min-max)."""
    size = size_text(mib)
    records = (
        (
            "s3-write",
            f"{size} write to the S3 store with its digest / boto3 alone, same SeaweedFS",
            "service_up",
            "boto_up",
        ),
        (
            "s3-write-no-digest",
            f"{size} write without a digest (no X-Content-SHA256) / boto3 alone",
            "service_up_unknown",
            "boto_up_unknown",
        ),
        (
            "s3-read",
            f"{size} read into a worker's cache / boto3 alone",
            "service_down",
            "boto_down",
        ),
    )
    found = []
    for name, figure, way, base in records:
        ratios = pair_ratios(costs, way, base)
        median = statistics.median(ratios)
        target = (
            "none (spooled, then uploaded)"
            if name == "s3-write-no-digest"
            else met(f">= {THROUGHPUT_TARGET:g}", median >= THROUGHPUT_TARGET)
        )
        found.append(Measured(name, figure, spread(median, ratios[0], ratios[-1], 2), target))
    return found


def report_throughput(
    costs: dict[str, list[Cost]], cache: dict[str, float], mib: int, settings: str
) -> None:
    size = mib * MIB
    mb = 1e6
    pairs = len(costs["service_up"])
    print(f"object of {mib} MiB, {pairs} interleaved pairs, store {settings}")
    print("  (ratio = service throughput / boto3's in the same pair: median [min-max];")
    print("   CPU = median seconds of CPU of this process / of the S3 server per transfer)")
    for label, way, base in MEASURES:
        service, boto = costs[way], costs[base]
        ratios = pair_ratios(costs, way, base)
        print(
            f"  {label}: service {size / statistics.median(c.wall_s for c in service) / mb:6.1f}"
            f" MB/s, boto3 {size / statistics.median(c.wall_s for c in boto) / mb:6.1f} MB/s, "
            f"ratio {statistics.median(ratios):.2f} [{ratios[0]:.2f}-{ratios[-1]:.2f}]; CPU "
            f"service {statistics.median(c.client_cpu_s for c in service):.2f} / "
            f"{statistics.median(c.server_cpu_s for c in service):.2f} s, boto3 "
            f"{statistics.median(c.client_cpu_s for c in boto):.2f} / "
            f"{statistics.median(c.server_cpu_s for c in boto):.2f} s"
        )
    print(
        f"  first local_path: {cache['first_gets']} GetObject, {cache['first_bytes']} bytes; "
        f"second: {cache['second_gets']} GetObject, {cache['second_bytes']} bytes, "
        f"{cache['second_s'] * 1000:.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--jobs", type=int, default=8)
    parser.add_argument("--http-mib", type=int, default=1024)
    parser.add_argument("--pairs", type=int, default=3, help="interleaved pairs a measure")
    parser.add_argument("--part-mib", type=int, default=Settings().s3_part_bytes // MIB)
    parser.add_argument("--in-flight", type=int, default=Settings().s3_parts_in_flight)
    add_record_options(parser)
    args = parser.parse_args()
    found: list[Measured] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        server = new_s3_server(root / "s3")
        try:
            os.environ.update(server.env)
            if args.mib:
                costs, cache = throughput(
                    server, root / "throughput", args.mib, args.pairs, args.part_mib, args.in_flight
                )
                settings = f"{args.part_mib} MiB parts, {args.in_flight} in flight"
                report_throughput(costs, cache, args.mib, settings)
                found += throughput_figures(costs, args.mib)
            if args.jobs or args.http_mib:
                bucket = server.new_bucket()
                s3_env = {**server.env, "BNADAPT_STORE_URL": f"s3://{bucket}/bench"}
                local, s3, up = job_seconds(
                    root / "stacks", s3_env, args.jobs, args.http_mib, server.client()
                )
                if up:
                    ratio = up["http_up"] / up["http_boto_up"]
                    found.append(
                        Measured(
                            "s3-api-upload",
                            f"{size_text(args.http_mib)} upload through the API (parts with "
                            "X-Content-SHA256) / boto3 alone",
                            round(ratio, 2),
                            met(f">= {THROUGHPUT_TARGET:g}", ratio >= THROUGHPUT_TARGET),
                        )
                    )
                    print(
                        f"  dataset of {up['http_bytes'] / MIB:.0f} MiB through the API "
                        f"(an upload part, X-Content-SHA256): {up['http_up'] / 1e6:.1f} MB/s, "
                        f"boto3 {up['http_boto_up'] / 1e6:.1f} MB/s, ratio {ratio:.2f}"
                    )
                if args.jobs:
                    local_s, s3_s = statistics.median(local), statistics.median(s3)
                    print(
                        f"adapt job, created to finished, median of {args.jobs}: local store "
                        f"{local_s:.3f} s, S3 store {s3_s:.3f} s, ratio {s3_s / local_s:.2f}"
                    )
                    found.append(
                        Measured(
                            "s3-small-job",
                            "small adapt job, S3 store / local store",
                            round(s3_s / local_s, 2),
                            met(f"<= {SMALL_JOB_TARGET:g}", s3_s / local_s <= SMALL_JOB_TARGET),
                        )
                    )
        finally:
            server.stop()
    write_figures("bench.data.store", args, found)


if __name__ == "__main__":
    main()
