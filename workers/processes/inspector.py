"""The worker side of model inspection (see api_schemas/inspection.py).

Runs as its own process beside the RQ worker (``bnadapt worker`` starts both). It runs torch
ops to build and load models; the RQ worker's parent imports torch but must run none, since
torch's thread pools (and CUDA) must not be live across RQ's fork of each job.

Every few seconds it publishes the architecture catalog and an "inspectors alive" mark, both
with a TTL, so the API can tell when no worker runs.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from typing import Final

import redis
import safetensors.torch
import torch
from pydantic import ValidationError

from api_schemas import ArchitecturePublic, BatchNormLayer, ProblemItem
from api_schemas.inspection import InspectFailure, InspectRequest, InspectSuccess
from service.errors import ObjectNotFoundError, WeightsFileError
from service.formats.weights import read_weights_header
from service.records import keys
from service.records.connection import redis_client
from service.settings import Settings, get_settings
from service.store import open_store
from service.store.base import Store
from workers.errors import ArchitectureError
from workers.models.architectures import (
    batchnorm_layers,
    build_model,
    describe,
    parameter_count,
    registry,
    resolve_kwargs,
    state_spec,
)
from workers.running.compute import weights_bytes

__all__ = ["catalog", "inspect", "serve"]

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


def inspect(request: InspectRequest, store: Store) -> InspectSuccess | InspectFailure:
    """Answers one request; every anticipated problem is an ``InspectFailure``."""
    try:
        kwargs = resolve_kwargs(request.architecture, request.kwargs)
        arch = registry()[request.architecture]
        if request.weights_sha256 is None:
            torch.manual_seed(request.seed)
            model = build_model(request.architecture, kwargs)
            data = weights_bytes({k: v.detach() for k, v in model.state_dict().items()})
            sha256, size = store.put_bytes(data), len(data)
        else:
            sha256 = request.weights_sha256
            path = store.local_path(sha256)
            header = read_weights_header(path)
            mismatch = _compare(
                state_spec(request.architecture, kwargs),
                {k: spec.shape for k, spec in header.items()},
            )
            if mismatch is not None:
                return mismatch
            model = build_model(request.architecture, kwargs)
            model.load_state_dict(safetensors.torch.load_file(str(path)), strict=True)
            size = path.stat().st_size
    except ArchitectureError as exc:
        return _failure(422, str(exc))
    except WeightsFileError as exc:
        return _failure(422, str(exc))
    except ObjectNotFoundError as exc:
        return _failure(422, f"the uploaded weights are gone from the store ({exc}); upload again")
    except RuntimeError as exc:  # load_state_dict: dtypes that do not convert, say
        return _failure(422, f"the weights do not load into {request.architecture}: {exc}")
    return InspectSuccess(
        weights_sha256=sha256,
        size_bytes=size,
        parameter_count=parameter_count(model),
        batchnorm_layers=[BatchNormLayer(**layer) for layer in batchnorm_layers(model)],
        input_shape=list(arch.input_shape(kwargs)),
    )


def _publish(client: redis.Redis, catalog_json: str) -> None:
    pipe = client.pipeline()
    pipe.set(keys.ARCHITECTURES, catalog_json, ex=ALIVE_TTL_S)
    pipe.set(keys.INSPECTORS_ALIVE, "1", ex=ALIVE_TTL_S)
    pipe.execute()


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
        reply = _failure(500, f"the worker failed to inspect the model: {exc}")
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
                _publish(client, catalog_json)
                published = time.monotonic()
            popped = client.blpop([keys.INSPECT_REQUESTS], timeout=POP_TIMEOUT_S)
            if popped is not None:
                _handle(client, store, popped[1])
        except redis.ConnectionError:
            log.warning("redis unreachable; retrying in 1 s")
            stop.wait(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description="Answer model inspection requests.")
    parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s inspector %(message)s")
    serve(get_settings())


if __name__ == "__main__":
    main()
