"""The ``bnadapt`` command.

Servers: ``up`` (everything on one machine), ``api``, ``worker``, ``keys create``, ``store gc``.
Client: ``architectures``, ``models add|list``, ``datasets add``, ``jobs
submit|show|list|cancel|download``; they find the API through ``--url``/``--key``, the
``BNADAPT_URL``/``BNADAPT_API_KEY`` variables, or the ``client.json`` that ``bnadapt up`` writes
in its data directory. ``demo`` runs the README's main job.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from api_schemas import JobPublic, JobStatus
from service.client import ApiClientError, Client
from service.errors import BnadaptError
from service.settings import get_settings
from service.up import (
    DEFAULT_API_PROCESSES,
    WORKER_THREADS_ENV,
    LocalStack,
    read_client_config,
    worker_command,
)

__all__ = ["main"]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from exc
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 1 or more, got {value}")
    return value


def _json_arg(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _client(args: argparse.Namespace) -> Client:
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


def _print(value: Any) -> None:
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


def cmd_up(args: argparse.Namespace) -> int:
    with LocalStack(
        Path(args.data_dir), args.host, args.port, args.device, args.api_processes
    ) as stack:
        assert stack.client_config is not None
        print(f"bnadapt is up at {stack.url} (API docs: {stack.url}/docs)")
        print(f"data directory: {stack.data_dir}")
        print(f"API key: {stack.client_config.key}")
        print(f"  (saved in {stack.data_dir / 'client.json'}: the CLI here needs no flags)")
        print("Ctrl-C stops everything.", flush=True)
        stopping = False

        def on_signal(signum: int, frame: object) -> None:
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        while not stopping:
            stack.check_alive()
            time.sleep(0.5)
        print("stopping...", flush=True)
    return 0


def cmd_api(args: argparse.Namespace) -> int:
    import uvicorn

    uvicorn.run(
        "service.app:create_app",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
    )
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    # A separate interpreter: the service never imports the workers' torch code itself.
    if args.threads is not None:
        os.environ[WORKER_THREADS_ENV] = str(args.threads)
    os.execv(sys.executable, worker_command(args.device))  # noqa: S606 - our own argv


def cmd_keys_create(args: argparse.Namespace) -> int:
    from service.records import Records
    from service.redis_conn import redis_client

    url = args.redis_url or get_settings().redis_url
    key = Records(redis_client(url)).create_api_key(args.tenant)
    print(key.key)
    print(f"(tenant {key.tenant_id}; shown once, only its hash is stored)", file=sys.stderr)
    return 0


def cmd_store_gc(args: argparse.Namespace) -> int:
    from service import keys
    from service.redis_conn import redis_client
    from service.store import LocalStore
    from service.store_gc import collect_now

    settings = get_settings()
    store = LocalStore(Path(args.store_dir) if args.store_dir else settings.store_path)
    grace_s = settings.store_gc_grace_s if args.grace_s is None else args.grace_s
    client = redis_client(args.redis_url or settings.redis_url)
    done = collect_now(client, store, grace_s)
    if done is None:
        left_s = max(int(client.pttl(keys.STORE_GC_LOCK)), 0) / 1000
        print(
            f"another store collection is running (its lock ends within {left_s:.0f} s unless "
            "it renews it); try again then",
            file=sys.stderr,
        )
        return 1
    _print(dataclasses.asdict(done))
    return 0


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from exc
    if not value >= 0:  # also NaN
        raise argparse.ArgumentTypeError(f"expected 0 or more seconds, got {text}")
    return value


def cmd_architectures(args: argparse.Namespace) -> int:
    for arch in _client(args).architectures():
        kwargs = ", ".join(f"{p.name}={p.default!r}" for p in arch.params)
        shape = "x".join("*" if d is None else str(d) for d in arch.input_shape)
        print(f"{arch.name:24} input {shape:12} kwargs: {kwargs}")
    return 0


def cmd_models_add(args: argparse.Namespace) -> int:
    weights = Path(args.weights) if args.weights else None
    _print(_client(args).add_model(args.architecture, args.kwargs, weights, args.seed))
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    for model in _client(args).models(page_size=args.page_size).items:
        print(f"{model.id}  {model.architecture:16} {model.source:6} parent={model.parent}")
    return 0


def cmd_datasets_add(args: argparse.Namespace) -> int:
    _print(_client(args).add_dataset(Path(args.file), args.name))
    return 0


def _print_evaluation(client: Client, job: JobPublic) -> None:
    """For a succeeded evaluate job, its metrics in one line on stderr (stdout stays JSON)."""
    if job.kind != "evaluate" or job.status is not JobStatus.SUCCEEDED:
        return
    metrics = client.report(job.id).metrics_before
    if metrics is None:
        return
    score = (
        f"accuracy {metrics.accuracy:.4f}" if metrics.accuracy is not None else f"mse {metrics.mse}"
    )
    print(
        f"{job.model_id} on {job.dataset_id}: {score}, loss {metrics.loss:.4f} "
        f"({metrics.num_samples} samples)",
        file=sys.stderr,
    )


def cmd_jobs_submit(args: argparse.Namespace) -> int:
    client = _client(args)
    job = client.submit(args.kind, args.model, args.dataset, args.params, args.idempotency_key)
    if not args.wait:
        _print(job)
        return 0
    job = wait_with_bar(client, job.id)
    _print(job)
    _print_evaluation(client, job)
    return 0 if job.status is JobStatus.SUCCEEDED else 1


def cmd_jobs_show(args: argparse.Namespace) -> int:
    client = _client(args)
    job = client.job(args.job_id)
    _print(job)
    _print_evaluation(client, job)
    return 0


def cmd_jobs_list(args: argparse.Namespace) -> int:
    for job in _client(args).jobs(page_size=args.page_size, status=args.status).items:
        print(f"{job.id}  {job.kind:8} {job.status.value:9} model={job.model_id}")
    return 0


def cmd_jobs_cancel(args: argparse.Namespace) -> int:
    _print(_client(args).cancel(args.job_id))
    return 0


def cmd_jobs_download(args: argparse.Namespace) -> int:
    """The new weights and the report; an evaluate job has the report only."""
    client = _client(args)
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


def cmd_demo(args: argparse.Namespace) -> int:
    from service.demo import run_demo

    return run_demo(Path(args.data_dir), args.port)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bnadapt", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data-dir",
        default=os.environ.get("BNADAPT_DATA_DIR", "data"),
        help="where `up` keeps its state (default: ./data)",
    )
    parser.add_argument("--url", help="API URL (default: from the data directory's client.json)")
    parser.add_argument("--key", help="API key")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start Redis, the API and a worker on this machine")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--device", default="auto", help="auto, cpu or cuda:N")
    up.add_argument(
        "--api-processes", type=_positive_int, default=DEFAULT_API_PROCESSES, help="uvicorn workers"
    )
    up.set_defaults(func=cmd_up)

    api = sub.add_parser("api", help="run the API (settings from BNADAPT_* variables)")
    api.add_argument("--host", default="127.0.0.1")
    api.add_argument("--port", type=int, default=8000)
    api.add_argument(
        "--workers",
        type=_positive_int,
        default=DEFAULT_API_PROCESSES,
        help="uvicorn worker processes",
    )
    api.set_defaults(func=cmd_api)

    worker = sub.add_parser("worker", help="run a worker (RQ worker + inspector)")
    worker.add_argument("--device", default="auto", help="auto, cpu or cuda:N")
    worker.add_argument(
        "--threads", type=_positive_int, help="torch threads per job (BNADAPT_WORKER_THREADS)"
    )
    worker.set_defaults(func=cmd_worker)

    keys = sub.add_parser("keys", help="API keys").add_subparsers(dest="keys", required=True)
    create = keys.add_parser("create", help="create an API key for a tenant")
    create.add_argument("--tenant", required=True)
    create.add_argument("--redis-url", help="default: BNADAPT_REDIS_URL")
    create.set_defaults(func=cmd_keys_create)

    store = sub.add_parser("store", help="the artifact store").add_subparsers(
        dest="store", required=True
    )
    gc = store.add_parser(
        "gc", help="delete store objects nothing uses (also runs on its own, periodically)"
    )
    gc.add_argument("--redis-url", help="default: BNADAPT_REDIS_URL")
    gc.add_argument("--store-dir", help="default: BNADAPT_STORE_DIR or <BNADAPT_DATA_DIR>/store")
    gc.add_argument(
        "--grace-s",
        type=_seconds,
        help="keep objects written or last used within this many seconds (default: "
        "BNADAPT_STORE_GC_GRACE_S, an hour); less is safe only while no API or worker runs",
    )
    gc.set_defaults(func=cmd_store_gc)

    sub.add_parser("architectures", help="list what can be registered").set_defaults(
        func=cmd_architectures
    )

    models = sub.add_parser("models").add_subparsers(dest="models", required=True)
    add = models.add_parser("add", help="register a model")
    add.add_argument("architecture")
    add.add_argument("--kwargs", type=_json_arg, default={}, help="JSON object")
    add.add_argument("--weights", help="a .safetensors file (else: initialised with --seed)")
    add.add_argument("--seed", type=int, default=0)
    add.set_defaults(func=cmd_models_add)
    listing = models.add_parser("list")
    listing.add_argument("--page-size", type=int, default=50)
    listing.set_defaults(func=cmd_models_list)

    datasets = sub.add_parser("datasets").add_subparsers(dest="datasets", required=True)
    dadd = datasets.add_parser("add", help="upload an .npz or .safetensors file with x (and y)")
    dadd.add_argument("file")
    dadd.add_argument("--name")
    dadd.set_defaults(func=cmd_datasets_add)

    jobs = sub.add_parser("jobs").add_subparsers(dest="jobs", required=True)
    submit = jobs.add_parser("submit", help="submit an adapt, train or evaluate job")
    submit.add_argument("kind", choices=["adapt", "train", "evaluate"])
    submit.add_argument("--model", required=True)
    submit.add_argument("--dataset", required=True)
    submit.add_argument("--params", type=_json_arg, default={}, help="JSON object")
    submit.add_argument("--idempotency-key")
    submit.add_argument("--wait", action="store_true", help="show progress until it ends")
    submit.set_defaults(func=cmd_jobs_submit)
    show = jobs.add_parser("show")
    show.add_argument("job_id")
    show.set_defaults(func=cmd_jobs_show)
    jlist = jobs.add_parser("list")
    jlist.add_argument("--status")
    jlist.add_argument("--page-size", type=int, default=50)
    jlist.set_defaults(func=cmd_jobs_list)
    cancel = jobs.add_parser("cancel")
    cancel.add_argument("job_id")
    cancel.set_defaults(func=cmd_jobs_cancel)
    download = jobs.add_parser(
        "download", help="the new weights and the report (evaluate jobs: the report)"
    )
    download.add_argument("job_id")
    download.add_argument("--out", default=".")
    download.set_defaults(func=cmd_jobs_download)

    demo = sub.add_parser("demo", help="the README's main job, end to end")
    demo.add_argument("--port", type=int, default=8000)
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except ApiClientError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except BnadaptError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
