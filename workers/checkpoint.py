"""The checkpoint wrapper, under its historical import path.

The code lives in :mod:`bnadapt.checkpoint`, the standalone library module; this module only
re-exports it so that ``from workers.checkpoint import ...`` keeps working.
"""

from bnadapt.checkpoint import (
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    apply_checkpointing,
    checkpoint,
    checkpoint_wrapper,
    disable_checkpointing,
)

__all__ = [
    "CheckpointImpl",
    "CheckpointWrapper",
    "apply_activation_checkpointing",
    "apply_checkpointing",
    "checkpoint",
    "checkpoint_wrapper",
    "disable_checkpointing",
]
