"""The whole service as processes for bench/service/overhead.py: harness/stack.py's ``Stack``, with
the API under ``uvicorn --workers N`` when asked, and the CPU time each part of it used."""

from __future__ import annotations

import os
from dataclasses import dataclass

from harness.servers import wait_for
from harness.stack import Stack

__all__ = ["BenchStack", "cpu_seconds", "machine_busy_seconds", "process_tree"]

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as file:
                found += [int(child) for child in file.read().split()]
    except FileNotFoundError:  # it exited meanwhile
        pass
    return found


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants now (Linux ``/proc``)."""
    tree, pending = [], [pid]
    while pending:
        current = pending.pop()
        tree.append(current)
        pending += _children(current)
    return tree


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes used so far, with that of their children they
    waited for (an RQ worker's job processes); processes that exited count 0."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as file:
                # The command name (field 2) may hold spaces; fields after it are plain.
                fields = file.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        total += sum(int(value) for value in fields[11:15])  # utime stime cutime cstime
    return total / CLOCK_TICKS_PER_S


def machine_busy_seconds() -> float:
    """CPU seconds all cores of the machine spent busy so far (``/proc/stat``: all but idle
    and iowait; guest time is already in user)."""
    with open("/proc/stat") as file:
        ticks = [int(value) for value in file.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS_PER_S


@dataclass
class BenchStack(Stack):
    """``api_workers`` > 1 runs uvicorn's process manager with that many API processes."""

    api_workers: int = 1

    def api_argv(self) -> list[str]:
        workers = ["--workers", str(self.api_workers)] if self.api_workers > 1 else []
        return [*super().api_argv(), "--no-access-log", *workers]

    def start_api(self, timeout_s: float = 60) -> None:
        super().start_api(timeout_s)
        # With several processes, /healthz answers once the first is up: wait for all.
        wait_for(
            lambda: (
                len(process_tree(self.api.pid)) >= self.api_workers + (self.api_workers > 1)
                if self.api is not None
                else False
            ),
            timeout_s=60,
            what=f"{self.api_workers} API processes",
        )

    def api_pids(self) -> list[int]:
        return process_tree(self.api.pid) if self.api is not None else []

    def worker_pids(self) -> list[int]:
        return process_tree(self.worker.pid) if self.worker is not None else []
