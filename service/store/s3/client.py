"""How this process reaches the bucket: boto3 sessions and clients, how they sign object
bytes, the clients made before a fork, and :class:`S3Bucket`, a bucket under a prefix with
the keys of the store's objects in it.

# NOTE [ What checks the bytes of a part ]
An object's bytes are checked three times: the writer hashes them as they are written (the
content key is that sha256, and a mismatch with an announced digest stores nothing); the
server checks each request's body against a checksum sent with it before it keeps it; and a
download into a cache is hashed again (NOTE [ Downloading into the cache ] in
service/store/s3/transfers.py). botocore offers
two per-request checks of a body: a CRC32 header (``x-amz-checksum-crc32``, its default for
PutObject and UploadPart) and, over plain HTTP only, a SHA-256 of the body in the SigV4
signature. Over HTTPS it already sends object bytes with the CRC32 alone, TLS guarding them.
Over plain HTTP it computes both, and the SHA-256 hashes every byte written a second time,
beside the object's own sha256 (the writer's CPU, item by item:
bench/history/2026-12-03-s3-write-client-cpu-goes.md; figure `s3-write` in bench/RESULTS.md).
SeaweedFS checks the CRC32 and not the SHA-256: a part changed after it was signed is refused
(BadDigest) when it has the CRC32 and stored when it has only the SHA-256. AWS S3 checks both.
So an UploadPart or PutObject that carries a checksum header is signed over that header, not
over its body (:func:`_sign_body_by_its_checksum`), as botocore does over HTTPS: every part
is still checked by the server, on AWS and on SeaweedFS. What this gives up, on plain HTTP
only, is protection against a body changed on purpose on the way (a CRC32 can be forged; a
signed SHA-256 cannot); such a link leaves downloads unsigned anyway, and a download into a
cache refuses bytes that do not hash to their key. Requests without a checksum header keep the
signed SHA-256: CompleteMultipartUpload (its list of parts has no checksum), and every request
where ``AWS_REQUEST_CHECKSUM_CALCULATION=when_required`` turns the CRC32 off.
"""

from __future__ import annotations

import functools
import os
import secrets
import threading
from typing import Any
from urllib.parse import urlsplit

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from service.settings import DEFAULT_S3_PARTS_IN_FLIGHT
from service.store.base import check_sha256

__all__ = ["S3Bucket", "not_found", "over_tls", "parse_s3_url", "warm_up"]

_session_lock = threading.Lock()
_sessions: dict[int, Any] = {}
# Clients warm_up made for forked children: (endpoint URL, parts in flight) -> (maker's pid,
# client). Never used in the process that made them.
_forkable: dict[tuple[str, int], tuple[int, Any]] = {}


def _session() -> Any:
    """This process's boto3 session. Making a client loads botocore's service model (some
    hundreds of milliseconds); a session keeps it, and holds no connection, so a session made
    before a fork (see :func:`warm_up`) serves the forked job too."""
    with _session_lock:
        session = _sessions.get(0)
        if session is None:
            session = _sessions[0] = boto3.session.Session()
        return session


def _client_config(parts_in_flight: int) -> Config:
    return Config(
        # SigV4 everywhere: botocore would presign with the legacy SigV2, which AWS regions
        # opened since 2014 refuse and SeaweedFS refuses with response parameters.
        signature_version="s3v4",
        retries={"max_attempts": 5, "mode": "standard"},
        max_pool_connections=max(10, 2 * parts_in_flight),
        connect_timeout=10,
        read_timeout=60,
    )


def _sign_body_by_its_checksum(unsigned: Config, request: Any, **_: Any) -> None:
    """Before an UploadPart or PutObject is signed: if botocore put a checksum header on it,
    the signature covers that header instead of a SHA-256 of the body (NOTE [ What checks
    the bytes of a part ]). Without such a header, nothing changes."""
    algorithm = request.context.get("checksum", {}).get("request_algorithm")
    if (
        isinstance(algorithm, dict)
        and algorithm.get("in") == "header"
        and algorithm.get("name") in request.headers
    ):
        # The signer reads `payload_signing_enabled` from the request's client config.
        request.context["client_config"] = unsigned


def _make_client(session: Any, endpoint_url: str | None, parts_in_flight: int) -> Any:
    """A new client, signing object bytes as NOTE [ What checks the bytes of a part ] says.
    Called with ``_session_lock`` held (a session is not thread-safe)."""
    client = session.client("s3", endpoint_url=endpoint_url, config=_client_config(parts_in_flight))
    config = client.meta.config
    unsigned = config.merge(Config(s3={**(config.s3 or {}), "payload_signing_enabled": False}))
    sign = functools.partial(_sign_body_by_its_checksum, unsigned)
    for operation in ("UploadPart", "PutObject"):
        client.meta.events.register(f"before-sign.s3.{operation}", sign)
    return client


def _new_client(endpoint_url: str | None, parts_in_flight: int) -> Any:
    """A client for this process: one warm_up made before the fork if there is one (tens of
    milliseconds saved per job), else a new one."""
    name = endpoint_url or ""
    with _session_lock:
        made = _forkable.pop((name, parts_in_flight), None)
        if made is not None and made[0] != os.getpid():
            return made[1]
        if made is not None:
            _forkable[(name, parts_in_flight)] = made  # the maker's: kept for its children
    session = _session()
    with _session_lock:
        return _make_client(session, endpoint_url, parts_in_flight)


def warm_up(parts_in_flight: int = DEFAULT_S3_PARTS_IN_FLIGHT) -> None:
    """Loads the S3 service model into this process's session and makes the client a job
    will use, without a request: an RQ worker calls it (through ``S3Store.warm_up``) before
    forking jobs, so each job has its client at once. The client is never used in this
    process, so it holds no connection a child could inherit; each forked child takes its own
    copy of it."""
    session = _session()
    with _session_lock:
        # No endpoint_url: like S3Bucket's own client, it reads AWS_ENDPOINT_URL itself.
        client = _make_client(session, None, parts_in_flight)
        _forkable[("", parts_in_flight)] = (os.getpid(), client)


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://BUCKET/PREFIX`` -> (bucket, prefix ending in ``/``, or empty)."""
    parts = urlsplit(url)
    if parts.scheme != "s3" or not parts.netloc or parts.query or parts.fragment:
        raise ValueError(
            f"not an S3 URL: {url!r}; write s3://BUCKET or s3://BUCKET/PREFIX (endpoint and "
            "credentials come from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)"
        )
    prefix = parts.path.strip("/")
    return parts.netloc, f"{prefix}/" if prefix else ""


def not_found(exc: ClientError) -> bool:
    """Whether the request failed because its object (or multipart upload) is absent."""
    code = str(exc.response.get("Error", {}).get("Code", ""))
    return code in {"404", "NoSuchKey", "NotFound", "NoSuchUpload"}


def over_tls(client: Any) -> bool:
    return str(client.meta.endpoint_url).startswith("https:")


class S3Bucket:
    """``s3://name/prefix`` as this process reaches it: its boto3 clients, made on first use
    and again in a forked child (boto3 clients do not survive a fork), and the keys of the
    store's objects under the prefix (the layout in :mod:`service.store.s3`)."""

    def __init__(self, name: str, prefix: str, parts_in_flight: int) -> None:
        self.name = name
        self.prefix = prefix
        self._parts_in_flight = parts_in_flight
        self._clients: dict[str, Any] = {}
        self._pid = os.getpid()

    def client(self, endpoint_url: str | None = None) -> Any:
        """This process's client for ``endpoint_url`` (None: the one boto3 reads from
        ``AWS_ENDPOINT_URL``, else AWS)."""
        if os.getpid() != self._pid:  # forked: boto3 clients do not survive a fork
            self._clients.clear()
            self._pid = os.getpid()
        name = endpoint_url or ""
        client = self._clients.get(name)
        if client is None:
            client = self._clients[name] = _new_client(endpoint_url, self._parts_in_flight)
        return client

    def object_key(self, sha256: str) -> str:
        return f"{self.objects_prefix}{check_sha256(sha256)}"

    @property
    def objects_prefix(self) -> str:
        """Where committed objects are, never modified."""
        return f"{self.prefix}objects/"

    @property
    def tmp_prefix(self) -> str:
        """Where objects that reached the bucket directly are, while they are checked."""
        return f"{self.prefix}tmp/"

    def new_temp_key(self) -> str:
        return f"{self.tmp_prefix}{secrets.token_hex(16)}"

    def has_object(self, sha256: str) -> bool:
        """Whether the object is under its content key (one HEAD request)."""
        try:
            self.client().head_object(Bucket=self.name, Key=self.object_key(sha256))
        except ClientError as exc:
            if not_found(exc):
                return False
            raise
        return True
