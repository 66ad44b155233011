"""The ``bnadapt`` commands that talk to a running API: ``architectures``, ``models
add|list|download|delete``, ``datasets add|list|delete``, ``jobs
submit|show|list|cancel|download|report|logs|delete``. They find the API through
``--url``/``--key``, the ``BNADAPT_URL``/``BNADAPT_API_KEY`` variables, or the ``client.json``
that ``bnadapt up`` writes in its data directory. The parser is in service/local/cli.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from api_schemas import ArchitecturePublic, JobPublic, JobStatus
from api_schemas.architectures import architecture_family
from api_schemas.jobs.public import JobLogEntry
from service.client import Client
from service.errors import BnadaptError
from service.local.summary import outcome_lines, report_summary
from service.local.torch_weights import PTH_SUFFIXES, pth_to_safetensors
from service.local.up import read_client_config

__all__ = [
    "api_client",
    "cmd_architectures",
    "cmd_datasets_add",
    "cmd_datasets_delete",
    "cmd_datasets_list",
    "cmd_jobs_cancel",
    "cmd_jobs_delete",
    "cmd_jobs_download",
    "cmd_jobs_list",
    "cmd_jobs_logs",
    "cmd_jobs_report",
    "cmd_jobs_show",
    "cmd_jobs_submit",
    "cmd_models_add",
    "cmd_models_delete",
    "cmd_models_download",
    "cmd_models_list",
    "json_arg",
    "preprocessing_arg",
    "print_value",
    "progress_line",
    "tag_arg",
    "wait_with_bar",
]


def json_arg(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def preprocessing_arg(text: str) -> dict[str, Any] | str:
    """A preprocessing spec: a JSON object, the path of a file holding one, or ``model`` (the
    model's own evaluation transform, where the API takes it: a job's params)."""
    if text == "model":
        return text
    if not text.lstrip().startswith("{") and Path(text).is_file():
        text = Path(text).read_text()
    return json_arg(text)


def tag_arg(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def api_client(args: argparse.Namespace) -> Client:
    url = args.url or os.environ.get("BNADAPT_URL")
    key = args.key or os.environ.get("BNADAPT_API_KEY")
    if not (url and key):
        saved = read_client_config(Path(args.data_dir))
        if saved is None:
            raise BnadaptError(
                "no API to talk to: start one with `bnadapt up` in this directory, or pass "
                "--url and --key (or set BNADAPT_URL and BNADAPT_API_KEY)"
            )
        url, key = url or saved.url, key or saved.key
    return Client(url, key)


def print_value(value: Any) -> None:
    if hasattr(value, "model_dump_json"):
        print(value.model_dump_json(indent=2))
    else:
        print(json.dumps(value, indent=2, default=str))


def progress_line(job: JobPublic) -> str:
    progress = job.progress
    if progress is None or progress.total == 0:
        return f"{job.id} {job.status.value}"
    width = 30
    filled = int(width * progress.done / progress.total)
    eta = f" ETA {progress.eta_seconds:.0f}s" if progress.eta_seconds is not None else ""
    return (
        f"{job.id} {job.status.value:9} {progress.phase:16} [{'#' * filled:<{width}}] "
        f"{progress.done}/{progress.total} {progress.unit}"
        + (f" {progress.samples_per_second:,.0f} samples/s" if progress.samples_per_second else "")
        + eta
    )


def wait_with_bar(client: Client, job_id: str) -> JobPublic:
    """Polls the job, redrawing one progress line on a terminal; elsewhere (a log, a pipe)
    prints a line when the status or phase changes, and at most every 5 s."""
    interactive = sys.stdout.isatty()
    last_key: tuple[str, str] = ("", "")
    last_print = 0.0

    def show(job: JobPublic) -> None:
        nonlocal last_key, last_print
        line = progress_line(job)
        if interactive:
            print("\r" + line.ljust(110), end="", flush=True)
            return
        key = (job.status.value, job.progress.phase if job.progress else "")
        if key != last_key or time.monotonic() - last_print > 5.0:
            print(line, flush=True)
            last_key, last_print = key, time.monotonic()

    job = client.wait(job_id, on_progress=show)
    if interactive:
        print()
    return job


def cmd_architectures(args: argparse.Namespace) -> int:
    """Families with counts and a few names; one line per architecture with ``--all`` or a
    pattern. Built-ins (names without a dot) are always listed one a line."""
    arches = api_client(args).architectures()
    pattern = getattr(args, "pattern", None)
    if pattern:
        arches = [a for a in arches if fnmatchcase(a.name, pattern) or pattern in a.name]
    if getattr(args, "all", False) or pattern:
        for arch in arches:
            print(_architecture_line(arch))
        return 0
    families: dict[str, list[str]] = {}
    for arch in arches:
        if "." not in arch.name:
            print(_architecture_line(arch))
        else:
            families.setdefault(architecture_family(arch.name), []).append(arch.name)
    for family, names in sorted(families.items()):
        sample = ", ".join(n.split(".", 1)[1] for n in names[:4])
        more = f", ... (+{len(names) - 4})" if len(names) > 4 else ""
        print(f"{family:24} {len(names):4} models: {sample}{more}")
    if families:
        print(
            f"{sum(map(len, families.values()))} zoo architectures in {len(families)} families; "
            "`bnadapt architectures PATTERN` lists their kwargs, --all lists every one",
            file=sys.stderr,
        )
    return 0


def _architecture_line(arch: ArchitecturePublic) -> str:
    kwargs = ", ".join(f"{p.name}={p.default!r}" for p in arch.params)
    shape = "x".join("*" if d is None else str(d) for d in arch.input_shape)
    return f"{arch.name:24} input {shape:12} kwargs: {kwargs}"


def cmd_models_add(args: argparse.Namespace) -> int:
    """A ``.pth`` file is converted to safetensors here, before it is sent (the service never
    unpickles): service/local/torch_weights.py."""
    weights: Path | bytes | None = Path(args.weights) if args.weights else None
    if isinstance(weights, Path) and weights.suffix.lower() in PTH_SUFFIXES:
        converted = pth_to_safetensors(weights)
        print(f"converted {weights} to safetensors ({len(converted):,} bytes)", file=sys.stderr)
        weights = converted
    model = api_client(args).add_model(args.architecture, args.kwargs, weights, args.seed)
    if model.renamed_keys is not None:
        renamed = model.renamed_keys
        what = ", ".join(
            [*(f"prefix {p!r}" for p in renamed.stripped_prefixes), renamed.layout or ""]
        )
        print(f"renamed {renamed.count} keys: {what.strip(', ')}", file=sys.stderr)
    print_value(model)
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    for model in api_client(args).models(page_size=args.page_size).items:
        print(f"{model.id}  {model.architecture:16} {model.source:6} parent={model.parent}")
    return 0


def cmd_models_download(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else Path(f"{args.model_id}.safetensors")
    print(api_client(args).download_weights(args.model_id, out))
    return 0


def cmd_models_delete(args: argparse.Namespace) -> int:
    api_client(args).delete_model(args.model_id)
    print(f"deleted model {args.model_id}", file=sys.stderr)
    return 0


def cmd_datasets_add(args: argparse.Namespace) -> int:
    """A resumable upload with a progress bar on stderr; the dataset as JSON on stdout."""
    client = api_client(args)
    path = Path(args.file)
    interactive = sys.stderr.isatty()
    announced = False

    def show(done: int, total: int) -> None:
        nonlocal announced
        if not announced:
            print(
                f"upload {client.last_upload_id}: if it is interrupted, resume it with "
                f"bnadapt datasets add {path} --resume {client.last_upload_id}",
                file=sys.stderr,
            )
            announced = True
        share = done / total if total else 1.0
        bar = "#" * int(share * 30)
        line = f"[{bar:30}] {share:6.1%} {done / 1e6:,.1f} of {total / 1e6:,.1f} MB"
        print(
            f"\r{line}" if interactive else line,
            end="" if interactive else "\n",
            file=sys.stderr,
            flush=True,
        )

    if args.preprocessing == "model":
        raise BnadaptError(
            "a dataset takes a preprocessing spec, not 'model' (a dataset serves any model): "
            "give 'model' to a job instead (bnadapt jobs submit ... --preprocessing model)"
        )
    if path.is_dir():
        if args.resume:
            raise BnadaptError("--resume continues the upload of a file; send a folder again whole")

        def skipped(paths: list[Path]) -> None:
            listed = ", ".join(str(p) for p in paths[:5]) + (" ..." if len(paths) > 5 else "")
            print(f"left out {len(paths)} files that are no .jpg/.png: {listed}", file=sys.stderr)

        dataset = client.upload_folder(
            path,
            args.name,
            preprocessing=args.preprocessing,
            on_progress=show,
            on_skipped=skipped,
        )
    else:
        dataset = client.upload_dataset(
            path,
            args.name,
            upload_id=args.resume,
            on_progress=show,
            preprocessing=args.preprocessing,
        )
    if interactive:
        print(file=sys.stderr)
    print_value(dataset)
    return 0


def cmd_datasets_list(args: argparse.Namespace) -> int:
    for dataset in api_client(args).datasets(page_size=args.page_size).items:
        shape = "x".join(str(d) for d in dataset.sample_shape)
        labels = dataset.label_kind or "no labels"
        print(f"{dataset.id}  {dataset.num_samples:8} x {shape:12} {labels:9} {dataset.name or ''}")
    return 0


def cmd_datasets_delete(args: argparse.Namespace) -> int:
    api_client(args).delete_dataset(args.dataset_id)
    print(f"deleted dataset {args.dataset_id}", file=sys.stderr)
    return 0


def _print_outcome(client: Client, job: JobPublic) -> None:
    """Under a succeeded adapt or evaluate job, its report's outcome lines on stderr (stdout
    stays JSON): :func:`service.local.summary.outcome_lines`."""
    if job.kind not in ("adapt", "evaluate") or job.status is not JobStatus.SUCCEEDED:
        return  # the other jobs print nothing: their report is not fetched
    for line in outcome_lines(job, client.report(job.id)):
        print(line, file=sys.stderr)


def cmd_jobs_submit(args: argparse.Namespace) -> int:
    client = api_client(args)
    params = dict(args.params)
    if args.preprocessing is not None:
        params["preprocessing"] = args.preprocessing
    job = client.submit(
        args.kind,
        args.model,
        args.dataset,
        params,
        args.idempotency_key,
        dict(args.tag),
        args.priority,
    )
    if not args.wait:
        print_value(job)
        return 0
    job = wait_with_bar(client, job.id)
    print_value(job)
    _print_outcome(client, job)
    return 0 if job.status is JobStatus.SUCCEEDED else 1


def cmd_jobs_show(args: argparse.Namespace) -> int:
    client = api_client(args)
    job = client.job(args.job_id)
    print_value(job)
    _print_outcome(client, job)
    return 0


def cmd_jobs_list(args: argparse.Namespace) -> int:
    page = api_client(args).jobs(
        page_size=args.page_size,
        status=args.status,
        kind=args.kind,
        model_id=args.model,
        dataset_id=args.dataset,
        tags=dict(args.tag),
    )
    for job in page.items:
        tags = " ".join(f"{k}={v}" for k, v in job.tags.items())
        print(f"{job.id}  {job.kind:8} {job.status.value:9} model={job.model_id} {tags}".rstrip())
    return 0


def cmd_jobs_report(args: argparse.Namespace) -> int:
    report = api_client(args).report(args.job_id)
    if args.json:
        print_value(report)
    else:
        print("\n".join(report_summary(report)))
    return 0


def _log_line(entry: JobLogEntry) -> str:
    part = f"[{entry.part}] " if entry.part else ""  # a part of a sharded job
    return f"{entry.at:%H:%M:%S} {entry.level:7} {part}{entry.message}"


def cmd_jobs_logs(args: argparse.Namespace) -> int:
    client = api_client(args)
    page = client.logs(args.job_id)
    for entry in page.items:
        print(_log_line(entry), flush=True)
    if args.follow:
        for entry in client.follow_logs(args.job_id, after=page.last_seq):
            print(_log_line(entry), flush=True)
    return 0


def cmd_jobs_delete(args: argparse.Namespace) -> int:
    api_client(args).delete_job(args.job_id)
    print(f"deleted job {args.job_id}", file=sys.stderr)
    return 0


def cmd_jobs_cancel(args: argparse.Namespace) -> int:
    print_value(api_client(args).cancel(args.job_id))
    return 0


def cmd_jobs_download(args: argparse.Namespace) -> int:
    """The new weights and the report; an evaluate job has the report only."""
    client = api_client(args)
    job = client.job(args.job_id)
    if job.result is None:
        raise BnadaptError(f"job {job.id} is {job.status.value}: nothing to download yet")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if job.result.model_id is None:
        print(f"job {job.id} ({job.kind}) registered no model: the report only", file=sys.stderr)
    else:
        model_id = job.result.model_id
        print(client.download_weights(model_id, out / f"{model_id}.safetensors"))
    report = out / f"{job.id}.report.json"
    report.write_text(client.report(job.id).model_dump_json(indent=2))
    print(report)
    return 0
