"""Synchronized BatchNorm on any backend: gloo on the CPU as well as NCCL on CUDA.

A standalone library module like :mod:`bnadapt.checkpoint` (torch and the standard library only).

- :class:`SyncBatchNorm` -- BatchNorm whose train-mode statistics are those of the global batch,
  all ranks of its process group together (NOTE [ Synchronized statistics ]). Its
  ``state_dict`` keys are BatchNorm's, so weights load both ways.
- :func:`convert_sync_batchnorm` -- replaces, in place, a model's BatchNorm layers by it.

Where torch's ``nn.SyncBatchNorm`` refuses CPU tensors (and DDP refuses it in a CPU model), this
one runs wherever ``torch.distributed.all_reduce`` does. Under :mod:`bnadapt.checkpoint`'s
wrapper its recomputation reuses the first forward's global statistics and makes no collective
(NOTE [ Values kept for the recomputation ] in bnadapt/checkpoint.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parameter import is_lazy

from bnadapt.checkpoint import _kept_for_recomputation

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]

# NOTE [ Synchronized statistics ]
#
# Forward, in train mode with a process group of two ranks or more (otherwise the module is
# plain BatchNorm: _BatchNorm's own forward, bitwise):
# 1. Each rank computes, per channel, the sum and the sum of squares of its slice, and its
#    count (samples x spatial positions; ranks may hold different counts, an empty slice
#    included, which still joins the collective). The sums come from torch.var_mean of the
#    slice (n * mean, n * (var + mean^2)) rather than from summing squares directly, so the
#    slice's own variance carries no cancellation; they are combined in float64, so the
#    global E[x^2] - mean^2 loses nothing that float32 statistics would notice.
# 2. ONE all_reduce of [sum (C), sum of squares (C), count (1)], concatenated: summing is
#    exact for any mix of counts, where torch's SyncBatchNorm all-gathers per-rank means.
# 3. The global mean, biased variance (clamped at 0) and invstd = 1 / sqrt(var + eps)
#    normalise the slice: y = x * (invstd * weight) + (bias - mean * invstd * weight), the
#    form torch's CPU kernel uses; the running statistics move as BatchNorm's do, by momentum
#    (or by 1 / num_batches_tracked when momentum is None) towards the mean and the unbiased
#    variance var * N / (N - 1) of the global count N.
# Backward: ONE all_reduce of [sum dy, sum dy * (x - mean)] per channel, which the input
# gradient needs from every rank:
#   dx = invstd * weight * (dy - mean(dy) - (x - mean) * invstd^2 * mean(dy * (x - mean)))
# with the means over the global batch; the weight and bias gradients stay local (sum
# dy * xhat, sum dy), for DDP to average like every other parameter's. With each rank's loss
# the mean over its slice, that makes a step the one-process step on the global batch.
# Under the checkpoint wrapper, step 1-3's statistics are computed once, in the first forward,
# and kept with the call: the recomputation normalises with those very tensors and runs no
# collective (NOTE [ Values kept for the recomputation ]); the backward's collective runs once,
# as without checkpointing.


class _GlobalStatistics(NamedTuple):
    """The global batch's statistics per channel, each of shape (C,), in the statistics' dtype."""

    mean: torch.Tensor
    invstd: torch.Tensor  # 1 / sqrt(biased variance + eps)
    unbiased_var: torch.Tensor  # for the running variance
    n: torch.Tensor  # (1,): values per channel (samples x positions), all ranks together


def _statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for float32 and narrower inputs (statistics of half inputs accumulate in float32,
    as torch's kernels do), float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def _reduced_dims(x: torch.Tensor) -> list[int]:
    """Every dimension of ``x`` (N, C, *) but the channels'."""
    return [0, *range(2, x.dim())]


def _channel_shape(x: torch.Tensor) -> tuple[int, ...]:
    """(1, C, 1, ...): a per-channel vector broadcast over ``x``."""
    return (1, x.size(1)) + (1,) * (x.dim() - 2)


def _global_statistics(x: torch.Tensor, eps: float, group: ProcessGroup) -> _GlobalStatistics:
    """Steps 1-3 of NOTE [ Synchronized statistics ]: one all_reduce over ``group``."""
    channels = x.size(1)
    count = x.numel() // channels
    dtype = _statistics_dtype(x.dtype)
    with torch.no_grad():
        if count > 0:
            var, mean = torch.var_mean(x.to(dtype), dim=_reduced_dims(x), correction=0)
            mean64 = mean.double()
            local = torch.cat(
                [
                    mean64 * count,
                    (var.double() + mean64 * mean64) * count,
                    mean64.new_full((1,), float(count)),
                ]
            )
        else:
            local = torch.zeros(2 * channels + 1, dtype=torch.float64, device=x.device)
        dist.all_reduce(local, group=group)
        total, squares, n = local[:channels], local[channels:-1], local[-1:]
        mean64 = total / n
        var64 = (squares / n - mean64 * mean64).clamp_(min=0)
        return _GlobalStatistics(
            mean=mean64.to(dtype),
            invstd=torch.rsqrt(var64 + eps).to(dtype),
            unbiased_var=(var64 * n / (n - 1)).to(dtype),
            n=n.to(dtype),
        )


class _SyncBatchNormFunction(torch.autograd.Function):
    """Normalises a rank's slice by the global statistics; its backward all-reduces the two
    sums the input gradient needs (NOTE [ Synchronized statistics ])."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        mean: torch.Tensor,
        invstd: torch.Tensor,
        n: torch.Tensor,
        group: ProcessGroup,
    ) -> torch.Tensor:
        shape = _channel_shape(x)
        scale = invstd if weight is None else invstd * weight
        shift = -mean * scale if bias is None else bias - mean * scale
        out = torch.addcmul(shift.view(shape), x, scale.view(shape)).to(x.dtype)
        ctx.save_for_backward(x, weight, mean, invstd, n)
        ctx.group = group
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, mean, invstd, n = ctx.saved_tensors
        shape, dims = _channel_shape(x), _reduced_dims(x)
        dy = grad_out.to(mean.dtype)
        centred = x.to(mean.dtype) - mean.view(shape)  # (N, C, *)
        sum_dy = dy.sum(dims)  # (C,)
        sum_dy_centred = (dy * centred).sum(dims)  # (C,)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            sums = torch.cat([sum_dy, sum_dy_centred])
            dist.all_reduce(sums, group=ctx.group)
            mean_dy, mean_dy_centred = (sums / n).split(x.size(1))
            scale = invstd if weight is None else invstd * weight
            grad_x = (
                (
                    dy
                    - mean_dy.view(shape)
                    - centred * (invstd * invstd * mean_dy_centred).view(shape)
                )
                * scale.view(shape)
            ).to(x.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sum_dy_centred * invstd).to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(ctx.bias_dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the global batch of a process group, on any backend.

    Arguments as torch's ``nn.SyncBatchNorm``; ``process_group`` None is the default group. In
    train mode with a process group of two ranks or more, the batch statistics are those of all
    ranks' inputs together (NOTE [ Synchronized statistics ]: one all_reduce forward, one
    backward); in eval mode, without an initialised process group, or with one rank, it is
    BatchNorm, bitwise. Takes inputs (N, C, *) of any number of spatial dimensions.
    """

    # NOTE [ BatchNorm in train mode ] and NOTE [ Values kept for the recomputation ] in
    # bnadapt/checkpoint.py: in train mode the output reads no running statistic (buffers are
    # reached only through _buffers), and the global statistics go through
    # _kept_for_recomputation.
    _checkpoint_batch_norm_forward: ClassVar[bool] = True
    _checkpoint_keeps_values: ClassVar[bool] = True

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: ProcessGroup | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype
        )
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm expects an input (N, C, *) of at least 2 dimensions, got "
                f"{input.dim()}D of shape {tuple(input.shape)}"
            )

    def _synchronized_group(self) -> ProcessGroup | None:
        """The process group to synchronise over in this call; None where the module is
        plain BatchNorm (eval mode, no initialised group, a group of one rank)."""
        if not self.training or not dist.is_available() or not dist.is_initialized():
            return None
        group = dist.group.WORLD if self.process_group is None else self.process_group
        if dist.get_world_size(group) < 2:
            return None
        return group

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        group = self._synchronized_group()
        if group is None:
            return super().forward(input)
        self._check_input_dim(input)
        if input.size(1) != self.num_features:
            raise ValueError(
                f"SyncBatchNorm({self.num_features}) got an input with {input.size(1)} "
                f"channels (shape {tuple(input.shape)}); its dimension 1 must be the channels"
            )
        factor = 0.0 if self.momentum is None else self.momentum
        batches = self.num_batches_tracked if self.track_running_stats else None
        if batches is not None:
            batches.add_(1)
            if self.momentum is None:  # cumulative moving average, as BatchNorm's
                factor = 1.0 / float(batches)
        stats = _kept_for_recomputation(self, lambda: _global_statistics(input, self.eps, group))
        mean, var = self.running_mean, self.running_var
        if batches is not None and mean is not None and var is not None:
            with torch.no_grad():
                mean.lerp_(stats.mean.to(mean.dtype), factor)
                var.lerp_(stats.unbiased_var.to(var.dtype), factor)
        out: torch.Tensor = _SyncBatchNormFunction.apply(  # type: ignore[no-untyped-call]
            input, self.weight, self.bias, stats.mean, stats.invstd, stats.n, group
        )
        return out


def _converted(module: nn.Module, name: str, process_group: ProcessGroup | None) -> nn.Module:
    """``module`` (a BatchNorm layer) as a :class:`SyncBatchNorm` sharing its parameters and
    buffers; raises where that would drop what the layer does."""
    kind = type(module)
    if kind.forward not in (_BatchNorm.forward, nn.SyncBatchNorm.forward):
        raise TypeError(
            f"cannot convert {name or 'the model'} ({kind.__name__}) to SyncBatchNorm: its "
            "forward is its own, and the conversion would drop what it adds to BatchNorm's. "
            "Replace it by a module that calls bnadapt's SyncBatchNorm itself, or leave it "
            "out of the conversion"
        )
    assert isinstance(module, _BatchNorm)
    if any(is_lazy(t) for t in (*module.parameters(False), *module.buffers(False))):
        raise ValueError(
            f"cannot convert {name or 'the model'} ({kind.__name__}) to SyncBatchNorm before "
            "it knows its channels; run one forward first, so that it materialises them"
        )
    # On the meta device: every tensor is the layer's own, assigned below.
    sync = SyncBatchNorm(
        module.num_features,
        module.eps,
        module.momentum,
        module.affine,
        module.track_running_stats,
        process_group,
        device="meta",
    )
    for parameter in ("weight", "bias"):
        if parameter in module._parameters:
            sync._parameters[parameter] = module._parameters[parameter]
    for buffer in ("running_mean", "running_var", "num_batches_tracked"):
        sync._buffers[buffer] = module._buffers.get(buffer)
    sync.train(module.training)
    if hasattr(module, "qconfig"):
        sync.qconfig = module.qconfig
    return sync


def convert_sync_batchnorm(
    module: nn.Module, process_group: ProcessGroup | None = None
) -> nn.Module:
    """Replace every BatchNorm layer of ``module`` (BatchNorm1d/2d/3d, torch's SyncBatchNorm)
    by a :class:`SyncBatchNorm` over ``process_group`` (None: the default group), in place;
    returns ``module``, or the new layer if ``module`` is one itself.

    The new layers share the old ones' parameters and buffers (the same tensors), training
    flag and ``state_dict`` keys. Layers of a BatchNorm subclass with a forward of its own
    (timm's ``BatchNormAct2d`` adds an activation) raise a ``TypeError``: converting them would
    silently drop what they add. Layers already bnadapt's SyncBatchNorm are left as they are.
    """
    return _convert(module, "", process_group)


def _convert(module: nn.Module, name: str, process_group: ProcessGroup | None) -> nn.Module:
    if isinstance(module, SyncBatchNorm):
        return module
    if isinstance(module, _BatchNorm):
        return _converted(module, name, process_group)
    for child_name, child in list(module._modules.items()):
        if child is None:
            continue
        new = _convert(child, f"{name}.{child_name}" if name else child_name, process_group)
        if new is not child:
            module._modules[child_name] = new
    return module
