"""A PyTorch ``.pth``/``.pt`` weights file converted to safetensors on the user's machine,
before it is uploaded: the service accepts safetensors only and never unpickles.

The file is read with ``torch.load(weights_only=True)`` (tensors and plain containers only;
a pickled model object or anything else that would run code is refused by torch). It may be
a ``state_dict`` or a training checkpoint that wraps one under ``"state_dict"``, ``"model"``,
``"state_dict_ema"`` or ``"model_ema"`` (the first of these that holds tensors). The keys are
sent as they are: the server renames ``module.``/``_orig_mod.`` prefixes and the libraries'
layouts to the architecture's own (NOTE [ Renaming weight keys ] in
workers/models/weight_keys.py) and says so in the model record.

torch is imported only here, only when a ``.pth`` file is converted (the one exception to "the
service never imports torch", declared in pyproject.toml's import contract): the CLI and the
client work without it for everything else, and the API never imports this module.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from service.errors import WeightsFileError

__all__ = ["PTH_SUFFIXES", "pth_to_safetensors"]

PTH_SUFFIXES: Final = frozenset({".pth", ".pt", ".bin", ".ckpt"})
_WRAPPERS: Final = ("state_dict", "model", "state_dict_ema", "model_ema")


def _state_dict(loaded: object, path: Path) -> Mapping[str, Any]:
    if isinstance(loaded, Mapping):
        for name in _WRAPPERS:
            inner = loaded.get(name)
            if isinstance(inner, Mapping) and inner:
                return inner
        return loaded
    raise WeightsFileError(
        f"{path} holds a {type(loaded).__name__}, not a state_dict; save the weights with "
        "torch.save(model.state_dict(), path)"
    )


def pth_to_safetensors(path: Path) -> bytes:
    """The state_dict in ``path`` as safetensors bytes; ``WeightsFileError`` saying what to
    do when torch is missing or the file holds no state_dict of tensors."""
    try:
        import safetensors.torch
        import torch
    except ImportError as exc:
        raise WeightsFileError(
            f"converting {path.name} to safetensors needs torch on this machine ({exc}); "
            "install it (pip install torch), or convert the file where torch is: "
            "safetensors.torch.save_file(torch.load(path, weights_only=True), 'model.safetensors')"
        ) from exc
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch's UnpicklingError, a truncated zip, ...: all the user's file
        raise WeightsFileError(
            f"{path} could not be read with torch.load(weights_only=True) ({exc}); it must hold "
            "a state_dict of tensors (torch.save(model.state_dict(), path)), not a pickled model"
        ) from exc
    state = _state_dict(loaded, path)
    not_tensors = [str(k) for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if not_tensors:
        raise WeightsFileError(
            f"{path} holds entries that are not tensors: {', '.join(not_tensors[:10])}; save "
            "the model's state_dict alone"
        )
    # Clones: safetensors refuses tensors that share memory (tied weights, views).
    tensors = {str(k): v.detach().clone().contiguous() for k, v in state.items()}
    return safetensors.torch.save(tensors)
