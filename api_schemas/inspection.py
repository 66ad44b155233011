"""Model inspection: the API asks a worker to build an architecture and check weights against it.

The API never imports torch, so whatever needs a built model (state_dict keys and shapes,
parameter count, BatchNorm layers, initial weights) is answered by a worker's inspector over
Redis: the request is pushed on its tenant's list and taken in the tenant's turn (NOTE [
Inspection turns ] in workers/processes/inspector.py), the reply on a per-request list.
"""

from typing import Literal

from pydantic import BaseModel, Field

from api_schemas.architectures import ArchitectureKwargs, ArchitectureName, InputShape
from api_schemas.common import ProblemItem, RequestModel, Sha256Hex
from api_schemas.datasets import Preprocessing
from api_schemas.models import ActivationFootprint, BatchNormLayer, RenamedKeys, Seed

__all__ = ["InspectFailure", "InspectRequest", "InspectSuccess"]


class InspectRequest(RequestModel):
    """Build ``architecture(**kwargs)``; check the stored weights against it, or, without
    weights, initialize them with ``seed`` and store them."""

    request_id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    architecture: ArchitectureName
    kwargs: ArchitectureKwargs
    weights_sha256: Sha256Hex | None = None
    seed: Seed = 0
    # When the API stops waiting for the reply, in the Redis server's time (seconds since the
    # epoch): an inspector builds no longer than that, and not at all past it.
    deadline_s: float | None = Field(default=None, ge=0)


class InspectSuccess(BaseModel):
    ok: Literal[True] = True
    weights_sha256: Sha256Hex
    size_bytes: int = Field(ge=0)
    parameter_count: int = Field(ge=0)
    batchnorm_layers: list[BatchNormLayer]
    input_shape: InputShape
    activations: ActivationFootprint | None = None
    preprocessing: Preprocessing | None = None
    renamed_keys: RenamedKeys | None = None


class InspectFailure(BaseModel):
    """The request was wrong (status 404 or 422) or the worker failed (500)."""

    ok: Literal[False] = False
    status: int
    detail: str
    errors: list[ProblemItem] | None = None
