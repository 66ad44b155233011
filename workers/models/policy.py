"""Applies a job's checkpoint policy (the contract's ``CheckpointPolicy``) to a model."""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase
from typing import Literal

from torch import nn

from workers.checkpoint import CheckpointWrapper, apply_checkpointing
from workers.errors import PolicyError
from workers.models.architectures import Architecture
from workers.models.modules import named_modules

__all__ = ["Preset", "apply_checkpoint_policy"]

Preset = Literal["none", "blocks"]

_NAMES_SHOWN = 20  # how many module names an error message lists


def _sample(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_NAMES_SHOWN])
    return shown + (f", ... ({len(names)} in all)" if len(names) > _NAMES_SHOWN else "")


def apply_checkpoint_policy(
    model: nn.Module,
    arch: Architecture,
    preset: Preset,
    modules: Sequence[str],
    types: Sequence[str],
    offload_to_cpu: bool,
) -> list[str]:
    """Wrap, in place, the modules the policy selects; returns their names.

    Selected: with ``preset="blocks"`` every instance of ``arch.block_types``; every module
    whose qualified name matches one of the fnmatch ``modules`` patterns (case-sensitive); every
    module whose class name is one of ``types``. The root is never wrapped, and a selected
    module inside another selected one is not wrapped again (it is checkpointed with it).
    """
    if preset not in ("none", "blocks"):
        raise PolicyError(f"unknown checkpoint preset {preset!r}; use 'none' or 'blocks'")
    candidates = [(name, module) for name, module in named_modules(model) if name]
    selected: set[nn.Module] = set()

    if preset == "blocks":
        if not arch.block_types:
            raise PolicyError(
                f"architecture {arch.name!r} names no blocks for the 'blocks' preset; use "
                "preset 'none' with `modules` patterns or `types` class names instead"
            )
        selected.update(m for _, m in candidates if isinstance(m, arch.block_types))

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
    return _wrapped_names(model, selected)


def _wrapped_names(model: nn.Module, selected: set[nn.Module]) -> list[str]:
    wrapped = {m.wrapped_module for m in model.modules() if isinstance(m, CheckpointWrapper)}
    return [name for name, m in named_modules(model) if m in wrapped and m in selected]
