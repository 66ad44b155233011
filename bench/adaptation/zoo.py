"""A zoo model's adaptation in a job against a bare loop with the library's own transform.

    .venv-zoo/bin/python -m bench.adaptation.zoo                 # torchvision.resnet18, 256 photos
    .venv-zoo/bin/python -m bench.adaptation.zoo --samples 32 --pairs 1   # a quick look

Runs in the zoo environment (torchvision; scripts/install_zoo.sh), without the service: a
local store, the payload built here, each pass in a fresh process, as bench/data/datasets.py's
``--passes`` does (its NOTE [ Comparing passes under load ] holds here too). The job's side is
a full adapt pass through ``compute()`` (workers/kinds/changing.py) of ``torchvision.resnet18``
(random weights: the work is the same as with trained ones) on a tar of photo-like JPEGs of
500x375 and 375x500, with the spec ``"preprocessing": "model"`` resolves to for it (shorter
side to 256, bilinear with antialiasing, centre crop 224, ImageNet's mean and std). The bare
side: a ``DataLoader`` over the same JPEGs that decodes with Pillow and applies the weights'
own ``transforms()`` (torchvision's ``ImageClassification``), the model in train mode under
``no_grad``, with as many loader processes. The ratio is bare time over job time (>= 0.9 is the
target), the median of ``--pairs`` interleaved pairs with its quartiles.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench import REPO
from bench.data.datasets import IMAGES_HEAD, IMAGES_TAIL, PASS, pass_figure, pass_row, run_in
from bench.data.decode import write_photo_tar
from bench.recording import Measured, add_record_options, write_figures

ARCHITECTURE = "torchvision.resnet18"
SIZES = ((500, 375), (375, 500))  # (width, height)

BARE_TORCHVISION = (
    IMAGES_HEAD
    + r"""
import torchvision
name = payload.model.architecture.partition('.')[2]
transform = torchvision.models.get_model_weights(name).DEFAULT.transforms()
class Images(Dataset):
    def __len__(self): return len(where)
    def __getitem__(self, i):
        with open(path, 'rb') as f:
            f.seek(where[i][0]); data = f.read(where[i][1])
        return transform(Image.open(io.BytesIO(data)).convert('RGB'))
"""
    + IMAGES_TAIL
)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import os

    import safetensors.torch

    from api_schemas import JobPayload
    from service.formats.images import describe_tar
    from service.store.local import LocalStore
    from workers.models.architectures import build_model
    from workers.models.eval_preprocessing import evaluation_preprocessing

    store_dir = work / "store"
    store = LocalStore(store_dir)
    kwargs = {"num_classes": 1000}
    net = build_model(ARCHITECTURE, kwargs)
    weights = store.put_bytes(safetensors.torch.save(dict(net.state_dict())))
    spec = evaluation_preprocessing(ARCHITECTURE, kwargs)
    assert spec is not None, "torchvision's resnet18 has an evaluation transform"
    tar_path = work / "photos.tar"
    write_photo_tar(tar_path, list(SIZES), args.samples)
    facts = describe_tar(tar_path, spec, max_pixels=1 << 26, max_classes=10, max_elements=1 << 40)
    sha = store.put_bytes(tar_path.read_bytes())
    payload = JobPayload.model_validate(
        {
            "job_id": "job_bench",
            "tenant_id": "bench",
            "kind": "adapt",
            "model": {
                "id": "m_bench",
                "architecture": ARCHITECTURE,
                "kwargs": kwargs,
                "weights_sha256": weights,
            },
            "dataset": {
                "id": "ds_bench",
                "sha256": sha,
                "format": "tar",
                "num_samples": facts.num_samples,
                "sample_shape": list(facts.sample_shape),
                "dtype": "uint8",
                "has_labels": False,
                "preprocessing": spec.model_dump(),
            },
            "params": {"batch_size": args.batch_size, "device": "cpu", "holdout": 0},
        }
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), BNADAPT_WORKER_THREADS=str(args.threads))
    results: dict[str, Any] = {"architecture": ARCHITECTURE, "image_tar": {}}
    for loaders in args.loaders:
        loader_env = dict(env, BNADAPT_LOADER_PROCESSES=str(loaders))
        runs: dict[str, list[dict[str, Any]]] = {"job": [], "bare": []}
        samples = 0
        for pair in range(args.pairs):
            for side in ("job", "bare") if pair % 2 == 0 else ("bare", "job"):
                if side == "job":
                    found = run_in(PASS, payload, store_dir, loader_env, args.threads)
                    samples = found["samples"]
                else:
                    count = str(samples or args.samples)
                    found = run_in(
                        BARE_TORCHVISION,
                        payload,
                        store_dir,
                        loader_env,
                        args.threads,
                        count,
                        str(loaders),
                    )
                runs[side].append(found)
        row = pass_row(samples, runs["job"], runs["bare"])
        print(json.dumps(row), flush=True)
        results["image_tar"][loaders] = row
    return results


def table(results: dict[str, Any]) -> str:
    """The markdown rows of bench/RESULTS.md."""
    lines = [
        "| pass | pairs | ratio, median (quartiles); target >= 0.9 | job / bare samples/s "
        "| CPU us/sample job / bare |",
        "|---|---|---|---|---|",
    ]
    for loaders, row in results["image_tar"].items():
        low, median, high = row["ratio_quartiles"]
        lines.append(
            f"| {results['architecture']}, {loaders} loader processes | {row['pairs']} "
            f"| **{median:.3f}** ({low:.3f}-{high:.3f}) "
            f"| {row['job_samples_per_s']:.1f} / {row['bare_samples_per_s']:.1f} "
            f"| {row['job_cpu_us_per_sample']:.0f} / {row['bare_cpu_us_per_sample']:.0f} |"
        )
    return "\n".join(lines)


def figure(results: dict[str, Any]) -> Measured:
    """The record of the run with the most loader processes."""
    loaders = max(results["image_tar"])
    row = results["image_tar"][loaders]
    return pass_figure(
        "zoo-adapt-pass",
        f"{results['architecture']} adapted in a job on {row['samples']} photos / bare loop, "
        f"{loaders} loaders",
        [row],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--loaders", type=int, nargs="*", default=[0, 2])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    add_record_options(parser)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="zoo_bench_", dir=args.dir))
    try:
        found = run(args, work)
        print(json.dumps(found, indent=2))
        print(table(found))
        write_figures("bench.adaptation.zoo", args, [figure(found)])
    finally:
        subprocess.run(["rm", "-rf", str(work)], check=False)


if __name__ == "__main__":
    main()
