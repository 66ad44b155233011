"""A PyTorch ``.pth``/``.pt`` weights file converted to safetensors on the user's machine,
before it is uploaded: the service accepts safetensors only and never unpickles.

The file is read with ``torch.load(weights_only=True)`` (tensors and plain containers only;
a pickled model object or anything else that would run code is refused by torch), and only
by a torch that keeps that promise (NOTE [ The torch that may unpickle ]). It may be
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

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from service.errors import WeightsFileError

__all__ = ["MIN_SAFE_TORCH", "PTH_SUFFIXES", "check_torch_version", "pth_to_safetensors"]

PTH_SUFFIXES: Final = frozenset({".pth", ".pt", ".bin", ".ckpt"})
_WRAPPERS: Final = ("state_dict", "model", "state_dict_ema", "model_ema")

# NOTE [ The torch that may unpickle ]
# ``weights_only=True`` is torch's own restricted unpickler, and it has had holes that let a
# crafted file run code anyway: CVE-2025-32434 (torch <= 2.5.1) and CVE-2026-24747 (torch
# <= 2.9.1). A ``.pth`` file is a user's file from anywhere, so it is unpickled only by a torch
# at or past the release that closed the last known one, 2.10.0 (what the ``worker`` extra
# requires too, pyproject.toml); an older torch is refused before ``torch.load`` is called,
# with the versions found and required. A pre-release of 2.10.0 (``2.10.0a0``, a nightly) is
# older than 2.10.0 here. The explicit ``weights_only=True`` also keeps
# ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` from turning the restriction off: torch lets that
# variable override only a call that did not say.
MIN_SAFE_TORCH: Final = (2, 10, 0)
_RELEASE: Final = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?(.*)")


def check_torch_version(found: str) -> None:
    """Raises ``WeightsFileError`` unless torch ``found`` (``torch.__version__``, as
    ``2.13.0+cu130``) may unpickle a user's file (NOTE [ The torch that may unpickle ])."""
    required = ".".join(map(str, MIN_SAFE_TORCH))
    match = _RELEASE.fullmatch(found.strip())
    release: tuple[int, int, int] | None = None
    if match is not None:
        release = (int(match[1]), int(match[2]), int(match[3] or 0))
        # A local label (+cpu) is the same release; anything else (a0, rc1, .dev2024) is
        # before it.
        if match[4] and not match[4].startswith("+") and release == MIN_SAFE_TORCH:
            release = None
    if release is None or release < MIN_SAFE_TORCH:
        raise WeightsFileError(
            f"converting a .pth file needs torch >= {required}, found torch {found}: older "
            "releases can run code hidden in a file even with torch.load(weights_only=True) "
            f"(CVE-2025-32434, CVE-2026-24747); upgrade torch (pip install 'torch>={required}'), "
            "or convert the file to safetensors where such a torch is installed"
        )


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
    check_torch_version(str(torch.__version__))
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
