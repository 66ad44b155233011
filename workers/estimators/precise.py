"""Precise BatchNorm statistics from sufficient statistics.

- :func:`collect_statistics` — one pass over the data, the model left as it was, giving a
  :class:`~workers.estimators.layer_statistics.LayerStatistics` per layer (per-channel count, mean
  and M2 in float64, mergeable and JSON-friendly, so shards computed by different workers combine).
- :func:`apply_statistics` — writes them as BatchNorm would: the mean, the unbiased variance
  (pooled per element, or averaged per batch as ``cumulative`` does).
- :func:`precise_batchnorm` — both; :func:`layerwise_precise_batchnorm` — one layer at a time,
  independent of the batch split. The ``prior`` estimator, which mixes them with the source
  statistics, is in workers/estimators/prior.py.

See NOTE [ Precise statistics ] for what the pass computes and how.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from workers.errors import AdaptError
from workers.estimators.base import (
    AdaptStats,
    EstimatorTask,
    check_stop,
    nonempty,
    resolve_batchnorm,
)
from workers.estimators.layer_statistics import LayerStatistics, Weighting
from workers.models.modules import training_flags

__all__ = [
    "apply_statistics",
    "collect_statistics",
    "layerwise_precise_batchnorm",
    "precise_batchnorm",
    "run",
    "running_statistics",
]

# NOTE [ Precise statistics ]
#
# What: for each selected layer, the mean and the unbiased variance of all the activations it
# receives during the pass, pooled element by element (not an average of batch averages): the
# same numbers, up to rounding, as the statistics of those activations concatenated, whatever
# their split into batches.
#
# Which activations: those of a train-mode pass (as fvcore's precise BN). Every selected
# BatchNorm layer runs in train mode and normalizes with its batch statistics, so a layer's
# input does not depend on the running statistics of the layers upstream, old or new, and all
# layers are estimated in one pass. Unselected BatchNorm layers, Dropout and the rest stay in
# eval mode, as in the other estimators. The price: below a selected layer, activations depend
# on that layer's batch statistics, hence a little on the batch size (as in training; 1e-2
# relative on a 4-block resnet between batches of 2 and one batch of all). A layer with no
# selected BatchNorm upstream sees the same inputs whatever the split, and its result is
# independent of the split. `layerwise_precise_batchnorm` (the job's `layerwise` option) makes
# every layer so, at the cost of one pass per layer: layer by layer in forward order, only the
# current layer in train mode, the layers before it already updated and in eval mode.
#
# How, at no extra pass over the activations: train-mode BatchNorm already reduces its input to
# the per-channel batch mean and unbiased variance. With momentum 1.0 it writes exactly those
# into running_mean and running_var (1 * new + 0 * old), and a forward hook reads them back
# after each call, with the element count per channel from the input's shape, and merges them
# into float64 accumulators (Chan et al.). The hook runs after every call, so a layer called
# twice in one forward counts both calls. On the CPU torch reduces float32 activations in double
# precision; on CUDA in float32 with Welford's algorithm — either way far below 1e-6 relative.
# The layers' buffers and momenta are put back afterwards: collecting leaves the model as it was,
# so shards can be collected on copies and merged before anything is written.


def _batch_statistics(
    bn: _BatchNorm, inputs: tuple[Any, ...], weighting: Weighting
) -> LayerStatistics:
    """What the layer just computed; see NOTE [ Precise statistics ]."""
    x = inputs[0]  # (B, C, ...)
    channels = x.shape[1]
    count = x.numel() // channels
    running_mean, running_var = running_statistics(bn)
    mean = running_mean.detach().to(torch.float64)  # (C,)
    var = running_var.detach().to(torch.float64)  # (C,) unbiased
    if weighting == "elements":  # the per-batch sums would cost time for nothing
        return LayerStatistics(count, mean, var * (count - 1), batches=1)
    return LayerStatistics(count, mean, var * (count - 1), batches=1, mean_sum=mean, var_sum=var)


def collect_statistics(
    model: nn.Module,
    batches: Iterable[torch.Tensor],
    *,
    layers: Sequence[str],
    progress: Callable[[int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    weighting: Weighting = "elements",
    forward: Callable[[torch.Tensor], Any] | None = None,
) -> dict[str, LayerStatistics]:
    """Statistics of the inputs of ``layers`` over ``batches`` (``(B, ...)`` on the model's
    device), from one train-mode pass under ``no_grad``; the model is left unchanged. With
    ``weighting="batches"`` they also hold the per-batch sums that ``cumulative`` averages.
    Raises :class:`AdaptError` on empty data or a layer the pass never reached. ``forward``
    runs each batch (default ``model``; a compiled job's ``torch.compile`` of it, whose graphs
    call the layers' hooks as the eager model does)."""
    selected = resolve_batchnorm(model, layers)
    run_batch = model if forward is None else forward
    checked = nonempty(batches)
    found: dict[str, LayerStatistics] = {}

    def hook_for(name: str) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
        def hook(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            assert isinstance(module, _BatchNorm)
            stats = _batch_statistics(module, inputs, weighting)
            found[name] = found[name].merge(stats) if name in found else stats

        return hook

    saved = [
        (bn, bn.momentum, {k: v.clone() for k, v in bn._buffers.items() if v is not None})
        for bn in selected
    ]
    handles = [
        bn.register_forward_hook(hook_for(name)) for name, bn in zip(layers, selected, strict=True)
    ]
    done = 0
    with training_flags(model), torch.no_grad():
        try:
            model.eval()
            for bn in selected:
                bn.train()
                bn.reset_running_stats()  # finite values, so 0 * old is 0
                bn.momentum = 1.0
            for batch in checked:  # (B, ...)
                check_stop(should_stop, done)
                run_batch(batch)
                done += 1
                if progress is not None:
                    progress(done)
        finally:
            for handle in handles:
                handle.remove()
            for bn, momentum, buffers in saved:
                bn.momentum = momentum
                for key, value in buffers.items():
                    buffer = bn._buffers[key]
                    assert buffer is not None
                    buffer.copy_(value)  # the same objects: references to them stay valid
    _require_reached(layers, found, f" in {done} batches")
    return found


def apply_statistics(
    model: nn.Module,
    stats: Mapping[str, LayerStatistics],
    layers: Sequence[str],
    weighting: Weighting = "elements",
) -> None:
    """Writes the running mean and unbiased variance that :meth:`LayerStatistics.running`
    gives for ``weighting`` (``elements``: ``mean`` and ``m2 / (count - 1)``), and
    ``num_batches_tracked = batches``, into each of ``layers``. Everything is checked before
    anything is written."""
    selected = resolve_batchnorm(model, layers)
    values = []
    for name, bn in zip(layers, selected, strict=True):
        found = stats.get(name)
        if found is None:
            raise AdaptError(f"no statistics for layer {name!r}; collect them for all layers")
        if found.channels != bn.num_features:
            raise AdaptError(
                f"statistics of {found.channels} channels for layer {name!r} of "
                f"{bn.num_features}; they were collected on another model"
            )
        values.append((bn, *found.running(weighting), found.batches))
    with torch.no_grad():
        for bn, mean, var, batches in values:
            running_mean, running_var = running_statistics(bn)
            assert bn.num_batches_tracked is not None
            running_mean.copy_(mean)
            running_var.copy_(var)
            bn.num_batches_tracked.fill_(batches)


def precise_batchnorm(
    model: nn.Module,
    batches: Iterable[torch.Tensor],
    *,
    layers: Sequence[str],
    progress: Callable[[int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    forward: Callable[[torch.Tensor], Any] | None = None,
) -> AdaptStats:
    """:func:`collect_statistics` then :func:`apply_statistics`."""
    counted = _Counted(batches)
    stats = collect_statistics(
        model, counted, layers=layers, progress=progress, should_stop=should_stop, forward=forward
    )
    apply_statistics(model, stats, layers)
    return AdaptStats(batches=counted.batches, samples=counted.samples)


def layerwise_precise_batchnorm(
    model: nn.Module,
    batches: Callable[[], Iterable[torch.Tensor]],
    *,
    layers: Sequence[str],
    progress: Callable[[int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> AdaptStats:
    """:func:`precise_batchnorm` one layer at a time, in the order the forward reaches them;
    ``batches()`` gives the data anew for each of these passes. Each pass runs only its layer
    in train mode: the layers before it hold their new statistics and normalize with them, so
    the layer's input, and what it collects, is the same whatever the split into batches (see
    NOTE [ Precise statistics ]). ``progress`` counts batches over all passes."""
    order = _forward_order(model, batches(), layers)
    passed = 0

    def report(done: int) -> None:
        if progress is not None:
            progress(passed + done)

    stats = AdaptStats(batches=0, samples=0)
    for name in order:
        stats = precise_batchnorm(
            model, batches(), layers=[name], progress=report, should_stop=should_stop
        )
        passed += stats.batches
    return stats


def _forward_order(
    model: nn.Module, batches: Iterable[torch.Tensor], layers: Sequence[str]
) -> list[str]:
    """``layers`` in the order an eval-mode forward of the first batch first calls them."""
    selected = resolve_batchnorm(model, layers)
    first = next(iter(nonempty(batches)))  # (B, ...)
    seen: list[str] = []

    def hook_for(name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(module: nn.Module, inputs: tuple[Any, ...]) -> None:
            if name not in seen:
                seen.append(name)

        return hook

    handles = [
        bn.register_forward_pre_hook(hook_for(name))
        for name, bn in zip(layers, selected, strict=True)
    ]
    try:
        with training_flags(model), torch.no_grad():
            model.eval()
            model(first)
    finally:
        for handle in handles:
            handle.remove()
    _require_reached(layers, seen, "")
    return seen


def _require_reached(layers: Sequence[str], reached: Container[str], during: str) -> None:
    """AdaptError naming the ``layers`` a pass never called (not in ``reached``)."""
    missing = [name for name in layers if name not in reached]
    if missing:
        raise AdaptError(
            f"layers {missing} received no input{during}: the model's forward does not use "
            "them; exclude them"
        )


def running_statistics(bn: _BatchNorm) -> tuple[torch.Tensor, torch.Tensor]:
    assert bn.running_mean is not None, "resolve_batchnorm keeps layers with running stats"
    assert bn.running_var is not None
    return bn.running_mean, bn.running_var


class _Counted:
    """Counts the batches and samples an iteration yields."""

    def __init__(self, batches: Iterable[torch.Tensor]) -> None:
        self._batches = batches
        self.batches = 0
        self.samples = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        for batch in self._batches:  # (B, ...)
            self.batches += 1
            self.samples += batch.shape[0]
            yield batch


def run(task: EstimatorTask) -> AdaptStats:
    """The ``precise`` row of the estimator table, ``layerwise`` or in one pass."""
    hooks = task.hooks
    if task.params.layerwise:
        task.start(task.total * len(task.layers))
        return layerwise_precise_batchnorm(
            task.model,
            task.batches,
            layers=task.layers,
            progress=hooks.report,
            should_stop=hooks.should_stop,
        )
    task.start()
    return precise_batchnorm(
        task.model,
        task.batches(),
        layers=task.layers,
        progress=hooks.report,
        should_stop=hooks.should_stop,
        forward=task.forward,
    )
