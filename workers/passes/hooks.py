"""What a job's computation reports to, and asks, the outside: progress and cancel requests.

A worker's job passes its :class:`workers.running.runtime.JobRuntime`; in-process runs (tests, the
benchmarks) pass :class:`NoHooks`, or nothing.
"""

from __future__ import annotations

from typing import Literal, Protocol

__all__ = ["JobHooks", "NoHooks"]


class JobHooks(Protocol):
    """What the computation reports to, and asks, the outside (see workers/running/runtime.py)."""

    def start_phase(
        self, phase: str, total: int, unit: Literal["batches", "steps"], samples_per_unit: float
    ) -> None: ...

    def report(self, done: int) -> None: ...

    def should_stop(self) -> bool: ...


class NoHooks:
    """For in-process runs: no progress, never stops."""

    def start_phase(
        self, phase: str, total: int, unit: Literal["batches", "steps"], samples_per_unit: float
    ) -> None:
        return None

    def report(self, done: int) -> None:
        return None

    def should_stop(self) -> bool:
        return False
