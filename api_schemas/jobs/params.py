"""The parameter pieces every job kind shares: batch sizes, devices, checkpoint policies."""

from typing import Annotated, Final, Literal

from pydantic import Field, StringConstraints

from api_schemas.common import RequestModel

__all__ = [
    "DEFAULT_MAX_ATTEMPTS",
    "DEVICE_PATTERN",
    "MAX_ATTEMPTS",
    "MAX_BATCH_SIZE",
    "MAX_SHARDS",
    "TAG_KEY_PATTERN",
    "BatchSize",
    "CheckpointPolicy",
    "Device",
    "JobTags",
    "MaxAttempts",
    "ModulePattern",
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
MaxAttempts = Annotated[int, Field(ge=1, le=MAX_ATTEMPTS)]


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


BatchSize = Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE)]

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
