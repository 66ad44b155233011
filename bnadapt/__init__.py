"""bnadapt: BatchNorm adaptation, and activation checkpointing that keeps running statistics exact.

The public library lives in submodules, imported on demand so that ``import bnadapt`` costs
nothing, each needing only torch and the standard library: :mod:`bnadapt.checkpoint` and
:mod:`bnadapt.sync_batchnorm` (a synchronized BatchNorm on any backend).
"""

__all__: list[str] = []
