"""bnadapt's SyncBatchNorm (bnadapt/sync_batchnorm.py, NOTE [ Synchronized statistics ]).

With 2 gloo processes on the CPU (spawned once for the module: tests/checkpoint/sync_ranks.py
holds what each rank runs), each rank on its slice of one global batch, equal or not, one of
them empty: outputs, input gradients, parameter gradients summed over the ranks and running
statistics equal those of one nn.BatchNorm on the whole global batch within 1e-5, the
tolerance the issue gives (the reduction order is the only difference). Under bnadapt's
checkpoint wrapper (blocks, the whole model, one module called twice, nested wrappers,
retain_graph, a plain function, a hooked or untracked BatchNorm, DDP) the wrapper's guarantee
holds bitwise on every rank, with as many collectives each step as the unwrapped model: the
recomputation reuses the first forward's statistics (NOTE [ Values kept for the
recomputation ] in bnadapt/checkpoint.py). A group of one rank, and no process group, is
nn.BatchNorm bitwise. On CUDA (marker gpu) the same checks run with NCCL where there are two
GPUs (gloo on one GPU otherwise), plus a comparison with torch's own nn.SyncBatchNorm.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import bnadapt.checkpoint
from bnadapt.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from tests.checkpoint.checkpoint_harness import assert_same, assert_same_model
from tests.checkpoint.sync_ranks import (
    CHECKS,
    CUDA_CHECKS,
    assert_same_forward_backward,
    spawn_ranks,
)


@pytest.fixture(scope="module")
def gloo_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, str | None]]:
    return spawn_ranks(tmp_path_factory.mktemp("sync-ranks"), "cpu", "gloo")


def assert_passed(failures: list[dict[str, str | None]], check: str) -> None:
    for rank, failed in enumerate(failures):
        assert check in failed, f"rank {rank} did not run {check}"
        assert failed[check] is None, f"rank {rank}, {check}:\n{failed[check]}"


@pytest.mark.parametrize("check", list(CHECKS))
def test_two_gloo_ranks(gloo_ranks: list[dict[str, str | None]], check: str) -> None:
    assert_passed(gloo_ranks, check)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_ranks_on_cuda(tmp_path: Path) -> None:
    """NCCL over two GPUs, or gloo with both ranks on the one GPU there is: the same checks
    (collectives counted, checkpointed == unwrapped) and torch's nn.SyncBatchNorm's results."""
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    failures = spawn_ranks(tmp_path, "cuda", backend)
    for check in CUDA_CHECKS:
        assert_passed(failures, check)


# -- In one process, without a process group ----------------------------------------------


@pytest.mark.parametrize(
    ("shape", "norm"),
    [((6, 3), nn.BatchNorm1d), ((4, 3, 5), nn.BatchNorm1d), ((4, 3, 5, 5), nn.BatchNorm2d)],
)
@pytest.mark.parametrize("momentum", [0.1, None])
def test_without_a_process_group_it_is_batchnorm_bitwise(
    shape: tuple[int, ...], norm: type[nn.Module], momentum: float | None
) -> None:
    assert not torch.distributed.is_initialized()
    reference = norm(3, momentum=momentum)
    sync = convert_sync_batchnorm(copy.deepcopy(reference))
    assert isinstance(sync, SyncBatchNorm)
    gen = torch.Generator().manual_seed(2)
    for training in (True, True, False, True):
        reference.train(training)
        sync.train(training)
        assert_same_forward_backward(reference, sync, torch.randn(shape, generator=gen))
    assert_same_model(reference, sync)


def test_state_dict_is_batchnorms_and_loads_both_ways() -> None:
    reference = nn.BatchNorm2d(5)
    with torch.no_grad():
        reference.running_mean.uniform_()  # type: ignore[union-attr]
        reference.weight.uniform_()
    sync = SyncBatchNorm(5)
    sync.load_state_dict(reference.state_dict(), strict=True)
    assert_same(dict(reference.state_dict()), dict(sync.state_dict()))
    back = nn.BatchNorm2d(5)
    back.load_state_dict(sync.state_dict(), strict=True)
    assert_same(dict(back.state_dict()), dict(sync.state_dict()))


def test_conversion_shares_the_layers_tensors_and_leaves_the_rest() -> None:
    bn = nn.BatchNorm2d(4, momentum=None, eps=1e-3).eval()
    torch_sync = nn.SyncBatchNorm(4)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), bn, nn.Sequential(torch_sync, nn.ReLU()))
    converted = convert_sync_batchnorm(model)
    assert converted is model
    new = model[1]
    assert isinstance(new, SyncBatchNorm) and isinstance(model[2][0], SyncBatchNorm)
    assert not new.training and new.momentum is None and new.eps == 1e-3
    assert new.weight is bn.weight and new.bias is bn.bias
    assert new.running_mean is bn.running_mean and new.num_batches_tracked is bn.num_batches_tracked
    assert isinstance(model[0], nn.Conv2d) and isinstance(model[2][1], nn.ReLU)
    # A layer itself comes back converted; one converted already stays as it is.
    assert isinstance(convert_sync_batchnorm(nn.BatchNorm1d(3)), SyncBatchNorm)
    assert convert_sync_batchnorm(new) is new


class BatchNormAct(nn.BatchNorm2d):
    """timm's BatchNormAct2d in small: BatchNorm with an activation in its forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(super().forward(x))


def test_conversion_refuses_what_it_would_change() -> None:
    with pytest.raises(TypeError, match=r"0\.0 \(BatchNormAct\).*forward is its own"):
        convert_sync_batchnorm(nn.Sequential(nn.Sequential(BatchNormAct(3))))
    with pytest.raises(ValueError, match="run one forward first"):
        convert_sync_batchnorm(nn.LazyBatchNorm2d())


def test_input_of_one_dimension_is_refused() -> None:
    with pytest.raises(ValueError, match=r"at least 2 dimensions, got 1D of shape \(4,\)"):
        SyncBatchNorm(4)(torch.randn(4))


def test_the_wrapper_gives_it_scratch_and_notes_that_it_keeps_values() -> None:
    """NOTE [ BatchNorm in train mode ] and NOTE [ Values kept for the recomputation ]: in
    train mode bnadapt's SyncBatchNorm gets scratch buffers (no copies) and makes the call keep
    values; a call of torch's BatchNorm alone keeps nothing, and enters no context for it."""
    model = nn.Sequential(nn.Conv2d(3, 4, 1), SyncBatchNorm(4))
    state = bnadapt.checkpoint._CallState(model)
    state.contexts()
    records = {module: record for module, _, _, record in state.records}
    assert records[model[1]] is not None and records[model[1]].scratch is not None
    assert state.values == [] and state.keeps
    plain = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4))
    state = bnadapt.checkpoint._CallState(plain)
    forward, _ = state.contexts()
    assert not state.keeps and forward is bnadapt.checkpoint._NOTHING
