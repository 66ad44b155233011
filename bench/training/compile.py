"""What ``compile: true`` does to a train job: the same job run eagerly and compiled.

Each workload is one train job run three times in this process through ``compute()``, the
function the worker runs (checkpoint wrappers on the blocks, the default policy): eagerly, then
compiled with inductor on an empty inductor cache (``cold``: what the first job of a model on a
fresh worker machine pays), then compiled again after ``torch._dynamo.reset()`` with the cache
the cold run filled (``warm``: a later job of the same model and shapes on the same machine).
The figures come from the jobs' own reports (NOTE [ Compiled jobs ] in
api_schemas/jobs/params.py): ``timings.compute_s`` (the training, compilation included) and
``steps`` (warm-up steps, compilation included, apart from steady-state throughput).

Ratios, each against the eager run of the same workload in the same run:
- wall: compute_s compiled / compute_s eager (above 1: the job took longer with compile);
- steady: steady_samples_per_s compiled / eager (above 1: compiled steps are faster);
- break-even: the steps after which the compiled job would be ahead, given its extra warm-up
  time and its saving per steady step (none when steps are not faster).

Workloads: ``digits`` (digits_cnn of width 16 on sklearn's 1,797 8x8 digits) and ``resnet``
(the resnet architecture, depth 4, width 16, on 1,024 random 3x32x32 images). torch runs on
``--threads`` threads (default 1, as the shared 2-core machine the figures were taken on).
``--quick`` runs a smaller digits job only, a smoke run whose figures mean nothing.

Run from the repository root: ``python -m bench.training.compile`` prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

# An empty inductor cache of this run's own, set before torch reads it: the cold runs compile.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bnadapt-inductor-bench-")

import torch
import torch._dynamo

from api_schemas import Report
from bench.recording import Measured, add_record_options, threads_text, write_figures
from bench.training._jobs import Workload, run_job, workloads
from service.store.local import LocalStore


def run(store: LocalStore, workload: Workload, compiled: bool) -> Report:
    """The workload's job on the CPU, eager or compiled, with dynamo's caches emptied first
    (the inductor cache on disk stays: the warm runs read it)."""
    torch._dynamo.reset()
    return run_job(store, workload, device="cpu", compile=compiled)


def steady_ratio(report: Report, eager: Report) -> float:
    """Steady samples per second of ``report``'s job over the eager job's."""
    assert report.steps is not None
    assert eager.steps is not None
    assert report.steps.steady_samples_per_s is not None
    assert eager.steps.steady_samples_per_s is not None
    return report.steps.steady_samples_per_s / eager.steps.steady_samples_per_s


def row(name: str, run: str, report: Report, eager: Report) -> str:
    steps, base = report.steps, eager.steps
    assert steps is not None
    assert base is not None
    wall = report.timings.compute_s / eager.timings.compute_s
    steady = steady_ratio(report, eager)
    step_s = steps.steady_s / steps.steady_steps
    base_step_s = base.steady_s / base.steady_steps
    extra = steps.warmup_s - base.warmup_s * steps.warmup_steps / base.warmup_steps
    saving = base_step_s - step_s
    break_even = f"{max(0.0, extra) / saving:,.0f} steps" if saving > 0 else "never"
    if not steps.compiled:
        wall_text = steady_text = "1"
        break_even = ""
    else:
        wall_text, steady_text = f"{wall:.2f}", f"{steady:.2f}"
    return (
        f"| {name} | {run} | {steps.steps} | {report.timings.compute_s:.2f} | "
        f"{steps.warmup_steps} | {steps.warmup_s:.2f} | {steps.graphs_compiled} | "
        f"{steps.steady_samples_per_s:,.0f} | {wall_text} | {steady_text} | {break_even} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    add_record_options(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), inductor for the compiled runs")
    print()
    print(
        "| workload | run | steps | compute_s | warm-up steps | warm-up s | graphs | "
        "steady samples/s | wall ratio | steady ratio | break-even |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    steady: dict[str, list[float]] = {}  # by workload: the cold and the warm run's ratio
    with tempfile.TemporaryDirectory() as root:
        store = LocalStore(Path(root))
        for workload in workloads(args.quick, resnet_images=1024, resnet_batch=64):
            eager = run(store, workload, compiled=False)
            print(row(workload.name, "eager", eager, eager), flush=True)
            cold = run(store, workload, compiled=True)
            print(row(workload.name, "compiled, cold cache", cold, eager), flush=True)
            warm = run(store, workload, compiled=True)
            print(row(workload.name, "compiled, warm cache", warm, eager), flush=True)
            steady[workload.name] = sorted(steady_ratio(run, eager) for run in (cold, warm))
    figure = f"compiled train job / eager, steady step, {threads_text(args.threads)}: " + "; ".join(
        steady
    )
    value = "; ".join(f"{low:.2f}-{high:.2f}" for low, high in steady.values())
    target = "none (pays by the number of steps)"
    write_figures(
        "bench.training.compile", args, [Measured("train-compiled", figure, value, target)]
    )


if __name__ == "__main__":
    main()
