"""The workers: torch, models, estimators, job running, sharding and the worker processes.

See docs/architecture.md for the map."""

import importlib
from typing import Any

__all__ = ["import_path"]


def import_path(path: str) -> Any:
    """The object a ``module:name`` path names, as the job-kind and estimator tables write
    their runners."""
    module, _, name = path.partition(":")
    if not module or not name:
        raise ValueError(f"not a module:name path: {path!r}")
    return getattr(importlib.import_module(module), name)
