"""Datasets at real scale: memory of the API during uploads, and of a job reading a dataset
far larger than its batches; throughput of a full pass on a memory-mapped dataset against a
bare loop over the same data in memory.

    python -m bench.data.datasets                      # 2 GiB and 7.5 GB uint8 sets
    python -m bench.data.datasets --samples 2000       # one small set, for a quick look
    python -m bench.data.datasets --passes             # only the two throughput ratios below

``--passes`` runs without the service (a local store, payloads built here, each pass in a
fresh process): (1) a full adapt pass through ``compute()`` on a memory-mapped uint8 npz of
(N, 3, 64, 64) against a bare loop over the same array in memory; (2) a full adapt pass on a
tar of JPEGs (resize, centre crop, normalise) with 0, 1 and 2 loader processes against a bare
``DataLoader`` that decodes the same way (Pillow, per sample) with as many processes. Each
ratio is the median of ``--pairs`` interleaved job/bare pairs, with its quartiles, beside the
CPU time per sample of each side, loader processes included (NOTE [ Comparing passes under
load ]). The job's pass is timed from the start of its adapt phase to its last batch, the
bare loop's from its first batch to its last: both include starting the loader processes.

Each set is (N, 3, 224, 224) uint8 images with int64 labels, written as an uncompressed npz
(what np.savez writes) without holding it in memory. The whole service runs as processes
(harness/stack.py); the job measurements rerun the payload the API enqueued in a fresh process
that samples its own anonymous memory (RssAnon in /proc/self/status) every 5 ms. RssAnon, not
RSS: the pages of a memory-mapped file count in RSS as soon as they are read, although the
kernel can drop them at any time, so RSS would charge the job with the dataset it maps.
Files are deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from api_schemas import JobStatus
from bench import REPO
from bench.recording import Measured, add_record_options, met, spread, write_figures
from harness.stack import Stack, job_payload, running_stack
from service.client import Client

SHAPE = (3, 224, 224)
MIB = 1024 * 1024
CHUNK = 8 * MIB
# A request may take this long: the upload of the largest set (gigabytes) in one body.
UPLOAD_TIMEOUT_S = 3600.0
# A full pass's throughput, bare time over job time, at least this.
PASS_TARGET = 0.9
# The API's peak RSS growth during an upload, at most this: it streams the body, whatever its size.
UPLOAD_MEMORY_TARGET_MIB = 64.0


def write_npz(path: Path, samples: int, seed: int = 0) -> None:
    """x (samples, 3, 224, 224) uint8 and y (samples,) int64, stored, written in chunks."""
    rng = np.random.default_rng(seed)
    block = rng.integers(0, 256, size=64 * MIB, dtype=np.uint8).tobytes()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        with archive.open("x.npy", "w", force_zip64=True) as member:
            header = {"descr": "|u1", "fortran_order": False, "shape": (samples, *SHAPE)}
            np.lib.format.write_array_header_2_0(member, header)
            left = samples * int(np.prod(SHAPE))
            offset = 0
            while left:
                n = min(left, len(block) - offset, CHUNK)
                member.write(block[offset : offset + n])
                offset = (offset + n) % (len(block) - CHUNK)
                left -= n
        labels = rng.integers(0, 10, size=samples).astype(np.int64)
        with archive.open("y.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array(member, labels)


class Sampler:
    """Peak of VmRSS and RssAnon of one process, sampled in a thread."""

    def __init__(self, pid: int, interval_s: float = 0.02) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.peak = {"VmRSS": 0, "RssAnon": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> dict[str, int]:
        found = {}
        with open(f"/proc/{self.pid}/status") as file:
            for line in file:
                key, _, value = line.partition(":")
                if key in self.peak:
                    found[key] = int(value.split()[0]) * 1024
        return found

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, value in self.now().items():
                self.peak[key] = max(self.peak[key], value)
            time.sleep(self.interval_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def file_chunks(path: Path) -> Iterator[bytes]:
    with path.open("rb") as file:
        while chunk := file.read(MIB):
            yield chunk


def upload(
    stack: Stack, client: Client, path: Path, resumable: bool
) -> tuple[dict[str, Any], dict]:
    assert stack.api is not None
    sampler = Sampler(stack.api.pid)
    before = sampler.now()
    started = time.perf_counter()
    with sampler:
        if resumable:
            dataset = client.upload_dataset(path, path.name).model_dump(mode="json")
        else:
            # The file as the request's body, streamed: a form the client has no method for.
            response = client.request(
                "POST", "/v1/datasets", params={"name": path.name}, content=file_chunks(path)
            )
            assert response.status_code == 201, response.text
            dataset = response.json()
    seconds = time.perf_counter() - started
    return dataset, {
        "form": "resumable (64 MiB parts)" if resumable else "streamed body",
        "bytes": path.stat().st_size,
        "seconds": seconds,
        "api_rss_before_mib": before["VmRSS"] / MIB,
        "api_peak_rss_increase_mib": (sampler.peak["VmRSS"] - before["VmRSS"]) / MIB,
        "api_peak_anon_increase_mib": (sampler.peak["RssAnon"] - before["RssAnon"]) / MIB,
    }


CHILD = r"""
import json, sys, threading, time
t0 = time.perf_counter()
peak = [0]
stop = threading.Event()
def anon():
    with open('/proc/self/status') as f:
        for line in f:
            if line.startswith('RssAnon:'):
                return int(line.split()[1]) * 1024
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], anon()); time.sleep(0.005)
import torch
torch.set_num_threads(int(sys.argv[3]))
from api_schemas import JobPayload
from service.store.local import LocalStore
from workers.kinds.changing import compute
payload = JobPayload.model_validate_json(open(sys.argv[1]).read())
store = LocalStore(sys.argv[2])
base = anon()
threading.Thread(target=sample, daemon=True).start()
from workers.running.loading import open_dataset
opened = time.perf_counter()
x, y = open_dataset(payload, store)
x[0:payload.params.batch_size].load()  # (B, 3, 224, 224) float32
first_read = time.perf_counter() - opened
del x, y
first = []
class Hooks:
    def start_phase(self, phase, total, unit, per): self.phase = phase
    def report(self, done):
        if self.phase == 'adapt' and not first: first.append(time.perf_counter())
    def should_stop(self): return False
start = time.perf_counter()
out = compute(payload, store, Hooks(), measure=sys.argv[4] == '1')
end = time.perf_counter()
stop.set()
r = out.report
print(json.dumps({'imports_s': start - t0, 'open_and_first_batch_s': first_read,
  'load_s': r.timings.load_s, 'first_adapt_batch_s': first[0] - start,
  'total_s': end - start, 'samples': r.samples, 'batches': r.batches,
  'base_anon_mib': base / 2**20, 'peak_anon_mib': peak[0] / 2**20,
  'compute_s': r.timings.compute_s}))
"""

BARE = r"""
import json, resource, sys, time
import numpy as np, torch
torch.set_num_threads(int(sys.argv[3]))
from api_schemas import JobPayload
from service.formats.arrays import open_arrays
from service.store.local import LocalStore
from workers.running.loading import load_model
payload = JobPayload.model_validate_json(open(sys.argv[1]).read())
store = LocalStore(sys.argv[2])
n = int(sys.argv[4]) if len(sys.argv) > 4 else None  # the first n samples, or all
x = np.array(open_arrays(store.local_path(payload.dataset.sha256)).x[:n])  # in memory
model = load_model(payload, store).train()
b = payload.params.batch_size
cpu = resource.getrusage(resource.RUSAGE_SELF)
start = time.perf_counter()
with torch.no_grad():
    for i in range(0, len(x), b):
        model(torch.from_numpy(x[i:i + b]).to(torch.float32).div_(255))
end = time.perf_counter()
done = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({'compute_s': end - start, 'samples': len(x),
  'cpu_s': done.ru_utime + done.ru_stime - cpu.ru_utime - cpu.ru_stime, 'children_cpu_s': 0.0}))
"""


def run_child(code: str, payload: Any, stack: Stack, threads: int, *extra: str) -> dict:
    return run_in(code, payload, stack.data_dir / "store", stack.env, threads, *extra)


def run_in(
    code: str, payload: Any, store: Path, env: dict[str, str], threads: int, *extra: str
) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
        file.write(payload.model_dump_json())
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, file.name, str(store), str(threads), *extra],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            cwd=REPO,
        )
    finally:
        os.unlink(file.name)
    return json.loads(done.stdout.strip().splitlines()[-1])


def submit(client: Client, model_id: str, dataset_id: str, params: dict) -> str:
    """Runs an adapt job to its end; its id."""
    job = client.wait(client.submit("adapt", model_id, dataset_id, params).id)
    assert job.status is JobStatus.SUCCEEDED, job
    return job.id


PASS = r"""
import json, resource, sys, time
import torch
torch.set_num_threads(int(sys.argv[3]))
from api_schemas import JobPayload
from service.store.local import LocalStore
from workers.kinds.changing import compute
payload = JobPayload.model_validate_json(open(sys.argv[1]).read())
def cpu():
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime
class Hooks:
    # The pass: from the start of the adapt phase to its last batch, wall and own CPU time (the
    # report compute() builds afterwards is no part of it); the loader processes' CPU time to
    # compute()'s return, when they have been joined, so that RUSAGE_CHILDREN holds them.
    def start_phase(self, phase, total, unit, per):
        if phase == 'adapt':
            self.total, self.cpu, self.start = total, cpu(), time.perf_counter()
    def report(self, done):
        if done == self.total: self.end, self.end_cpu = time.perf_counter(), cpu()
    def should_stop(self): return False
hooks = Hooks()
out = compute(payload, LocalStore(sys.argv[2]), hooks, measure=False)
children = cpu()[1]
print(json.dumps({'compute_s': hooks.end - hooks.start, 'samples': out.report.samples,
  'report_compute_s': out.report.timings.compute_s, 'cpu_s': hooks.end_cpu[0] - hooks.cpu[0],
  'children_cpu_s': children - hooks.cpu[1]}))
"""

# The bare loops (BARE above, given a sample count, and the loops over a tar of images: these,
# with the Images dataset of their own between IMAGES_HEAD and IMAGES_TAIL) run the model as the
# job's pass does (train mode, no_grad) over the same number of samples (the job's report
# says how many it adapted on). argv: the payload's file, the store, torch threads, samples,
# loader processes; ``where``: each image's (offset, size) in the tar.
IMAGES_HEAD = r"""
import io, json, resource, sys, tarfile, time
import numpy as np, torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset
torch.set_num_threads(int(sys.argv[3]))
from api_schemas import JobPayload
from service.store.local import LocalStore
from workers.running.loading import load_model
payload = JobPayload.model_validate_json(open(sys.argv[1]).read())
store = LocalStore(sys.argv[2])
n, workers = int(sys.argv[4]), int(sys.argv[5])
path = store.local_path(payload.dataset.sha256)
with tarfile.open(path) as archive:
    where = [(m.offset_data, m.size) for m in archive if m.name.endswith('.jpg')][:n]
spec = payload.dataset.preprocessing
"""
IMAGES_TAIL = r"""
def cpu():
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime
model = load_model(payload, store).train()
loader = DataLoader(Images(), batch_size=payload.params.batch_size, num_workers=workers)
before = cpu()
start = time.perf_counter()
with torch.no_grad():
    for xb in loader:
        model(xb)
end = time.perf_counter()
# The iterator's end joined the loader processes (not persistent), so RUSAGE_CHILDREN holds them.
own, children = cpu()
print(json.dumps({'compute_s': end - start, 'samples': len(where), 'cpu_s': own - before[0],
  'children_cpu_s': children - before[1]}))
"""
BARE_IMAGES = (
    IMAGES_HEAD
    + r"""
mean = torch.tensor(spec.mean).view(3, 1, 1)
std = torch.tensor(spec.std).view(3, 1, 1)
class Images(Dataset):
    def __len__(self): return len(where)
    def __getitem__(self, i):
        with open(path, 'rb') as f:
            f.seek(where[i][0]); data = f.read(where[i][1])
        image = Image.open(io.BytesIO(data)).convert('RGB')
        image = image.resize(tuple(spec.resize[::-1]), Image.Resampling.BILINEAR)
        h, w = spec.center_crop
        left, top = (image.width - w) // 2, (image.height - h) // 2
        image = image.crop((left, top, left + w, top + h))
        x = torch.from_numpy(np.asarray(image)).permute(2, 0, 1).float().div_(255)
        return x.sub_(mean).div_(std)
"""
    + IMAGES_TAIL
)


def write_image_tar(path: Path, samples: int, size: tuple[int, int] = (96, 128)) -> None:
    """``samples`` JPEGs of ``size`` (height, width): smooth random images (noise decodes
    slower than photographs), labels 0..9."""
    import io
    import tarfile

    from PIL import Image

    rng = np.random.default_rng(0)
    with tarfile.open(path, "w") as archive:
        for i in range(samples):
            small = rng.integers(0, 256, size=(size[0] // 8, size[1] // 8, 3), dtype=np.uint8)
            image = Image.fromarray(small).resize(size[::-1], Image.Resampling.BILINEAR)
            out = io.BytesIO()
            image.save(out, format="JPEG", quality=90)
            for name, data in (
                (f"{i:06d}.jpg", out.getvalue()),
                (f"{i:06d}.cls", b"%d" % (i % 10)),
            ):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))


# NOTE [ Comparing passes under load ]
# The machine these ratios are taken on is shared, and a neighbour's load moves a pass's wall
# time by 2-5x. So each ratio is the median of paired ratios (job and bare run back to back,
# the order alternating), with the quartiles as its spread; and each side's CPU time per
# sample, its loader processes included, is reported beside it: CPU time moves far less with
# the load than wall time (it still grows with cache and memory contention), and it says
# whether the job does more work than the bare loop, whatever the scheduling.


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """Lower quartile, median, upper quartile (the value itself, thrice, for one value)."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    low, median, high = statistics.quantiles(values, n=4, method="inclusive")
    return low, median, high


def pass_row(samples: int, job: list[dict], bare: list[dict]) -> dict[str, Any]:
    """One configuration's paired passes: throughput ratio (bare time over job time, >= 0.9 is
    the target) and CPU per sample of each side, own process and loader processes."""

    def cpu_us(run: dict) -> float:
        return (run["cpu_s"] + run["children_cpu_s"]) / samples * 1e6

    ratios = [b["compute_s"] / j["compute_s"] for j, b in zip(job, bare, strict=True)]
    cpu_ratios = [cpu_us(b) / cpu_us(j) for j, b in zip(job, bare, strict=True)]
    return {
        "samples": samples,
        "pairs": len(ratios),
        "ratio_quartiles": quartiles(ratios),
        "job_samples_per_s": samples / statistics.median(j["compute_s"] for j in job),
        "bare_samples_per_s": samples / statistics.median(b["compute_s"] for b in bare),
        "cpu_ratio_quartiles": quartiles(cpu_ratios),
        "job_cpu_us_per_sample": statistics.median(cpu_us(j) for j in job),
        "bare_cpu_us_per_sample": statistics.median(cpu_us(b) for b in bare),
        "job_loader_cpu_us_per_sample": statistics.median(
            j["children_cpu_s"] / samples * 1e6 for j in job
        ),
        "bare_loader_cpu_us_per_sample": statistics.median(
            b["children_cpu_s"] / samples * 1e6 for b in bare
        ),
        "job_s": [round(j["compute_s"], 3) for j in job],
        "bare_s": [round(b["compute_s"], 3) for b in bare],
        "load_average": os.getloadavg()[0],
    }


def pass_ratio(row: dict[str, Any]) -> str:
    """A pass row's ratio as the records give it: the median with its quartiles."""
    low, median, high = row["ratio_quartiles"]
    return spread(median, low, high)


def pass_target(rows: list[dict[str, Any]]) -> str:
    """The pass target, met when every row's median ratio meets it."""
    medians = [row["ratio_quartiles"][1] for row in rows]
    return met(f">= {PASS_TARGET:g}", min(medians) >= PASS_TARGET)


def pass_figure(name: str, figure: str, rows: list[dict[str, Any]]) -> Measured:
    """The record of full passes against their bare loops: each row's ratio, '; ' between."""
    return Measured(name, figure, "; ".join(map(pass_ratio, rows)), pass_target(rows))


def passes_figures(results: dict[str, Any]) -> list[Measured]:
    tars = results["image_tar"]
    mmap = pass_figure(
        "data-mmap-pass",
        "full adapt pass on a memory-mapped uint8 npz / bare loop over the array",
        [results["mmap_uint8"]],
    )
    tar = Measured(
        "data-tar-pass",
        "full adapt pass on a JPEG tar / bare DataLoader, "
        + " / ".join(map(str, tars))
        + " loader processes",
        " / ".join(f"{row['ratio_quartiles'][1]:.3f}" for row in tars.values()),
        pass_target(list(tars.values())),
    )
    return [mmap, tar]


def upload_figures(uploads: list[dict[str, Any]]) -> list[Measured]:
    """The API's memory growth during the streamed uploads, the largest first."""
    streamed = sorted(
        (row for row in uploads if row["form"] == "streamed body"),
        key=lambda row: row["bytes"],
        reverse=True,
    )
    growth = [row["api_peak_rss_increase_mib"] for row in streamed]
    figure = "API memory growth during " + " / ".join(
        f"a {row['bytes'] / 2**30:.1f} GiB upload" for row in streamed
    )
    return [
        Measured(
            "data-upload-memory",
            figure,
            " / ".join(f"{mib:+.1f}" for mib in growth),
            met(f"<= {UPLOAD_MEMORY_TARGET_MIB:g} MiB", max(growth) <= UPLOAD_MEMORY_TARGET_MIB),
            "MiB",
        )
    ]


def passes_table(results: dict[str, Any]) -> str:
    """The markdown table of bench/RESULTS.md for ``passes``' results."""
    rows = [("mmap'd uint8 npz", results["mmap_uint8"])]
    rows += [
        (f"JPEG tar, {loaders} loader processes", row)
        for loaders, row in results["image_tar"].items()
    ]
    lines = [
        "| pass | pairs | ratio, median (quartiles); target >= 0.9 | job / bare samples/s "
        "| CPU us/sample job / bare (loaders) | CPU ratio bare/job |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in rows:
        low, median, high = row["ratio_quartiles"]
        cpu_low, cpu_median, cpu_high = row["cpu_ratio_quartiles"]
        lines.append(
            f"| {name} | {row['pairs']} | **{median:.3f}** ({low:.3f}-{high:.3f}) "
            f"| {row['job_samples_per_s']:.0f} / {row['bare_samples_per_s']:.0f} "
            f"| {row['job_cpu_us_per_sample']:.0f} ({row['job_loader_cpu_us_per_sample']:.0f}) / "
            f"{row['bare_cpu_us_per_sample']:.0f} ({row['bare_loader_cpu_us_per_sample']:.0f}) "
            f"| {cpu_median:.3f} ({cpu_low:.3f}-{cpu_high:.3f}) |"
        )
    return "\n".join(lines)


def passes(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """NOTE in the module docstring: the two throughput ratios, without the service."""
    from api_schemas import JobPayload, Preprocessing
    from service.formats.images import describe_tar
    from service.store.local import LocalStore

    store_dir = work / "store"
    store = LocalStore(store_dir)
    model = {"architecture": "resnet", "kwargs": {"depth": 2, "width": 8}}
    import safetensors.torch

    from workers.models.architectures import build_model

    net = build_model("resnet", model["kwargs"])
    weights = store.put_bytes(safetensors.torch.save(dict(net.state_dict())))
    env = dict(os.environ, PYTHONPATH=str(REPO), BNADAPT_WORKER_THREADS=str(args.threads))
    results: dict[str, Any] = {}

    def payload(sha: str, fmt: str, n: int, shape: list[int], spec: Any) -> JobPayload:
        return JobPayload.model_validate(
            {
                "job_id": "job_bench",
                "tenant_id": "bench",
                "kind": "adapt",
                "model": {
                    "id": "m_bench",
                    "architecture": "resnet",
                    "kwargs": model["kwargs"],
                    "weights_sha256": weights,
                },
                "dataset": {
                    "id": "ds_bench",
                    "sha256": sha,
                    "format": fmt,
                    "num_samples": n,
                    "sample_shape": shape,
                    "dtype": "uint8",
                    "has_labels": True,
                    "label_kind": "class",
                    "num_classes": 10,
                    "preprocessing": spec,
                },
                "params": {"batch_size": 32, "device": "cpu", "holdout": 0},
            }
        )

    def ratio(job_code: str, bare_code: str, job: JobPayload, env: dict, *bare_args: str) -> dict:
        """``args.pairs`` pairs of passes, job and bare, each in a fresh process, the order
        alternating (the job first in even pairs; its report gives the bare loop its sample
        count); see NOTE [ Comparing passes under load ]."""
        runs: dict[str, list[dict]] = {"job": [], "bare": []}
        samples = 0

        def run_job() -> None:
            nonlocal samples
            found = run_in(job_code, job, store_dir, env, args.threads)
            samples = found["samples"]
            runs["job"].append(found)

        def run_bare() -> None:
            found = run_in(bare_code, job, store_dir, env, args.threads, str(samples), *bare_args)
            assert found["samples"] == samples, (found, samples)
            runs["bare"].append(found)

        for pair in range(args.pairs):
            for run in (run_job, run_bare) if pair % 2 == 0 else (run_bare, run_job):
                run()
        row = pass_row(samples, runs["job"], runs["bare"])
        print(json.dumps(row), flush=True)
        return row

    n = args.pass_samples
    x = np.random.default_rng(1).integers(0, 256, size=(n, 3, 64, 64), dtype=np.uint8)
    array_path = work / "arrays.npz"
    np.savez(array_path, x=x, y=(np.arange(n) % 10).astype(np.int64))
    sha = store.put_bytes(array_path.read_bytes())
    print("full pass, mmap'd uint8 (N, 3, 64, 64)", flush=True)
    results["mmap_uint8"] = ratio(PASS, BARE, payload(sha, "npz", n, [3, 64, 64], None), env)

    tar_path = work / "images.tar"
    write_image_tar(tar_path, args.image_samples)
    spec = Preprocessing(
        resize=[64, 64], center_crop=[56, 56], mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225]
    )
    facts = describe_tar(tar_path, spec, max_pixels=1 << 26, max_classes=10, max_elements=1 << 40)
    sha = store.put_bytes(tar_path.read_bytes())
    job = payload(sha, "tar", facts.num_samples, list(facts.sample_shape), spec.model_dump())
    results["image_tar"] = {}
    for loaders in args.loaders:
        print(f"full pass, JPEG tar, {loaders} loader processes", flush=True)
        loader_env = dict(env, BNADAPT_LOADER_PROCESSES=str(loaders))
        results["image_tar"][loaders] = ratio(PASS, BARE_IMAGES, job, loader_env, str(loaders))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, nargs="*", default=[14266, 50000])
    parser.add_argument("--full-pass-samples", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--passes", action="store_true", help="only the throughput ratios")
    parser.add_argument("--pass-samples", type=int, default=4000)
    parser.add_argument("--image-samples", type=int, default=2000)
    parser.add_argument("--loaders", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument(
        "--pairs", type=int, default=3, help="--passes: job/bare pairs per configuration"
    )
    add_record_options(parser)
    args = parser.parse_args()
    if args.passes:
        work = Path(tempfile.mkdtemp(prefix="data_bench_", dir=args.dir))
        try:
            found = passes(args, work)
            print(json.dumps(found, indent=2))
            print(passes_table(found))
            write_figures("bench.data.datasets", args, passes_figures(found))
        finally:
            subprocess.run(["rm", "-rf", str(work)], check=False)
        return
    results: dict[str, Any] = {"uploads": [], "jobs": [], "full_pass": None}
    work = Path(tempfile.mkdtemp(prefix="data_bench_", dir=args.dir))
    env = {
        "BNADAPT_WORKER_THREADS": str(args.threads),
        "BNADAPT_MAX_UPLOAD_PART_BYTES": str(256 * MIB),
    }
    try:
        with running_stack(work / "stack", env) as stack:
            key = stack.records().create_api_key("bench").key
            client = Client(stack.url, key, timeout_s=UPLOAD_TIMEOUT_S)
            model = client.add_model("resnet", {"depth": 2, "width": 8})
            for samples in args.samples:
                path = work / f"images_{samples}.npz"
                write_npz(path, samples)
                dataset, row = upload(stack, client, path, resumable=False)
                results["uploads"].append(row)
                print(json.dumps(row), flush=True)
                if samples <= 20000:
                    _, row = upload(stack, client, path, resumable=True)
                    results["uploads"].append(row)
                    print(json.dumps(row), flush=True)
                path.unlink()
                params = {"batch_size": 32, "max_batches": 2, "device": "cpu"}
                job_id = submit(client, model.id, dataset["id"], params)
                payload = job_payload(stack, job_id)
                row = run_child(CHILD, payload, stack, args.threads, "1")
                batch_mib = 32 * int(np.prod(SHAPE)) * 4 / MIB
                row |= {
                    "samples_in_set": samples,
                    "bytes": dataset["size_bytes"],
                    "batch_float32_mib": batch_mib,
                    "report_load_s": None,
                }
                results["jobs"].append(row)
                print(json.dumps(row), flush=True)
                client.delete_dataset(dataset["id"])
            # Full pass, mmap'd uint8 through the job's code vs a bare loop in memory.
            path = work / "full.npz"
            write_npz(path, args.full_pass_samples, seed=1)
            dataset, _ = upload(stack, client, path, resumable=False)
            path.unlink()
            params = {"batch_size": 32, "max_batches": 1, "device": "cpu"}
            payload = job_payload(stack, submit(client, model.id, dataset["id"], params))
            full = payload.model_copy(
                update={"params": payload.params.model_copy(update={"max_batches": None})}
            )
            job, bare = [], []
            for _ in range(3):  # alternated, best of three each
                job.append(run_child(CHILD, full, stack, args.threads, "0")["compute_s"])
                bare.append(run_child(BARE, full, stack, args.threads)["compute_s"])
            n = args.full_pass_samples
            results["full_pass"] = {
                "samples": n,
                "job_mmap_samples_per_s": n / min(job),
                "bare_in_memory_samples_per_s": n / min(bare),
                "ratio": min(bare) / min(job),
            }
            print(json.dumps(results["full_pass"]), flush=True)
    finally:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    print(json.dumps(results, indent=2))
    write_figures("bench.data.datasets", args, upload_figures(results["uploads"]))


if __name__ == "__main__":
    main()
