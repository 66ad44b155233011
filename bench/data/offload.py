"""``/healthz`` latency while large dataset registrations run (NOTE [ Heavy work off the request
path ] in service/api/offload.py): the p50 and p99 of a stream of ``/healthz`` requests with the
API quiet, then while ``--registrations`` resumable uploads of ``--mib`` MiB each are completed
at once (parts joined, hashed, checked as a dataset and registered), reported as ratios to the
quiet figures. The API runs in its own process (a real stack on a local store), the probes
from this one, one at a time.

Two settings of ``BNADAPT_API_COPY_THREADS`` in one run, each on a fresh stack: the default
(4), and 40, as many as the request path's pool, which is how many copies ran at once when
they shared it (before the pool of their own, 40 copies also took every thread of the request
path: a wait no ratio shows, measured by tests/api/tenancy/test_heavy_work.py instead).

    .venv/bin/python -m bench.data.offload [--mib 64] [--registrations 20] [--quiet 300]

Small run, to check the bench works: ``--mib 2 --quiet 50``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from bench.recording import Measured, add_record_options, write_figures
from harness.stack import npz_bytes, running_stack

MIB = 1024 * 1024
COPY_THREADS = (4, 40)
# What a probe of a busy API may take at p99 with the default copy threads.
HEALTHZ_P99_TARGET_MS = 100.0


def dataset_file(mib: int, seed: int) -> bytes:
    """An npz of uint8 images, about ``mib`` MiB, its bytes unlike any other seed's."""
    samples = max(1, mib * MIB // (3 * 64 * 64))
    x = np.random.default_rng(seed).integers(0, 256, (samples, 3, 64, 64), dtype=np.uint8)
    return npz_bytes(x=x)


def started_upload(client: httpx.Client, content: bytes) -> str:
    created = client.post("/v1/uploads", json={"size_bytes": len(content)})
    created.raise_for_status()
    upload_id: str = created.json()["id"]
    half = len(content) // 2
    for number, part in ((1, content[:half]), (2, content[half:])):
        client.put(f"/v1/uploads/{upload_id}/parts/{number}", content=part).raise_for_status()
    return upload_id


def probe(url: str, until: threading.Event | None, count: int) -> list[float]:
    """``/healthz`` latencies in seconds, one request at a time: ``count`` of them, or as
    many as fit before ``until`` is set."""
    latencies: list[float] = []
    with httpx.Client(base_url=url, timeout=120) as client:
        while (until is None and len(latencies) < count) or (
            until is not None and not until.is_set()
        ):
            start = time.perf_counter()
            client.get("/healthz").raise_for_status()
            latencies.append(time.perf_counter() - start)
    return latencies


def p(latencies: list[float], q: float) -> float:
    return statistics.quantiles(latencies, n=100, method="inclusive")[int(q) - 1]


def measure(copy_threads: int, files: list[bytes], quiet: int) -> dict[str, float]:
    env = {
        "BNADAPT_API_COPY_THREADS": str(copy_threads),
        "BNADAPT_MAX_UPLOAD_PART_BYTES": str(max(len(f) for f in files)),
    }
    with tempfile.TemporaryDirectory() as root, running_stack(Path(root), env) as stack:
        client = stack.client("bench").http
        uploads = [started_upload(client, content) for content in files]
        calm = probe(stack.url, None, quiet)
        done = threading.Event()
        with ThreadPoolExecutor(len(uploads) + 1) as pool:
            probes = pool.submit(probe, stack.url, done, 0)
            start = time.perf_counter()
            completions = [
                pool.submit(client.post, f"/v1/uploads/{upload_id}:complete", json={})
                for upload_id in uploads
            ]
            for completion in completions:
                completion.result().raise_for_status()
            elapsed = time.perf_counter() - start
            done.set()
            busy = probes.result()
    return {
        "quiet_p50_ms": 1000 * p(calm, 50),
        "quiet_p99_ms": 1000 * p(calm, 99),
        "busy_p50_ms": 1000 * p(busy, 50),
        "busy_p99_ms": 1000 * p(busy, 99),
        "busy_probes": len(busy),
        "completions_s": elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="each dataset file's size")
    parser.add_argument("--registrations", type=int, default=20)
    parser.add_argument("--quiet", type=int, default=300, help="probes of the quiet API")
    add_record_options(parser)
    args = parser.parse_args()
    found: dict[int, dict[str, float]] = {}
    files = [dataset_file(args.mib, seed) for seed in range(args.registrations)]
    print(
        f"{args.registrations} registrations of {len(files[0]) / MIB:.1f} MiB at once; "
        "/healthz probed one request at a time"
    )
    print(
        "| copy threads | quiet p50 / p99 ms | busy p50 / p99 ms | p99 busy / quiet | "
        "probes while busy | completions s |"
    )
    print("|---|---|---|---|---|---|")
    for threads in COPY_THREADS:
        r = measure(threads, files, args.quiet)
        print(
            f"| {threads} | {r['quiet_p50_ms']:.1f} / {r['quiet_p99_ms']:.1f} | "
            f"{r['busy_p50_ms']:.1f} / {r['busy_p99_ms']:.1f} | "
            f"{r['busy_p99_ms'] / r['quiet_p99_ms']:.1f}x | {r['busy_probes']} | "
            f"{r['completions_s']:.1f} |",
            flush=True,
        )
        found[threads] = r
    default = found[COPY_THREADS[0]]
    busy = default["busy_p99_ms"]
    figure = (
        f"/healthz p99 while {args.registrations} registrations of {args.mib} MiB complete, "
        f"{COPY_THREADS[0]} copy threads"
    )
    value = f"{busy:.1f} ({busy / default['quiet_p99_ms']:.1f} times quiet)"
    target = (
        f"<= {HEALTHZ_P99_TARGET_MS:g} ms: {'met' if busy <= HEALTHZ_P99_TARGET_MS else 'missed'}"
    )
    write_figures(
        "bench.data.offload", args, [Measured("offload-healthz", figure, value, target, "ms")]
    )


if __name__ == "__main__":
    main()
