"""Weights as people hold them, renamed to the architecture's own ``state_dict`` keys.

# NOTE [ Renaming weight keys ]
Uploaded weights are checked against the architecture's ``state_dict`` by the inspector
(workers/processes/inspector.py). Keys that do not match as they are get renamed, in this
order, and only where the result is the architecture's key set:
1. **Prefixes on every key**: ``module.`` (``DataParallel``/``DistributedDataParallel``) and
   ``_orig_mod.`` (``torch.compile``), in any combination and nesting, outermost first; a
   prefix is stripped only when every key has it.
2. **A library's older layout**, by name: torchvision's DenseNet checkpoints name
   ``denselayerN.norm.1.weight`` what the model calls ``denselayerN.norm1.weight`` (the rule
   torchvision applies itself when it loads them).
3. **timm's own conversion** (it needs the tensors, so it runs on the loaded state): the
   ``checkpoint_filter_fn`` of the model's timm module, which timm applies to the original
   repositories' weights (a ViT's or a ResNet's of its paper) before loading them.
The stored weights are then written again as safetensors with the canonical keys (a new
object: the model record points at it, the upload is collected), and the record says what was
renamed (``ModelPublic.renamed_keys``).
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import torch

__all__ = ["KeyRenaming", "canonical_names", "timm_conversion"]

log = logging.getLogger(__name__)

PREFIXES: Final = ("module.", "_orig_mod.")
_DENSENET: Final = re.compile(
    r"^(.*denselayer\d+\.(?:norm|relu|conv))\.((?:[12])\.(?:weight|bias|running_mean|running_var))$"
)


@dataclass(frozen=True)
class KeyRenaming:
    """What renamed the keys (the contract's ``RenamedKeys``) and, for renames by name, the
    file key -> model key of every key."""

    count: int  # keys whose name changed
    stripped_prefixes: list[str] = field(default_factory=list)
    layout: str | None = None
    names: dict[str, str] = field(default_factory=dict)

    def public(self) -> dict[str, Any]:
        return {
            "stripped_prefixes": self.stripped_prefixes,
            "layout": self.layout,
            "count": self.count,
        }


def _strip_prefixes(keys: list[str]) -> tuple[list[str], list[str]]:
    stripped: list[str] = []
    while keys:
        prefix = next((p for p in PREFIXES if all(k.startswith(p) for k in keys)), None)
        if prefix is None:
            break
        stripped.append(prefix)
        keys = [k.removeprefix(prefix) for k in keys]
    return keys, stripped


def canonical_names(
    found: Iterable[str], expected: Collection[str], architecture: str
) -> KeyRenaming | None:
    """How to rename ``found`` keys to ``expected`` by name alone (NOTE [ Renaming weight
    keys ], steps 1 and 2): None when they match already, or when no rename makes them match
    (the caller then reports the keys as they are, or tries timm's conversion)."""
    original = list(found)
    wanted = set(expected)
    if set(original) == wanted:
        return None
    keys, stripped = _strip_prefixes(original)
    layout = None
    if set(keys) != wanted and architecture.startswith("torchvision.densenet"):
        converted = [_DENSENET.sub(r"\1\2", k) for k in keys]
        if converted != keys:
            keys, layout = converted, "torchvision densenet (norm.1 -> norm1)"
    if set(keys) != wanted or len(keys) != len(set(keys)):
        return None
    names = dict(zip(original, keys, strict=True))
    count = sum(old != new for old, new in names.items())
    return KeyRenaming(count, stripped, layout, names)


def timm_conversion(
    state: Mapping[str, torch.Tensor], architecture: str, kwargs: Mapping[str, Any]
) -> tuple[dict[str, torch.Tensor], KeyRenaming] | None:
    """``state`` converted by timm's ``checkpoint_filter_fn`` for the model's family (NOTE [
    Renaming weight keys ], step 3), prefixes stripped first; None when the architecture is not
    timm's or its family has no conversion. The caller checks the result like any upload."""
    library, _, name = architecture.partition(".")
    if library != "timm":
        return None
    try:
        timm = importlib.import_module("timm")
        registry = importlib.import_module("timm.models")
        module = importlib.import_module(registry.model_entrypoint(name).__module__)
        convert = getattr(module, "checkpoint_filter_fn", None)
        if convert is None:
            return None
        keys, stripped = _strip_prefixes(list(state))
        stripped_state = dict(zip(keys, state.values(), strict=True))
        with torch.device("meta"):
            model = timm.create_model(name, pretrained=False, **kwargs)
        converted: dict[str, torch.Tensor] = convert(stripped_state, model)
    except Exception as exc:  # noqa: BLE001 - weights the conversion does not expect: no rename
        log.info("timm's conversion does not apply to these weights of %s: %r", architecture, exc)
        return None
    if set(converted) == set(stripped_state) and not stripped:
        return None  # the conversion changed no name: nothing to report
    # Keys of the model the upload did not name as they are: renamed (or made) by the
    # conversion or the stripping.
    count = len(set(converted) - set(state))
    layout = f"timm {module.__name__}.checkpoint_filter_fn"
    return converted, KeyRenaming(count, stripped, layout)
