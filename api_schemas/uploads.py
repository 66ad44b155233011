"""Dataset files that reach an S3 store without passing through the API: direct multipart
uploads with presigned part URLs, and imports of objects already in a bucket."""

from typing import Literal

from pydantic import BaseModel, Field

from api_schemas.common import RequestModel, UtcDatetime

__all__ = ["DatasetImport", "DirectUploadComplete", "DirectUploadCreate", "DirectUploadPublic"]

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


class DatasetImport(RequestModel):
    """Register a dataset from an object already in an S3 bucket the service can read."""

    source: str = Field(pattern=r"^s3://[^/]+/.+", max_length=2048)
    name: str | None = Field(default=None, min_length=1, max_length=256)
