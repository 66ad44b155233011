"""The worker side of model inspection (see api_schemas/inspection.py).

Runs as its own process beside the RQ worker (``bnadapt worker`` starts both). It runs torch
ops to build and load models; the RQ worker's parent imports torch but must run none, since
torch's thread pools (and CUDA) must not be live across RQ's fork of each job.

It takes requests in turns between tenants, at most one of a tenant's in flight (NOTE [
Inspection turns ]), and has a builder process of its own answer each (:class:`Builder`): one
held to ``BNADAPT_INSPECT_MEMORY_BYTES`` (NOTE [ Bounded builds ] in workers/models/sizing.py)
and stopped past the time its registration waits, started again when it dies, so that no
model, however large, ends or stalls the inspector for everyone. Every few seconds, builds or
not, it publishes the architecture catalog and an "inspectors alive" mark, both with a TTL,
so the API can tell when no worker runs.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import logging
import multiprocessing
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Final, TypeVar, cast

import redis
import safetensors.torch
import torch
from pydantic import TypeAdapter, ValidationError

from api_schemas import ActivationFootprint, ArchitecturePublic, BatchNormLayer, ProblemItem
from api_schemas.inspection import InspectFailure, InspectRequest, InspectSuccess
from api_schemas.models import RenamedKeys
from service.errors import ObjectNotFoundError, WeightsFileError
from service.formats.weights import WeightSpec, read_weights_header
from service.log_format import configure_logging
from service.public_text import scrub_internals
from service.records import keys
from service.records.connection import redis_client
from service.records.format import text
from service.settings import Settings, get_settings
from service.store import open_store
from service.store.base import Store
from service.upkeep.parent_death import die_with_parent, die_with_supervisor
from workers.errors import ArchitectureError
from workers.models.architectures import (
    activation_footprint,
    batchnorm_layers,
    build_model,
    describe,
    load_weights,
    parameter_count,
    registry,
    resolve_kwargs,
    state_spec,
)
from workers.models.eval_preprocessing import evaluation_preprocessing
from workers.models.sizing import BuildLimits, check_size, format_bytes
from workers.models.weight_keys import KeyRenaming, canonical_names, timm_conversion
from workers.running.capacity import hold_job_to, oom_kills
from workers.running.saving import weights_bytes

__all__ = [
    "Builder",
    "Built",
    "InspectionTurns",
    "build_and_check",
    "build_limits",
    "catalog",
    "publish",
    "serve",
]

log = logging.getLogger(__name__)

PUBLISH_INTERVAL_S: Final = 5.0
ALIVE_TTL_S: Final = 20
REPLY_TTL_S: Final = 120
POP_TIMEOUT_S: Final = 2


def catalog() -> list[ArchitecturePublic]:
    found = []
    for arch in registry().values():
        try:
            found.append(ArchitecturePublic.model_validate(describe(arch)))
        except (ValidationError, TypeError, ValueError):
            log.warning("architecture %r cannot be described; not offered", arch.name)
    return found


def _failure(status: int, detail: str, errors: list[ProblemItem] | None = None) -> InspectFailure:
    return InspectFailure(status=status, detail=detail, errors=errors)


def _compare(
    expected: dict[str, tuple[tuple[int, ...], str]], found: dict[str, tuple[int, ...]]
) -> InspectFailure | None:
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    misshaped = sorted(k for k in set(expected) & set(found) if tuple(found[k]) != expected[k][0])
    if not (missing or unexpected or misshaped):
        return None
    errors = (
        [ProblemItem(loc=["weights", k], msg="missing key") for k in missing]
        + [ProblemItem(loc=["weights", k], msg="unexpected key") for k in unexpected]
        + [
            ProblemItem(
                loc=["weights", k],
                msg=f"shape {list(found[k])}, expected {list(expected[k][0])}",
            )
            for k in misshaped
        ]
    )

    def listed(names: list[str]) -> str:
        return ", ".join(names[:10]) + (f" (+{len(names) - 10} more)" if len(names) > 10 else "")

    parts = []
    if missing:
        parts.append(f"{len(missing)} missing key(s): {listed(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key(s): {listed(unexpected)}")
    if misshaped:
        parts.append(
            f"{len(misshaped)} mis-shaped key(s): "
            + listed([f"{k} {list(found[k])} != {list(expected[k][0])}" for k in misshaped])
        )
    return _failure(
        422,
        "the weights do not load into this architecture with strict=True: "
        + "; ".join(parts)
        + ". Save them from a model built with the same architecture and kwargs",
        errors,
    )


# File dtypes (safetensors codes) that load into a tensor of the model's dtype without losing
# anything; any other pair is refused rather than cast silently (int8 or bool into a float
# weight, float64 rounded to float32). Integer buffers (num_batches_tracked) stay integers.
_INTEGER_CODES: Final = frozenset({"I8", "I16", "I32", "I64", "U8", "U16", "U32"})
_LOSSLESS_CODES: Final[dict[str, frozenset[str]]] = {
    "float32": frozenset({"F32", "F16", "BF16"}),
    "float64": frozenset({"F64", "F32", "F16", "BF16"}),
    "float16": frozenset({"F16"}),
    "bfloat16": frozenset({"BF16"}),
    "int64": _INTEGER_CODES,
    "int32": frozenset({"I32", "I16", "I8", "U16", "U8"}),
    "bool": frozenset({"BOOL"}),
}


def _check_dtypes(
    expected: dict[str, tuple[tuple[int, ...], str]], found: dict[str, str]
) -> InspectFailure | None:
    """Refuses tensors whose dtype would be converted with a loss (or changed in kind)."""
    wrong = sorted(
        key
        for key, (_, dtype) in expected.items()
        if found[key] not in _LOSSLESS_CODES.get(dtype, frozenset())
    )
    if not wrong:
        return None
    listed = [f"{k} is {found[k]}, the model holds {expected[k][1]}" for k in wrong]
    return _failure(
        422,
        f"{len(wrong)} tensor(s) of the weights have a dtype that would be converted with a "
        f"loss or change of kind on loading: {'; '.join(listed[:10])}"
        + (f" (+{len(wrong) - 10} more)" if len(wrong) > 10 else "")
        + ". Save the weights in the model's own dtypes, e.g. from model.float().state_dict() "
        "(integer buffers such as num_batches_tracked stay integers)",
        [ProblemItem(loc=["weights", k], msg=f"dtype {found[k]}") for k in wrong],
    )


def _check_finite(state: dict[str, torch.Tensor]) -> InspectFailure | None:
    """Refuses weights holding NaN or infinities: every job on them would produce NaN."""
    bad = {
        key: int((~torch.isfinite(value)).sum())
        for key, value in state.items()
        if value.is_floating_point()
    }
    bad = {key: count for key, count in sorted(bad.items()) if count}
    if not bad:
        return None
    listed = [f"{k} ({n} of {state[k].numel()} values)" for k, n in bad.items()]
    return _failure(
        422,
        f"the weights hold non-finite values (NaN or Inf) in {len(bad)} tensor(s): "
        f"{', '.join(listed[:10])}"
        + (f" (+{len(bad) - 10} more)" if len(bad) > 10 else "")
        + "; a model with such weights computes NaN outputs and statistics: upload weights "
        "from before the training diverged",
        [ProblemItem(loc=["weights", k], msg=f"{n} non-finite values") for k, n in bad.items()],
    )


def _check_header(
    expected: dict[str, tuple[tuple[int, ...], str]], found: Mapping[str, WeightSpec]
) -> InspectFailure | None:
    return _compare(expected, {k: spec.shape for k, spec in found.items()}) or _check_dtypes(
        expected, {k: spec.dtype for k, spec in found.items()}
    )


# safetensors' dtype codes of the tensors a conversion makes.
_CODES: Final = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _renamed_state(
    path: Path,
    header: dict[str, WeightSpec],
    expected: dict[str, tuple[tuple[int, ...], str]],
    architecture: str,
    kwargs: Mapping[str, Any],
) -> tuple[dict[str, torch.Tensor], KeyRenaming | None] | InspectFailure:
    """The weights under the architecture's own keys (NOTE [ Renaming weight keys ] in
    workers/models/weight_keys.py) once their names, shapes and dtypes fit it, with what was
    renamed; the failure for the keys as uploaded when nothing makes them fit."""
    renaming = canonical_names(header, expected, architecture)
    names = renaming.names if renaming is not None else {k: k for k in header}
    mismatch = _check_header(expected, {names[k]: spec for k, spec in header.items()})
    if mismatch is None:
        state = safetensors.torch.load_file(str(path))
        return {names[k]: v for k, v in state.items()}, renaming
    converted = timm_conversion(safetensors.torch.load_file(str(path)), architecture, kwargs)
    if converted is None:
        return mismatch
    state, renaming = converted
    specs = {
        k: WeightSpec(tuple(v.shape), _CODES.get(v.dtype, str(v.dtype))) for k, v in state.items()
    }
    return _check_header(expected, specs) or (state, renaming)


def _is_out_of_memory(exc: BaseException) -> bool:
    """An allocation that failed: Python's MemoryError, or torch's allocator refusing
    (``DefaultCPUAllocator: can't allocate memory: ...``)."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(m in text for m in _OUT_OF_MEMORY_MARKS)


_OUT_OF_MEMORY_MARKS: Final = ("can't allocate memory", "cannot allocate memory", "out of memory")


def _out_of_memory(architecture: str, limits: BuildLimits) -> InspectFailure:
    return _failure(
        422,
        f"building and checking {architecture} with these kwargs ran out of the memory one "
        f"inspection may use ({format_bytes(limits.memory_bytes)}, "
        "BNADAPT_INSPECT_MEMORY_BYTES): choose smaller kwargs",
    )


# NOTE [ Large builds yield ]
# The lanes' builders share the machine's processors with each other and with the rest of the
# worker. The scheduler divides a processor fairly between runnable threads, so a small build
# that wakes while a large one runs beside it can wait in the run queue far longer than it
# takes to build: its time is all queue (the runs that log each build's run-queue wait in
# bench/history/2026-12-07-tenancy-second-pass-submissions-under-quotas.md; figure
# `noisy-neighbour-registrations` in bench/RESULTS.md). A build whose measured footprint is past
# SMALL_BUILD_BYTES (or that the meta device cannot measure) therefore lowers the priority of
# the thread it runs in by LARGE_BUILD_NICENESS: each request's build and checks run in a
# thread of their own (``_answer_in_thread``), so the builder's process and its next build
# keep theirs; lowering a thread's own priority needs no privilege. A small build then takes
# the processor when it wakes, and the large one uses what is left. The activation probe
# (``Built.measured``) runs on the builder's main thread, always the same one: torch's profiler,
# which it uses, ties itself to the thread that first starts it and refuses (and prints so)
# any other, which then measures nothing. torch's intra-op threads, where a lane has more than
# one processor, keep the priority they were started with.
SMALL_BUILD_BYTES: Final = 64 * 2**20
LARGE_BUILD_NICENESS: Final = 10


def _yield_to_small_builds() -> None:
    """Lowers this thread's scheduling priority (NOTE [ Large builds yield ])."""
    with contextlib.suppress(OSError, AttributeError):  # where threads' priorities are not own
        thread = threading.get_native_id()
        current = os.getpriority(os.PRIO_PROCESS, thread)
        os.setpriority(os.PRIO_PROCESS, thread, min(19, current + LARGE_BUILD_NICENESS))


@dataclass
class Built:
    """A model built and checked, and its answer but for the activations, which
    :meth:`measured` adds (on the builder's own thread: NOTE [ Large builds yield ])."""

    answer: InspectSuccess
    model: torch.nn.Module

    def measured(self) -> InspectSuccess:
        # Last: the probe moves the model's BatchNorm statistics.
        activations = _activations(self.model, list(self.answer.input_shape))
        return self.answer.model_copy(update={"activations": activations})


def build_and_check(
    request: InspectRequest, store: Store, limits: BuildLimits
) -> Built | InspectFailure:
    """The model of ``request`` built (or loaded and checked) and its weights stored; every
    anticipated problem is an ``InspectFailure``. The model is measured before it is built,
    and refused past ``limits`` (NOTE [ Bounded builds ] in workers/models/sizing.py); a large
    build lowers the priority of the thread it runs in (NOTE [ Large builds yield ])."""
    try:
        kwargs = resolve_kwargs(request.architecture, request.kwargs)
        arch = registry()[request.architecture]
        measured = check_size(request.architecture, kwargs, limits)
        if measured is None or measured.needed_bytes() > SMALL_BUILD_BYTES:
            _yield_to_small_builds()
        renaming = None
        if request.weights_sha256 is None:
            torch.manual_seed(request.seed)
            model = build_model(request.architecture, kwargs)
            data = weights_bytes({k: v.detach() for k, v in model.state_dict().items()})
            sha256, size = store.put_bytes(data), len(data)
            del data  # not held while the probe runs: NOTE [ Bounded builds ]
        else:
            sha256 = request.weights_sha256
            path = store.local_path(sha256)
            header = read_weights_header(path)
            expected = state_spec(request.architecture, kwargs)
            loaded = _renamed_state(path, header, expected, request.architecture, kwargs)
            if isinstance(loaded, InspectFailure):
                return loaded
            state, renaming = loaded
            not_finite = _check_finite(state)
            if not_finite is not None:
                return not_finite
            model = build_model(request.architecture, kwargs)
            load_weights(model, state)
            size = path.stat().st_size
            if renaming is not None:  # stored again under the architecture's own keys
                data = weights_bytes(state)
                sha256, size = store.put_bytes(data), len(data)
                del data
            del state  # the model holds its own copy
    except ArchitectureError as exc:
        return _failure(422, str(exc))
    except WeightsFileError as exc:
        return _failure(422, str(exc))
    except ObjectNotFoundError as exc:
        log.warning("inspection %s: %s", request.request_id, exc)
        return _failure(422, "the uploaded weights are gone from the store; upload them again")
    except MemoryError:
        return _out_of_memory(request.architecture, limits)
    # load_state_dict: dtypes that do not convert, say; a module's own loading hook refusing
    # (ValueError)
    except (RuntimeError, ValueError) as exc:
        if _is_out_of_memory(exc):  # never the allocator's own text
            return _out_of_memory(request.architecture, limits)
        detail = scrub_internals(str(exc))
        return _failure(422, f"the weights do not load into {request.architecture}: {detail}")
    answer = InspectSuccess(
        weights_sha256=sha256,
        size_bytes=size,
        parameter_count=parameter_count(model),
        batchnorm_layers=[BatchNormLayer(**layer) for layer in batchnorm_layers(model)],
        input_shape=list(arch.input_shape(kwargs)),
        preprocessing=evaluation_preprocessing(request.architecture, kwargs),
        renamed_keys=None if renaming is None else RenamedKeys(**renaming.public()),
    )
    return Built(answer, model)


def _activations(
    model: torch.nn.Module, input_shape: list[int | None]
) -> ActivationFootprint | None:
    """The model's activation footprint; None (the API then checks no job of it against the
    workers' memory) when a forward on a probe input fails, as a model whose real inputs
    have sizes the probe does not."""
    try:
        return ActivationFootprint(**activation_footprint(model, input_shape))
    except Exception:
        log.warning("could not measure the activations of a model", exc_info=True)
        return None


def publish(client: redis.Redis, catalog_json: str) -> bool:
    """Marks an inspector alive and makes ``catalog_json`` the published catalog: written
    (about 1 MB with the zoo) only when the one in Redis is another or gone, else its expiry
    renewed. True when it was written."""
    digest = hashlib.sha256(catalog_json.encode()).hexdigest()
    pipe = client.pipeline()
    pipe.set(keys.INSPECTORS_ALIVE, "1", ex=ALIVE_TTL_S)
    pipe.get(keys.ARCHITECTURES_DIGEST)
    pipe.expire(keys.ARCHITECTURES, ALIVE_TTL_S)  # False when it is gone
    pipe.expire(keys.ARCHITECTURES_DIGEST, ALIVE_TTL_S)
    _, stored, renewed, _ = pipe.execute()
    stored = stored.decode() if isinstance(stored, bytes) else stored
    if renewed and stored == digest:
        return False
    pipe = client.pipeline()
    pipe.set(keys.ARCHITECTURES, catalog_json, ex=ALIVE_TTL_S)
    pipe.set(keys.ARCHITECTURES_DIGEST, digest, ex=ALIVE_TTL_S)
    pipe.execute()
    return True


# NOTE [ Inspection turns ]
# The API pushes a registration's request on its tenant's list (keys.inspect_requests), adds
# the tenant to the sorted set keys.INSPECT_TENANTS (score 0 when it is not there) and rings
# keys.INSPECT_BELL, which idle inspectors wait on (service/api/inspection.py). An inspector
# takes its next request with one script (_TAKE_LUA): first what an earlier release left on
# keys.INSPECT_REQUESTS, then, over the tenants in the order of their turns, from the first
# that has a request waiting and none in flight (no keys.inspect_busy mark): the head of its
# list (first in, first out within a tenant). Taking marks the tenant busy with a lease and
# moves its turn past the clock, as NOTE [ Fair turns ] in service/records/tenancy/turns.py does for
# jobs: a tenant's turn is max(its score, the clock); a take sets the clock to that turn and
# the tenant's score to the turn plus one. So a tenant that had nothing waiting comes back at
# the clock (no credit saved up while idle), ahead of every tenant taken since; behind
# another tenant's many builds, a request waits for the build in flight and at most one build
# of each other tenant whose turn comes first. The busy mark keeps a tenant to one build at a
# time across every inspector; the reply releases it (if it still holds this take's token),
# and it lapses after the build's time limit when an inspector dies with it. A tenant with
# nothing waiting whose turn is the clock leaves the set: it would come back at the clock.
_TAKE_LUA: Final = """
local legacy, tenants, clock_key = ARGV[1], ARGV[2], ARGV[3]
local requests, busy, token, lease_ms = ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local raw = redis.call('LPOP', legacy)
if raw then return {'', raw, '0'} end
local clock = tonumber(redis.call('GET', clock_key) or '0')
local ranked = redis.call('ZRANGE', tenants, 0, -1, 'WITHSCORES')
for j = 1, #ranked, 2 do
  local tenant, score = ranked[j], tonumber(ranked[j + 1])
  if redis.call('EXISTS', busy .. tenant) == 0 then
    raw = redis.call('LPOP', requests .. tenant)
    if raw then
      local turn = math.max(score, clock)
      redis.call('SET', clock_key, string.format('%.17g', turn))
      redis.call('ZADD', tenants, string.format('%.17g', turn + 1), tenant)
      redis.call('SET', busy .. tenant, token, 'PX', lease_ms)
      local now = redis.call('TIME')
      return {tenant, raw, now[1] .. '.' .. string.format('%06d', tonumber(now[2]))}
    end
    if score <= clock then redis.call('ZREM', tenants, tenant) end
  end
end
return nil
"""
# KEYS[1]: a tenant's busy mark; ARGV[1]: the token of the take that set it.
_RELEASE_LUA: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
# How long a busy mark outlives the build's time limit (an inspector that died with it).
LEASE_MARGIN_S: Final = 30.0
# What a build leaves of its registration's wait for the reply to reach it.
REPLY_MARGIN_S: Final = 1.0


@dataclass(frozen=True)
class Taken:
    """A request taken in its tenant's turn; ``tenant`` is empty for an earlier release's."""

    tenant: str
    raw: bytes
    token: str
    now_s: float  # the Redis server's time when it was taken (0 for an earlier release's)

    def time_left(self, request: InspectRequest) -> float | None:
        """Seconds until the API stops waiting for the reply; None when it did not say."""
        if request.deadline_s is None or not self.now_s:
            return None
        return request.deadline_s - self.now_s


class InspectionTurns:
    """Takes inspection requests in turns between tenants (NOTE [ Inspection turns ])."""

    def __init__(self, client: redis.Redis, lease_s: float) -> None:
        self.client = client
        self.lease_ms = max(1, round(lease_s * 1000))
        self._take = client.register_script(_TAKE_LUA)
        self._release = client.register_script(_RELEASE_LUA)

    def take(self) -> Taken | None:
        token = secrets.token_hex(8)
        args: list[str | int] = [
            keys.INSPECT_REQUESTS,
            keys.INSPECT_TENANTS,
            keys.INSPECT_CLOCK,
            keys.inspect_requests(""),
            keys.inspect_busy(""),
            token,
            self.lease_ms,
        ]
        taken = cast("list[bytes] | None", self._take(args=args))
        if not taken:
            return None
        return Taken(text(taken[0]), bytes(taken[1]), token, float(text(taken[2])))

    def wait(self, timeout_s: float) -> None:
        """Returns when a request was pushed (or a moment after), or after ``timeout_s``."""
        self.client.blpop([keys.INSPECT_BELL], timeout=timeout_s)

    def release(self, pipe: redis.client.Pipeline, taken: Taken) -> None:
        if taken.tenant:
            self._release(keys=[keys.inspect_busy(taken.tenant)], args=[taken.token], client=pipe)


def build_limits(settings: Settings) -> BuildLimits:
    return BuildLimits(settings.max_weights_bytes, settings.inspect_memory_limit)


_Answer = TypeVar("_Answer")


def _guarded(request: InspectRequest, step: Callable[[], _Answer]) -> _Answer | InspectFailure:
    """``step()``, or a 500 saying the inspection failed where it raised."""
    try:
        return step()
    except Exception as exc:  # a bug must not end the builder: report it as a 500
        log.exception("inspection %s failed", request.request_id)
        return _failure(
            500,
            f"the worker failed to inspect the model ({type(exc).__name__}); the worker's log "
            "has the detail",
        )


_READY: Final = b"ready"


def _builder_main(conn: Connection, settings: Settings, parent_pid: int) -> None:
    """The builder process: answers the requests ``conn`` brings, one at a time, until the
    inspector closes it, its allocations held to the inspection's memory (NOTE [ Bounded
    builds ] in workers/models/sizing.py)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the inspector ends it
    die_with_parent(signal.SIGKILL, parent_pid)
    configure_logging("inspector", settings.log_format)
    limits = build_limits(settings)
    store = open_store(settings)
    registry()  # the zoo's imports, before the cap counts from what the process holds
    # The lanes' builders share the processors: each takes its share of torch's threads. With
    # a thread per processor in each, two builders' OpenMP threads spin against each other and
    # a small build waits on the large one beside it (the runs with a builder's torch threads
    # in bench/history/2026-12-07-tenancy-second-pass-submissions-under-quotas.md).
    torch.set_num_threads(max(1, _processors() // settings.inspect_builders))
    hold_job_to(limits.memory_bytes, "cpu")
    conn.send_bytes(_READY)
    while True:
        try:
            raw = conn.recv_bytes()
        except EOFError:
            return
        request = InspectRequest.model_validate_json(raw)
        reply = _answer_in_thread(request, store, limits)
        conn.send_bytes(reply.model_dump_json().encode())


def _answer_in_thread(
    request: InspectRequest, store: Store, limits: BuildLimits
) -> InspectSuccess | InspectFailure:
    """The answer to ``request``: its build and checks in a thread of their own, whose
    priority a large build lowers for itself, and its activation probe on this thread (NOTE
    [ Large builds yield ])."""
    built: list[Built | InspectFailure] = []
    thread = threading.Thread(
        target=lambda: built.append(
            _guarded(request, functools.partial(build_and_check, request, store, limits))
        ),
        name="build",
    )
    thread.start()
    thread.join()
    if not built:  # the thread ended without an answer: it raised past Exception
        return _failure(500, "the worker failed to inspect the model; its log has the detail")
    if isinstance(built[0], InspectFailure):
        return built[0]
    return _guarded(request, built[0].measured)


def _processors() -> int:
    """The processors this process may run on (its affinity where the system says)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


_REPLY: Final[TypeAdapter[InspectSuccess | InspectFailure]] = TypeAdapter(
    InspectSuccess | InspectFailure
)
# How long a new builder may take to import torch (and the zoo) and say it is ready.
BUILDER_START_TIMEOUT_S: Final = 300.0
# The pause before starting a builder again after one failed to start.
BUILDER_RESTART_PAUSE_S: Final = 5.0


def _slice(deadline: float) -> float:
    """The next wait: until ``deadline``, at most a publishing interval."""
    return min(PUBLISH_INTERVAL_S, max(0.0, deadline - time.monotonic()))


class Builder:
    """The process that builds models for one inspector, one at a time: started with the
    ``spawn`` method (never forked from a process that ran torch), held to the inspection's
    memory, started again when it dies or overruns the time limit. The inspector waits for it
    in slices, calling ``keep_alive`` (publish the catalog and the alive mark) between."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.limits = build_limits(settings)
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        self._ready = False

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        process = context.Process(
            target=_builder_main,
            args=(theirs, self.settings, os.getpid()),
            name="bnadapt-builder",
            daemon=True,
        )
        process.start()
        theirs.close()
        self._process, self._conn, self._ready = process, ours, False
        log.info("started the model builder (pid %s)", process.pid)

    def _discard(self) -> int | None:
        """Ends the process (if it still runs); its exit code."""
        process, conn = self._process, self._conn
        self._process, self._conn, self._ready = None, None, False
        if conn is not None:
            conn.close()
        if process is None:
            return None
        if process.is_alive():
            process.kill()
        process.join(timeout=10)
        return process.exitcode

    def ready(self, keep_alive: Callable[[], None], stop: threading.Event) -> bool:
        """Whether a builder waits for requests: starts one where there is none and waits
        until it says so. False when it died starting, took too long, or ``stop`` was set."""
        if self._ready and self._process is not None and self._process.is_alive():
            return True
        if self._process is None or not self._process.is_alive():
            self._discard()
            self._start()
        assert self._conn is not None
        deadline = time.monotonic() + BUILDER_START_TIMEOUT_S
        while not stop.is_set():
            if self._conn.poll(PUBLISH_INTERVAL_S):
                try:
                    self._ready = self._conn.recv_bytes() == _READY
                except (EOFError, OSError):
                    code = self._discard()
                    log.error("the model builder exited (code %s) while starting", code)
                    return False
                return self._ready
            keep_alive()
            if time.monotonic() > deadline:
                self._discard()
                log.error("the model builder did not start within %g s", BUILDER_START_TIMEOUT_S)
                return False
        return False

    def answer(
        self, request: InspectRequest, limit_s: float, keep_alive: Callable[[], None]
    ) -> InspectSuccess | InspectFailure:
        """The builder's answer to ``request``; a failure saying what happened when it died,
        ran out of memory or ran past ``limit_s`` (it is started again then)."""
        assert self._conn is not None, "call ready() first"
        kills = oom_kills()
        deadline = time.monotonic() + limit_s
        try:
            self._conn.send_bytes(request.model_dump_json().encode())
            while not self._conn.poll(_slice(deadline)):
                keep_alive()
                if time.monotonic() >= deadline:
                    self._discard()
                    log.warning("inspection %s overran %g s", request.request_id, limit_s)
                    return _failure(
                        422,
                        f"building and checking {request.architecture} took longer than "
                        f"{limit_s:.0f} s, what was left of the {self.settings.inspect_timeout_s:g}"
                        " s one registration may wait for it (BNADAPT_INSPECT_TIMEOUT_S): "
                        "choose smaller kwargs",
                    )
            raw = self._conn.recv_bytes()
        except (EOFError, OSError):
            return self._died(request, self._discard(), kills)
        try:
            return _REPLY.validate_json(raw)
        except ValidationError:
            log.exception("inspection %s: the builder's reply does not parse", request.request_id)
            self._discard()
            return _failure(500, "the worker failed to inspect the model; its log has the detail")

    def _died(
        self, request: InspectRequest, code: int | None, kills_before: int | None
    ) -> InspectFailure:
        how = f"code {code}"
        if code is not None and code < 0:
            how = signal.Signals(-code).name
        log.warning("the model builder ended (%s) during inspection %s", how, request.request_id)
        kills_after = oom_kills()
        if kills_before is not None and kills_after is not None and kills_after > kills_before:
            return _failure(
                422,
                f"building {request.architecture} with these kwargs ran out of the machine's "
                "memory (the kernel's out-of-memory killer ended the process building it): "
                "choose smaller kwargs",
            )
        return _failure(
            503,
            f"the process building {request.architecture} ended ({how}) before it answered; "
            "it has been started again: retry, and if it happens again with these kwargs, "
            "choose smaller ones (the machine may lack the memory)",
        )

    def close(self) -> None:
        self._discard()


def _waited(taken: Taken, request: InspectRequest, timeout_s: float) -> str:
    """How long ``request`` waited to be taken, read from the deadline the API gave it (its
    sending time plus ``timeout_s``, on the Redis server's clock), for the log."""
    if request.deadline_s is None or not taken.now_s:
        return "wait unknown"
    return f"taken {taken.now_s - (request.deadline_s - timeout_s):.2f} s after it was sent"


def _handle(
    client: redis.Redis,
    turns: InspectionTurns,
    builder: Builder,
    taken: Taken,
    keep_alive: Callable[[], None],
) -> None:
    """Answers one taken request and releases its tenant's turn."""
    try:
        request: InspectRequest | None = InspectRequest.model_validate_json(taken.raw)
    except ValidationError:
        log.warning("dropping a malformed inspection request")
        request = None
    limit_s = builder.settings.inspect_timeout_s
    left = None if request is None else taken.time_left(request)
    if left is not None:
        limit_s = min(limit_s, left - REPLY_MARGIN_S)
    if request is not None and limit_s <= 0:
        log.info("inspection %s: its registration stopped waiting", request.request_id)
        request = None
    pipe = client.pipeline()
    if request is not None:
        started = time.monotonic()
        reply = builder.answer(request, limit_s, keep_alive)
        log.info(
            "inspection %s of %s for tenant %s: %s (built in %.2f s, %s)",
            request.request_id,
            request.architecture,
            taken.tenant or "(an earlier release's)",
            "ok" if isinstance(reply, InspectSuccess) else reply.status,
            time.monotonic() - started,
            _waited(taken, request, builder.settings.inspect_timeout_s),
        )
        pipe.lpush(keys.inspect_reply(request.request_id), reply.model_dump_json())
        pipe.expire(keys.inspect_reply(request.request_id), REPLY_TTL_S)
    turns.release(pipe, taken)
    pipe.execute()


def serve(settings: Settings, stop: threading.Event | None = None) -> None:
    """Answers inspection requests until ``stop`` is set (or forever): takes them in turns
    between tenants (NOTE [ Inspection turns ]) in ``settings.inspect_builders`` lanes, each
    with a builder process of its own, so a build in flight never holds another tenant's."""
    stop = stop or threading.Event()
    client = redis_client(settings.redis_url)
    turns = InspectionTurns(client, settings.inspect_timeout_s + LEASE_MARGIN_S)
    alive = _AliveMark(client, "[" + ",".join(a.model_dump_json() for a in catalog()) + "]")
    lanes = [
        threading.Thread(
            target=_serve_lane,
            args=(client, turns, Builder(settings), alive.keep_alive, stop),
            name=f"inspection-lane-{i}",
            daemon=True,
        )
        for i in range(settings.inspect_builders)
    ]
    for lane in lanes:
        lane.start()
    for lane in lanes:
        lane.join()


class _AliveMark:
    """The catalog and the "inspectors alive" mark, published when due by whichever lane
    calls first (between builds, and between the slices of a long build)."""

    def __init__(self, client: redis.Redis, catalog_json: str) -> None:
        self.client = client
        self.catalog_json = catalog_json
        self._published = 0.0
        self._lock = threading.Lock()

    def keep_alive(self) -> None:
        with self._lock:
            if time.monotonic() - self._published <= PUBLISH_INTERVAL_S:
                return
            try:
                publish(self.client, self.catalog_json)
                self._published = time.monotonic()
            except redis.ConnectionError:
                log.warning("redis unreachable; publishing again in %g s", PUBLISH_INTERVAL_S)


def _serve_lane(
    client: redis.Redis,
    turns: InspectionTurns,
    builder: Builder,
    keep_alive: Callable[[], None],
    stop: threading.Event,
) -> None:
    """One lane: takes the next request whose tenant has none in flight and has its builder
    answer it, until ``stop`` is set."""
    try:
        while not stop.is_set():
            try:
                keep_alive()
                if not builder.ready(keep_alive, stop):
                    stop.wait(BUILDER_RESTART_PAUSE_S)
                    continue
                taken = turns.take()
                if taken is None:
                    turns.wait(POP_TIMEOUT_S)
                else:
                    _handle(client, turns, builder, taken, keep_alive)
            except redis.ConnectionError:
                log.warning("redis unreachable; retrying in 1 s")
                stop.wait(1.0)
    finally:
        builder.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="Answer model inspection requests.")
    parser.parse_args()
    die_with_supervisor()
    settings = get_settings()
    configure_logging("inspector", settings.log_format)
    serve(settings)


if __name__ == "__main__":
    main()
