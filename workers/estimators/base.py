"""The estimator contract: what every estimator's runner takes and returns, and the checks they
share.

A row of ``api_schemas.jobs.adapt.ESTIMATORS`` names its ``runner``, a :data:`Runner`: it takes
an :class:`EstimatorTask` (the loaded model, the job's params, the selected layers, its hooks
and data) and returns the :class:`AdaptStats` of what it ran (NOTE [ The estimator table ]).
The estimator modules and workers/estimators/dispatch.py, which runs the row's runner, import
this module and never each other's contract, so no two of them import each other.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Final, Literal

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from api_schemas import AdaptParams
from workers.errors import AdaptError, JobCanceled
from workers.estimators.layer_statistics import LayerStatistics
from workers.models.modules import named_modules
from workers.passes.data import Batches, Data, num_batches
from workers.passes.hooks import JobHooks
from workers.passes.steps import Forward, StepClock
from workers.passes.transfer import device_batches

__all__ = [
    "NO_BATCHES",
    "AdaptStats",
    "Estimate",
    "EstimatorTask",
    "MergedRunner",
    "Runner",
    "check_stop",
    "nonempty",
    "resolve_affine_norms",
    "resolve_batchnorm",
    "select_affine_norms",
    "select_batchnorm",
]


@dataclass(frozen=True)
class AdaptStats:
    batches: int
    samples: int


@dataclass(frozen=True)
class EstimatorTask:
    """What an estimator's runner gets: the model, the job's params, the selected layers, the
    job's hooks (progress, cancel) and its data."""

    model: nn.Module
    params: AdaptParams
    layers: list[str]
    hooks: JobHooks
    x: Data  # (N, ...) read a batch at a time, on the CPU
    reset: bool
    device: torch.device
    # Estimators with backward passes (the row's `backward`): what runs their steps' forward
    # passes (None: the model; a compiled job's torch.compile of it) and what times the steps.
    forward: Forward | None = None
    clock: StepClock | None = None
    # Estimators that train affine parameters (entropy): the LayerNorm and GroupNorm layers
    # whose weight and bias they train besides those of ``layers`` (select_affine_norms).
    affine_layers: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        """The batches one pass runs: whole batches in order, at most ``max_batches``."""
        return num_batches(len(self.x), self.params.batch_size, self.params.max_batches)

    def batches(self) -> Iterator[torch.Tensor]:
        """A fresh pass over the job's batches, each made on the device as it comes (NOTE [
        Batches to the device ] in workers/passes/transfer.py)."""
        return device_batches(
            self.x,
            self.params.batch_size,
            self.params.max_batches,
            self.device,
            self.params.channels_last,
        )

    def sequence(self) -> Batches:
        """The job's batches on the CPU as a sequence that reads a batch when it is indexed
        (an estimator that cycles over them holds none)."""
        return Batches(self.x, self.params.batch_size, self.params.max_batches)

    def start(
        self, total: int | None = None, unit: Literal["batches", "steps"] = "batches"
    ) -> None:
        """Starts the job's `adapt` phase: ``total`` (default :attr:`total`) units."""
        self.hooks.start_phase(
            "adapt", self.total if total is None else total, unit, float(self.params.batch_size)
        )


# An adapt job's estimation step on the task's loaded model and selected layers. By default the
# job's estimator runs over the dataset (workers/estimators/dispatch.py `run_task`); the merge
# of a sharded job applies the statistics its shards collected instead
# (workers/sharding/compute.py).
Estimate = Callable[[EstimatorTask], AdaptStats]
# A row's `runner`: the estimator's own estimation step.
Runner = Estimate
# The row's `merged_runner`: the merge's step with the shards' merged statistics per layer
# and what the shards ran (batches and samples, all shards together).
MergedRunner = Callable[[EstimatorTask, Mapping[str, LayerStatistics], AdaptStats], AdaptStats]


def select_batchnorm(
    model: nn.Module, include: Sequence[str], exclude: Sequence[str], required: bool = True
) -> list[str]:
    """Names of the BatchNorm layers (any ``_BatchNorm``: BatchNorm1d/2d/3d, SyncBatchNorm,
    timm's BatchNormAct2d) that track running statistics, match an ``include`` fnmatch pattern
    and no ``exclude`` pattern. :class:`AdaptError` when there are none, unless not
    ``required``."""
    layers = [
        (name, module)
        for name, module in named_modules(model)
        if isinstance(module, _BatchNorm) and module.track_running_stats
    ]
    chosen = [
        name
        for name, _ in layers
        if any(fnmatchcase(name, p) for p in include)
        and not any(fnmatchcase(name, p) for p in exclude)
    ]
    if not chosen and required:
        available = ", ".join(name for name, _ in layers) or "none"
        raise AdaptError(
            f"no BatchNorm layer to adapt: include {list(include)} and exclude {list(exclude)} "
            f"select none of the layers with running statistics ({available}); widen `include` "
            "or narrow `exclude`"
        )
    return chosen


def resolve_batchnorm(model: nn.Module, layers: Sequence[str]) -> list[_BatchNorm]:
    """The modules of ``layers``, in order; :class:`AdaptError` unless each is a BatchNorm
    layer with running statistics, and unless there is at least one."""
    by_name = dict(named_modules(model))
    resolved = []
    for name in layers:
        module = by_name.get(name)
        if not isinstance(module, _BatchNorm) or not module.track_running_stats:
            what = "no module" if module is None else type(module).__name__
            raise AdaptError(
                f"layer {name!r} is {what}, not a BatchNorm layer with running statistics; "
                "pick names from select_batchnorm()"
            )
        resolved.append(module)
    if not resolved:
        raise AdaptError("no layers to adapt were given; pass the names select_batchnorm() gives")
    return resolved


# The layers whose affine parameters `entropy` trains besides BatchNorm's (as SAR does):
# LayerNorm (timm's and torchvision's LayerNorm2d are subclasses) and GroupNorm.
AFFINE_NORM_TYPES: Final = (nn.LayerNorm, nn.GroupNorm)


def _has_affine(module: nn.Module) -> bool:
    return any(isinstance(getattr(module, p, None), nn.Parameter) for p in ("weight", "bias"))


def select_affine_norms(
    model: nn.Module, include: Sequence[str], exclude: Sequence[str]
) -> list[str]:
    """Names of the LayerNorm and GroupNorm layers with affine parameters that match an
    ``include`` fnmatch pattern and no ``exclude`` pattern (possibly none)."""
    return [
        name
        for name, module in named_modules(model)
        if isinstance(module, AFFINE_NORM_TYPES)
        and _has_affine(module)
        and any(fnmatchcase(name, p) for p in include)
        and not any(fnmatchcase(name, p) for p in exclude)
    ]


def resolve_affine_norms(model: nn.Module, layers: Sequence[str]) -> list[nn.Module]:
    """The modules of ``layers``; :class:`AdaptError` unless each is a LayerNorm or GroupNorm
    layer with affine parameters."""
    by_name = dict(named_modules(model))
    resolved: list[nn.Module] = []
    for name in layers:
        module = by_name.get(name)
        if not isinstance(module, AFFINE_NORM_TYPES) or not _has_affine(module):
            what = "no module" if module is None else type(module).__name__
            raise AdaptError(
                f"layer {name!r} is {what}, not a LayerNorm or GroupNorm layer with affine "
                "parameters; pick names from select_affine_norms()"
            )
        resolved.append(module)
    return resolved


NO_BATCHES: Final = (
    "no batches to adapt on: the data set is empty or max_batches is 0; upload data with at "
    "least one sample"
)


def nonempty(batches: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """All of ``batches``; raises :class:`AdaptError` now, before anything is changed, when
    there are none."""
    iterator = iter(batches)
    first = next(iterator, None)
    if first is None:
        raise AdaptError(NO_BATCHES)
    return itertools.chain([first], iterator)


def check_stop(should_stop: Callable[[], bool] | None, done: int) -> None:
    """Raises :class:`JobCanceled` when ``should_stop()`` answers True."""
    if should_stop is not None and should_stop():
        raise JobCanceled(f"BatchNorm adaptation canceled after {done} batches")
