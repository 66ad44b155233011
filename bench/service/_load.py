"""A closed-loop HTTP load generator for bench/service/overhead.py, run as its own process.

``tasks`` asyncio tasks, each on its own keep-alive connection, send their next request as soon
as the previous answer arrived. Until ``--start-at`` (a ``time.time()`` instant shared by all
generator processes) they only warm up (connect, first requests); then each records every
request it completes within ``--duration-s`` seconds. Prints one JSON line: completed requests,
unexpected statuses, latencies in ms, the seconds the window really lasted and this process's
CPU seconds over it.

The default client writes HTTP/1.1 by hand over asyncio streams, so that the generator takes as
little as it can of the cores it shares with the server: on the 2-core machine of
bench/RESULTS.md an ``httpx.AsyncClient`` (``--client httpx``) spent several ms of CPU per
request, as much as the API itself. It imports nothing from the repository and no torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

REQUEST_TIMEOUT_S = 30.0

# Sends one request and answers (status, body).
Send = Callable[[], Awaitable[tuple[int, bytes]]]


class RawClient:
    """HTTP/1.1 on one keep-alive asyncio connection, opened again if the server closed it.
    Answers must carry Content-Length (uvicorn's JSON answers do)."""

    def __init__(self, url: str, method: str, path: str, key: str, body: bytes) -> None:
        parsed = urllib.parse.urlsplit(url)
        self._host, self._port = parsed.hostname or "127.0.0.1", parsed.port or 80
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {parsed.netloc}\r\n"
            f"Authorization: Bearer {key}\r\nAccept: */*\r\n"
        )
        if body:
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        self._request = (head + "\r\n").encode() + body
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def send(self) -> tuple[int, bytes]:
        if self._streams is None:
            self._streams = await asyncio.open_connection(self._host, self._port)
        reader, writer = self._streams
        writer.write(self._request)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            await self.close()  # the server closed the idle connection: once more
            return await self.send()
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = dict(line.lower().split(": ", 1) for line in lines[1:] if line)
        if "content-length" not in headers:
            raise RuntimeError(f"an answer without Content-Length: {headers}")
        body = await reader.readexactly(int(headers["content-length"]))
        if headers.get("connection") == "close":
            await self.close()
        return status, body

    async def close(self) -> None:
        if self._streams is not None:
            self._streams[1].close()
            self._streams = None


def _httpx_sender(client: httpx.AsyncClient, method: str, path: str, body: bytes) -> Send:
    headers = {"Content-Type": "application/json"} if body else None

    async def send() -> tuple[int, bytes]:
        response = await client.request(method, path, content=body or None, headers=headers)
        return response.status_code, response.content

    return send


async def _task(
    send: Send,
    expected: int,
    start: float,
    end: float,
    latencies_ms: list[float],
    errors: list[str],
) -> None:
    while True:
        began = time.time()
        if began >= end:
            return
        status, body = await send()
        done = time.time()
        if began < start:  # warming up
            continue
        if status != expected:
            errors.append(f"{status} {body[:200]!r}")
        elif done <= end:
            latencies_ms.append((done - began) * 1e3)


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    body = args.body.encode()
    latencies_ms: list[float] = []
    errors: list[str] = []
    start, end = args.start_at, args.start_at + args.duration_s
    cpu_at_start: float | None = None

    async def mark_start() -> None:
        nonlocal cpu_at_start
        await asyncio.sleep(max(start - time.time(), 0.0))
        cpu_at_start = time.process_time()

    async with contextlib.AsyncExitStack() as stack:
        senders: list[Send] = []
        if args.client == "httpx":
            client = await stack.enter_async_context(
                httpx.AsyncClient(
                    base_url=args.url,
                    headers={"Authorization": f"Bearer {args.key}"},
                    limits=httpx.Limits(max_connections=args.tasks),
                    timeout=REQUEST_TIMEOUT_S,
                )
            )
            senders = [_httpx_sender(client, args.method, args.path, body)] * args.tasks
        else:
            for _ in range(args.tasks):
                raw = RawClient(args.url, args.method, args.path, args.key, body)
                stack.push_async_callback(raw.close)
                senders.append(raw.send)
        marker = asyncio.create_task(mark_start())
        await asyncio.gather(
            *(_task(s, args.expect, start, end, latencies_ms, errors) for s in senders)
        )
        await marker
    finished = time.time()
    assert cpu_at_start is not None
    return {
        "completed": len(latencies_ms),
        "errors": len(errors),
        "first_errors": errors[:3],
        "latencies_ms": latencies_ms,
        "window_s": min(finished, end) - start,
        "cpu_s": time.process_time() - cpu_at_start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--key", required=True, help="an API key")
    parser.add_argument("--method", default="GET")
    parser.add_argument("--path", required=True)
    parser.add_argument("--body", default="", help="a JSON request body")
    parser.add_argument("--expect", type=int, default=200, help="the status every answer has")
    parser.add_argument("--tasks", type=int, default=16, help="concurrent requests")
    parser.add_argument("--client", choices=("raw", "httpx"), default="raw")
    parser.add_argument("--start-at", type=float, required=True, help="time.time() to start at")
    parser.add_argument("--duration-s", type=float, default=10.0)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(_run(args))))


if __name__ == "__main__":
    main()
