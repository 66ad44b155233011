"""Does sharding an adapt job over workers make it finish sooner?

The whole service (Redis-compatible server, API, two workers with one torch thread each, so
each worker has a core of this 2-core machine) runs one adapt job at a time: the same
`precise` job with shards=1 and shards=2, on the same data with labels (the job then also
measures the model before and after on all of it) and without. Reported: the wall time from
submit to succeeded, median of ``--repeats`` runs in alternating order, and the ratio
one worker / sharded (the speedup; 2.0 would be perfect on two workers).

    .venv/bin/python -m bench.data.shards [--samples 4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.recording import Measured, add_record_options, write_figures
from harness.stack import Client, npz_bytes, running_stack

ARCH = {"in_channels": 1, "depth": 4, "width": 32}
BATCH = 64


def created(response: Any, status: int) -> dict[str, Any]:
    if response.status_code != status:
        raise SystemExit(f"{response.status_code}: {response.text}")
    body: dict[str, Any] = response.json()
    return body


def run_job(client: Client, model_id: str, dataset_id: str, shards: int) -> float:
    body = {
        "kind": "adapt",
        "model_id": model_id,
        "dataset_id": dataset_id,
        "params": {"estimator": "precise", "batch_size": BATCH, "shards": shards},
    }
    started = time.perf_counter()
    job = created(client.submit(body), 202)
    done = client.wait(job["id"], timeout_s=1800)
    elapsed = time.perf_counter() - started
    if done["status"] != "succeeded":
        raise SystemExit(f"job {job['id']} {done['status']}: {done.get('error')}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    add_record_options(parser)
    args = parser.parse_args()
    speedups: dict[bool, float] = {}
    rng = np.random.default_rng(0)
    x = rng.random((args.samples, 1, 32, 32), dtype=np.float32)  # (N, 1, 32, 32)
    y = rng.integers(0, 10, args.samples)
    settings = {"BNADAPT_WORKER_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp, running_stack(Path(tmp), settings, 2) as stack:
        client = stack.client("bench")
        model = created(client.add_model("resnet", ARCH), 201)
        print(
            f"resnet {ARCH}, {args.samples} images 1x32x32, batches of {BATCH}, precise; "
            f"2 workers x 1 torch thread; median of {args.repeats}"
        )
        for labels in (True, False):
            data = npz_bytes(x=x, y=y) if labels else npz_bytes(x=x)
            dataset = created(client.add_dataset(data), 201)
            run_job(client, model["id"], dataset["id"], 2)  # warm both workers
            times: dict[int, list[float]] = {1: [], 2: []}
            for repeat in range(args.repeats):
                for shards in (1, 2) if repeat % 2 == 0 else (2, 1):
                    times[shards].append(run_job(client, model["id"], dataset["id"], shards))
            one, two = (statistics.median(times[k]) for k in (1, 2))
            what = "with labels (evaluated before and after)" if labels else "without labels"
            print(
                f"{what:42} one worker {one:6.2f} s   2 shards {two:6.2f} s   "
                f"speedup {one / two:.2f}   (runs: {times})"
            )
            speedups[labels] = one / two
    figure = "adapt job on 2 workers (2 shards) / 1 worker: labelled / unlabelled data"
    value = f"{speedups[True]:.2f} / {speedups[False]:.2f} times as fast"
    write_figures(
        "bench.data.shards", args, [Measured("shards-scaling", figure, value, "none (the scaling)")]
    )


if __name__ == "__main__":
    main()
