"""Pieces every resource shares: id and digest formats, timestamps, the error body, pages."""

import secrets
from datetime import UTC, datetime
from typing import Annotated, Final, Generic, Literal, TypeVar

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
)

__all__ = [
    "ID_PATTERN",
    "SHA256_PATTERN",
    "IdPrefix",
    "Page",
    "Problem",
    "ProblemItem",
    "RequestModel",
    "ResourceId",
    "Sha256Hex",
    "UtcDatetime",
    "new_id",
    "utc_now",
]

# Checked on every id in a path, so `abc:cancel` or `../x` never reaches a lookup.
ID_PATTERN: Final = r"^[A-Za-z0-9_-]{1,64}$"
SHA256_PATTERN: Final = r"^[0-9a-f]{64}$"

IdPrefix = Literal["mdl", "ds", "job", "tn", "up"]

# pydantic matches patterns with Rust's regex, where `$` is the true end of the string (Python's
# `re` would also accept a trailing newline).
ResourceId = Annotated[str, StringConstraints(pattern=ID_PATTERN)]
Sha256Hex = Annotated[str, StringConstraints(pattern=SHA256_PATTERN)]


def _as_utc(value: datetime) -> datetime:
    return value.astimezone(UTC)


# Naive datetimes are refused rather than guessed; aware ones are normalized to UTC.
UtcDatetime = Annotated[AwareDatetime, AfterValidator(_as_utc)]

T = TypeVar("T")


def utc_now() -> datetime:
    """The current time as a timezone-aware UTC datetime."""
    return datetime.now(UTC)


def new_id(prefix: IdPrefix) -> str:
    """A fresh random id such as ``mdl_`` followed by 22 url-safe characters (128 bits)."""
    return f"{prefix}_{secrets.token_urlsafe(16)}"


class RequestModel(BaseModel):
    """Base of everything a client (or the service, for a worker) sends: unknown fields are
    errors, and so are NaN and infinities, which JSON cannot carry portably."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ProblemItem(BaseModel):
    """One validation failure: where (a path into the request) and what."""

    loc: list[str | int]
    msg: str


class Problem(BaseModel):
    """The one error body of the API: RFC 9457 problem details."""

    type: str = "about:blank"
    title: str
    status: int = Field(ge=400, le=599)
    detail: str | None = None
    instance: str | None = None
    errors: list[ProblemItem] | None = None


class Page(BaseModel, Generic[T]):
    """One page of a listing; pass ``next_page_token`` back to get the next, ``None`` at the end."""

    items: list[T]
    next_page_token: str | None = None
