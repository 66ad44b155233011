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

Run from the repository root: ``python bench/train_compile_bench.py`` prints a markdown table.
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

# An empty inductor cache of this run's own, set before torch reads it: the cold runs compile.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="bnadapt-inductor-bench-")

import numpy as np
import torch
import torch._dynamo
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
    x = (data.images / 16.0).astype(np.float32)[:, None]  # (1797, 1, 8, 8)
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
    images = rng.random((1024, 3, 32, 32), dtype=np.float32)
    labels = rng.integers(0, 10, 1024).astype(np.int64)
    resnet = Workload(
        "resnet",
        "resnet",
        {"depth": 4, "width": 16},
        images,
        labels,
        {"epochs": 2, "batch_size": 64, "lr": 0.02},
    )
    return [digits, resnet]


def npz_bytes(**arrays: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)  # type: ignore[arg-type]
    return buffer.getvalue()


def run_job(store: LocalStore, workload: Workload, compiled: bool) -> Report:
    torch.manual_seed(0)
    model = build_model(workload.architecture, workload.kwargs)
    params = TrainParams.model_validate(
        {**workload.params, "device": "cpu", "compile": compiled, "validation_fraction": 0.0}
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
    torch._dynamo.reset()
    return compute(payload, store).report


def row(name: str, run: str, report: Report, eager: Report) -> str:
    steps, base = report.steps, eager.steps
    assert steps is not None
    assert base is not None
    assert steps.steady_samples_per_s is not None
    assert base.steady_samples_per_s is not None
    wall = report.timings.compute_s / eager.timings.compute_s
    steady = steps.steady_samples_per_s / base.steady_samples_per_s
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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), inductor for the compiled runs")
    print()
    print(
        "| workload | run | steps | compute_s | warm-up steps | warm-up s | graphs | "
        "steady samples/s | wall ratio | steady ratio | break-even |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        store = LocalStore(Path(root))
        for workload in workloads(args.quick):
            eager = run_job(store, workload, compiled=False)
            print(row(workload.name, "eager", eager, eager), flush=True)
            cold = run_job(store, workload, compiled=True)
            print(row(workload.name, "compiled, cold cache", cold, eager), flush=True)
            warm = run_job(store, workload, compiled=True)
            print(row(workload.name, "compiled, warm cache", warm, eager), flush=True)


if __name__ == "__main__":
    main()
