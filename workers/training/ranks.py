"""A train job in several processes on one worker: its ranks, launched by torch's elastic
launcher (the machinery behind ``torchrun``), kept in step by DDP (docs/distributed.md).

The job's own process (the RQ job process, which keeps the heartbeat, the progress and the
cancel flag: workers/running/runtime.py) loads and measures the model as for any job; for the
training itself it calls :func:`train_in_ranks`, which runs ``processes`` ranks through
``elastic_launch`` and waits for them. Each rank (:func:`run_rank`, in a process of its own)
loads the job again, wraps its model in DDP and runs :func:`train_model` on its slice of each
global batch. Rank 0 hands back the trained state; the job's process loads it into its model,
measures, reports and saves as for a job in one process, so only one process writes results.

NOTE [ Ranks' batches ]

Each epoch is one global permutation drawn from the job's seed, the same on every rank; it is
cut into global batches of ``batch_size`` as in one process, and rank r of N trains on the
r-th of every N samples of each global batch (``RankSlice.take`` in
workers/training/training.py): DistributedSampler's deal, batch by batch. A short last batch is
cut to a multiple of N (the samples over are left out of that epoch's step), and dropped when
it leaves a rank fewer than 2 samples. DDP averages the ranks' gradients, each the gradient of
the mean loss over its slice: with equal slices, the gradient of the global batch's mean loss
except that each rank's BatchNorm normalises with its own slice's statistics
(``sync_batchnorm`` converts it to bnadapt's SyncBatchNorm, which uses the global batch's, on
the CPU as on CUDA). DDP broadcasts rank 0's buffers before each forward, so the running
statistics the job keeps are rank 0's.

NOTE [ What the ranks share with the job's process ]

The ranks read the job's inputs from the store, and the training checkpoint to resume from
that the job's process chose (the job's latest, NOTE [ Ranks in a checkpoint ] in
workers/training/train_state.py). Rank 0 alone writes to the store and Redis, through its own
client, what one process would write while it trains: the job's training checkpoints
(every rank takes part in gathering each, at the same step) and its epochs for the events
stream (workers/training/resumption.py). They share a private temporary directory with the
job's process (``_Workdir``): rank 0 writes its progress
there after each step and the trained state (safetensors) at the end; a rank that fails writes
its error's kind and message there; the job's process creates a ``stop`` file there when the
job is canceled or lost, which every rank checks before each step. What comes back through the
launcher is each rank's :class:`RankOutcome` as JSON text: no pickled user data.

NOTE [ Ranks meet on the loopback ]

Nobody outside the job can reach the ranks' meeting point: torch's c10d rendezvous hosts a
TCPStore, which listens on every interface whatever host it is given and asks no one who
connects, and gloo and NCCL pick a network interface of their own unless told. So the
launcher's agent meets through ``_FileRendezvous`` (a ``FileStore`` in the job's private
directory: one node, no socket), each rank joins the process group through another
``FileStore`` there (``init_process_group(store=...)``; nothing reads MASTER_ADDR/PORT), and
each rank names the loopback interface to gloo and NCCL (``GLOO_SOCKET_IFNAME``,
``NCCL_SOCKET_IFNAME``: :func:`loopback_interface`, read from the system) before it joins, so
the connections between ranks are on 127.0.0.1 and their listening sockets bound to it
(tests/e2e/training/test_processes_e2e.py reads the kernel's socket table while a job trains).

NOTE [ A job's memory among its processes ]

A worker's ``BNADAPT_WORKER_MEMORY_BYTES`` is the job's, not each process's
(workers/running/capacity.py): when it launches the ranks, the job's process divides what it
has left under its cap (its own use so far is its to keep: it measures again afterwards)
equally among them, and each rank holds itself to its share (``RLIMIT_DATA``), as its loader
processes do to theirs of the rank's (NOTE [ Loader processes' memory ] in
workers/passes/process_memory.py). A rank that needs
more fails the job as out of memory, saying its share; it is not retried. The admission
estimate counts each rank's weights and optimizer state and its slice of the batch (NOTE [
Activation estimate ] in service/jobs/submission.py).

Failures: the ranks of a job live and die together. The launcher runs with ``max_restarts``
0; when one rank ends with an error or is killed, its agent ends the others and raises, and
the job's attempt ends with it: a rank's own error (bad data, NaN) fails the job with its
message, as does a rank killed for memory; a rank killed by a signal otherwise is an
interruption (retried as one attempt, NOTE [ Job attempts ] in service/records/job_life/retries.py).
Each rank asks the kernel for SIGKILL when the job's process dies, so a job process killed by
RQ (stop, timeout) leaves no rank behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import tempfile
import threading
from dataclasses import asdict
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Final

import safetensors.torch
import torch
import torch.distributed as dist
from pydantic import BaseModel
from torch import nn
from torch._C._distributed_c10d import FileStore  # torch.distributed exports it undeclared
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)
from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from torch.nn.parallel import DistributedDataParallel

from api_schemas import JobPayload, TrainParams
from api_schemas.reports import EpochLog, StepTimings
from bnadapt.sync_batchnorm import convert_sync_batchnorm
from service.records.connection import redis_client
from service.records.sync import Records
from service.settings import MIB, get_settings
from service.store import open_store
from service.upkeep.parent_death import die_with_parent
from workers import errors
from workers.errors import JobCanceled, JobInterrupted, TrainError, WorkerError
from workers.faults import rank_allocation
from workers.models.modules import named_modules
from workers.passes.hooks import JobHooks
from workers.passes.process_memory import hold_process_to, memory_left
from workers.passes.steps import StepClock
from workers.running.capacity import oom_kills
from workers.running.compute import one_sample_batch_explained
from workers.running.evaluation import loss_for
from workers.running.failures import is_out_of_memory, out_of_memory_message
from workers.running.loading import LoadedJob, load_job, resolve_device
from workers.training.resumption import StoredCheckpoints
from workers.training.train_state import TrainState, load_state
from workers.training.training import Checkpointing, RankSlice, TrainHooks, train_with_params

__all__ = ["RankOutcome", "loopback_interface", "run_rank", "train_in_ranks"]

# How often the job's process reads rank 0's progress and passes a cancel on to the ranks.
WATCH_INTERVAL_S: Final = 0.2
# How long the ranks may take to start and meet (importing torch, once a rank a process).
RENDEZVOUS_TIMEOUT_S: Final = 300
# How long ranks asked to stop (one of them failed) get before SIGKILL.
SHUTDOWN_TIMEOUT_S: Final = 10
_STATE: Final = "state.safetensors"
_PROGRESS: Final = "progress"
_STOP: Final = "stop"
_RENDEZVOUS: Final = "rendezvous"  # the agent's FileStore
_RANKS_STORE: Final = "ranks"  # the ranks' process group's FileStore
_FILE_RENDEZVOUS: Final = "bnadapt-file"  # its name in torch's rendezvous registry
_LOOPBACK_ADDRESS: Final = "127.0.0.1"
_IFF_LOOPBACK: Final = 0x8  # the interface flag, as Linux's /sys/class/net/*/flags shows it
_SYS_NET: Final = Path("/sys/class/net")


class RankOutcome(BaseModel):
    """What one rank trained, as it sends it back to the job's process."""

    rank: int
    steps: int
    samples: int  # the global batches' samples, all ranks together
    epochs: list[EpochLog]  # rank 0's carry the validation; others' have none
    best_epoch: int | None = None  # keep_best: rank 0's kept epoch
    timings: StepTimings | None  # this rank's steps, counting its own slices


class _Workdir:
    """The private directory a job's process shares with its ranks (NOTE [ What the ranks
    share with the job's process ])."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    @property
    def state(self) -> Path:
        return self.path / _STATE

    @property
    def rendezvous(self) -> Path:
        return self.path / _RENDEZVOUS

    @property
    def ranks_store(self) -> Path:
        return self.path / _RANKS_STORE

    def error(self, rank: int) -> Path:
        return self.path / f"error-{rank}.json"

    def stop_requested(self) -> bool:
        return (self.path / _STOP).exists()

    def request_stop(self) -> None:
        (self.path / _STOP).touch()

    def write_progress(self, done: int, total: int) -> None:
        # Written whole and renamed: the job's process never reads half a line.
        partial = self.path / f"{_PROGRESS}.partial"
        partial.write_text(f"{done} {total}")
        partial.replace(self.path / _PROGRESS)

    def read_progress(self) -> tuple[int, int] | None:
        try:
            done, total = (self.path / _PROGRESS).read_text().split()
        except (OSError, ValueError):
            return None
        return int(done), int(total)


class _FileRendezvous(RendezvousHandler):
    """The launcher's rendezvous for the one node of a job, through a ``FileStore`` in the
    job's private directory: no socket (NOTE [ Ranks meet on the loopback ])."""

    def __init__(self, path: str, run_id: str) -> None:
        self._path, self._run_id = path, run_id
        self._store: FileStore | None = None

    def get_backend(self) -> str:
        return _FILE_RENDEZVOUS

    @property
    def use_agent_store(self) -> bool:
        return False  # the ranks meet through a store of their own (run_rank)

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            self._store = FileStore(self._path, 1)
        # The ranks read no MASTER_ADDR/PORT (they join through a FileStore): the agent sets
        # them all the same, to this loopback placeholder.
        return RendezvousInfo(self._store, 0, 1, RendezvousStoreInfo(_LOOPBACK_ADDRESS, 0))

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        return True


def _file_rendezvous(params: RendezvousParameters) -> RendezvousHandler:
    if params.min_nodes != 1 or params.max_nodes != 1:
        raise ValueError(
            f"the file rendezvous joins one node, not {params.min_nodes} to {params.max_nodes}"
        )
    return _FileRendezvous(params.endpoint, params.run_id)


def loopback_interface() -> str:
    """The name of this machine's loopback interface (``lo`` on Linux, ``lo0`` on macOS), read
    from the system: the interface Linux flags IFF_LOOPBACK, else the one named ``lo...``."""
    with contextlib.suppress(OSError):
        for entry in sorted(_SYS_NET.iterdir()):
            with contextlib.suppress(OSError, ValueError):
                if int((entry / "flags").read_text(), 16) & _IFF_LOOPBACK:
                    return entry.name
    names = sorted(name for _, name in socket.if_nameindex() if name.startswith("lo"))
    if not names:
        raise WorkerError(
            "this machine shows no loopback interface, which a job's ranks talk over; run "
            "jobs with processes > 1 on workers whose machine has one (lo)"
        )
    return names[0]


def _rank_device(requested: str, local_rank: int) -> torch.device:
    """Rank r's device: the r-th of the worker's GPUs on CUDA (one rank a GPU), made this
    process's current one before anything touches CUDA (else every rank would open a context
    on the first GPU); else the CPU."""
    device = resolve_device(requested)
    if device.type != "cuda":
        return device
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def run_rank(
    payload_json: str,
    workdir: str,
    parent_pid: int,
    threads: int,
    resume_sha256: str | None,
    keep_checkpoints: bool,
    memory_share: int | None = None,
) -> str:
    """One rank of a train job; the launcher's entry point, run in a process of its own with
    torch.distributed's environment (RANK, WORLD_SIZE, LOCAL_RANK). Resumes from the stored
    checkpoint ``resume_sha256``; with ``keep_checkpoints`` (a worker's run) rank 0 writes the
    job's checkpoints and epochs; holds itself to ``memory_share`` bytes (NOTE [ A job's
    memory among its processes ]). Returns its :class:`RankOutcome` as JSON."""
    die_with_parent(signal.SIGKILL, parent_pid)  # no rank outlives the job's process
    if memory_share is not None:
        hold_process_to(memory_share)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    shared = _Workdir(workdir)
    torch.set_num_threads(threads)
    try:
        payload = JobPayload.model_validate_json(payload_json)
        _held = rank_allocation(payload.job_id)  # tests only, held while it trains (faults.py)
        params = payload.params
        assert isinstance(params, TrainParams), f"{payload.kind} jobs do not train"
        device = _rank_device(params.device, local_rank)
        settings = get_settings()
        store = open_store(settings)
        job = load_job(payload, store)
        resume = None if resume_sha256 is None else load_state(store.local_path(resume_sha256))
        stored = None
        if keep_checkpoints and rank == 0:
            records = Records(redis_client(settings.redis_url, outage_s=settings.redis_outage_s))
            stored = StoredCheckpoints(records, store, payload, settings.tenant_max_stored_bytes)
        checkpointing = None
        if keep_checkpoints:
            save = _written_by_rank_0 if stored is None else stored.save
            checkpointing = Checkpointing.of(params, save, resume)
        # NOTE [ Ranks meet on the loopback ]
        interface = loopback_interface()
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = interface
        meeting = FileStore(str(shared.ranks_store), world_size)
        meeting.set_timeout(timedelta(seconds=RENDEZVOUS_TIMEOUT_S))
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=meeting,
            rank=rank,
            world_size=world_size,
        )
        outcome = _train_rank(
            params, job, device, shared, RankSlice(rank, world_size), checkpointing, stored
        )
        return outcome.model_dump_json()
    except BaseException as exc:
        kind = type(exc).__name__ if isinstance(exc, WorkerError) else "WorkerError"
        message = str(exc) or type(exc).__name__
        if is_out_of_memory(exc):
            message = _out_of_memory_in_rank(rank, world_size, memory_share, message)
        elif not isinstance(exc, WorkerError):
            message = f"rank {rank} of {world_size} failed: {type(exc).__name__}: {message}"
        with contextlib.suppress(OSError):  # the error itself propagates either way
            shared.error(rank).write_text(json.dumps({"kind": kind, "message": message}))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _out_of_memory_in_rank(rank: int, world_size: int, share: int | None, what: str) -> str:
    """A rank's allocation failure as the job's error, with its share of the job's memory."""
    if share is None:
        return out_of_memory_message(f"rank {rank} of {world_size}: {what[:300]}")
    return out_of_memory_message(
        f"rank {rank} of {world_size} needed more than its share of the job's memory, "
        f"{share / MIB:.0f} MiB: what the worker holds a job to (BNADAPT_WORKER_MEMORY_BYTES) "
        f"less what the job's own process held, divided among its {world_size} ranks, each "
        f"with its own copy of the model and its optimizer state; with fewer processes each "
        f"rank has more. The allocator said: {what[:300]}"
    )


def _written_by_rank_0(state: TrainState) -> None:
    """Ranks other than 0 take part in each checkpoint (NOTE [ Ranks in a checkpoint ] in
    workers/training/train_state.py) and write nothing."""


def _train_rank(
    params: TrainParams,
    job: LoadedJob,
    device: torch.device,
    shared: _Workdir,
    ranks: RankSlice,
    checkpointing: Checkpointing | None,
    stored: StoredCheckpoints | None,
) -> RankOutcome:
    assert job.y is not None, "the API only accepts train jobs on labelled datasets"
    model: nn.Module = job.model.to(device)
    if params.sync_batchnorm:
        # bnadapt's own SyncBatchNorm, on gloo as on NCCL. Converted after the checkpoint policy
        # wrapped its blocks: the wrapper reads its modules when it runs, and its recomputation
        # reuses the first forward's global statistics (no second collective).
        try:
            model = convert_sync_batchnorm(model)
        except TypeError as exc:  # a BatchNorm with a forward of its own (timm's BatchNormAct2d)
            raise TrainError(f"sync_batchnorm: {exc}; submit without sync_batchnorm") from exc
    # DDP broadcasts rank 0's parameters and buffers now and its buffers before each forward
    # (NOTE [ Ranks' batches ]); validation and the saved state use `model` itself.
    ddp = DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )
    tracked_before = _batches_tracked(model)
    clock = StepClock(device, None)
    progress = shared.write_progress if ranks.rank == 0 else None
    loss = params.loss or loss_for(job.y)
    with one_sample_batch_explained(None, params.batch_size // ranks.world_size, None):
        trained = train_with_params(
            params,
            model,
            job.x,
            job.y,
            loss=loss,
            device=device,
            checkpointing=checkpointing,
            hooks=TrainHooks(
                progress=progress,
                should_stop=shared.stop_requested,
                on_epoch=None
                if stored is None
                else partial(stored.publish_epoch, epochs=params.epochs),
                forward=ddp,
                clock=clock,
            ),
            ranks=ranks,
        )
    # Micro-batches, one BatchNorm update each (NOTE [ Micro-batches and steps ]).
    _check_one_update_a_step(model, tracked_before, trained.batches, ranks.rank)
    if ranks.rank == 0:
        state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
        written = shared.path / f"{_STATE}.partial"
        safetensors.torch.save_file(state, str(written))
        written.replace(shared.state)
    return RankOutcome(
        rank=ranks.rank,
        steps=trained.batches,  # micro-batches: the report's `batches`
        samples=trained.samples,
        epochs=[EpochLog(**asdict(e)) for e in trained.epochs],
        best_epoch=trained.best_epoch,
        timings=None if clock.steps == 0 else clock.timings(),
    )


def _batches_tracked(model: nn.Module) -> dict[str, int]:
    """Each BatchNorm layer's ``num_batches_tracked``, by name."""
    return {
        name: int(module.num_batches_tracked)
        for name, module in named_modules(model)
        if isinstance(module, nn.modules.batchnorm._BatchNorm)
        and module.num_batches_tracked is not None
    }


def _check_one_update_a_step(
    model: nn.Module, before: dict[str, int], steps: int, rank: int
) -> None:
    """The checkpoint wrapper's guarantee, on this rank: each BatchNorm layer counted exactly
    one batch a step. DDP gives every rank rank 0's buffers before each forward, so on any
    rank the count after the last step is the count before plus the steps."""
    for name, count in _batches_tracked(model).items():
        if count != before[name] + steps:
            raise TrainError(
                f"rank {rank}: BatchNorm layer {name!r} counted {count - before[name]} batches "
                f"in {steps} steps; its statistics were updated more than once a step. Report "
                "this with the job's checkpoint policy; submit with checkpoint preset 'none' "
                "meanwhile"
            )


def _processes_fit(processes: int, device: torch.device) -> None:
    """On CUDA, one rank a GPU: no more ranks than the worker's GPUs."""
    if device.type == "cuda" and processes > torch.cuda.device_count():
        raise WorkerError(
            f"the job asks for processes={processes}, one GPU each, but this worker serves "
            f"{torch.cuda.device_count()} GPU(s); submit with processes <= "
            f"{torch.cuda.device_count()}, or run a worker with more GPUs (bnadapt worker "
            "--device cuda serves all the machine's GPUs)"
        )


class _Watch:
    """A thread of the job's process that passes rank 0's progress on to the job's hooks and
    a cancel on to the ranks."""

    def __init__(self, shared: _Workdir, hooks: JobHooks, batch_size: int) -> None:
        self._shared, self._hooks, self._batch_size = shared, hooks, batch_size
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ranks-watch", daemon=True)
        self._total = 0

    def __enter__(self) -> _Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._done.wait(WATCH_INTERVAL_S):
            if self._hooks.should_stop():
                self._shared.request_stop()
            read = self._shared.read_progress()
            if read is None:
                continue
            done, total = read
            if total != self._total:
                self._hooks.start_phase("train", total, "steps", float(self._batch_size))
                self._total = total
            self._hooks.report(done)


def train_in_ranks(
    payload: JobPayload,
    params: TrainParams,
    job: LoadedJob,
    hooks: JobHooks,
    *,
    resume_sha256: str | None = None,
    keep_checkpoints: bool = False,
) -> list[RankOutcome]:
    """Trains ``job.model`` with ``params.processes`` ranks and loads rank 0's state into it;
    returns what each rank trained, in rank order, or raises what ended the ranks (module
    docstring: failures). The ranks resume from the stored training checkpoint
    ``resume_sha256``; with ``keep_checkpoints`` (a worker's run) rank 0 writes the job's
    checkpoints and epochs (workers/training/resumption.py)."""
    processes = params.processes
    _processes_fit(processes, job.device)
    threads = max(1, torch.get_num_threads() // processes)
    # NOTE [ A job's memory among its processes ]: what this process holds now stays its own
    # (it measures the trained model afterwards); the rest is the ranks', in equal shares.
    left = memory_left()
    share = None if left is None else left // processes
    with tempfile.TemporaryDirectory(prefix="bnadapt-ranks-") as workdir:
        shared = _Workdir(workdir)
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=processes,
            run_id=payload.job_id,
            # NOTE [ Ranks meet on the loopback ]: a file, no socket.
            rdzv_backend=_FILE_RENDEZVOUS,
            rdzv_endpoint=str(shared.rendezvous),
            max_restarts=0,  # the ranks live and die together: one failure ends the attempt
            monitor_interval=0.1,
            start_method="spawn",  # the job's process may hold CUDA state: never fork it
            local_addr=_LOOPBACK_ADDRESS,
            logs_specs=DefaultLogsSpecs(log_dir=str(shared.path / "logs")),
            shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        )
        # Registered once a process (the same function again is accepted).
        rendezvous_handler_registry.register(_FILE_RENDEZVOUS, _file_rendezvous)
        launch = elastic_launch(config, run_rank)
        oom_kills_before = oom_kills()
        try:
            with _Watch(shared, hooks, params.batch_size):
                results = launch(
                    payload.model_dump_json(),
                    workdir,
                    os.getpid(),
                    threads,
                    resume_sha256,
                    keep_checkpoints,
                    share,
                )
        except ChildFailedError as exc:
            raise _ranks_failure(exc, shared, hooks, oom_kills_before) from exc
        state = safetensors.torch.load_file(str(shared.state))
    job.model.load_state_dict(state)
    return [RankOutcome.model_validate_json(results[r]) for r in range(processes)]


def _ranks_failure(
    exc: ChildFailedError, shared: _Workdir, hooks: JobHooks, oom_kills_before: int | None
) -> WorkerError:
    """What ended a job's ranks, as the job's error: a cancel, the job's own failure (a rank
    killed by the out-of-memory killer, or a rank's own error with its message), or an
    interruption (a rank killed by a signal otherwise: retried)."""
    if hooks.should_stop():
        return JobCanceled("training canceled while its ranks ran")
    killed = sorted(r for r, f in exc.failures.items() if f.exitcode < 0)
    if killed:
        failure = exc.failures[killed[0]]
        after = oom_kills()
        if oom_kills_before is not None and after is not None and after > oom_kills_before:
            # As a job process killed for memory (workers/running/capacity.py): not retried.
            return WorkerError(
                out_of_memory_message(
                    f"rank {killed[0]} was killed by the kernel's out-of-memory killer"
                )
            )
        return JobInterrupted(
            f"rank {killed[0]} of the job's processes was killed ({failure.signal_name()}); "
            "its other ranks were stopped with it"
        )
    # A rank's own error first (DataError, TrainError, ...): the others' are often only their
    # collective breaking off when it ended.
    found: list[WorkerError] = []
    for rank in sorted(exc.failures):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            written = json.loads(shared.error(rank).read_text())
            kind = getattr(errors, str(written["kind"]), WorkerError)
            if isinstance(kind, type) and issubclass(kind, WorkerError):
                found.append(kind(str(written["message"])))
    if found:
        return next((e for e in found if type(e) is not WorkerError), found[0])
    rank, failure = exc.get_first_failure()
    return WorkerError(
        f"rank {rank} of the job's processes ended with exit code {failure.exitcode}; "
        "see the worker's log"
    )
