"""Weights files: safetensors only (a pickle can run code), read from the header alone."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Final

from safetensors import SafetensorError, safe_open

from service.errors import WeightsFileError
from service.formats.sniff import check_safetensors_header, safetensors_specs, sniff, what_it_is

__all__ = [
    "DEFAULT_MAX_WEIGHTS_HEADER_BYTES",
    "DEFAULT_MAX_WEIGHT_KEYS",
    "WeightSpec",
    "read_weights_header",
]

DEFAULT_MAX_WEIGHT_KEYS: Final = 100_000
# Parsing a header costs time and memory in proportion to its size, so its size is bounded
# before it is read; 16 MiB leaves ~160 bytes per key at the key limit.
DEFAULT_MAX_WEIGHTS_HEADER_BYTES: Final = 16 << 20
_HOW_TO_SAVE_WEIGHTS: Final = (
    "convert with safetensors.torch.save_file(model.state_dict(), path) and upload that"
)


@dataclass(frozen=True)
class WeightSpec:
    """One tensor of a weights file, from its header."""

    shape: tuple[int, ...]
    dtype: str  # safetensors' code: "F32", "BF16", "I64", ...


def read_weights_header(
    path: Path,
    *,
    max_keys: int = DEFAULT_MAX_WEIGHT_KEYS,
    max_header_bytes: int = DEFAULT_MAX_WEIGHTS_HEADER_BYTES,
) -> dict[str, WeightSpec]:
    """The tensors a safetensors weights file declares, read from its header only.

    Raises ``WeightsFileError`` for anything but a complete safetensors file within the limits.
    """
    kind, head = sniff(path)
    if kind != "safetensors":
        raise WeightsFileError(
            f"this is {what_it_is(kind, head)}; weights are accepted as safetensors only, "
            f"because loading pickles can run code: {_HOW_TO_SAVE_WEIGHTS}"
        )
    check_safetensors_header(path, max_header_bytes, WeightsFileError)
    try:
        with safe_open(str(path), framework="numpy") as opened:
            if len(opened.keys()) > max_keys:
                raise WeightsFileError(
                    f"the weights file holds {len(opened.keys())} tensors, more than the limit "
                    f"of {max_keys}"
                )
            raw = safetensors_specs(opened)
    except SafetensorError as exc:
        raise WeightsFileError(
            f"not a valid safetensors file ({exc}); it may be truncated or corrupt: "
            f"upload it again, or {_HOW_TO_SAVE_WEIGHTS}"
        ) from exc
    return {key: WeightSpec(shape, dtype) for key, (shape, dtype) in raw.items()}
