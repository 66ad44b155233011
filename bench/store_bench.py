"""The S3 store against boto3 alone and against the local store, on one SeaweedFS server.

1. Throughput of one object of ``--mib`` MiB: written through ``S3Store.writer`` in 1 MiB
   chunks (what the API's upload route does), and read through ``S3Store.local_path`` on a
   machine with an empty cache (what a worker does), against boto3's own managed transfers
   (``upload_fileobj`` / ``download_file``) of the same bytes to the same server in the same
   run. Ratio: service throughput / boto3 throughput.
2. The second job on the same inputs: GetObject requests and bytes a second ``local_path`` of
   the same object sends to the bucket (a botocore event counts them).
3. Per-job overhead: a whole small adapt job (submit to succeeded, one CPU worker, the API
   over HTTP) on the S3 store against the local store, ``--jobs`` jobs each after a warm-up
   job (the local stack first, then the S3 one).

    .venv/bin/python bench/store_bench.py [--mib 1024] [--jobs 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.records.connection import redis_client
from service.store.cache import ObjectCache
from service.store.s3 import S3Store
from tests.e2e.test_e2e import digits_npz
from tests.servers import S3Server, new_redis_server, new_s3_server
from tests.stack import Client, running_stack

MIB = 1024 * 1024


def throughput(server: S3Server, root: Path, mib: int) -> dict[str, float]:
    redis = new_redis_server(root / "redis")
    try:
        bucket = server.new_bucket()
        client = redis_client(redis.url)
        source = root / "object.bin"
        with source.open("wb") as file:
            for _ in range(mib):
                file.write(os.urandom(MIB))
        size = mib * MIB
        boto = server.client()

        start = time.perf_counter()
        with source.open("rb") as file:
            boto.upload_fileobj(file, bucket, "plain/object.bin")
        boto_up = size / (time.perf_counter() - start)
        start = time.perf_counter()
        boto.download_file(bucket, "plain/object.bin", str(root / "plain.bin"))
        boto_down = size / (time.perf_counter() - start)
        (root / "plain.bin").unlink()

        writer_machine = S3Store(bucket, "svc/", ObjectCache(root / "a", 0), client)
        start = time.perf_counter()
        with writer_machine.writer() as writer, source.open("rb") as file:
            while chunk := file.read(MIB):
                writer.write(chunk)
        service_up = size / (time.perf_counter() - start)
        source.unlink()
        writer_machine.cache.discard(writer.sha256)

        reader = S3Store(bucket, "svc/", ObjectCache(root / "b", 4 * size), client)
        gets: list[int] = []
        reader.client.meta.events.register(
            "after-call.s3.GetObject",
            lambda http_response, **_: gets.append(
                int(http_response.headers.get("content-length", 0))
            ),
        )
        start = time.perf_counter()
        reader.local_path(writer.sha256)
        service_down = size / (time.perf_counter() - start)
        first_gets, first_bytes = len(gets), sum(gets)
        start = time.perf_counter()
        reader.local_path(writer.sha256)
        second_s = time.perf_counter() - start
        return {
            "boto_up": boto_up,
            "boto_down": boto_down,
            "service_up": service_up,
            "service_down": service_down,
            "first_gets": first_gets,
            "first_bytes": first_bytes,
            "second_gets": len(gets) - first_gets,
            "second_bytes": sum(gets) - first_bytes,
            "second_s": second_s,
        }
    finally:
        redis.stop()


def job_seconds(root: Path, env: dict[str, str], jobs: int) -> list[float]:
    with running_stack(root, {**env, "BNADAPT_WORKER_THREADS": "1"}) as stack:
        client: Client = stack.client("bench")
        model = client.add_model("digits_cnn", {"width": 8}).json()
        dataset = client.add_dataset(digits_npz(n=512)).json()
        body: dict[str, Any] = {
            "kind": "adapt",
            "model_id": model["id"],
            "dataset_id": dataset["id"],
            "params": {"batch_size": 128},
        }
        times = []
        for _ in range(jobs + 1):  # the first one warms the worker and its cache
            start = time.perf_counter()
            job = client.submit(body).json()
            assert client.wait(job["id"], timeout_s=300)["status"] == "succeeded"
            times.append(time.perf_counter() - start)
        return times[1:]


def report_throughput(result: dict[str, float], mib: int) -> None:
    mb = 1e6
    print(f"object of {mib} MiB")
    for way in ("up", "down"):
        service, boto = result[f"service_{way}"], result[f"boto_{way}"]
        print(
            f"  {way:>4}: service {service / mb:7.1f} MB/s, boto3 {boto / mb:7.1f} MB/s, "
            f"ratio {service / boto:.2f}"
        )
    print(
        f"  first local_path: {result['first_gets']} GetObject, {result['first_bytes']} bytes; "
        f"second: {result['second_gets']} GetObject, {result['second_bytes']} bytes, "
        f"{result['second_s'] * 1000:.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--jobs", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        server = new_s3_server(root / "s3")
        try:
            os.environ.update(server.env)
            if args.mib:
                report_throughput(throughput(server, root / "throughput", args.mib), args.mib)
            if args.jobs:
                bucket = server.new_bucket()
                s3_env = {**server.env, "BNADAPT_STORE_URL": f"s3://{bucket}/bench"}
                local = job_seconds(root / "local", {}, args.jobs)
                s3 = job_seconds(root / "s3stack", s3_env, args.jobs)
                local_s, s3_s = statistics.median(local), statistics.median(s3)
                print(
                    f"adapt job, submit to succeeded, median of {args.jobs}: local store "
                    f"{local_s:.3f} s, S3 store {s3_s:.3f} s, ratio {s3_s / local_s:.2f}"
                )
        finally:
            server.stop()


if __name__ == "__main__":
    main()
