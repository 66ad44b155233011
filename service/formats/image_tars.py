"""What every writer of an image tar (NOTE [ Image datasets ] in service/formats/images.py)
shares: which files are images, and a member's bytes as a tar holds them. A local folder
streamed by the client (service/formats/image_folders.py) and a bucket's folder copied by the
API (service/formats/folder_tars.py) write their tars with these, so the two agree on what a
member is and how long it is.
"""

from __future__ import annotations

import tarfile
from typing import Final

__all__ = [
    "IMAGE_EXTENSIONS",
    "OTHER_IMAGE_EXTENSIONS",
    "TAR_BLOCK",
    "TAR_END",
    "image_extension",
    "tar_header",
    "tar_member_size",
    "tar_padding",
]

# The images a dataset holds: JPEG and PNG, by extension in any case.
IMAGE_EXTENSIONS: Final = frozenset({"jpg", "jpeg", "png"})
# torchvision's ImageFolder's other image formats: a folder holding them is refused rather
# than its images dropped (a dataset that silently lost samples).
OTHER_IMAGE_EXTENSIONS: Final = frozenset({"ppm", "bmp", "pgm", "tif", "tiff", "webp"})
TAR_BLOCK: Final = tarfile.BLOCKSIZE  # 512: a header, and the unit data is padded to
TAR_END: Final = b"\0" * (2 * TAR_BLOCK)  # two zero blocks end a tar


def image_extension(name: str) -> str:
    """The lower-case extension of a file or key name (its last segment), without the dot;
    empty when it has none."""
    last = name.rpartition("/")[2]
    return last.rpartition(".")[2].lower() if "." in last else ""


def tar_header(name: str, size: int) -> bytes:
    """A member's header (mode 644, time 0: the tar of the same files is the same bytes);
    PAX, so that any UTF-8 name is kept."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o644, 0
    return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")


def tar_padding(size: int) -> bytes:
    """The zeros after ``size`` bytes of data, up to the next block."""
    return b"\0" * (-size % TAR_BLOCK)


def tar_member_size(name: str, size: int) -> int:
    """The bytes a member of ``size`` data bytes takes: header, data, padding."""
    return len(tar_header(name, size)) + size + len(tar_padding(size))
