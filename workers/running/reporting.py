"""What a job changed: per BatchNorm layer and per state tensor (the contract's report parts).

All figures are computed in float64 on the CPU from two snapshots, so they cost no device
memory and do not depend on the device the job ran on.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = [
    "BatchNormChange",
    "TensorChange",
    "batchnorm_changes",
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


@dataclass(frozen=True)
class TensorChange:
    name: str
    changed: bool  # not torch.equal: any bit differs
    max_abs: float  # max |after - before|, 0 for an empty tensor
    relative_l2: float  # ||after - before|| / max(||before||, tiny)


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
        changes.append(
            TensorChange(
                name=name,
                changed=not torch.equal(old, new),
                max_abs=max_abs,
                relative_l2=torch.linalg.vector_norm(diff).item() / max(norm, _TINY),
            )
        )
    return changes
