"""The ``bnadapt`` command.

Servers: ``up`` (everything on one machine), ``api``, ``worker``, ``keys create``, ``store gc``.
Client: ``architectures``, ``models add|list``, ``datasets add``, ``jobs
submit|show|list|cancel|download`` (service/local/cli_client.py). ``demo`` runs the README's main
job.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

from api_schemas import ESTIMATORS, JOB_KINDS
from service.client import ApiClientError
from service.errors import BnadaptError
from service.local.cli_client import (
    cmd_architectures,
    cmd_datasets_add,
    cmd_jobs_cancel,
    cmd_jobs_download,
    cmd_jobs_list,
    cmd_jobs_show,
    cmd_jobs_submit,
    cmd_models_add,
    cmd_models_list,
    json_arg,
    print_value,
)
from service.local.up import (
    DEFAULT_API_PROCESSES,
    WORKER_THREADS_ENV,
    LocalStack,
    worker_command,
)
from service.settings import get_settings

__all__ = ["main"]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from exc
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 1 or more, got {value}")
    return value


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
        "service.api.app:create_app",
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
    from service.records.connection import redis_client
    from service.records.sync import Records

    url = args.redis_url or get_settings().redis_url
    key = Records(redis_client(url)).create_api_key(args.tenant)
    print(key.key)
    print(f"(tenant {key.tenant_id}; shown once, only its hash is stored)", file=sys.stderr)
    return 0


def cmd_store_gc(args: argparse.Namespace) -> int:
    from service.records import keys
    from service.records.connection import redis_client
    from service.store import open_store
    from service.store.gc import collect_now

    settings = get_settings()
    if args.store_dir:
        settings = settings.model_copy(update={"store_dir": Path(args.store_dir)})
    store = open_store(settings)
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
    print_value(dataclasses.asdict(done))
    return 0


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from exc
    if not value >= 0:  # also NaN
        raise argparse.ArgumentTypeError(f"expected 0 or more seconds, got {text}")
    return value


def cmd_demo(args: argparse.Namespace) -> int:
    from service.local.demo import run_demo

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
    add.add_argument("--kwargs", type=json_arg, default={}, help="JSON object")
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
    dadd.add_argument(
        "--resume",
        metavar="UPLOAD_ID",
        help="continue an interrupted upload (its id is printed when it starts)",
    )
    dadd.set_defaults(func=cmd_datasets_add)

    jobs = sub.add_parser("jobs").add_subparsers(dest="jobs", required=True)
    kinds = "; ".join(f"{kind}: {spec.summary}" for kind, spec in JOB_KINDS.items())
    submit = jobs.add_parser("submit", help=f"submit a job ({', '.join(JOB_KINDS)})")
    submit.add_argument("kind", choices=list(JOB_KINDS), help=kinds)
    submit.add_argument("--model", required=True)
    submit.add_argument("--dataset", required=True)
    estimators = ", ".join(ESTIMATORS)
    submit.add_argument(
        "--params",
        type=json_arg,
        default={},
        help=f"the kind's params as a JSON object (adapt estimators: {estimators})",
    )
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
