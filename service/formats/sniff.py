"""What a file is, from its first bytes (never from its name), and safetensors header checks
shared by dataset and weights files."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final, Literal

from service.errors import BnadaptError

__all__ = ["FileKind", "check_safetensors_header", "safetensors_specs", "sniff", "what_it_is"]

FileKind = Literal["zip", "safetensors", "tar", "pickle", "npy", "empty", "unknown"]
_TAR_MAGIC_AT: Final = 257  # "ustar" in a POSIX or GNU tar header


def sniff(path: Path) -> tuple[FileKind, bytes]:
    with path.open("rb") as file:
        head = file.read(9)
        file.seek(_TAR_MAGIC_AT)
        magic = file.read(5)
    if not head:
        return "empty", head
    if head.startswith(b"PK\x03\x04"):
        return "zip", head
    if magic == b"ustar":
        return "tar", head
    if head.startswith(b"\x93NUMPY"):
        return "npy", head
    # safetensors: u64 little-endian header length, then a JSON object. Tested before pickle:
    # a header length of e.g. 640 also begins with the bytes 0x80 0x02.
    if len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < 1 << 32:
        return "safetensors", head
    if head[0] == 0x80 and len(head) > 1 and 2 <= head[1] <= 5:
        return "pickle", head  # PROTO opcode; also the legacy (non-zip) torch.save format
    return "unknown", head


def what_it_is(kind: FileKind, head: bytes) -> str:
    return {
        "zip": "a zip file, such as a PyTorch checkpoint from torch.save",
        "safetensors": "a safetensors file",
        "tar": "a tar file",
        "pickle": "a Python pickle (pickle.dump, or torch.save's legacy format), refused because "
        "loading a pickle can run code",
        "npy": "a single numpy .npy array",
        "empty": "an empty file",
        "unknown": f"a file of unknown type (it starts with {head!r})",
    }[kind]


def check_safetensors_header(path: Path, max_header_bytes: int, error: type[BnadaptError]) -> int:
    """Returns the length of the JSON header that follows the first 8 bytes."""
    size = path.stat().st_size
    with path.open("rb") as file:
        declared = int.from_bytes(file.read(8), "little")
    if declared > size - 8:
        raise error(
            f"truncated safetensors file: its header declares {declared} bytes but only "
            f"{max(size - 8, 0)} follow; upload the complete file"
        )
    if declared > max_header_bytes:
        raise error(
            f"the safetensors header is {declared} bytes, more than the limit of "
            f"{max_header_bytes}; it lists too many tensors or too much metadata"
        )
    return declared


def safetensors_specs(opened: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """Shapes and dtype codes from an open ``safe_open`` handle (an untyped API)."""
    specs = {}
    for key in opened.keys():  # noqa: SIM118  # safe_open has no __iter__
        tensor_slice = opened.get_slice(key)
        specs[str(key)] = (tuple(tensor_slice.get_shape()), str(tensor_slice.get_dtype()))
    return specs
