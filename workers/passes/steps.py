"""The optimizer steps of a job: compiling the model that runs them, and timing them.

NOTE [ Compiled jobs ] (api_schemas/jobs/params.py) says which jobs compile and why inductor is
the default. :func:`step_forward` gives what a train job's steps and an adapt job's estimator
passes call: the wrapped model itself, or ``torch.compile`` of it. Everything else in the job
(loading, measurement, validation, the report's snapshots) uses the wrapped model as it is, so
state_dict keys and module names are the uncompiled ones, and only the graphs of the job's own
pass are compiled.

:class:`StepClock` times the steps one by one, alike for compiled and eager jobs, so two jobs'
``steady_samples_per_s`` compare like for like (the report's :class:`StepTimings`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch._dynamo
import torch._dynamo.utils
from torch import nn

from api_schemas.reports import StepTimings
from workers.errors import WorkerError

__all__ = ["CompileError", "StepClock", "step_forward"]

Forward = Callable[[torch.Tensor], torch.Tensor]


class CompileError(WorkerError):
    """torch.compile could not compile the model (no C compiler, an unsupported operation)."""


def _graphs() -> int:
    # dynamo's own count of the graphs it compiled in this process: read before and after each
    # step to tell the steps that compiled (torch has no public counter for it).
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def step_forward(model: nn.Module, backend: str | None) -> Forward:
    """``model`` (``backend=None``), or ``torch.compile(model, backend=backend)`` whose
    compilation errors become :class:`CompileError` with what to do. Not ``fullgraph``: a
    policy with ``offload_to_cpu`` breaks the graph (its saved-tensor hooks run eagerly)."""
    if backend is None:
        return model
    compiled = torch.compile(model, backend=backend)

    def forward(batch: torch.Tensor) -> torch.Tensor:
        try:
            out: torch.Tensor = compiled(batch)
        except torch._dynamo.exc.TorchDynamoException as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            hint = (
                " or with compile_backend 'aot_eager' (no C compiler needed; no speed-up)"
                if backend == "inductor"
                else ""
            )
            raise CompileError(
                f"torch.compile with backend {backend!r} failed on this model: {first}. "
                f"Submit the job without compile{hint}"
            ) from exc
        return out

    return forward


class StepClock:
    """Times each optimizer step; see :class:`StepTimings` for what it reports.

    ``start()`` before a step, ``stop(samples)`` after it. On CUDA each stop synchronises the
    device, so that a step's time is its own (compiled and eager jobs alike)."""

    def __init__(self, device: torch.device, backend: str | None) -> None:
        self._cuda = device.type == "cuda"
        self._device = device
        self._backend = backend
        self._started = 0.0
        self._graphs_before = 0
        self._first_graphs = _graphs()
        self.steps = self.warmup_steps = self.steady_steps = self.steady_samples = 0
        self.warmup_s = self.steady_s = 0.0

    def start(self) -> None:
        self._graphs_before = _graphs()
        self._started = time.perf_counter()

    def stop(self, samples: int) -> None:
        if self._cuda:
            torch.cuda.synchronize(self._device)
        elapsed = time.perf_counter() - self._started
        if self.steps == 0 or _graphs() != self._graphs_before:
            self.warmup_steps += 1
            self.warmup_s += elapsed
        else:
            self.steady_steps += 1
            self.steady_samples += samples
            self.steady_s += elapsed
        self.steps += 1

    def timings(self) -> StepTimings:
        rate = self.steady_samples / self.steady_s if self.steady_steps and self.steady_s else None
        return StepTimings(
            compiled=self._backend is not None,
            backend=self._backend,
            steps=self.steps,
            warmup_steps=self.warmup_steps,
            warmup_s=self.warmup_s,
            graphs_compiled=_graphs() - self._first_graphs if self._backend else 0,
            steady_steps=self.steady_steps,
            steady_samples=self.steady_samples,
            steady_s=self.steady_s,
            steady_samples_per_s=rate,
        )
