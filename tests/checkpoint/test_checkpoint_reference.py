"""Why bnadapt/checkpoint.py exists: the other wrappers, on the same model, get the statistics
wrong. These tests document the measured bug; if torch or fairscale ever fix it, they fail and
the README's claims need revisiting."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from bnadapt.checkpoint import checkpoint_wrapper


def conv_bn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))


class TorchCheckpointed(nn.Module):
    def __init__(self, module: nn.Module, use_reentrant: bool) -> None:
        super().__init__()
        self.module = module
        self.use_reentrant = use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch_checkpoint(self.module, x, use_reentrant=self.use_reentrant)
        assert isinstance(out, torch.Tensor)
        return out


def batch() -> torch.Tensor:
    return torch.randn(8, 3, 6, 6, generator=torch.Generator().manual_seed(5), requires_grad=True)


def bn_of(model: nn.Module) -> nn.BatchNorm2d:
    return next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_torch_checkpoint_counts_a_batch_twice_on_backward(use_reentrant: bool) -> None:
    plain = conv_bn()
    theirs = TorchCheckpointed(copy.deepcopy(plain), use_reentrant)
    ours = checkpoint_wrapper(copy.deepcopy(plain))
    for model in (plain, theirs, ours):
        model(batch()).sum().backward()
    assert int(bn_of(plain).num_batches_tracked) == 1
    assert int(bn_of(theirs).num_batches_tracked) == 2  # the recomputation updated again
    assert not torch.equal(bn_of(theirs).running_mean, bn_of(plain).running_mean)
    assert int(bn_of(ours).num_batches_tracked) == 1
    assert torch.equal(bn_of(ours).running_mean, bn_of(plain).running_mean)
    assert torch.equal(bn_of(ours).running_var, bn_of(plain).running_var)


def test_fairscale_misses_forward_only_adaptation() -> None:
    fairscale_checkpoint = pytest.importorskip("fairscale.nn.checkpoint")
    plain = conv_bn()
    theirs = fairscale_checkpoint.checkpoint_wrapper(copy.deepcopy(plain))
    ours = checkpoint_wrapper(copy.deepcopy(plain))
    start = bn_of(plain).running_mean.clone()
    for model in (plain, theirs, ours):
        model.train()
        with torch.no_grad():
            model(batch())
    assert int(bn_of(plain).num_batches_tracked) == 1
    assert int(bn_of(theirs).num_batches_tracked) == 0  # the adaptation did nothing
    assert torch.equal(bn_of(theirs).running_mean, start)
    assert int(bn_of(ours).num_batches_tracked) == 1
    assert torch.equal(bn_of(ours).running_mean, bn_of(plain).running_mean)
