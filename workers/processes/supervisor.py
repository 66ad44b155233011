"""``bnadapt worker``: keeps one RQ worker and one inspector process running.

A child that exits (Redis went away for a few seconds, say: RQ's worker then exits) is started
again with a growing delay. The supervisor also does the housekeeping
(service/upkeep/housekeeping.py: failing jobs whose process died, collecting unused store objects),
so both happen even where no API runs. SIGINT or SIGTERM stops the
children: RQ finishes the current job on the first signal; after ``STOP_GRACE_S`` the
supervisor signals again (RQ then kills the job) and finally kills what is left.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Final

from service.log_format import configure_logging
from service.records.connection import redis_client
from service.records.sync import Records
from service.settings import get_settings
from service.store import open_store
from service.upkeep.housekeeping import Housekeeping
from service.upkeep.parent_death import SUPERVISOR_PID_ENV
from workers.running.loading import WORKER_DEVICE_ENV

__all__ = ["main", "worker_commands"]

log = logging.getLogger(__name__)

STOP_GRACE_S: Final = 20.0
MAX_RESTART_DELAY_S: Final = 30.0
# A child that ran this long before exiting restarts at once (its delay resets).
STABLE_AFTER_S: Final = 60.0
HOUSEKEEPING_INTERVAL_S: Final = 10.0


@dataclass
class _Child:
    name: str
    command: list[str]
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    failures: int = 0
    next_start: float = field(default=0.0)


def device_class(device: str) -> str:
    """``cpu``, ``cuda`` or ``mps``: which jobs' queue the worker serves (NOTE [ Queues by
    device ] in service/settings.py). ``auto`` is ``cuda`` where torch sees a GPU. This runs in
    the supervisor, never in the RQ worker's parent, whose forked jobs could not use a CUDA
    state made before the fork."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device.partition(":")[0]


def gpu_indices(device: str) -> list[str] | None:
    """The GPUs a ``--device`` of ``cuda:N`` or ``cuda:N,cuda:M,...`` names, in order; None
    for any other device (``cuda`` alone: every GPU the worker sees). Raises ``ValueError``
    for a list that is not of that form."""
    if not device.startswith("cuda:"):
        return None
    parts = device.split(",")
    indices = [p.removeprefix("cuda:") for p in parts]
    if not all(p.startswith("cuda:") and i.isdigit() for p, i in zip(parts, indices, strict=True)):
        raise ValueError(
            f"--device {device!r}: give cuda (every GPU), cuda:N, or GPUs as cuda:0,cuda:1"
        )
    if len(set(indices)) != len(indices):
        raise ValueError(f"--device {device!r} names a GPU twice; name each once")
    return indices


def worker_commands(device: str) -> list[tuple[str, list[str], dict[str, str]]]:
    """(name, argv, extra environment) of each child. ``cuda:N`` pins the RQ worker to GPU N
    through CUDA_VISIBLE_DEVICES, ``cuda:N,cuda:M`` to those GPUs, ``cuda`` serves every GPU
    the machine shows: a job runs on the first, a train job with ``processes`` P on the first
    P (docs/distributed.md). The inspector never uses a GPU."""
    worker_env: dict[str, str] = {}
    worker_device = device
    indices = gpu_indices(device)
    if indices is not None:
        worker_env["CUDA_VISIBLE_DEVICES"] = ",".join(indices)
        worker_device = "cuda"
    worker_env[WORKER_DEVICE_ENV] = worker_device
    python = sys.executable
    return [
        (
            "rq-worker",
            [
                python,
                "-m",
                "workers.processes.rq_worker",
                "--device",
                worker_device,
                "--device-class",
                device_class(device),
            ],
            worker_env,
        ),
        ("inspector", [python, "-m", "workers.processes.inspector"], {"CUDA_VISIBLE_DEVICES": ""}),
    ]


def _start(child: _Child) -> None:
    # The child asks to get SIGTERM when this process dies, even by SIGKILL (RQ's worker then
    # finishes its job and exits; the inspector exits at once): no orphan keeps taking jobs
    # beside a restarted supervisor. Started from the main thread: see die_with_parent.
    env = {**os.environ, **child.env, SUPERVISOR_PID_ENV: str(os.getpid())}
    child.process = subprocess.Popen(child.command, env=env)  # noqa: S603 - our own argv
    child.started = time.monotonic()
    log.info("started %s (pid %d)", child.name, child.process.pid)


def _stop_all(children: list[_Child]) -> None:
    running = [c for c in children if c.process is not None and c.process.poll() is None]
    for child in running:
        assert child.process is not None
        child.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for signum in (signal.SIGTERM, signal.SIGKILL):
        for child in running:
            assert child.process is not None
            try:
                child.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; sending %s", child.name, signum.name)
                child.process.send_signal(signum)
        deadline = time.monotonic() + 5.0
    for child in running:
        assert child.process is not None
        child.process.wait()


def supervise(device: str, stop: threading.Event) -> None:
    settings = get_settings()
    housekeeping = Housekeeping(
        Records(redis_client(settings.redis_url)),
        open_store(settings),
        settings,
        HOUSEKEEPING_INTERVAL_S,
    )
    housekeeping.start()
    children = [_Child(name, cmd, env) for name, cmd, env in worker_commands(device)]
    try:
        while not stop.is_set():
            now = time.monotonic()
            for child in children:
                if child.process is not None and child.process.poll() is not None:
                    code = child.process.returncode
                    ran = now - child.started
                    child.failures = 0 if ran > STABLE_AFTER_S else child.failures + 1
                    delay = min(2.0**child.failures - 1, MAX_RESTART_DELAY_S)
                    log.warning(
                        "%s exited (code %s); restarting in %.0f s", child.name, code, delay
                    )
                    child.process = None
                    child.next_start = now + delay
                if child.process is None and now >= child.next_start:
                    _start(child)
            stop.wait(0.5)
    finally:
        _stop_all(children)
        housekeeping.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description="Run a bnadapt worker (RQ worker + inspector).")
    parser.add_argument(
        "--device",
        default="auto",
        help="auto (CUDA when present), cpu, cuda (every GPU), cuda:N (one GPU) or "
        "cuda:0,cuda:1 (those GPUs)",
    )
    args = parser.parse_args()
    try:
        gpu_indices(args.device)
    except ValueError as exc:
        parser.error(str(exc))
    configure_logging("supervisor", get_settings().log_format)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        log.info("stopping (%s)", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    supervise(args.device, stop)


if __name__ == "__main__":
    main()
