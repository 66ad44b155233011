"""bnadapt: BatchNorm adaptation, and activation checkpointing that keeps running statistics exact.

The public library lives in submodules, imported on demand so that ``import bnadapt`` costs
nothing: :mod:`bnadapt.checkpoint` (needs only torch and the standard library).
"""

__all__: list[str] = []
