"""What ``processes: N`` does to a train job's step throughput on the CPU (gloo): the same job
in one process and in N ranks, on the same global batch (docs/distributed.md).

Each workload is one train job run through ``compute()``, the function the worker runs
(checkpoint wrappers on the blocks, the default policy), first with ``processes: 1`` on
``--threads`` torch threads, then with ``processes: N``, whose ranks share those threads
(``--threads // N`` each, as the worker gives them). The figures come from the jobs' own
reports: ``steps.steady_samples_per_s`` (one process) against the sum of the ranks'
``rank_steps[r].steady_samples_per_s`` (each rank counts its own slices), and
``timings.compute_s``, which for the ranks includes starting them (spawning N interpreters
that import torch, the rendezvous) and every epoch's validation on rank 0.

Ratios, each against the one-process run of the same workload in the same run:
- steady: samples per second of the N ranks together / of one process (above 1: the ranks
  train faster);
- wall: compute_s with N ranks / with one (below 1: the job ended sooner).

Workloads: ``digits`` (digits_cnn of width 16 on sklearn's 1,797 8x8 digits) and ``resnet``
(the resnet architecture, depth 4, width 16, on 2,048 random 3x32x32 images). ``--quick``
runs a small digits job only, a smoke run whose figures mean nothing.

Run from the repository root: ``python bench/train_processes_bench.py --threads 8 --processes
2 4`` prints a markdown table. ``--device cuda --processes 2`` compares one GPU with two
(NCCL), on a machine with that many (bench/gpu_checks.sh runs it).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sklearn.datasets import load_digits

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from api_schemas import JobPayload, Report, TrainParams  # noqa: E402
from api_schemas.jobs.public import JobPayloadDataset, JobPayloadModel  # noqa: E402
from service.store.local import LocalStore  # noqa: E402
from workers.kinds.changing import compute  # noqa: E402
from workers.models.architectures import build_model  # noqa: E402
from workers.running.saving import weights_bytes  # noqa: E402


@dataclass(frozen=True)
class Workload:
    name: str
    architecture: str
    kwargs: dict[str, Any]
    x: np.ndarray
    y: np.ndarray
    params: dict[str, Any]


def workloads(quick: bool) -> list[Workload]:
    data = load_digits()
    x = (data.images / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)  # (1797, 1, 8, 8)
    y = data.target.astype(np.int64)
    digits = Workload(
        "digits",
        "digits_cnn",
        {"width": 16},
        x[:400] if quick else x,
        y[:400] if quick else y,
        {"epochs": 1 if quick else 3, "batch_size": 64, "lr": 0.02},
    )
    if quick:
        return [digits]
    rng = np.random.default_rng(0)
    images = rng.random((2048, 3, 32, 32), dtype=np.float32)
    labels = rng.integers(0, 10, 2048).astype(np.int64)
    resnet = Workload(
        "resnet",
        "resnet",
        {"depth": 4, "width": 16},
        images,
        labels,
        {"epochs": 2, "batch_size": 128, "lr": 0.02},
    )
    return [digits, resnet]


def npz_bytes(**arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]
    return buffer.getvalue()


def run_job(store: LocalStore, workload: Workload, processes: int, device: str) -> Report:
    torch.manual_seed(0)
    model = build_model(workload.architecture, workload.kwargs)
    params = TrainParams.model_validate(
        {**workload.params, "device": device, "processes": processes, "validation_fraction": 0.0}
    )
    payload = JobPayload(
        job_id="job_bench",
        tenant_id="tn_bench",
        kind="train",
        model=JobPayloadModel(
            id="mdl_bench",
            architecture=workload.architecture,
            kwargs=workload.kwargs,
            weights_sha256=store.put_bytes(weights_bytes(model.state_dict())),
        ),
        dataset=JobPayloadDataset(
            id="ds_bench",
            sha256=store.put_bytes(npz_bytes(x=workload.x, y=workload.y)),
            format="npz",
        ),
        params=params,
    )
    return compute(payload, store).report


def samples_per_s(report: Report) -> float:
    """The job's steady samples per second: one process's, or its ranks' together."""
    if report.rank_steps:
        rates = [r.steady_samples_per_s for r in report.rank_steps]
    else:
        assert report.steps is not None
        rates = [report.steps.steady_samples_per_s]
    assert all(rate is not None for rate in rates), "too few steps to time a steady state"
    return sum(rate for rate in rates if rate is not None)


def row(name: str, processes: int, report: Report, single: Report) -> str:
    rate = samples_per_s(report)
    steady = rate / samples_per_s(single)
    wall = report.timings.compute_s / single.timings.compute_s
    return (
        f"| {name} | {processes} | {report.world_size} | {report.batches} | "
        f"{report.timings.compute_s:.2f} | {rate:,.0f} | {steady:.2f} | {wall:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads, all ranks together")
    parser.add_argument("--processes", type=int, nargs="+", default=[2])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one GPU a rank, NCCL"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    where = "gloo, CPU" if args.device == "cpu" else "NCCL, one GPU a rank"
    print(f"torch {torch.__version__}, {args.threads} thread(s) in all, {where}")
    print()
    print(
        "| workload | processes | world_size | steps | compute_s | steady samples/s | "
        "steady ratio | wall ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        store = LocalStore(Path(root))
        os.environ["BNADAPT_STORE_DIR"] = root  # where the ranks open the job's store
        for workload in workloads(args.quick):
            single = run_job(store, workload, 1, args.device)
            print(row(workload.name, 1, single, single), flush=True)
            for processes in args.processes:
                ranked = run_job(store, workload, processes, args.device)
                print(row(workload.name, processes, ranked, single), flush=True)


if __name__ == "__main__":
    main()
