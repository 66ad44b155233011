"""Buckets a dataset is imported from, read with the store's credentials: a folder's listing a
page at a time, and an object's bytes as a stream. The store's own prefix is never read here
(NOTE [ Import sources ] in service/records/tenancy/import_sources.py)."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, Final

from botocore.exceptions import ClientError

from service.errors import ObjectNotFoundError
from service.store.base import SourcePage
from service.store.s3.transfers import BodyReader

__all__ = ["S3SourceFolders"]

# The buffer of a reader that streams a source object.
_READ_CHUNK: Final = 1024 * 1024
# S3 lists at most 1000 keys a request.
_PAGE_KEYS: Final = 1000


class S3SourceFolders:
    """``bucket`` as folders (the ``/`` delimiter), through ``client``; keys for which
    ``owned(bucket, key)`` is true (the store's own) are left out of listings and refused."""

    def __init__(self, client: Any, bucket: str, owned: Callable[[str, str], bool]) -> None:
        self._client = client
        self.bucket = bucket
        self._owned = owned

    def pages(self, prefix: str) -> Iterator[SourcePage]:
        if self._owned(self.bucket, prefix):
            raise ObjectNotFoundError("the store's own prefix is not a source")
        paginator = self._client.get_paginator("list_objects_v2")
        pages = paginator.paginate(
            Bucket=self.bucket,
            Prefix=prefix,
            Delimiter="/",
            PaginationConfig={"PageSize": _PAGE_KEYS},
        )
        try:
            for page in pages:
                files = [
                    (entry["Key"], int(entry["Size"]))
                    for entry in page.get("Contents", ())
                    if not self._owned(self.bucket, entry["Key"])
                ]
                folders = [
                    entry["Prefix"]
                    for entry in page.get("CommonPrefixes", ())
                    if not self._owned(self.bucket, entry["Prefix"])
                ]
                yield SourcePage(files, folders)
        except ClientError as exc:  # no such bucket, or not ours to list
            raise ObjectNotFoundError(f"cannot list s3://{self.bucket}/{prefix}: {exc}") from exc

    @contextlib.contextmanager
    def open(self, key: str) -> Iterator[tuple[int, BinaryIO]]:
        if self._owned(self.bucket, key):
            raise ObjectNotFoundError("the store's own objects are not a source")
        try:
            reply = self._client.get_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            raise ObjectNotFoundError(f"cannot read s3://{self.bucket}/{key}: {exc}") from exc
        body = reply["Body"]
        try:
            yield int(reply["ContentLength"]), io.BufferedReader(BodyReader(body), _READ_CHUNK)
        finally:
            body.close()
