"""What every job kind shares: the base classes of its params and of its create request
(NOTE [ Shared job fields ]), and the pieces they are made of (batch sizes, devices, bounds,
checkpoint policies).

NOTE [ Shared job fields ]
A field that every kind has is declared once, here: :class:`BaseJobParams` holds what the
params of every kind have (the API reads them of any job: its queue, its preprocessing),
:class:`ModelJobParams` adds what the kinds that change a model have (what the worker's
loading and shared computation read: workers/running/), and :class:`BaseJobCreate` is the
create request with everything but the kind. A kind's classes derive from them
(api_schemas/jobs/adapt.py, ...): its request only narrows ``kind`` to its name and
``params`` to its params class, and its params class adds its own fields, or declares a
shared one again only to change its default (``evaluate``'s larger ``batch_size``). pydantic
flattens inherited fields into each class's schema, so the OpenAPI document shows every
field in every kind, with no schema for the bases. Inherited fields come first in a class's
fields (and so in its JSON).
"""

from typing import Annotated, Any, Final, Literal, Self

from pydantic import Discriminator, Field, StringConstraints, Tag, model_validator

from api_schemas.common import RequestModel, ResourceId
from api_schemas.datasets import Preprocessing
from api_schemas.models import Seed

__all__ = [
    "DEFAULT_MAX_ATTEMPTS",
    "DEVICE_PATTERN",
    "MAX_ATTEMPTS",
    "MAX_BATCH_SIZE",
    "MAX_JOB_TIMEOUT_S",
    "MAX_LR",
    "MAX_NUM_BATCHES",
    "MAX_PRIORITY",
    "MAX_SHARDS",
    "MAX_STEPS",
    "MIN_PRIORITY",
    "TAG_KEY_PATTERN",
    "BaseJobCreate",
    "BaseJobParams",
    "BatchSize",
    "CheckpointPolicy",
    "CompileBackend",
    "Device",
    "JobPreprocessing",
    "JobPriority",
    "JobTags",
    "JobTimeout",
    "MaxAttempts",
    "ModelJobParams",
    "ModulePattern",
    "NumBatches",
    "PatternList",
    "num_batches",
]

MAX_BATCH_SIZE: Final = 65536
# Shards of one adapt job; each is an RQ job with its statistics in Redis (see
# workers/sharding/compute.py).
MAX_SHARDS: Final = 256
# How many times a job runs when its runs are interrupted (its process killed, its heartbeat
# lost); a job that fails for its own reasons (bad data, NaN) runs once.
DEFAULT_MAX_ATTEMPTS: Final = 3
MAX_ATTEMPTS: Final = 10
# The order of a tenant's own queued jobs: higher first, first in first out within one
# priority. It never moves the tenant's turn among other tenants (NOTE [ Fair turns ] in
# service/records/tenancy/turns.py).
MIN_PRIORITY: Final = -10
MAX_PRIORITY: Final = 10
JobPriority = Annotated[int, Field(ge=MIN_PRIORITY, le=MAX_PRIORITY)]
MaxAttempts = Annotated[
    int,
    Field(
        ge=1,
        le=MAX_ATTEMPTS,
        description=f"Runs the job may have when a run is interrupted (its process or worker "
        f"lost); a job that fails for its own reasons (out of memory, NaN, bad data) runs "
        f"once. 1 to {MAX_ATTEMPTS}.",
    ),
]

# NOTE [ Job bounds ]
# Every number a job takes has an upper bound a person would choose, in its schema (and so in
# the OpenAPI document); what no schema can know (the memory a job's activations need against
# the workers', the timeout cap an operator set) is checked at submission, in check_fit
# (service/jobs/submission.py), with a 422 saying what fits.
# Batches and steps: a million batches of 64 is 64 million samples per pass, far past any
# dataset a job here reads in hours.
MAX_NUM_BATCHES: Final = 1_000_000
MAX_STEPS: Final = 1_000_000
# Learning rates: 10 is past any rate that trains (SGD and Adam alike diverge well below it).
MAX_LR: Final = 10.0
# The schema's cap on a job's own `timeout_s` (a week); the operator's cap,
# BNADAPT_JOB_TIMEOUT_MAX_S (48 h by default), is checked at submission.
MAX_JOB_TIMEOUT_S: Final = 7 * 24 * 3600
JobTimeout = Annotated[
    int | None,
    Field(
        ge=1,
        le=MAX_JOB_TIMEOUT_S,
        description="Seconds the job may run before its worker stops it; it then ends failed "
        "with an error saying it timed out (and is not retried). null: the service's default "
        "(BNADAPT_JOB_TIMEOUT_S, 6 h unless the operator changed it). At most the service's "
        "cap (BNADAPT_JOB_TIMEOUT_MAX_S, 48 h unless changed): a longer one is refused (422).",
    ),
]
NumBatches = Annotated[int, Field(ge=1, le=MAX_NUM_BATCHES)]


# A job's tags: a string map the client chooses (`{"experiment": "shift-3"}`), shown on the job
# and filtered on by GET /v1/jobs?tag=experiment:shift-3. Keys are short names, values short
# strings, so that a `key:value` filter is unambiguous (the key has no colon).
TAG_KEY_PATTERN: Final = r"^[A-Za-z0-9_.-]{1,64}$"
MAX_TAGS: Final = 32
JobTags = Annotated[
    dict[
        Annotated[str, StringConstraints(pattern=TAG_KEY_PATTERN)],
        Annotated[str, StringConstraints(max_length=256)],
    ],
    Field(max_length=MAX_TAGS),
]


def num_batches(num_samples: int, batch_size: int, max_batches: int | None = None) -> int:
    """How many batches a job runs over ``num_samples``: whole batches of ``batch_size`` in
    order, the last one possibly short, at most ``max_batches``."""
    count = -(-num_samples // batch_size)
    return count if max_batches is None else min(count, max_batches)


BatchSize = Annotated[
    int,
    Field(
        ge=1,
        le=MAX_BATCH_SIZE,
        description=f"Samples per batch, 1 to {MAX_BATCH_SIZE}. A batch whose activations "
        "(estimated from the model and the samples' shape after preprocessing) do not fit the "
        "workers' memory is refused (422) with the largest batch_size that fits.",
    ),
]


def _spec_or_model(value: Any) -> str:
    # A string can only be "model": an error then says so, not what a spec lacks.
    return "model" if isinstance(value, str) else "spec"


# A job's preprocessing spec for its images, in place of the dataset's (docs/datasets.md), or
# "model": the model's own evaluation transform (ModelPublic.preprocessing), which the API
# puts in its place when the job is submitted; the report gives the spec the job ran with.
# Discriminated, so that a bad spec's error names only what is wrong with the spec.
JobPreprocessing = (
    Annotated[
        Annotated[Preprocessing, Tag("spec")] | Annotated[Literal["model"], Tag("model")],
        Discriminator(_spec_or_model),
    ]
    | None
)

DEVICE_PATTERN: Final = r"^(auto|cpu|mps|cuda(:[0-9]{1,2})?)$"
Device = Annotated[str, StringConstraints(pattern=DEVICE_PATTERN)]

# An fnmatch pattern on qualified module names (`layer1.*`) or a module class name.
ModulePattern = Annotated[str, StringConstraints(min_length=1, max_length=256)]
PatternList = Annotated[list[ModulePattern], Field(max_length=256)]


class CheckpointPolicy(RequestModel):
    """Which modules run under activation checkpointing. ``blocks`` wraps the blocks the
    architecture names; ``modules`` and ``types`` add modules by qualified name pattern or by
    class name."""

    preset: Literal["none", "blocks"] = "blocks"
    modules: PatternList = Field(default_factory=list)
    types: PatternList = Field(default_factory=list)
    offload_to_cpu: bool = False


# NOTE [ Compiled jobs ]
# A train job, or an adapt job whose estimator's row has `compiles` (every estimator but
# `auto`, whose candidates are passes of their own; not with `layerwise`, one pass per layer),
# may ask for `compile: true`: the worker runs its training steps, or the estimator's passes,
# through `torch.compile` of the wrapped model (checkpoint wrappers inside, whose statistics
# guarantee holds under compile: NOTE [ Under torch.compile ] in bnadapt/checkpoint.py). Only
# those are compiled: the measurement before and after and a train job's validation run the
# same model eagerly, so a job compiles the graphs of its own pass only (eval mode under
# no_grad would be a second set of graphs, paid for a few batches). An estimator's pass runs
# the selected BatchNorm layers in train mode with hooks that read their statistics (precise):
# dynamo traces the hooks with the model, and the statistics equal the eager pass's to
# inductor's rounding (2e-6 relative on the built-in resnet; aot_eager: bit for bit). One
# forward pass per batch repays a compilation only on large passes on a GPU (a pass over
# ImageNet: hundreds of batches of the same shape), which is where a job asks for it.
# The backend is `compile_backend`, "inductor" by default: it is the backend that generates
# fused kernels (C++ on the CPU, Triton on CUDA) and so the only one that can be faster than
# eager; it needs a C compiler on the worker. "aot_eager" traces the same graphs (forward and
# backward through AOT autograd) and runs them with eager kernels: no compiler needed and no
# speed-up, for checking that a model compiles or for a worker without a C compiler.
# Compilation happens inside the first step (and any step that recompiles, such as a shorter
# last batch): the job's heartbeat keeps beating, and a cancel takes effect at the next step.
# The report's `steps` (StepTimings in api_schemas/reports.py) times that warm-up apart from
# the steady steps, for compiled and eager jobs alike; the speed-up is the ratio of two jobs'
# steady throughput, which python -m bench.training.compile measures.
CompileBackend = Literal["inductor", "aot_eager"]


class BaseJobParams(RequestModel):
    """What the params of every kind have (NOTE [ Shared job fields ])."""

    batch_size: BatchSize = 64
    device: Device = "auto"
    # A spec for this job's images in place of the dataset's, or "model" (JobPreprocessing).
    preprocessing: JobPreprocessing = None


class ModelJobParams(BaseJobParams):
    """What the params of every kind that changes a model have (``AdaptParams``,
    ``TrainParams``): what loading the job and the computation all such kinds share read
    (NOTE [ Shared job fields ])."""

    checkpoint: CheckpointPolicy = Field(default_factory=CheckpointPolicy)
    seed: Seed = 0
    # NOTE [ Compiled jobs ].
    compile: bool = False
    compile_backend: CompileBackend = "inductor"

    @model_validator(mode="after")
    def _compile_backend_fits(self) -> Self:
        # A backend other than the default without `compile: true` would be ignored, so it is
        # refused. The default itself passes: stored params carry every field, defaults
        # included.
        if self.compile_backend != "inductor" and not self.compile:
            raise ValueError(
                f"compile_backend {self.compile_backend!r} is an option of compiled jobs; add "
                "compile: true, or drop compile_backend"
            )
        return self


class BaseJobCreate(RequestModel):
    """What the create request of every kind has (NOTE [ Shared job fields ]); a kind's
    request narrows ``kind`` to its name and ``params`` to its params class."""

    kind: str
    model_id: ResourceId
    dataset_id: ResourceId
    params: BaseJobParams
    max_attempts: MaxAttempts = DEFAULT_MAX_ATTEMPTS
    tags: JobTags = Field(default_factory=dict)
    priority: JobPriority = 0
    timeout_s: JobTimeout = None
