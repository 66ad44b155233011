"""The worker side of model inspection (see api_schemas/inspection.py).

Runs as its own process beside the RQ worker (``bnadapt worker`` starts both). It runs torch
ops to build and load models; the RQ worker's parent imports torch but must run none, since
torch's thread pools (and CUDA) must not be live across RQ's fork of each job.

Every few seconds it publishes the architecture catalog and an "inspectors alive" mark, both
with a TTL, so the API can tell when no worker runs.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import redis
import safetensors.torch
import torch
from pydantic import ValidationError

from api_schemas import ActivationFootprint, ArchitecturePublic, BatchNormLayer, ProblemItem
from api_schemas.inspection import InspectFailure, InspectRequest, InspectSuccess
from api_schemas.models import RenamedKeys
from service.errors import ObjectNotFoundError, WeightsFileError
from service.formats.weights import WeightSpec, read_weights_header
from service.log_format import configure_logging
from service.public_text import scrub_internals
from service.records import keys
from service.records.connection import redis_client
from service.settings import Settings, get_settings
from service.store import open_store
from service.store.base import Store
from service.upkeep.parent_death import die_with_supervisor
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
from workers.models.weight_keys import KeyRenaming, canonical_names, timm_conversion
from workers.running.saving import weights_bytes

__all__ = ["catalog", "inspect", "publish", "serve"]

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


def inspect(request: InspectRequest, store: Store) -> InspectSuccess | InspectFailure:
    """Answers one request; every anticipated problem is an ``InspectFailure``."""
    try:
        kwargs = resolve_kwargs(request.architecture, request.kwargs)
        arch = registry()[request.architecture]
        renaming = None
        if request.weights_sha256 is None:
            torch.manual_seed(request.seed)
            model = build_model(request.architecture, kwargs)
            data = weights_bytes({k: v.detach() for k, v in model.state_dict().items()})
            sha256, size = store.put_bytes(data), len(data)
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
    except ArchitectureError as exc:
        return _failure(422, str(exc))
    except WeightsFileError as exc:
        return _failure(422, str(exc))
    except ObjectNotFoundError as exc:
        log.warning("inspection %s: %s", request.request_id, exc)
        return _failure(422, "the uploaded weights are gone from the store; upload them again")
    # load_state_dict: dtypes that do not convert, say; a module's own loading hook refusing
    # (ValueError)
    except (RuntimeError, ValueError) as exc:
        detail = scrub_internals(str(exc))
        return _failure(422, f"the weights do not load into {request.architecture}: {detail}")
    layers = [BatchNormLayer(**layer) for layer in batchnorm_layers(model)]
    input_shape = list(arch.input_shape(kwargs))
    return InspectSuccess(
        weights_sha256=sha256,
        size_bytes=size,
        parameter_count=parameter_count(model),
        batchnorm_layers=layers,
        input_shape=input_shape,
        preprocessing=evaluation_preprocessing(request.architecture, kwargs),
        renamed_keys=None if renaming is None else RenamedKeys(**renaming.public()),
        activations=_activations(model, input_shape),  # last: it moves BatchNorm statistics
    )


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


def _handle(client: redis.Redis, store: Store, raw: bytes | str) -> None:
    try:
        request = InspectRequest.model_validate_json(raw)
    except ValidationError:
        log.warning("dropping a malformed inspection request")
        return
    try:
        reply: InspectSuccess | InspectFailure = inspect(request, store)
    except Exception as exc:  # a bug must not kill the inspector: report it as a 500
        log.exception("inspection %s failed", request.request_id)
        reply = _failure(
            500,
            f"the worker failed to inspect the model ({type(exc).__name__}); the worker's log "
            "has the detail",
        )
    pipe = client.pipeline()
    pipe.lpush(keys.inspect_reply(request.request_id), reply.model_dump_json())
    pipe.expire(keys.inspect_reply(request.request_id), REPLY_TTL_S)
    pipe.execute()


def serve(settings: Settings, stop: threading.Event | None = None) -> None:
    """Answers inspection requests until ``stop`` is set (or forever)."""
    stop = stop or threading.Event()
    client = redis_client(settings.redis_url)
    store = open_store(settings)
    catalog_json = "[" + ",".join(a.model_dump_json() for a in catalog()) + "]"
    published = 0.0
    while not stop.is_set():
        try:
            if time.monotonic() - published > PUBLISH_INTERVAL_S:
                publish(client, catalog_json)
                published = time.monotonic()
            # The head: the oldest request (the API pushes at the tail): first in, first out.
            popped = client.blpop([keys.INSPECT_REQUESTS], timeout=POP_TIMEOUT_S)
            if popped is not None:
                _handle(client, store, popped[1])
        except redis.ConnectionError:
            log.warning("redis unreachable; retrying in 1 s")
            stop.wait(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description="Answer model inspection requests.")
    parser.parse_args()
    die_with_supervisor()
    settings = get_settings()
    configure_logging("inspector", settings.log_format)
    serve(settings)


if __name__ == "__main__":
    main()
