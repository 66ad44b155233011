"""What bench/service/overhead.py measures, and its markdown tables."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

OVERHEAD_TARGET_S = 0.150
READS_TARGET_PER_S = 1000.0
READS_P99_TARGET_S = 0.050
SUBMITS_TARGET_PER_S = 300.0
ADAPT_TARGET = 0.95


def median(values: list[float]) -> float:
    return statistics.median(values)


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def quartiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    low, mid, high = statistics.quantiles(values, n=4)
    return low, mid, high


def verdict(met: bool) -> str:
    return "yes" if met else "**no**"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


@dataclasses.dataclass(frozen=True)
class CpuUse:
    """Cores busy on average over a stretch of time: the machine's, and ours within it."""

    wall_s: float
    machine_s: float  # CPU seconds of all processes on the machine
    ours_s: float  # of the service's processes and this benchmark's

    @property
    def others_cores(self) -> float:
        """Processes that are not ours: the noise of a shared machine."""
        return max(self.machine_s - self.ours_s, 0.0) / self.wall_s


@dataclasses.dataclass(frozen=True)
class JobTiming:
    """Seconds, for one job as the client saw it and as the job's records and report say."""

    total_s: float  # POST sent -> success seen
    submit_s: float  # POST round trip
    enqueue_s: float  # created_at -> RQ's enqueued_at (in the API)
    dequeue_s: float  # RQ's enqueued_at -> RQ's started_at: dequeue, fork, RQ's preparation
    start_s: float  # RQ's started_at -> our started_at: run_job's setup, mark started
    run_s: float  # our started_at -> our finished_at
    observed_s: float  # our finished_at -> success seen by the client
    compute_s: float
    load_s: float
    job_total_s: float  # timings.total_s: all of compute()

    @property
    def overhead_s(self) -> float:
        return self.total_s - self.compute_s

    @property
    def queue_s(self) -> float:
        return self.enqueue_s + self.dequeue_s + self.start_s


@dataclasses.dataclass(frozen=True)
class LoadResult:
    api_processes: int
    what: str
    completed: int
    errors: int
    latencies_ms: list[float]
    window_s: float
    cores: dict[str, float]  # CPU seconds over the window / window: API, Redis, clients
    others_cores: float

    @property
    def rate(self) -> float:
        return self.completed / self.window_s


@dataclasses.dataclass(frozen=True)
class AdaptResult:
    samples: int
    job_compute_s: list[float]  # timings.compute_s of compute(), one per pair
    job_load_s: list[float]
    bare_s: list[float]  # the bare loop over the same samples, one per pair

    @property
    def ratios(self) -> list[float]:
        """Job throughput over bare throughput, per pair."""
        return [b / c for b, c in zip(self.bare_s, self.job_compute_s, strict=True)]


_BREAKDOWN: list[tuple[str, Callable[[JobTiming], float]]] = [
    ("POST sent -> succeeded seen by the client", lambda t: t.total_s),
    ("`compute_s` (the job's computation)", lambda t: t.compute_s),
    ("**overhead** = the above less `compute_s`", lambda t: t.overhead_s),
    ("- POST /v1/jobs round trip", lambda t: t.submit_s),
    ("- queued: `created_at` -> `started_at`", lambda t: t.queue_s),
    ("  - `created_at` -> RQ enqueued (in the API)", lambda t: t.enqueue_s),
    ("  - RQ enqueued -> RQ started: dequeue, fork, RQ's bookkeeping", lambda t: t.dequeue_s),
    ("  - RQ started -> `started_at`: run_job's setup, mark running", lambda t: t.start_s),
    (
        "- running less compute: `started_at` -> `finished_at` less `compute_s`",
        lambda t: t.run_s - t.compute_s,
    ),
    ("  - `load_s` (model, weights, dataset)", lambda t: t.load_s),
    (
        "  - rest of compute(): evaluations, report",
        lambda t: t.job_total_s - t.load_s - t.compute_s,
    ),
    ("  - after compute(): save, register, mark succeeded", lambda t: t.run_s - t.job_total_s),
    ("- `finished_at` -> succeeded seen by the client", lambda t: t.observed_s),
]


def overhead_table(tiny: dict[str, list[JobTiming]], cpu: CpuUse) -> list[str]:
    names = list(tiny)
    lines = [
        "| per job (median over jobs) | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for label, value in _BREAKDOWN:
        cells = " | ".join(ms(median([value(t) for t in tiny[n]])) for n in names)
        lines.append(f"| {label} | {cells} |")
    lines.append("")
    for name in names:
        overhead = [t.overhead_s for t in tiny[name]]
        met = median(overhead) <= OVERHEAD_TARGET_S
        lines.append(
            f"- overhead, {name}: **{ms(median(overhead))}** (p90 "
            f"{ms(percentile(overhead, 90))}); target <= {ms(OVERHEAD_TARGET_S)}: {verdict(met)}"
        )
    lines.append(f"- other processes on the machine meanwhile: {cpu.others_cores:.2f} cores")
    return lines


def load_table(loads: list[LoadResult]) -> list[str]:
    lines = [
        "| API processes | request | per second | p50 | p99 | errors "
        "| cores: API / Redis / clients / others | target | met |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for load in loads:
        rate, p99_ms = load.rate, percentile(load.latencies_ms, 99)
        if load.what.startswith("GET"):
            target = f">= {READS_TARGET_PER_S:.0f}/s, p99 <= {READS_P99_TARGET_S * 1e3:.0f} ms"
            met = rate >= READS_TARGET_PER_S and p99_ms <= READS_P99_TARGET_S * 1e3
        else:
            target = f">= {SUBMITS_TARGET_PER_S:.0f}/s"
            met = rate >= SUBMITS_TARGET_PER_S
        cores = " / ".join(f"{v:.2f}" for v in [*load.cores.values(), load.others_cores])
        lines.append(
            f"| {load.api_processes} | `{load.what}` | **{rate:.0f}** "
            f"| {median(load.latencies_ms):.1f} ms | {p99_ms:.1f} ms | {load.errors} | {cores} "
            f"| {target} | {verdict(met and load.errors == 0)} |"
        )
    return lines


def adapt_table(
    adapt: AdaptResult, service: dict[str, list[JobTiming]], cpu: CpuUse, poll_s: float
) -> list[str]:
    low, mid, high = quartiles(adapt.ratios)
    bare_rate = adapt.samples / median(adapt.bare_s)
    job_rate = adapt.samples / median(adapt.job_compute_s)
    lines = [
        "| loop | samples/s (median) | over bare | target | met |",
        "|---|---|---|---|---|",
        f"| bare `model.train(); with no_grad: model(x)` | {bare_rate:.0f} | 1 | | |",
        f"| `compute()` in this process: samples / `compute_s` | {job_rate:.0f} "
        f"| **{mid:.3f}** ({low:.3f}-{high:.3f}) | >= {ADAPT_TARGET} "
        f"| {verdict(mid >= ADAPT_TARGET)} |",
    ]
    for name, timings in service.items():
        rate = adapt.samples / median([t.compute_s for t in timings])
        lines.append(
            f"| the same job through the worker, {name} ({len(timings)} jobs, not paired) "
            f"| {rate:.0f} | {rate / bare_rate:.3f} | (information) | |"
        )
    lines += ["", f"- `load_s` of compute() in this process: {ms(median(adapt.job_load_s))}"]
    for name, timings in service.items():
        lines.append(
            f"- through the worker, {name}: `load_s` {ms(median([t.load_s for t in timings]))}, "
            f"overhead (POST -> seen, less `compute_s`, polled every {ms(poll_s)}) "
            f"{ms(median([t.overhead_s for t in timings]))}"
        )
    lines.append(
        f"- other processes on the machine during the paired runs: {cpu.others_cores:.2f} cores"
    )
    return lines
