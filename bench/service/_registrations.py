"""The noisy neighbour's registrations phase (``bench/service/noisy_neighbour.py --phase
registrations``): tenant A completes large uploads and dataset imports and registers large
built-in models, all at once and over and over, while tenant B registers a small model and a
small dataset, timed, and ``/healthz`` is read 20 times a second, timed.

The heavy work in the API (joining an upload's parts, copying and checking an import) takes
its threads in turns by tenant (NOTE [ Heavy work in turns ] in service/api/offload.py); the
models are built by a worker's inspector. A's figures say how much of its load got through
(and what was refused: its quotas answer 429 as to any tenant).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from harness.servers import new_s3_server
from service.client import ApiClientError, Client

# B registers one small model and one small dataset every REGISTER_INTERVAL_S (or as soon as
# the last answered, when that took longer): some 8 requests a second, within its rate limit.
REGISTER_INTERVAL_S = 0.25
HEALTHZ_INTERVAL_S = 0.05
SMALL_MODEL: dict[str, Any] = {"in_features": 16, "hidden": 16, "depth": 1}


def latency_figures(latencies: list[float]) -> dict[str, float]:
    """Count, p50, p99 and max (ms) of ``latencies`` (s)."""
    ordered = sorted(latencies) or [float("nan")]
    return {
        "count": len(latencies),
        "p50_ms": 1000 * statistics.median(ordered),
        "p99_ms": 1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "max_ms": 1000 * ordered[-1],
    }


@dataclass
class Timings:
    """B's registrations and the /healthz reads of one phase: latencies (s) and errors."""

    model: list[float] = field(default_factory=list)
    dataset: list[float] = field(default_factory=list)
    healthz: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def figures(self) -> dict[str, Any]:
        return {
            "model": latency_figures(self.model),
            "dataset": latency_figures(self.dataset),
            "healthz": latency_figures(self.healthz),
            "errors": self.errors[:5],
            "error_count": len(self.errors),
        }


def _healthz_reads(url: str, until: float, timings: Timings) -> None:
    with httpx.Client(base_url=url, timeout=60) as http:
        while time.monotonic() < until:
            start = time.perf_counter()
            response = http.get("/healthz")
            took = time.perf_counter() - start
            if response.status_code == 200:
                timings.healthz.append(took)
            else:
                timings.errors.append(f"healthz {response.status_code}")
            time.sleep(max(0.0, HEALTHZ_INTERVAL_S - took))


def _timed(kind: list[float], errors: list[str], what: str, call: Any) -> float:
    start = time.perf_counter()
    try:
        call()
    except (ApiClientError, httpx.HTTPError) as exc:
        errors.append(f"{what}: {str(exc)[:200]}")
    took = time.perf_counter() - start
    kind.append(took)
    return took


def b_registrations(client: Client, url: str, dataset: Path, seconds: float) -> Timings:
    """B's small model and small dataset, registered in turn every REGISTER_INTERVAL_S for
    ``seconds``, with /healthz read beside them; a failed registration's time is counted too
    (it is what B waited) and its error kept."""
    timings = Timings()
    until = time.monotonic() + seconds
    reader = threading.Thread(target=_healthz_reads, args=(url, until, timings), daemon=True)
    reader.start()
    while time.monotonic() < until:
        took = _timed(
            timings.model,
            timings.errors,
            "model",
            lambda: client.add_model("mlp", SMALL_MODEL),
        )
        took += _timed(
            timings.dataset, timings.errors, "dataset", lambda: client.add_dataset(dataset)
        )
        time.sleep(max(0.0, REGISTER_INTERVAL_S - took))
    reader.join()
    return timings


@dataclass
class S3Sources:
    """An S3-compatible server (SeaweedFS) holding the store and the objects A imports."""

    env: dict[str, str]  # the stack's: the store on S3, the keys to reach it
    sources: list[str]  # s3://BUCKET/a/<name>, one per file
    prefix: str  # what A is allowed to import from


@contextlib.contextmanager
def s3_sources(work: Path, files: list[Path]) -> Iterator[S3Sources]:
    """A started SeaweedFS with a bucket for the store and one with ``files`` under ``a/``;
    stopped on exit. Imports need a store on S3 (they copy server-side)."""
    server = new_s3_server(work / "s3")
    try:
        store_bucket, source_bucket = server.new_bucket(), server.new_bucket()
        s3 = server.client()
        for path in files:
            s3.upload_file(str(path), source_bucket, f"a/{path.name}")
        yield S3Sources(
            {**server.env, "BNADAPT_STORE_URL": f"s3://{store_bucket}/store/"},
            [f"s3://{source_bucket}/a/{path.name}" for path in files],
            f"s3://{source_bucket}/a/",
        )
    finally:
        server.stop()


class RegistrationFlood:
    """Tenant A's heavy registrations, each kind on its own threads, over and over until
    :meth:`stop`: resumable uploads of ``files`` (all at once), imports of ``sources`` (all at
    once) and ``model_threads`` registrations of an ``mlp`` of ``model_kwargs`` at a time."""

    def __init__(
        self,
        url: str,
        key: str,
        files: list[Path],
        sources: list[str],
        model_kwargs: dict[str, int],
        model_threads: int,
    ) -> None:
        self.url, self.key = url, key
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.done = {"uploads": 0, "imports": 0, "models": 0}
        self.refused_429 = 0
        self.errors: list[str] = []
        work = [
            *(("uploads", self._upload, path) for path in files),
            *(("imports", self._import, source) for source in sources),
            *(("models", self._model, model_kwargs) for _ in range(model_threads)),
        ]
        self.threads = [threading.Thread(target=self._loop, args=args) for args in work]

    def start(self) -> None:
        for thread in self.threads:
            thread.daemon = True
            thread.start()

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=300)

    def figures(self) -> dict[str, Any]:
        with self.lock:
            return {
                "done": dict(self.done),
                "refused_429": self.refused_429,
                "errors": self.errors[:5],
                "error_count": len(self.errors),
            }

    def _loop(self, kind: str, once: Any, what: Any) -> None:
        client = Client(self.url, self.key, timeout_s=600, rate_retries=60)
        while not self.stopping.is_set():
            try:
                once(client, what)
            except ApiClientError as exc:
                with self.lock:
                    if exc.status == 429:
                        self.refused_429 += 1
                    else:
                        self.errors.append(f"{kind} {exc.status}: {exc.detail[:200]}")
                time.sleep(0.5)  # a refusal (a quota): try again a little later
                continue
            except httpx.HTTPError as exc:
                with self.lock:
                    self.errors.append(f"{kind} {type(exc).__name__}")
                time.sleep(0.5)
                continue
            with self.lock:
                self.done[kind] += 1

    @staticmethod
    def _upload(client: Client, path: Path) -> None:
        client.upload_dataset(path, retries=60)

    @staticmethod
    def _import(client: Client, source: str) -> None:
        response = client.request("POST", "/v1/datasets:import", json={"source": source})
        if response.status_code != 201:
            raise ApiClientError(response.status_code, response.text)

    @staticmethod
    def _model(client: Client, kwargs: dict[str, int]) -> None:
        client.add_model("mlp", kwargs)


def below_everything(niceness: int) -> None:
    """This process (A's client) at ``niceness``, in a session of its own whose scheduling
    group is at ``niceness`` too. Where the kernel groups processes by session (autogroup,
    ``/proc/sys/kernel/sched_autogroup_enabled``), a nice value ranks a process only within
    its session's group, and the groups share a processor evenly: A's client at nice 19 still
    took half the worker's processor from the worker's session, and B's builds waited for it
    in the run queue for seconds (bench/RESULTS.md). A client on a machine of its own takes
    none; its own group at the same niceness takes what the service leaves."""
    with contextlib.suppress(OSError):  # already a session's leader
        os.setsid()
    os.nice(niceness)
    with contextlib.suppress(OSError):  # no autogroups here: the nice value alone ranks it
        Path("/proc/self/autogroup").write_text(str(niceness))


def run_registration_flood(
    url: str,
    key: str,
    files: list[Path],
    sources: list[str],
    model_kwargs: dict[str, int],
    model_threads: int,
    pin: bool,
    a_nice: int,
    stop: Any,
    figures: Any,
) -> None:
    """Tenant A's process: the flood until ``stop`` is set, then its figures on ``figures``.
    ``a_nice``: A's client below everything else, as on a machine of its own."""
    if a_nice:
        below_everything(a_nice)
    if pin:
        os.sched_setaffinity(0, {1})  # A's client beside the worker, off the API's core
    flood = RegistrationFlood(url, key, files, sources, model_kwargs, model_threads)
    flood.start()
    stop.wait()
    flood.stop()
    figures.put(flood.figures())
