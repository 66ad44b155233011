"""The ``bnadapt`` commands that run the service on this machine: ``up`` (everything),
``api``, ``worker``, and ``demo`` (the README's main job)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from service.local.cli.options import Commands, positive_int
from service.local.up import (
    API_HOST_ENV,
    DEFAULT_API_PROCESSES,
    WORKER_THREADS_ENV,
    LocalStack,
    fresh_metrics_dir,
    worker_command,
)
from service.settings import get_settings

__all__ = ["declare_api", "declare_demo", "declare_up", "declare_worker"]


def declare_up(commands: Commands) -> None:
    up = commands.add_parser("up", help="start Redis, the API and a worker on this machine")
    up.add_argument("--host", default="127.0.0.1", help="address the API listens on")
    up.add_argument("--port", type=int, default=8000, help="port the API listens on")
    up.add_argument(
        "--advertise-host",
        default=None,
        help="the name or address clients reach this machine by, given to them in client.json "
        "and as uploads' transfer_url (default: --host, or this machine's name when --host is "
        "a wildcard such as 0.0.0.0)",
    )
    up.add_argument("--device", default="auto", help="the worker's device: auto, cpu or cuda:N")
    up.add_argument(
        "--api-processes",
        type=positive_int,
        default=DEFAULT_API_PROCESSES,
        help="uvicorn worker processes of the API",
    )
    up.add_argument(
        "--uploads-nice",
        type=int,
        choices=range(20),
        metavar="0..19",
        default=None,
        help="run an API process of its own for the bytes of uploads, at this lower priority "
        "(a nice value, e.g. 19): other requests then keep their pace during large uploads",
    )
    up.set_defaults(func=cmd_up)


def cmd_up(args: argparse.Namespace) -> int:
    with LocalStack(
        Path(args.data_dir),
        args.host,
        args.port,
        args.device,
        args.api_processes,
        uploads_nice=args.uploads_nice,
        advertise_host=args.advertise_host,
    ) as stack:
        assert stack.client_config is not None
        print(f"bnadapt is up at {stack.url} (API docs: {stack.url}/docs)")
        print(f"data directory: {stack.data_dir}")
        print(f"API key: {stack.client_config.key}")
        print(f"  (saved in {stack.data_dir / 'client.json'}: the CLI here needs no flags)")
        print("Ctrl-C stops everything.", flush=True)
        stopping = _Stopping()
        signal.signal(signal.SIGINT, stopping.on_signal)
        signal.signal(signal.SIGTERM, stopping.on_signal)
        while not stopping.asked:
            stack.check_alive()
            time.sleep(0.5)
        print("stopping...", flush=True)
    return 0


class _Stopping:
    """Whether SIGINT or SIGTERM came: ``up`` then stops what it started, in order."""

    asked = False

    def on_signal(self, signum: int, frame: object) -> None:
        self.asked = True


def declare_api(commands: Commands) -> None:
    api = commands.add_parser("api", help="run the API (settings from BNADAPT_* variables)")
    api.add_argument("--host", default="127.0.0.1", help="address to listen on")
    api.add_argument("--port", type=int, default=8000, help="port to listen on")
    api.add_argument(
        "--workers",
        type=positive_int,
        default=DEFAULT_API_PROCESSES,
        help="uvicorn worker processes",
    )
    api.set_defaults(func=cmd_api)


def cmd_api(args: argparse.Namespace) -> int:
    import uvicorn

    if args.workers > 1 and "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
        # The processes' request metrics, summed at a scrape (service/api/metrics.py).
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(
            fresh_metrics_dir(get_settings().data_dir.resolve())
        )
    # Where it listens, for what only an API on loopback answers (NOTE [ Cheap scrapes ]).
    os.environ[API_HOST_ENV] = args.host
    uvicorn.run(
        "service.api.app:create_app",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
    )
    return 0


def declare_worker(commands: Commands) -> None:
    worker = commands.add_parser("worker", help="run a worker (RQ worker + inspector)")
    worker.add_argument(
        "--device",
        default="auto",
        help="auto, cpu, cuda (every GPU), cuda:N, or GPUs as cuda:0,cuda:1",
    )
    worker.add_argument(
        "--threads", type=positive_int, help="torch threads per job (BNADAPT_WORKER_THREADS)"
    )
    worker.set_defaults(func=cmd_worker)


def cmd_worker(args: argparse.Namespace) -> int:
    # A separate interpreter: the service never imports the workers' torch code itself.
    if args.threads is not None:
        os.environ[WORKER_THREADS_ENV] = str(args.threads)
    os.execv(sys.executable, worker_command(args.device))  # noqa: S606 - our own argv


def declare_demo(commands: Commands) -> None:
    demo = commands.add_parser("demo", help="the README's main job, end to end")
    demo.add_argument("--port", type=int, default=8000, help="port the demo's API listens on")
    demo.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from service.local.demo import run_demo

    return run_demo(Path(args.data_dir), args.port)
