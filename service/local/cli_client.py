"""What the ``bnadapt`` commands that talk to a running API share with ``bnadapt demo``: the
client, found through ``--url``/``--key``, the ``BNADAPT_URL``/``BNADAPT_API_KEY`` variables,
or the ``client.json`` that ``bnadapt up`` writes in its data directory; the argument types of
JSON and tags; values and a job's progress printed on a terminal. The commands themselves are
in service/local/cli/.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from api_schemas import JobPublic
from service.client import Client
from service.errors import BnadaptError
from service.local.up import read_client_config

__all__ = [
    "api_client",
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
