"""Models: an architecture, its kwargs and a safetensors weights file."""

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from api_schemas.architectures import ArchitectureKwargs, ArchitectureName, InputShape
from api_schemas.common import RequestModel, ResourceId, Sha256Hex, UtcDatetime
from api_schemas.datasets import Preprocessing

__all__ = [
    "ActivationFootprint",
    "BatchNormLayer",
    "ModelCreate",
    "ModelPublic",
    "ModelSource",
    "RenamedKeys",
    "Seed",
]

ModelSource = Literal["upload", "init", "job"]

# Non-negative and within int64: torch, numpy and Redis all take it as is.
Seed = Annotated[int, Field(ge=0, le=2**63 - 1)]


class BatchNormLayer(BaseModel):
    """A normalization layer with running statistics, as found in the built model."""

    name: str
    kind: str  # the class name, e.g. "BatchNorm2d"
    num_features: int = Field(ge=1)
    momentum: float | None = Field(ge=0.0, le=1.0)  # None: cumulative average
    track_running_stats: bool


class ActivationFootprint(BaseModel):
    """What a model's activations take, in bytes per element of its input (one number of one
    sample), measured by the worker that inspected it; the API multiplies it by a job's batch
    (NOTE [ Activation estimate ] in service/jobs/submission.py)."""

    forward_bytes_per_element: float = Field(
        ge=0.0,
        description="A pass without gradients (evaluation, forward-only adaptation): the "
        "input and twice the largest module's input and output (a residual branch beside "
        "its input).",
    )
    backward_bytes_per_element: float = Field(
        ge=0.0,
        description="A pass with gradients (training, entropy): the input, every module's "
        "output, which autograd keeps until the backward pass, and the largest module's "
        "input and output (its gradients).",
    )


class RenamedKeys(BaseModel):
    """How the uploaded weights' keys were renamed to the architecture's own (its
    ``state_dict`` names) before they were stored: prefixes stripped from every key (as
    ``module.`` of DataParallel and ``_orig_mod.`` of torch.compile, outermost first) and a
    library's own older layout converted (``layout``); ``count`` keys changed their name."""

    stripped_prefixes: list[str] = Field(default_factory=list)
    layout: str | None = None
    count: int = Field(ge=0)


class ModelPublic(BaseModel):
    """A stored model. ``parent`` is the model a job started from (lineage)."""

    id: ResourceId
    architecture: ArchitectureName
    kwargs: ArchitectureKwargs
    sha256: Sha256Hex
    size_bytes: int = Field(ge=0)
    parameter_count: int = Field(ge=0)
    batchnorm_layers: list[BatchNormLayer]
    input_shape: InputShape
    parent: ResourceId | None = None
    source: ModelSource
    job_id: ResourceId | None = None
    created_at: UtcDatetime
    # null for models registered before it was measured, or whose measurement failed: their
    # jobs are not checked against the workers' memory.
    activations: ActivationFootprint | None = None
    # The architecture's own evaluation transform (torchvision's weights' transform, timm's
    # data config) as a spec: what a job's "preprocessing": "model" runs with. Null for
    # architectures without one.
    preprocessing: Preprocessing | None = None
    # Set when the uploaded weights' keys were renamed before they were stored.
    renamed_keys: RenamedKeys | None = None


class ModelCreate(RequestModel):
    """Registers a model; sent as the multipart form field ``meta`` (a JSON string) next to an
    optional ``weights`` file. Without weights the model is initialized with ``seed``."""

    architecture: ArchitectureName
    kwargs: ArchitectureKwargs = Field(default_factory=dict)
    seed: Seed = 0
