"""CUDA paths of bnadapt/checkpoint.py; skipped without CUDA. Run on a GPU machine with
``pytest -m gpu``."""

from __future__ import annotations

import copy
import socket

import pytest
import torch
import torch._inductor.config
import torch.distributed as dist
from torch import nn

from bnadapt.checkpoint import apply_checkpointing
from tests.checkpoint.checkpoint_harness import assert_same
from tests.checkpoint.test_checkpoint_compile import (
    PREPARES,
    Prepare,
    assert_counts_exact,
    max_difference,
    run_steps,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def sync_bn_net() -> nn.Module:
    torch.manual_seed(0)
    blocks = [
        nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()) for _ in range(3)
    ]
    return nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(*blocks)).cuda()


def train_steps(model: nn.Module, dtype: torch.dtype | None) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(3)
    outs = []
    for _ in range(4):
        x = torch.randn(4, 8, 6, 6, device="cuda", generator=gen, requires_grad=True)
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            out = model(x)
        out.float().square().mean().backward()
        outs.append(out.detach())
    return outs


@pytest.fixture(autouse=True)
def deterministic_cudnn() -> object:
    # Bitwise comparisons need cuDNN to pick the same deterministic kernels in both runs.
    before = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before


@pytest.fixture
def nccl_group() -> object:
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("offload", [False, True])
def test_sync_batchnorm_with_nccl_updates_once(nccl_group: object, offload: bool) -> None:
    plain = sync_bn_net()
    wrapped = apply_checkpointing(
        copy.deepcopy(plain),
        check_fn=lambda m: isinstance(m, nn.Sequential),
        offload_to_cpu=offload,
    )
    assert_same(train_steps(plain, None), train_steps(wrapped, None))
    assert_same(dict(plain.state_dict()), dict(wrapped.state_dict()))
    counts = {
        int(m.num_batches_tracked) for m in wrapped.modules() if isinstance(m, nn.SyncBatchNorm)
    }
    assert counts == {4}


def test_bf16_autocast_on_cuda() -> None:
    plain = sync_bn_net()  # no process group: SyncBatchNorm acts as BatchNorm
    wrapped = apply_checkpointing(
        copy.deepcopy(plain), check_fn=lambda m: isinstance(m, nn.Sequential)
    )
    assert_same(train_steps(plain, torch.bfloat16), train_steps(wrapped, torch.bfloat16))
    assert_same(dict(plain.state_dict()), dict(wrapped.state_dict()))


@pytest.mark.parametrize("prepare", PREPARES)
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_wrapper_on_cuda(prepare: Prepare, backend: str) -> None:
    # Inductor without CUDA graphs (the default mode; CUDA graphs would replay stale buffer
    # writes across the comparison's separate models).
    with torch._inductor.config.patch({"triton.cudagraphs": False}):
        plain = run_steps(prepare, wrap=False, backend=backend, device="cuda")
        wrapped = run_steps(prepare, wrap=True, backend=backend, device="cuda")
        assert_counts_exact(plain, 3)
        assert_counts_exact(wrapped, 3)
        if backend == "inductor":
            eager = run_steps(prepare, wrap=False, backend="none", device="cuda")
            assert max_difference(plain, wrapped) <= max_difference(eager, plain)
        else:
            assert_same(plain, wrapped)
