"""What each rank runs for tests/checkpoint/test_sync_batchnorm.py: checks of bnadapt's
SyncBatchNorm in a real process group of 2 ranks, spawned by :func:`spawn_ranks`.

Every check runs on both ranks; each rank takes its slice of one global batch that both draw
from the same seed, and asserts about itself only after the check's last collective, so a
failing assertion never leaves the other rank waiting. A check's failures come back per rank
(a JSON file each); any other error ends the spawn with its traceback.

Collectives are counted by the process group's own sequence number, which every collective on
the group advances, whichever function issued it: a recomputation that all-reduced again, or
issued any other collective, would show.
"""

from __future__ import annotations

import copy
import datetime
import functools
import json
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from bnadapt.checkpoint import apply_checkpointing, checkpoint, checkpoint_wrapper
from bnadapt.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from tests.checkpoint.checkpoint_harness import assert_same, assert_same_model

WORLD_SIZE = 2
# The ranks fail rather than hang if one of them stops joining the collectives.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
# The tolerance: N ranks against one process differ only by their reduction order.
ATOL = 1e-5


@dataclass(frozen=True)
class Rank:
    rank: int
    device: torch.device

    def take(self, sizes: tuple[int, ...]) -> slice:
        """This rank's slice of a global batch dealt out ``sizes`` (one size a rank)."""
        start = sum(sizes[: self.rank])
        return slice(start, start + sizes[self.rank])


def collectives() -> int:
    """How many collectives the default process group has run so far."""
    group = dist.group.WORLD
    assert group is not None
    return int(group._get_sequence_number_for_group())


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=ATOL, msg=lambda m: f"{what}: {m}")


# -- SyncBatchNorm on slices against BatchNorm on the global batch -------------------------


def matches_batchnorm(
    me: Rank, features: tuple[int, ...], sizes: tuple[int, ...], momentum: float | None
) -> None:
    """Three train steps of each rank's slice through SyncBatchNorm against nn.BatchNorm on
    the whole global batch, then eval: outputs, input gradients, parameter gradients summed
    over the ranks, running statistics and num_batches_tracked, within ATOL."""
    norm = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}
    shape = (sum(sizes), *features)
    gen = torch.Generator().manual_seed(11)
    reference = norm[len(shape)](features[0], momentum=momentum)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5, generator=gen)
        reference.bias.uniform_(-1, 1, generator=gen)
    sync = convert_sync_batchnorm(copy.deepcopy(reference)).to(me.device)
    reference.to(me.device)
    assert isinstance(sync, SyncBatchNorm)
    mine = me.take(sizes)
    pairs: list[tuple[torch.Tensor, torch.Tensor, str]] = []
    local_differs = False
    for step in range(3):
        x = (torch.randn(shape, generator=gen) * 2 + 1).to(me.device)
        dy = torch.randn(shape, generator=gen).to(me.device)
        whole = x.clone().requires_grad_()
        out = reference(whole)
        out.backward(dy)
        part = x[mine].clone().requires_grad_()
        synced = sync(part)
        synced.backward(dy[mine])
        pairs += [
            (synced, out[mine].detach(), f"output, step {step}"),
            (part.grad, whole.grad[mine], f"input gradient, step {step}"),  # type: ignore[index]
        ]
        # The test can tell: a rank's slice normalised by its own statistics differs.
        alone = nn.functional.batch_norm(
            part.detach(), None, None, sync.weight, sync.bias, training=True
        )
        local_differs |= not torch.allclose(alone, synced.detach(), rtol=0, atol=1e-3)
    grads = torch.cat([sync.weight.grad, sync.bias.grad])  # type: ignore[list-item]
    dist.all_reduce(grads)  # each rank's is its slice's: their sum is the global batch's
    sync.eval()
    reference.eval()
    x = (torch.randn(shape, generator=gen) * 2 + 1).to(me.device)
    pairs.append((sync(x[mine]), reference(x)[mine], "eval output"))
    # Asserts only now, every collective of the check done.
    for actual, expected, what in pairs:
        assert actual is not None
        close(actual.detach(), expected, what)
    assert reference.weight.grad is not None and reference.bias.grad is not None
    close(grads, torch.cat([reference.weight.grad, reference.bias.grad]), "weight and bias grad")
    close(sync.running_mean, reference.running_mean, "running_mean")  # type: ignore[arg-type]
    close(sync.running_var, reference.running_var, "running_var")  # type: ignore[arg-type]
    assert torch.equal(sync.num_batches_tracked, reference.num_batches_tracked)  # type: ignore[arg-type]
    if 1 < sizes[me.rank] < sum(sizes):
        assert local_differs, "the slice alone normalises as the global batch: a weak test"


def assert_same_forward_backward(reference: nn.Module, other: nn.Module, x: torch.Tensor) -> None:
    """The two modules' outputs on ``x`` and the gradients they send back to it, the same."""
    outs = []
    for module in (reference, other):
        fresh = x.clone().requires_grad_()
        out = module(fresh)
        out.square().sum().backward()
        outs.append((out, fresh.grad))
    assert_same(outs[0], outs[1])


def one_rank_groups_are_batchnorm(me: Rank) -> None:
    """A process group of one rank (each rank its own): nn.BatchNorm2d bitwise, and no
    collective on that group."""
    groups = [dist.new_group([rank]) for rank in range(WORLD_SIZE)]  # every rank makes each
    own = groups[me.rank]
    assert own is not None
    gen = torch.Generator().manual_seed(5)
    reference = nn.BatchNorm2d(3, momentum=None).to(me.device)
    sync = convert_sync_batchnorm(copy.deepcopy(reference), process_group=own)
    before = own._get_sequence_number_for_group()
    for _ in range(3):
        x = torch.randn(4, 3, 5, 5, generator=gen).to(me.device)
        assert_same_forward_backward(reference, sync, x)
    assert own._get_sequence_number_for_group() == before
    assert_same_model(reference, sync)


# -- Checkpointed against unwrapped: bitwise, and as many collectives ----------------------


def block(channels: int = 4) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU()
    )


def is_block(module: nn.Module) -> bool:
    return isinstance(module, nn.Sequential) and len(module) == 3


class Twice(nn.Module):
    """One block called twice in a forward: its SyncBatchNorm's two calls keep two sets of
    statistics, which the recomputation must take back in order."""

    def __init__(self) -> None:
        super().__init__()
        self.block = block()
        self.head = nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.block(self.block(x)))
        return out


def blocks(n: int = 3) -> nn.Module:
    return nn.Sequential(*(block() for _ in range(n)))


def hooked() -> nn.Module:
    """A BatchNorm with a forward hook of its own: the wrapper records and copies its buffers
    (no scratch), and must still see that it keeps its statistics."""
    model = convert_sync_batchnorm(blocks(2))  # the conversion keeps no hooks: hook after it
    model[0][1].register_forward_hook(lambda module, args, out: None)
    return model


def untracked() -> nn.Module:
    model = blocks(1)
    model[0][1] = nn.BatchNorm2d(4, track_running_stats=False)
    return model


def one_in_eval() -> nn.Module:
    model = blocks(2)
    model[0][1].eval()
    return model


def wrap_blocks(model: nn.Module) -> nn.Module:
    return apply_checkpointing(model, check_fn=is_block)


def wrap_nested(model: nn.Module) -> nn.Module:
    """A wrapped block inside a wrapped Sequential of blocks."""
    model[0] = checkpoint_wrapper(model[0])
    return checkpoint_wrapper(model)


class Function(nn.Module):
    """``model`` through bnadapt's ``checkpoint`` of a plain function (no root module: the
    modules are recorded as the function reaches them)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(functools.partial(_call, self.model), x)
        return out


def _call(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = model(x)
    return out


def ddp(model: nn.Module, me: Rank) -> nn.Module:
    ids = [me.device.index] if me.device.type == "cuda" else None
    return DistributedDataParallel(model.to(me.device), device_ids=ids)


@dataclass(frozen=True)
class Scenario:
    build: Callable[[], nn.Module]
    wrap: Callable[[nn.Module], nn.Module]
    backwards: int = 1  # more: retain_graph, every backward recomputes
    ddp: bool = False


SCENARIOS: dict[str, Scenario] = {
    "blocks": Scenario(blocks, wrap_blocks),
    "whole_model": Scenario(blocks, checkpoint_wrapper),
    "called_twice": Scenario(Twice, checkpoint_wrapper),
    "nested": Scenario(blocks, wrap_nested),
    "retain_graph": Scenario(blocks, wrap_blocks, backwards=3),
    "function": Scenario(blocks, Function),
    "hooked": Scenario(hooked, wrap_blocks),
    "untracked": Scenario(untracked, wrap_blocks),
    "one_in_eval": Scenario(one_in_eval, wrap_blocks),
    "ddp": Scenario(blocks, wrap_blocks, ddp=True),
}

STEPS = 2


def run_steps(
    model: nn.Module, me: Rank, backwards: int = 1
) -> tuple[list[Any], list[tuple[int, int]]]:
    """STEPS steps of this rank's slices (unequal: 5 and 3) through ``model``, each
    ``backwards`` times backward (retain_graph but the last): their outputs and input
    gradients, and each step's collectives (forward, backward)."""
    gen = torch.Generator().manual_seed(3)
    mine = me.take((5, 3))
    results: list[Any] = []
    counts = []
    for _ in range(STEPS):
        x = torch.randn(8, 4, 6, 6, generator=gen)[mine].to(me.device).requires_grad_()
        dy = torch.randn(8, 4, 6, 6, generator=gen)[mine].to(me.device)
        first = collectives()
        out = model(x)
        forward = collectives() - first
        for i in range(backwards):
            out.backward(dy, retain_graph=i + 1 < backwards)
        counts.append((forward, collectives() - first - forward))
        results.append((out.detach(), x.grad))
    return results, counts


def checkpointed_equals_unwrapped(me: Rank, scenario: Scenario) -> None:
    """The wrapper's guarantee on this rank (outputs, gradients and state_dict bitwise those of
    the unwrapped model), with exactly the unwrapped model's collectives each step: the
    recomputation reuses the first forward's statistics instead of all-reducing again."""
    torch.manual_seed(0)
    plain = convert_sync_batchnorm(scenario.build()).to(me.device)
    wrapped = scenario.wrap(copy.deepcopy(plain))
    syncs = sum(isinstance(m, SyncBatchNorm) for m in plain.modules())
    plain_run = ddp(plain, me) if scenario.ddp else plain
    wrapped_run = ddp(wrapped, me) if scenario.ddp else wrapped
    plain_results, plain_counts = run_steps(plain_run, me, scenario.backwards)
    wrapped_results, wrapped_counts = run_steps(wrapped_run, me, scenario.backwards)
    if isinstance(wrapped, Function):
        wrapped = wrapped.model
    assert syncs > 0
    assert wrapped_counts == plain_counts, (
        f"collectives a step (forward, backward): wrapped {wrapped_counts}, unwrapped "
        f"{plain_counts}"
    )
    assert all(forward > 0 for forward, _ in plain_counts)
    assert_same(plain_results, wrapped_results)
    assert_same_model(plain, wrapped)


# -- The same against torch's nn.SyncBatchNorm (CUDA only: torch's refuses CPU tensors) -------


def matches_torch_sync_batchnorm(me: Rank) -> None:
    """bnadapt's SyncBatchNorm against torch's over the same group and slices (unequal):
    outputs, input and parameter gradients, running statistics, within ATOL."""
    torch.manual_seed(0)
    ours = convert_sync_batchnorm(blocks(2)).to(me.device)
    theirs = nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ours))  # type: ignore[no-untyped-call]
    assert not any(isinstance(m, SyncBatchNorm) for m in theirs.modules())
    plain_results, _ = run_steps(theirs, me)
    our_results, _ = run_steps(ours, me)
    for (a_out, a_grad), (b_out, b_grad) in zip(plain_results, our_results, strict=True):
        close(b_out, a_out, "output")
        close(b_grad, a_grad, "input gradient")
    for (name, a), b in zip(theirs.state_dict().items(), ours.state_dict().values(), strict=True):
        close(b.float(), a.float(), name)
    for (name, a), b in zip(theirs.named_parameters(), ours.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        close(b.grad, a.grad, f"{name}.grad")


# -- The registry of checks, and the spawned ranks ----------------------------------------

Check = Callable[[Rank], None]

CHECKS: dict[str, Check] = {
    "batchnorm_2d_equal_slices": functools.partial(
        matches_batchnorm, features=(3,), sizes=(4, 4), momentum=0.1
    ),
    "batchnorm_3d_unequal_slices": functools.partial(
        matches_batchnorm, features=(3, 5), sizes=(5, 2), momentum=0.1
    ),
    "batchnorm_4d_unequal_slices": functools.partial(
        matches_batchnorm, features=(4, 3, 3), sizes=(5, 3), momentum=0.1
    ),
    "batchnorm_cumulative_average": functools.partial(
        matches_batchnorm, features=(4, 3, 3), sizes=(3, 5), momentum=None
    ),
    "batchnorm_one_rank_empty": functools.partial(
        matches_batchnorm, features=(4, 3, 3), sizes=(6, 0), momentum=0.1
    ),
    "one_rank_groups_are_batchnorm": one_rank_groups_are_batchnorm,
    **{
        f"checkpointed_{name}": functools.partial(checkpointed_equals_unwrapped, scenario=s)
        for name, s in SCENARIOS.items()
    },
}
CUDA_CHECKS: dict[str, Check] = {
    **CHECKS,
    "matches_torch_sync_batchnorm": matches_torch_sync_batchnorm,
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _rank_main(rank: int, port: int, device_type: str, backend: str, out: str) -> None:
    """One spawned rank: joins the group, runs every check of its device, writes what failed."""
    if device_type == "cuda":
        # One GPU a rank where there are two (NCCL needs it); else both on the first (gloo).
        index = rank if torch.cuda.device_count() >= WORLD_SIZE else 0
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
        # Bitwise comparisons need cuDNN to pick the same deterministic kernels each time.
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=COLLECTIVE_TIMEOUT,
    )
    try:
        me = Rank(rank, device)
        failures: dict[str, str | None] = {}
        for name, check in (CUDA_CHECKS if device_type == "cuda" else CHECKS).items():
            try:
                check(me)
                failures[name] = None
            except AssertionError:
                failures[name] = traceback.format_exc()
        Path(out, f"rank{rank}.json").write_text(json.dumps(failures))
    finally:
        dist.destroy_process_group()


def spawn_ranks(out: Path, device_type: str, backend: str) -> list[dict[str, str | None]]:
    """Runs the checks of ``device_type`` in 2 spawned ranks; each rank's failures by check
    (None: passed)."""
    mp.spawn(_rank_main, args=(free_port(), device_type, backend, str(out)), nprocs=WORLD_SIZE)
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
