"""The benchmark of record for an adapt job at the GPU's limit (issue 30).

    .venv-zoo/bin/python -m bench.adaptation.record             # 50,000 + 2,000 photos, CUDA
    .venv-zoo/bin/python -m bench.adaptation.record --quick     # a few hundred: does it run
    .venv-zoo/bin/python -m bench.adaptation.record --cpu --quick   # the CPU rows, quick

CUDA rows: ``torchvision.resnet50`` (random weights: the work is a trained model's) BN-adapted
with ``precise`` over synthetic ImageNet-size JPEGs (photo-like, quality 90, made here with one
process per core; a few hundred distinct photos repeated), registered in a local store, the
job's spec the usual evaluation one (shorter side to 256, centre crop 224, ImageNet's mean and
std). Each side runs in a fresh process (each pays its CUDA start, as a worker's job process
does):

- **job**: ``compute()`` (workers/kinds/changing.py) of the adapt job, ``precision: bf16``
  and ``channels_last`` (the job at its limit; ``--fp32`` for the exact path), decoding as the
  worker would (``BNADAPT_DECODE`` auto: nvJPEG where torchvision can), then its weights
  serialised and stored: images/s end to end, from the job's start to its weights stored, and
  of its adapt pass alone. ``measure_batches: 1`` bounds the report's prediction diagnostics
  to one batch (without it they would predict on up to 10,000 of the samples, twice).
- **bare forward** (the limit): the same model, train mode under ``no_grad``, the same
  precision and memory format, on one pre-decoded batch already on the GPU, run as many times
  as the job has batches, after a warm-up: images/s. Target: job / bare >= 0.85.
- **plain loop**: what users write: torchvision's ``ImageFolder`` over the same JPEGs (hard
  links in a folder), ``Resize(256)``, ``CenterCrop(224)``, ``ToTensor()``, ``Normalize``, a
  ``DataLoader`` with a process per core but one and ``pin_memory``, the model in fp32 train
  mode under ``no_grad`` on the GPU: images/s. Target: job / plain >= 3.

Photo sizes: 500 x 375 (``--images``, 50,000 by default) and 4000 x 3000 (``--large-images``,
2,000 by default: 4.5 MB each). bench/gpu_checks.sh runs it with fewer (stated there) to fit
its budget. ``--cpu``: the CPU rows, the job's full pass against a bare loop with the fastest
decoder on the same cores, for both sizes (bench/data/decode.py, run from here).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import REPO

ARCHITECTURE = "torchvision.resnet50"
SPEC = {
    "resize_shorter": 256,
    "center_crop": [224, 224],
    "interpolation": "bilinear",
    "mean": [0.485, 0.456, 0.406],
    "std": [0.229, 0.224, 0.225],
}
MAX_DISTINCT = 256  # distinct photos per size; the rest repeat them (decoding costs the same)
WARMUP_BATCHES = 5


def _photo(args: tuple[int, int, int]) -> bytes:
    from harness.photos import photo_jpeg

    return photo_jpeg(*args)


def make_photos(work: Path, size: tuple[int, int], count: int) -> tuple[Path, Path]:
    """A tar of ``count`` photo-like JPEGs of ``size`` (width, height) and a folder of the same
    images (hard links to the distinct ones) in one class, as ImageFolder reads them: the tar's
    path and the folder's (the distinct photos lie in it too, apart from the class)."""
    cores = len(os.sched_getaffinity(0))
    distinct = min(count, MAX_DISTINCT if size[0] * size[1] < 4_000_000 else 2 * cores)
    with multiprocessing.Pool(cores) as pool:
        photos = pool.map(_photo, [(size[0], size[1], seed) for seed in range(distinct)])
    name = f"{size[0]}x{size[1]}"
    root = work / f"folder_{name}"
    unique = root / "distinct"
    folder = root / "images" / "class_0"
    unique.mkdir(parents=True)
    folder.mkdir(parents=True)
    for i, data in enumerate(photos):
        (unique / f"{i}.jpg").write_bytes(data)
    tar_path = work / f"photos_{name}.tar"
    with tarfile.open(tar_path, "w") as archive:
        for i in range(count):
            source = unique / f"{i % distinct}.jpg"
            archive.add(source, arcname=f"{i:06d}.jpg")
            os.link(source, folder / f"{i:06d}.jpg")
    return tar_path, root


def register(store_dir: Path, tar_path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The tar and ResNet-50's random weights in a local store; the job's payload as JSON."""
    import safetensors.torch

    from api_schemas import JobPayload, Preprocessing
    from service.formats.images import describe_tar
    from service.store.local import LocalStore
    from workers.models.architectures import build_model

    store = LocalStore(store_dir)
    weights = store.put_bytes(
        safetensors.torch.save(dict(build_model(ARCHITECTURE, {}).state_dict()))
    )
    spec = Preprocessing.model_validate(SPEC)
    facts = describe_tar(tar_path, spec, max_pixels=1 << 26, max_classes=10, max_elements=1 << 40)
    with store.writer() as writer, tar_path.open("rb") as file:
        while chunk := file.read(1 << 24):
            writer.write(chunk)
    params: dict[str, Any] = {
        "batch_size": args.batch_size,
        "estimator": "precise",
        "device": args.device,
        "holdout": 0,
        "measure_batches": 1,
    }
    if not args.fp32:
        params.update(precision="bf16", channels_last=True)
    payload = JobPayload.model_validate(
        {
            "job_id": "job_record",
            "tenant_id": "bench",
            "kind": "adapt",
            "model": {
                "id": "m_record",
                "architecture": ARCHITECTURE,
                "kwargs": {},
                "weights_sha256": weights,
            },
            "dataset": {
                "id": "ds_record",
                "sha256": writer.sha256,
                "format": "tar",
                "num_samples": facts.num_samples,
                "sample_shape": list(facts.sample_shape),
                "dtype": "uint8",
                "has_labels": False,
                "preprocessing": spec.model_dump(),
            },
            "params": params,
        }
    )
    return json.loads(payload.model_dump_json())


def side_job(payload_path: Path, store_dir: Path) -> dict[str, Any]:
    """The adapt job from its start to its weights stored, in this process."""
    started = time.perf_counter()
    import safetensors.torch

    from api_schemas import JobPayload
    from service.store.local import LocalStore
    from workers.kinds.changing import compute

    payload = JobPayload.model_validate_json(payload_path.read_text())
    store = LocalStore(store_dir)

    class Hooks:
        """The adapt pass's first and last batch."""

        total = 0
        start = end = 0.0

        def start_phase(self, phase: str, total: int, unit: str, per: float) -> None:
            if phase == "adapt":
                self.total, self.start = total, time.perf_counter()

        def report(self, done: int) -> None:
            if done == self.total:
                self.end = time.perf_counter()

        def should_stop(self) -> bool:
            return False

    hooks = Hooks()
    out = compute(payload, store, hooks, measure=False)
    store.put_bytes(safetensors.torch.save(out.state_dict))
    ended = time.perf_counter()
    return {
        "images": out.report.samples,
        "end_to_end_s": ended - started,
        "pass_s": hooks.end - hooks.start,
        "device": out.report.device,
    }


def side_bare(payload_path: Path, store_dir: Path) -> dict[str, Any]:
    """The same model's train-mode forward on one pre-decoded batch on the GPU."""
    import torch

    from api_schemas import AdaptParams, JobPayload
    from service.store.local import LocalStore
    from workers.passes.precision import adaptation_numerics
    from workers.running.loading import load_model, resolve_device

    payload = JobPayload.model_validate_json(payload_path.read_text())
    params = payload.params
    assert isinstance(params, AdaptParams)
    device = resolve_device(params.device)
    model = load_model(payload, LocalStore(store_dir)).to(device).train()
    batch = torch.randn(params.batch_size, 3, 224, 224, device=device)
    if params.channels_last:
        batch = batch.contiguous(memory_format=torch.channels_last)
    batches = -(-payload.dataset.num_samples // params.batch_size)
    with (
        adaptation_numerics(model, device, params.precision, params.channels_last),
        torch.no_grad(),
    ):
        for _ in range(WARMUP_BATCHES):
            model(batch)
        _sync(device)
        start = time.perf_counter()
        for _ in range(batches):
            model(batch)
        _sync(device)
    return {"images": batches * params.batch_size, "pass_s": time.perf_counter() - start}


def side_plain(payload_path: Path, folder: Path) -> dict[str, Any]:
    """torchvision's ImageFolder and a DataLoader, the model in fp32, as users write it."""
    import torch
    import torchvision
    from torch.utils.data import DataLoader
    from torchvision import transforms

    from api_schemas import AdaptParams, JobPayload
    from workers.running.loading import resolve_device

    payload = JobPayload.model_validate_json(payload_path.read_text())
    params = payload.params
    assert isinstance(params, AdaptParams)
    device = resolve_device(params.device)
    model = torchvision.models.resnet50().to(device).train()
    transform = transforms.Compose(
        [
            transforms.Resize(256),
            transforms.CenterCrop(224),
            transforms.ToTensor(),
            transforms.Normalize(SPEC["mean"], SPEC["std"]),
        ]
    )
    images = torchvision.datasets.ImageFolder(str(folder), transform=transform)
    workers = max(1, len(os.sched_getaffinity(0)) - 1)
    loader = DataLoader(images, batch_size=params.batch_size, num_workers=workers, pin_memory=True)
    start = time.perf_counter()
    with torch.no_grad():
        for x, _ in loader:
            model(x.to(device, non_blocking=True))
    _sync(device)
    return {"images": len(images), "pass_s": time.perf_counter() - start}


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_side(side: str, payload_path: Path, where: Path) -> dict[str, Any]:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.adaptation.record",
            "--side",
            side,
            str(payload_path),
            str(where),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    if done.returncode != 0:
        raise RuntimeError(f"the {side} side failed:\n{done.stderr[-4000:]}")
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def torchvision_imports() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - the plain loop's row is then left out
        return False
    return True


def cuda_rows(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    rows = []
    for size, count in (((500, 375), args.images), ((4000, 3000), args.large_images)):
        if count == 0:
            continue
        made = time.perf_counter()
        tar_path, root = make_photos(work, size, count)
        store_dir = work / f"store_{size[0]}"
        payload = register(store_dir, tar_path, args)
        tar_path.unlink()
        payload_path = work / f"payload_{size[0]}.json"
        payload_path.write_text(json.dumps(payload))
        made_s = time.perf_counter() - made
        job = run_side("job", payload_path, store_dir)
        bare = run_side("bare", payload_path, store_dir)
        images = root / "images"
        plain = run_side("plain", payload_path, images) if torchvision_imports() else None
        row: dict[str, Any] = {
            "photos": f"{size[0]}x{size[1]}",
            "images": job["images"],
            "data_s": round(made_s, 1),
            "job_images_per_s": job["images"] / job["end_to_end_s"],
            "job_pass_images_per_s": job["images"] / job["pass_s"],
            "bare_images_per_s": bare["images"] / bare["pass_s"],
            "device": job["device"],
        }
        row["job_over_bare"] = row["job_images_per_s"] / row["bare_images_per_s"]
        row["pass_over_bare"] = row["job_pass_images_per_s"] / row["bare_images_per_s"]
        if plain is not None:
            row["plain_images_per_s"] = plain["images"] / plain["pass_s"]
            row["job_over_plain"] = row["job_images_per_s"] / row["plain_images_per_s"]
        print(json.dumps(row), flush=True)
        rows.append(row)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(store_dir, ignore_errors=True)
    return rows


def table(rows: list[dict[str, Any]], precision: str) -> str:
    lines = [
        f"| photos | images | job images/s, end to end (pass alone), {precision} "
        "| bare forward images/s | job / bare (target >= 0.85), end to end (pass) "
        "| plain loop images/s | job / plain (target >= 3) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        plain = f"{r['plain_images_per_s']:.0f}" if "plain_images_per_s" in r else "-"
        over = f"**{r['job_over_plain']:.2f}**" if "job_over_plain" in r else "-"
        lines.append(
            f"| {r['photos']} | {r['images']} "
            f"| {r['job_images_per_s']:.0f} ({r['job_pass_images_per_s']:.0f}) "
            f"| {r['bare_images_per_s']:.0f} "
            f"| **{r['job_over_bare']:.3f}** ({r['pass_over_bare']:.3f}) | {plain} | {over} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=50_000, help="500x375 photos")
    parser.add_argument("--large-images", type=int, default=2_000, help="4000x3000 photos")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--fp32", action="store_true", help="the job in fp32 (exact statistics)")
    parser.add_argument("--quick", action="store_true", help="a few hundred photos")
    parser.add_argument("--cpu", action="store_true", help="the CPU rows (bench/data/decode.py)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--side", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        side, payload_path, where = args.side
        run = {"job": side_job, "bare": side_bare, "plain": side_plain}[side]
        print(json.dumps(run(Path(payload_path), Path(where))))
        return
    if args.cpu:
        quick = ["--pairs", "1", "--photos", "32", "--large-photos", "4"] if args.quick else []
        subprocess.run([sys.executable, "-m", "bench.data.decode", *quick], check=True, cwd=REPO)
        return
    if args.quick:
        args.images, args.large_images, args.batch_size = 512, 32, 64
    work = Path(tempfile.mkdtemp(prefix="adapt_record_", dir=args.dir))
    try:
        rows = cuda_rows(args, work)
        print(table(rows, "fp32" if args.fp32 else "bf16, channels_last"))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
