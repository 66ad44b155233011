"""Applies a job's checkpoint policy (the contract's ``CheckpointPolicy``) to a model."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Literal

from torch import nn

from bnadapt.checkpoint import CheckpointWrapper, apply_checkpointing
from workers.errors import PolicyError
from workers.models.architectures import Architecture
from workers.models.modules import named_modules

__all__ = [
    "BlocksRule",
    "CheckpointOutcome",
    "Preset",
    "apply_checkpoint_policy",
    "checkpoint_model",
    "find_blocks",
]

Preset = Literal["none", "blocks"]
# Which step of NOTE [ The blocks rule ] found a model's blocks ("none": neither did).
BlocksRule = Literal["block_types", "repeated", "none"]

# NOTE [ The blocks rule ]
#
# The `blocks` preset wraps a model's repeated blocks, found in two steps:
# 1. the architecture's own block classes (`Architecture.block_types`): every instance of them
#    in the model. The built-ins name theirs; the zoo names each family's (torchvision's
#    BasicBlock/Bottleneck, InvertedResidual, MBConv/FusedMBConv, ResBottleneckBlock,
#    _DenseBlock, CNBlock, EncoderBlock, ...; timm's residual, efficientnet, ConvNeXt and ViT
#    blocks: workers/models/zoo.py);
# 2. where the model holds none of them, the structural rule: every child of an nn.Sequential
#    or nn.ModuleList (at any depth) whose class is shared by another child of that same
#    container, is not itself a plain container (Sequential, ModuleList, ModuleDict) and has
#    submodules and parameters: the stages of repeated residual, inverted-residual and
#    transformer blocks the zoo's families are built of. A Sequential of bare Conv2d layers
#    (VGG) has none. A module whose input is a list the caller changes after the call (a
#    DenseNet layer's, which is why DenseNet's blocks are its _DenseBlock) cannot be
#    checkpointed: its recomputation would not see the input of the forward.
# A block inside another selected block is checkpointed with it, not wrapped again. Where both
# steps find nothing the model runs without checkpointing, and the job's report says so
# (`checkpoint.note`): a default job never fails for its policy.
_PLAIN_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)

_NAMES_SHOWN = 20  # how many module names an error message lists


def _sample(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_NAMES_SHOWN])
    return shown + (f", ... ({len(names)} in all)" if len(names) > _NAMES_SHOWN else "")


def _unwrapped(module: nn.Module) -> nn.Module:
    while isinstance(module, CheckpointWrapper):
        module = module.wrapped_module
    return module


def _repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """Step 2 of NOTE [ The blocks rule ]."""
    found: list[nn.Module] = []
    for _, container in named_modules(model):
        if type(container) not in (nn.Sequential, nn.ModuleList):
            continue
        children = [
            child
            for child in map(_unwrapped, container.children())
            if not isinstance(child, _PLAIN_CONTAINERS)
            and next(child.children(), None) is not None
            and next(child.parameters(), None) is not None
        ]
        counts = Counter(type(child) for child in children)
        found.extend(child for child in children if counts[type(child)] > 1)
    return found


def find_blocks(model: nn.Module, arch: Architecture) -> tuple[list[nn.Module], BlocksRule]:
    """The modules the ``blocks`` preset selects and the step of NOTE [ The blocks rule ]
    that found them."""
    if arch.block_types:
        typed = [m for name, m in named_modules(model) if name and isinstance(m, arch.block_types)]
        if typed:
            return typed, "block_types"
    repeated = _repeated_blocks(model)
    return repeated, "repeated" if repeated else "none"


@dataclass(frozen=True)
class CheckpointOutcome:
    """What a policy wrapped: the modules' names and, for the ``blocks`` preset, how its
    blocks were found (None for ``none``)."""

    wrapped: list[str]
    blocks_rule: BlocksRule | None

    @property
    def note(self) -> str | None:
        """Said in the job's report when the blocks preset found nothing to wrap."""
        if self.blocks_rule != "none":
            return None
        return (
            "the 'blocks' preset found no repeated blocks in this model (NOTE [ The blocks "
            "rule ]): it ran without checkpointing those"
            + ("" if not self.wrapped else ", with the modules and types the policy named")
            + "; name modules by `modules` patterns or `types` to checkpoint them"
        )


def apply_checkpoint_policy(
    model: nn.Module,
    arch: Architecture,
    preset: Preset,
    modules: Sequence[str],
    types: Sequence[str],
    offload_to_cpu: bool,
) -> list[str]:
    """Wrap, in place, the modules the policy selects; returns their names
    (:func:`checkpoint_model` also says how the blocks were found)."""
    return checkpoint_model(model, arch, preset, modules, types, offload_to_cpu).wrapped


def checkpoint_model(
    model: nn.Module,
    arch: Architecture,
    preset: Preset,
    modules: Sequence[str],
    types: Sequence[str],
    offload_to_cpu: bool,
) -> CheckpointOutcome:
    """Wrap, in place, the modules the policy selects.

    Selected: with ``preset="blocks"`` the blocks of NOTE [ The blocks rule ]; every module
    whose qualified name matches one of the fnmatch ``modules`` patterns (case-sensitive); every
    module whose class name is one of ``types``. The root is never wrapped, and a selected
    module inside another selected one is not wrapped again (it is checkpointed with it).
    """
    if preset not in ("none", "blocks"):
        raise PolicyError(f"unknown checkpoint preset {preset!r}; use 'none' or 'blocks'")
    candidates = [(name, module) for name, module in named_modules(model) if name]
    selected: set[nn.Module] = set()

    rule: BlocksRule | None = None
    if preset == "blocks":
        blocks, rule = find_blocks(model, arch)
        selected.update(blocks)

    for pattern in modules:
        matched = [m for name, m in candidates if fnmatchcase(name, pattern)]
        if not matched:
            raise PolicyError(
                f"checkpoint pattern {pattern!r} matches no module of {arch.name!r}; its "
                f"modules are: {_sample([name for name, _ in candidates])}"
            )
        selected.update(matched)

    present = sorted({type(m).__name__ for _, m in candidates})
    unknown = sorted(set(types) - set(present))
    if unknown:
        raise PolicyError(
            f"checkpoint types {unknown} name no module class of {arch.name!r}; its classes "
            f"are: {', '.join(present)}"
        )
    selected.update(m for _, m in candidates if type(m).__name__ in types)

    apply_checkpointing(model, check_fn=lambda m: m in selected, offload_to_cpu=offload_to_cpu)
    return CheckpointOutcome(_wrapped_names(model, selected), rule)


def _wrapped_names(model: nn.Module, selected: set[nn.Module]) -> list[str]:
    wrapped = {m.wrapped_module for m in model.modules() if isinstance(m, CheckpointWrapper)}
    return [name for name, m in named_modules(model) if m in wrapped and m in selected]
