"""Walking and handling a model's module tree, checkpoint wrappers included.

- :func:`named_modules` — like ``model.named_modules()``, with the names of ``state_dict``;
- :func:`training_flags` — puts every module's train/eval flag back on exit;
- :func:`model_device` — where a model's tensors live.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from bnadapt.checkpoint import CheckpointWrapper

__all__ = ["model_device", "named_modules", "training_flags"]


def named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Like ``model.named_modules()``, but a checkpoint wrapper stands for the module it
    wraps, under that module's name: names are those of ``state_dict`` whether or not the
    model is wrapped."""
    return _named_modules(model, "", set())


def _named_modules(
    module: nn.Module, name: str, seen: set[nn.Module]
) -> Iterator[tuple[str, nn.Module]]:
    while isinstance(module, CheckpointWrapper):
        module = module.wrapped_module
    if module in seen:  # shared modules are listed once, as torch does
        return
    seen.add(module)
    yield name, module
    for child_name, child in module.named_children():
        yield from _named_modules(child, f"{name}.{child_name}" if name else child_name, seen)


@contextmanager
def training_flags(model: nn.Module) -> Iterator[None]:
    """Restore every module's ``training`` flag on exit, exception or not (``model.train(b)``
    would set them all alike, losing a submodule kept in eval mode on purpose)."""
    flags = [(module, module.training) for module in model.modules()]
    try:
        yield
    finally:
        for module, training in flags:
            module.training = training


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer; the CPU if it has none."""
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    return torch.device("cpu") if first is None else first.device
