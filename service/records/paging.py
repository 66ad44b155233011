"""Cursor pagination over a tenant's index of resources (service/records/stored/resources.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import redis

from api_schemas import Page
from service.records.format import decode_token, encode_token, text

__all__ = ["newest_first"]

T = TypeVar("T")


def newest_first(
    client: redis.Redis,
    index: str,
    load: Callable[[str], T | None],
    page_size: int,
    token: str | None,
) -> Page[T]:
    """Newest first. The token is the last index member returned, so items created while
    paging never shift later pages. With a filter, scans at most 20 pages' worth of index
    per call; a short page with a token just means more may follow."""
    upper = "+" if token is None else "(" + decode_token(token)
    items: list[T] = []
    last: str | None = None
    scanned = 0
    while len(items) < page_size and scanned < 20 * page_size:
        batch = [text(m) for m in client.zrevrangebylex(index, upper, "-", start=0, num=page_size)]
        if not batch:
            return Page(items=items, next_page_token=None)
        for member in batch:
            scanned += 1
            last = member
            item = load(member.split(":", 1)[1])
            if item is not None:
                items.append(item)
                if len(items) == page_size:
                    break
        assert last is not None
        upper = "(" + last
        if len(batch) < page_size and len(items) < page_size:
            return Page(items=items, next_page_token=None)
    assert last is not None
    more = client.zrevrangebylex(index, "(" + last, "-", start=0, num=1)
    return Page(items=items, next_page_token=encode_token(last) if more else None)
