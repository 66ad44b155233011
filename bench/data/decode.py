"""Photos through a job's full pass against a bare loop with the fastest decoder here.

    python -m bench.data.decode                       # 500x375 and 4000x3000 photos
    python -m bench.data.decode --pairs 1 --photos 32 --large-photos 4   # a quick look

Issue 30's CPU row. Without the service, as bench/data/datasets.py's ``--passes`` (its NOTE
[ Comparing passes under load ] holds here): a full adapt pass through ``compute()`` of the
built-in ResNet (depth 2, width 8: a model light enough that decoding sets the pace, the
pipeline's hard case) over a tar of photo-like JPEGs (harness/photos.py) with the usual
evaluation spec (shorter side to 256, centre crop 224, ImageNet's mean and std), against a
bare ``DataLoader`` with as many processes whose samples are decoded the fastest way Pillow
knows (``draft`` at reduced size in the DCT domain where the target allows, then the resize
and crop) and normalised, the model in train mode under ``no_grad``. Two photo sizes: 500 x
375 (a web photo: no reduced decode, the target is more than half of it) and 4000 x 3000 (a
camera's 12 MP: decoded at 1/8). The ratio is bare time over job time (>= 0.9 is the target).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from bench import REPO
from bench.data.datasets import IMAGES_HEAD, IMAGES_TAIL, PASS, pass_figure, pass_row, run_in
from bench.recording import add_record_options, write_figures

BARE_FASTEST = (
    IMAGES_HEAD
    + r"""
mean = torch.tensor(spec.mean).view(3, 1, 1)
std = torch.tensor(spec.std).view(3, 1, 1)
short, (ch, cw) = spec.resize_shorter, spec.center_crop
class Images(Dataset):
    def __len__(self): return len(where)
    def __getitem__(self, i):
        with open(path, 'rb') as f:
            f.seek(where[i][0]); data = f.read(where[i][1])
        image = Image.open(io.BytesIO(data))
        w, h = image.size
        size = (short, int(short * h / w)) if w <= h else (int(short * w / h), short)
        image.draft('RGB', size)
        image = image.convert('RGB').resize(size, Image.Resampling.BILINEAR)
        left, top = round((size[0] - cw) / 2), round((size[1] - ch) / 2)
        image = image.crop((left, top, left + cw, top + ch))
        x = torch.from_numpy(np.asarray(image)).permute(2, 0, 1).float().div_(255)
        return x.sub_(mean).div_(std)
"""
    + IMAGES_TAIL
)

SPEC = {
    "resize_shorter": 256,
    "center_crop": [224, 224],
    "interpolation": "bilinear",
    "mean": [0.485, 0.456, 0.406],
    "std": [0.229, 0.224, 0.225],
}


def write_photo_tar(path: Path, sizes: list[tuple[int, int]], samples: int) -> None:
    """``samples`` photo-like JPEGs (harness/photos.py) of ``sizes`` (width, height) in turn,
    eight different ones repeated."""
    from harness.photos import photo_jpeg

    photos = [photo_jpeg(*sizes[i % len(sizes)], seed=i) for i in range(min(8, samples))]
    with tarfile.open(path, "w") as archive:
        for i in range(samples):
            data = photos[i % len(photos)]
            info = tarfile.TarInfo(f"{i:06d}.jpg")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import safetensors.torch

    from api_schemas import JobPayload, Preprocessing
    from service.formats.images import describe_tar
    from service.store.local import LocalStore
    from workers.models.architectures import build_model

    store_dir = work / "store"
    store = LocalStore(store_dir)
    kwargs = {"depth": 2, "width": 8}
    weights = store.put_bytes(
        safetensors.torch.save(dict(build_model("resnet", kwargs).state_dict()))
    )
    spec = Preprocessing.model_validate(SPEC)
    env = dict(os.environ, PYTHONPATH=str(REPO), BNADAPT_WORKER_THREADS=str(args.threads))
    env["BNADAPT_LOADER_PROCESSES"] = str(args.loaders)
    results: dict[str, Any] = {}
    for size, samples in (((500, 375), args.photos), ((4000, 3000), args.large_photos)):
        tar_path = work / f"photos_{size[0]}x{size[1]}.tar"
        write_photo_tar(tar_path, [size], samples)
        facts = describe_tar(
            tar_path, spec, max_pixels=1 << 26, max_classes=10, max_elements=1 << 40
        )
        sha = store.put_bytes(tar_path.read_bytes())
        tar_path.unlink()
        payload = JobPayload.model_validate(
            {
                "job_id": "job_bench",
                "tenant_id": "bench",
                "kind": "adapt",
                "model": {
                    "id": "m_bench",
                    "architecture": "resnet",
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
                "params": {"batch_size": 32, "device": "cpu", "holdout": 0},
            }
        )
        runs: dict[str, list[dict[str, Any]]] = {"job": [], "bare": []}
        for pair in range(args.pairs):
            for side in ("job", "bare") if pair % 2 == 0 else ("bare", "job"):
                if side == "job":
                    found = run_in(PASS, payload, store_dir, env, args.threads)
                else:
                    extra = (str(samples), str(args.loaders))
                    found = run_in(BARE_FASTEST, payload, store_dir, env, args.threads, *extra)
                runs[side].append(found)
        row = pass_row(samples, runs["job"], runs["bare"])
        name = f"{size[0]}x{size[1]}"
        print(name, json.dumps(row), flush=True)
        results[name] = row
    return results


def table(results: dict[str, Any], loaders: int) -> str:
    lines = [
        "| photos | pairs | ratio bare/job, median (quartiles); target >= 0.9 "
        "| job / bare images/s | CPU us/image job / bare |",
        "|---|---|---|---|---|",
    ]
    for name, row in results.items():
        low, median, high = row["ratio_quartiles"]
        lines.append(
            f"| {name}, {loaders} loader processes | {row['pairs']} "
            f"| **{median:.3f}** ({low:.3f}-{high:.3f}) "
            f"| {row['job_samples_per_s']:.1f} / {row['bare_samples_per_s']:.1f} "
            f"| {row['job_cpu_us_per_sample']:.0f} / {row['bare_cpu_us_per_sample']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--photos", type=int, default=512, help="500x375 photos")
    parser.add_argument("--large-photos", type=int, default=64, help="4000x3000 photos")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--loaders", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    add_record_options(parser)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="decode_bench_", dir=args.dir))
    try:
        found = run(args, work)
        print(json.dumps(found, indent=2))
        print(table(found, args.loaders))
        figure = "adapt pass on photos / bare loop, Pillow's reduced decoding: " + "; ".join(found)
        record = pass_figure("photo-pass", figure, list(found.values()))
        write_figures("bench.data.decode", args, [record])
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
