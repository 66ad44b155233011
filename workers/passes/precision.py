"""An adaptation pass's numerics: bfloat16 autocast and channels-last memory format.

# NOTE [ Adaptation in bf16 ]
An adapt job's ``precision: "bf16"`` runs the estimator's passes under
``torch.autocast(dtype=torch.bfloat16)`` on the job's device: convolutions and linear layers
take and give bfloat16, which halves the activations' bytes and runs on the GPU's bf16 tensor
cores. BatchNorm is on none of autocast's lists: it gets the bf16 activations with its float32
weights and buffers, gives bf16, and reduces its input to the batch mean and variance in
float32. Measured on torch 2.13's CPU: a BatchNorm2d with momentum 1 on a bf16 input (64 x 8 x
16 x 16) writes float32 buffers whose mean and variance are those of the bf16 values to 1e-7
and 7e-7 relative (float32's rounding; a bf16 accumulation would be off by ~1e-3). So a
layer's statistics differ from the fp32 pass only by the bf16 rounding of the activations it
sees and of the layers before it, and the estimators accumulate as in fp32: precise in float64
(NOTE [ Precise statistics ] in workers/estimators/precise.py), the moving averages in the
float32 buffers.

How far from fp32, measured (tests/workers/estimators/test_adapt_precision.py, ``pytest -s`` prints
them; torch 2.13, CPU): the largest difference of a running mean or variance between the bf16 and
the fp32 pass, relative to that layer's largest fp32 value, over all adapted layers; 96 samples in
batches of 32, inputs shifted from the initial statistics. The test asserts each is above 1e-4
(far above float32's rounding: the pass ran in bf16) and within the bound, four times the
largest measured; on CUDA (``-m gpu``) with channels_last too, against the same bound.

| estimator | digits_cnn (width 8, 8 x 8) | resnet (depth 2, width 8, 32 x 32) | bound |
|---|---|---|---|
| ema | 1.7e-3 | 2.5e-3 | 1e-2 |
| ema_momentum | 1.7e-3 | 2.5e-3 | 1e-2 |
| cumulative | 1.7e-3 | 2.5e-3 | 1e-2 |
| precise | 1.7e-3 | 2.5e-3 | 1e-2 |
| prior | 1.7e-3 | 2.5e-3 | 1e-2 |
| entropy (2 steps) | 1.7e-3 | 2.5e-3 | 1e-2 |

bf16 keeps 8 bits of mantissa, so ~2e-3 is one rounding of the activations; deeper models add
a rounding per layer, not per batch (nothing accumulates in bf16). ``auto`` picks among
precise and prior candidates, each within these bounds, but a candidate's score can tip its
choice: its result is not bounded by them.

Where a job asks for exact statistics (``fp32``, the default) nothing here runs: the pass is
what it was before bf16 existed, bit for bit on the CPU.

``channels_last`` (4-D inputs only) converts the model's parameters and buffers to the
channels-last memory format for the pass and back to the default format afterwards (stored
weights keep their layout), and the batches come in that format (NOTE [ Batches to the device ]
in workers/passes/transfer.py). On the CPU it changes which convolution kernels run, so its
numbers are within float32 rounding of the default's, not bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["adaptation_numerics", "autocast"]

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[None]:
    """The autocast of a job's ``precision`` on ``device``: none for ``fp32``, bfloat16 or
    float16 autocast for ``bf16`` or ``fp16`` (train and adapt jobs both)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision not in _AUTOCAST_DTYPES:
        raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp16', got {precision!r}")
    return torch.autocast(device_type=device.type, dtype=_AUTOCAST_DTYPES[precision])


def _contiguous(model: nn.Module) -> None:
    model.to(memory_format=torch.contiguous_format)  # type: ignore[call-overload]


@contextlib.contextmanager
def adaptation_numerics(
    model: nn.Module, device: torch.device, precision: str, channels_last: bool
) -> Iterator[None]:
    """Runs the block with ``model`` in channels-last format (``channels_last``) under bf16
    autocast on ``device`` (``precision == "bf16"``); see NOTE [ Adaptation in bf16 ]. The
    model's memory format is put back even when the block raises."""
    with contextlib.ExitStack() as stack:
        if channels_last:
            model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
            stack.callback(_contiguous, model)
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be 'fp32' or 'bf16', got {precision!r}")
        stack.enter_context(autocast(device, precision))
        yield
