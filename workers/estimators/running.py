"""BatchNorm adaptation: re-estimate running statistics with forward passes only.

Two estimators here, each equal bitwise to the loop users write by hand (``precise`` and
``prior`` are in workers/estimators/precise.py, ``entropy`` in workers/estimators/entropy.py):

- ``ema``: the selected layers in train mode with their own momentum, ``model(x)`` under
  ``no_grad`` per batch; running stats are reset first only when asked.
- ``cumulative``: as ``torch.optim.swa_utils.update_bn``: reset, momentum ``None`` (an equal-
  weight average of the batch statistics: torch divides by num_batches_tracked), momentum
  restored afterwards.

Unlike ``update_bn``, only the selected BatchNorm layers are in train mode during the pass:
Dropout and unselected BatchNorm stay in eval mode, so unselected statistics are kept bit for
bit and the pass is deterministic. Under ``no_grad`` a checkpoint wrapper just calls its
module, so wrapped models give the same result.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import TYPE_CHECKING, Final, Literal

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from workers.errors import AdaptError, JobCanceled
from workers.models.modules import named_modules, training_flags

if TYPE_CHECKING:
    from workers.estimators.dispatch import EstimatorTask

__all__ = [
    "NO_BATCHES",
    "AdaptStats",
    "Estimator",
    "adapt_batchnorm",
    "check_stop",
    "nonempty",
    "resolve_batchnorm",
    "run_cumulative",
    "run_ema",
    "select_batchnorm",
]

Estimator = Literal["ema", "cumulative"]


@dataclass(frozen=True)
class AdaptStats:
    batches: int
    samples: int


def select_batchnorm(model: nn.Module, include: Sequence[str], exclude: Sequence[str]) -> list[str]:
    """Names of the BatchNorm layers (any ``_BatchNorm``, SyncBatchNorm included) that track
    running statistics, match an ``include`` fnmatch pattern and no ``exclude`` pattern."""
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
    if not chosen:
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


def adapt_batchnorm(
    model: nn.Module,
    batches: Iterable[torch.Tensor],
    *,
    estimator: Estimator,
    layers: Sequence[str],
    reset: bool,
    progress: Callable[[int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> AdaptStats:
    """Update the running statistics of ``layers`` from ``batches`` (inputs on the model's
    device, ``(B, ...)``); see the module docstring. ``reset`` applies to ``ema`` only:
    ``cumulative`` always resets. ``progress(batches_done)`` after each batch; ``should_stop()``
    before each, raising :class:`JobCanceled` when it answers True.
    """
    if estimator not in ("ema", "cumulative"):
        raise AdaptError(
            f"unknown estimator {estimator!r} for adapt_batchnorm; use 'ema' or 'cumulative' "
            "(precise and prior: workers/estimators/precise.py, entropy: "
            "workers/estimators/entropy.py)"
        )
    selected = resolve_batchnorm(model, layers)
    checked = nonempty(batches)
    momenta = [bn.momentum for bn in selected]
    done = samples = 0
    with training_flags(model), torch.no_grad():
        try:
            model.eval()
            for bn in selected:
                bn.train()
                if estimator == "cumulative" or reset:
                    bn.reset_running_stats()
                if estimator == "cumulative":
                    bn.momentum = None
            for batch in checked:  # (B, ...)
                check_stop(should_stop, done)
                model(batch)
                done += 1
                samples += batch.shape[0]
                if progress is not None:
                    progress(done)
        finally:
            for bn, momentum in zip(selected, momenta, strict=True):
                bn.momentum = momentum
    return AdaptStats(batches=done, samples=samples)


def run_ema(task: EstimatorTask) -> AdaptStats:
    """The ``ema`` row of the estimator table: the layers' own momentum."""
    return _run(task, "ema")


def run_cumulative(task: EstimatorTask) -> AdaptStats:
    """The ``cumulative`` row of the estimator table."""
    return _run(task, "cumulative")


def _run(task: EstimatorTask, estimator: Estimator) -> AdaptStats:
    task.start()
    return adapt_batchnorm(
        task.model,
        task.batches(),
        estimator=estimator,
        layers=task.layers,
        reset=task.reset,
        progress=task.hooks.report,
        should_stop=task.hooks.should_stop,
    )
