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

Run from the repository root: ``python -m bench.training.processes --threads 8 --processes
2 4`` prints a markdown table. ``--device cuda --processes 2`` compares one GPU with two
(NCCL), on a machine with that many (bench/gpu_checks.sh runs it).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch

from api_schemas import Report
from bench.recording import Measured, add_record_options, write_figures
from bench.training._jobs import run_job, workloads
from service.store.local import LocalStore


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
    add_record_options(parser)
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
    steady: dict[str, float] = {}  # by workload: the first --processes against one
    with tempfile.TemporaryDirectory() as root:
        store = LocalStore(Path(root))
        os.environ["BNADAPT_STORE_DIR"] = root  # where the ranks open the job's store
        for workload in workloads(args.quick, resnet_images=2048, resnet_batch=128):
            single = run_job(store, workload, processes=1, device=args.device)
            print(row(workload.name, 1, single, single), flush=True)
            for processes in args.processes:
                ranked = run_job(store, workload, processes=processes, device=args.device)
                print(row(workload.name, processes, ranked, single), flush=True)
                steady.setdefault(workload.name, samples_per_s(ranked) / samples_per_s(single))
    backend = "gloo" if args.device == "cpu" else "NCCL"
    figure = (
        f"train job in {args.processes[0]} processes ({backend}) / 1, steady samples/s: "
        + "; ".join(steady)
    )
    value = "; ".join(f"{ratio:.2f}" for ratio in steady.values())
    write_figures(
        "bench.training.processes",
        args,
        [Measured("train-processes", figure, value, "none (the scaling)")],
    )


if __name__ == "__main__":
    main()
