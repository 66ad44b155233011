"""What an API response must be, for tests and benches: created, or a problem naming its
cause."""

from __future__ import annotations

from typing import Any

__all__ = ["created", "problem"]


def created(response: Any, status: int = 201) -> dict[str, Any]:
    """The body of ``response``, which must have ``status`` (201 by default)."""
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    return body


def problem(response: Any, status: int, *phrases: str) -> dict[str, Any]:
    """The response is a problem+json with ``status`` whose detail names each phrase."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = response.json()
    assert body["status"] == status
    for phrase in phrases:
        assert phrase.lower() in body["detail"].lower(), body["detail"]
    return body
