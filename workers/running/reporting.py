"""What a job changed: per BatchNorm layer and per state tensor (the contract's report parts).

The figures are computed in float64 on the CPU from two snapshots, so they cost no device
memory and do not depend on the device the job ran on. How the model's predictions on target
samples changed, without labels, is workers/passes/predictions.py.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import torch
from torch import nn

from workers.models.modules import named_modules

__all__ = [
    "AffineChange",
    "BatchNormChange",
    "TensorChange",
    "affine_changes",
    "batchnorm_changes",
    "frozen_norm_names",
    "state_snapshot",
    "tensor_changes",
]

# Floor of a denominator, so a ratio or a relative change from zero stays finite (reports are
# JSON, which has no inf or nan). float32's smallest normal: below any real norm or variance.
_TINY = float(torch.finfo(torch.float32).tiny)


@dataclass(frozen=True)
class BatchNormChange:
    name: str
    adapted: bool
    running_mean_mean_abs_shift: float  # mean over channels of |after - before|
    running_var_mean_ratio: float  # mean over channels of after / before (1 where equal)
    num_batches_tracked_before: int
    num_batches_tracked_after: int
    batches_run: int  # batches this layer saw in train mode during the job (0 if not adapted)
    reset: bool = False  # its statistics were cleared before the job's batches


# NOTE [ Relative change from a zero baseline ]
# relative_l2 = ||after - before|| / ||before|| says how much a tensor moved for its size. It
# has no meaning where ||before|| is (about) zero: a freshly initialised model's running_mean
# is all zeros, and dividing by a floor gave 7.9e37. There, and for integer tensors (counters
# such as num_batches_tracked, whose "relative change" says nothing), relative_l2 is None and
# the report shows what it can: the absolute change ``l2``, and for a one-element integer
# tensor its plain values ``before`` and ``after``.
ZERO_BASELINE_L2: Final = 1e-12


@dataclass(frozen=True)
class TensorChange:
    name: str
    changed: bool  # not torch.equal: any bit differs
    max_abs: float  # max |after - before|, 0 for an empty tensor
    # ||after - before|| / ||before||; None for an integer tensor or a zero baseline
    # (NOTE [ Relative change from a zero baseline ])
    relative_l2: float | None
    l2: float = 0.0  # ||after - before||
    before: float | None = None  # a one-element integer tensor's values (a counter)
    after: float | None = None


def state_snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of ``model.state_dict()`` on the CPU, unaffected by later updates."""
    return {key: value.detach().to("cpu", copy=True) for key, value in model.state_dict().items()}


def _float64(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", torch.float64)


def batchnorm_changes(
    before: Mapping[str, torch.Tensor],
    after: Mapping[str, torch.Tensor],
    layers: Sequence[str],
    adapted: Collection[str],
    batches_run: int,
    reset: bool = False,
) -> list[BatchNormChange]:
    """One entry per layer of ``layers`` (state_dict prefixes of BatchNorm layers) that has
    running statistics; layers without them (``track_running_stats=False``) are left out.
    ``reset``: the ``adapted`` layers' statistics were cleared before the batches ran."""
    changes = []
    for name in layers:
        if f"{name}.running_mean" not in before:
            continue
        mean_before = _float64(before[f"{name}.running_mean"])  # (C,)
        mean_after = _float64(after[f"{name}.running_mean"])
        var_before = _float64(before[f"{name}.running_var"])  # (C,)
        var_after = _float64(after[f"{name}.running_var"])
        ratio = torch.where(var_after == var_before, 1.0, var_after / var_before.clamp_min(_TINY))
        changes.append(
            BatchNormChange(
                name=name,
                adapted=name in adapted,
                running_mean_mean_abs_shift=(mean_after - mean_before).abs().mean().item(),
                running_var_mean_ratio=ratio.mean().item(),
                num_batches_tracked_before=int(before[f"{name}.num_batches_tracked"]),
                num_batches_tracked_after=int(after[f"{name}.num_batches_tracked"]),
                batches_run=batches_run if name in adapted else 0,
                reset=reset and name in adapted,
            )
        )
    return changes


def tensor_changes(
    before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor]
) -> list[TensorChange]:
    """One entry per state_dict key, in ``before``'s order; both must have the same keys."""
    if set(before) != set(after):
        raise ValueError(
            f"snapshots differ in keys: only before {sorted(set(before) - set(after))}, "
            f"only after {sorted(set(after) - set(before))}"
        )
    changes = []
    for name, old in before.items():
        new = after[name]
        diff = _float64(new) - _float64(old)
        max_abs = diff.abs().max().item() if diff.numel() else 0.0
        norm = torch.linalg.vector_norm(_float64(old)).item()
        l2 = torch.linalg.vector_norm(diff).item()
        counter = not (old.is_floating_point() or old.is_complex())
        if counter or norm < ZERO_BASELINE_L2:
            relative = 0.0 if l2 == 0.0 and not counter else None
        else:
            relative = l2 / norm
        one_value = counter and old.numel() == 1
        changes.append(
            TensorChange(
                name=name,
                changed=not torch.equal(old, new),
                max_abs=max_abs,
                relative_l2=relative,
                l2=l2,
                before=float(old.item()) if one_value else None,
                after=float(new.item()) if one_value else None,
            )
        )
    return changes


@dataclass(frozen=True)
class AffineChange:
    name: str
    kind: str  # the layer's class name
    parameters: list[str]  # its affine parameters: "weight", "bias"
    changed: bool
    max_abs: float  # max |after - before| over the parameters' elements


def affine_changes(
    model: nn.Module,
    before: Mapping[str, torch.Tensor],
    after: Mapping[str, torch.Tensor],
    layers: Sequence[str],
) -> list[AffineChange]:
    """One entry per layer of ``layers`` (normalization layers whose affine parameters were
    trained), from the state snapshots."""
    modules = dict(named_modules(model))
    changes = []
    for name in layers:
        parameters = [p for p in ("weight", "bias") if f"{name}.{p}" in before]
        diffs = [
            (_float64(after[f"{name}.{p}"]) - _float64(before[f"{name}.{p}"])).abs()
            for p in parameters
        ]
        changes.append(
            AffineChange(
                name=name,
                kind=type(modules[name]).__name__,
                parameters=parameters,
                changed=any(
                    not torch.equal(before[f"{name}.{p}"], after[f"{name}.{p}"]) for p in parameters
                ),
                max_abs=max((d.max().item() for d in diffs if d.numel()), default=0.0),
            )
        )
    return changes


def frozen_norm_names(model: nn.Module) -> list[str]:
    """The model's frozen BatchNorm layers (torchvision's and timm's ``FrozenBatchNorm2d``,
    timm's ``FrozenBatchNormAct2d``): statistics and affine parameters held as buffers, which
    no estimator adapts."""
    return [
        name
        for name, module in named_modules(model)
        if type(module).__name__.startswith("FrozenBatchNorm")
    ]
