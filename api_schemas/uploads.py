"""Dataset files that reach an S3 store without passing through the API: direct multipart
uploads with presigned part URLs, and imports of objects already in a bucket."""

import re
from typing import Annotated, Final, Literal

from pydantic import AfterValidator, BaseModel, Field

from api_schemas.common import RequestModel, UtcDatetime
from api_schemas.datasets import Preprocessing

__all__ = [
    "DatasetImport",
    "DirectUploadComplete",
    "DirectUploadCreate",
    "DirectUploadPublic",
    "split_s3_source",
]

# S3 allows at most 10,000 parts in one upload.
MAX_PARTS = 10_000


class DirectUploadCreate(RequestModel):
    """Start a direct upload of a dataset file of ``size`` bytes."""

    direct: Literal[True]
    size: int = Field(ge=1)
    name: str | None = Field(default=None, min_length=1, max_length=256)


class DirectUploadPublic(BaseModel):
    """Where to PUT each part: part ``i`` (from 1) is bytes ``[(i-1)*part_bytes,
    i*part_bytes)`` of the file. Keep each answer's ``ETag`` header for the completion."""

    id: str
    part_bytes: int
    part_urls: list[str]
    complete_url: str
    expires_at: UtcDatetime


class DirectUploadComplete(RequestModel):
    """The ``ETag`` the bucket answered for each part, in part order."""

    etags: list[str] = Field(min_length=1, max_length=MAX_PARTS)


# S3's rules for bucket names (3-63 lower-case letters, digits, dots and hyphens), with the
# underscore some S3-compatible servers allow.
_BUCKET: Final = re.compile(r"[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]")
# S3 keys are at most 1024 bytes of UTF-8.
_MAX_KEY_BYTES: Final = 1024
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")


def split_s3_source(url: str) -> tuple[str, str]:
    """``s3://BUCKET/KEY`` -> (bucket, key): the key of an object, or a prefix ending in ``/``,
    or ``""`` for the whole bucket. ``ValueError`` for anything a client or server could read
    as another key than the one written: a ``.`` or ``..`` segment (an HTTP client may remove
    dot segments from a path), an empty segment, a backslash, a control character
    (NOTE [ Import sources ] in service/records/tenancy/import_sources.py)."""
    how = "write s3://BUCKET/KEY (an object) or s3://BUCKET/PREFIX/ (a folder)"
    if not url.startswith("s3://"):
        raise ValueError(f"a source is an S3 URL: {how}")
    bucket, _, key = url.removeprefix("s3://").partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise ValueError(
            "the bucket name must be 3-63 lower-case letters, digits, dots or hyphens: " + how
        )
    if len(key.encode()) > _MAX_KEY_BYTES:
        raise ValueError(f"an S3 key has at most {_MAX_KEY_BYTES} bytes: {how}")
    if _CONTROL.search(key) or "\\" in key:
        raise ValueError(f"the key has a control character or a backslash: {how}")
    segments = key.split("/")
    if key.endswith("/"):
        segments.pop()  # a prefix: its last segment is the empty one after the slash
    if key and any(segment in {"", ".", ".."} for segment in segments):
        raise ValueError(
            f"the key has an empty, '.' or '..' segment ('//', '/./', '/../'): {how}, with "
            "each folder named as it is in the bucket"
        )
    return bucket, key


def _object_or_prefix(url: str) -> str:
    if not split_s3_source(url)[1]:
        raise ValueError("name an object or a folder in the bucket, not the whole bucket")
    return url


class DatasetImport(RequestModel):
    """Register a dataset from an S3 bucket the operator allowed this tenant to import from:
    an object (``s3://BUCKET/KEY``: an .npz, .safetensors or tar file), or a folder of JPEG
    and PNG images (``s3://BUCKET/PREFIX/``, ending in ``/``: class subfolders are the labels,
    in sorted order as torchvision's ImageFolder gives them; images directly in the folder
    make an unlabelled dataset)."""

    source: Annotated[str, AfterValidator(_object_or_prefix)] = Field(max_length=2048)
    name: str | None = Field(default=None, min_length=1, max_length=256)
    # For a tar of images or a folder: how to turn its images into tensors (docs/datasets.md).
    preprocessing: Preprocessing | None = None
