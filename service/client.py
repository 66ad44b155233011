"""A Python client for the bnadapt API (what the CLI uses). No torch needed.

client = Client("http://127.0.0.1:8000", "bna_...")
model = client.add_model("digits_cnn", weights=Path("w.safetensors"))
dataset = client.add_dataset(Path("target.npz"))
images = client.upload_folder(Path("photos/"), preprocessing={"resize_shorter": 256,
                              "center_crop": [224, 224], "interpolation": "bicubic"})
job = client.submit("adapt", model.id, dataset.id, {"estimator": "cumulative"})
job = client.wait(job.id, on_progress=print)
client.download_weights(new_model_id(job), Path("adapted.safetensors"))
check = client.wait(client.submit("evaluate", new_model_id(job), dataset.id).id)
print(client.report(check.id).metrics_before)  # an evaluate job's result: accuracy, loss
client.request("GET", "/readyz").status_code  # any request; the response as it came
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import httpx

from api_schemas import ArchitecturePublic, DatasetPublic, JobPublic, ModelPublic, Page, Progress
from api_schemas.datasets import Preprocessing, UploadPublic
from api_schemas.jobs.public import JobLogEntry, JobLogPage
from api_schemas.reports import Report
from service.errors import BnadaptError
from service.formats.image_folders import plan_folder, tar_size, tar_stream

__all__ = [
    "TRANSFER_HOSTS_ENV",
    "ApiClientError",
    "Client",
    "JobEvent",
    "PreprocessingArg",
    "TransferUrlError",
    "new_model_id",
]

DEFAULT_TIMEOUT_S: Final = 120.0
DEFAULT_PART_BYTES: Final = 64 * 1024 * 1024  # a resumable upload's part
POLL_INTERVAL_S: Final = 0.25
# Hosts besides the API's own that may receive the API key as an upload's transfer_url,
# comma-separated (NOTE [ Where the key goes ]).
TRANSFER_HOSTS_ENV: Final = "BNADAPT_TRANSFER_HOSTS"

# NOTE [ Where the key goes ]
# Every request the client sends carries its API key: to the API, and to the ``transfer_url``
# an upload names (the API processes an operator runs for upload bytes: NOTE [ Upload bytes in
# processes of their own ] in service/api/routes/uploads.py). A transfer_url is the server's
# word, so the client sends its key there only where the API is: the same scheme and host as
# the URL the client was given (any port: ``bnadapt up --uploads-nice`` listens on another
# port of the same machine), or a host the user allowed (``Client(transfer_hosts=...)``, else
# BNADAPT_TRANSFER_HOSTS). Any other is refused before a byte is sent to it.

# A dataset's preprocessing spec as a client gives it: the schema's object or its JSON fields.
PreprocessingArg = Preprocessing | Mapping[str, Any] | None


def _spec(preprocessing: PreprocessingArg) -> dict[str, Any] | None:
    if preprocessing is None:
        return None
    if isinstance(preprocessing, Preprocessing):
        return preprocessing.model_dump(mode="json", exclude_defaults=True)
    return dict(preprocessing)


class TransferUrlError(BnadaptError):
    """An upload's ``transfer_url`` is on a host this client does not send its key to (NOTE
    [ Where the key goes ])."""


class ApiClientError(BnadaptError):
    """The API answered with an error; ``status`` and ``detail`` come from its problem body."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"HTTP {status}: {detail}")
        self.status = status
        self.detail = detail


JobEvent = tuple[str, dict[str, Any]]
# How often wait() reconnects to a job's event stream that broke (a restarted API).
RECONNECT_DELAY_S: Final = 1.0


def _sse_events(lines: Iterator[str]) -> Iterator[JobEvent]:
    """(event, decoded data) of a text/event-stream; comments (keep-alives) skipped."""
    event, data = "message", list[str]()
    for line in lines:
        if not line:
            if data:
                yield event, json.loads("\n".join(data))
            event, data = "message", []
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "event":
                event = value
            elif name == "data":
                data.append(value)


def new_model_id(job: JobPublic) -> str:
    """The id of the model a succeeded ``adapt`` or ``train`` job registered; raises
    :class:`BnadaptError` for a job that has none (not succeeded, or an ``evaluate`` job)."""
    if job.result is None:
        raise BnadaptError(f"job {job.id} is {job.status.value}: it has no new model (yet)")
    if job.result.model_id is None:
        raise BnadaptError(
            f"job {job.id} ({job.kind}) registers no model; its result is the report at "
            f"{job.result.report_url}"
        )
    return job.result.model_id


class Client:
    """One tenant's client: its API key, the API's base URL and one keep-alive connection
    (``http``). The resource methods answer parsed records and raise :class:`ApiClientError`
    when the API answers an error; a request refused by the tenant's request rate (429
    ``rate_per_s``) they send again after its Retry-After, up to ``rate_retries`` times (the
    API refuses it before acting, so sending it again does nothing twice). :meth:`request` is
    the low-level way, for callers that read statuses, headers or error bodies themselves (the
    tests, the benches): it answers every response as it came."""

    def __init__(
        self,
        url: str,
        key: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        rate_retries: int = 3,
        transfer_hosts: Iterable[str] | None = None,
    ) -> None:
        """``transfer_hosts``: hosts besides the API's that an upload's ``transfer_url`` may
        name (NOTE [ Where the key goes ]); None: those of BNADAPT_TRANSFER_HOSTS."""
        if rate_retries < 0:
            raise ValueError(f"rate_retries must be >= 0, got {rate_retries}")
        self.http = httpx.Client(
            base_url=url.rstrip("/"),
            headers={"Authorization": f"Bearer {key}"},
            timeout=timeout_s,
        )
        self.rate_retries = rate_retries
        if transfer_hosts is None:
            transfer_hosts = os.environ.get(TRANSFER_HOSTS_ENV, "").split(",")
        self.transfer_hosts = frozenset(h.strip().lower() for h in transfer_hosts if h.strip())
        self.last_upload_id: str | None = None  # of the latest upload_dataset

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, **options: Any) -> httpx.Response:
        """Sends one request to ``path`` (under the base URL) with the tenant's key and
        answers the response as it came, whatever its status: nothing is checked or parsed.
        ``options`` are :meth:`httpx.Client.request`'s (``params``, ``json``, ``data``,
        ``files``, ``content``, ``headers``, ``timeout``, ...); a ``headers`` entry named
        ``Authorization`` replaces the key for this request. Transport errors
        (:class:`httpx.TransportError`) propagate."""
        return self.http.request(method, path, **options)

    def _check(self, response: httpx.Response) -> httpx.Response:
        if response.is_success or response.status_code == 304:
            return response
        try:
            body = response.json()
            detail = str(body.get("detail") or body.get("title") or body)
        except ValueError:
            detail = response.text[:500]
        raise ApiClientError(response.status_code, detail)

    def architectures(self) -> list[ArchitecturePublic]:
        response = self._check(self._send("GET", "/v1/architectures"))
        return [ArchitecturePublic.model_validate(a) for a in response.json()]

    def add_model(
        self,
        architecture: str,
        kwargs: dict[str, Any] | None = None,
        weights: Path | bytes | None = None,
        seed: int = 0,
    ) -> ModelPublic:
        """Registers a model; ``weights`` a safetensors file or its bytes (a ``.pth`` file is
        converted first: :func:`service.local.torch_weights.pth_to_safetensors`)."""
        meta = json.dumps({"architecture": architecture, "kwargs": kwargs or {}, "seed": seed})
        if weights is None:
            response = self._send("POST", "/v1/models", data={"meta": meta})
        elif isinstance(weights, bytes):
            response = self._send(
                "POST",
                "/v1/models",
                data={"meta": meta},
                files={"weights": ("weights.safetensors", weights)},
            )
        else:
            with weights.open("rb") as file:
                response = self._send(
                    "POST",
                    "/v1/models",
                    data={"meta": meta},
                    files={"weights": (weights.name, file)},
                )
        return ModelPublic.model_validate(self._check(response).json())

    def models(self, page_size: int = 50, page_token: str | None = None) -> Page[ModelPublic]:
        params: dict[str, Any] = {"page_size": page_size}
        if page_token:
            params["page_token"] = page_token
        response = self._check(self._send("GET", "/v1/models", params=params))
        return Page[ModelPublic].model_validate(response.json())

    def add_dataset(
        self, path: Path, name: str | None = None, preprocessing: PreprocessingArg = None
    ) -> DatasetPublic:
        # The digest lets an S3 store write the file straight to its content key.
        headers = {"X-Content-SHA256": _file_sha256(path)}
        fields = {"name": name} if name else {}
        spec = _spec(preprocessing)
        if spec is not None:
            fields["preprocessing"] = json.dumps(spec)
        with path.open("rb") as file:
            response = self._send(
                "POST",
                "/v1/datasets",
                files={"file": (path.name, file)},
                data=fields or None,
                headers=headers,
            )
        return DatasetPublic.model_validate(self._check(response).json())

    def upload_dataset(
        self,
        path: Path,
        name: str | None = None,
        *,
        upload_id: str | None = None,
        part_bytes: int = DEFAULT_PART_BYTES,
        retries: int = 5,
        on_progress: Callable[[int, int], None] | None = None,
        preprocessing: PreprocessingArg = None,
    ) -> DatasetPublic:
        """Uploads a dataset file of any size through a resumable upload (``/v1/uploads``):
        parts the server already holds with the same digest are skipped, so passing the
        ``upload_id`` of an interrupted upload resumes it; a part whose connection drops is
        sent again, up to ``retries`` times, and so is a request refused by the tenant's
        request rate (429 ``rate_per_s``), after the wait its Retry-After asks for.
        ``on_progress(bytes_done, bytes_total)``; the first call comes once the upload exists,
        with ``upload_id`` set on :attr:`last_upload_id` so that a caller can tell the user how
        to resume."""
        total = path.stat().st_size
        if upload_id is None:
            body = {"name": name or path.name, "size_bytes": total}
            upload = UploadPublic.model_validate(
                self._check(self._paced("POST", "/v1/uploads", retries, json=body)).json()
            )
        else:
            upload = self._upload(upload_id)
        self.last_upload_id = upload.id
        size = max(1, min(part_bytes, upload.max_part_bytes))
        held = {part.number: part for part in upload.parts}
        done = 0
        whole = hashlib.sha256()  # sent with :complete: an S3 store writes the file directly
        with path.open("rb") as file:
            for number, start in enumerate(range(0, total, size), start=1):
                file.seek(start)
                data = file.read(size)
                part = held.get(number)
                whole.update(data)
                digest = hashlib.sha256(data).hexdigest()
                if part is None or part.sha256 != digest:
                    self._put_part(upload, number, data, digest, retries)
                done += len(data)
                if on_progress is not None:
                    on_progress(done, total)
        return self._complete(upload, name, whole.hexdigest(), preprocessing, retries)

    def upload_folder(
        self,
        folder: Path,
        name: str | None = None,
        *,
        preprocessing: PreprocessingArg = None,
        part_bytes: int = DEFAULT_PART_BYTES,
        retries: int = 5,
        on_progress: Callable[[int, int], None] | None = None,
        on_skipped: Callable[[list[Path]], None] | None = None,
    ) -> DatasetPublic:
        """Uploads a folder of images as a dataset (NOTE [ Folders of images ] in
        service/formats/image_folders.py: class subfolders are labels, numbered as
        torchvision's ImageFolder numbers them; a flat folder is unlabelled): the tar is made
        as the files are read and sent part by part through a resumable upload, with no copy
        on disk; a part is held in memory only while it is sent (and sent again when its
        connection drops). ``on_skipped`` gets the files that are no image, before the upload
        starts. A folder of images of several sizes needs a ``preprocessing`` that gives one
        size (a ``resize``, or ``resize_shorter`` or ``crop_pct`` with a ``center_crop``)."""
        plan = plan_folder(folder)
        if on_skipped is not None and plan.skipped:
            on_skipped(plan.skipped)
        total = tar_size(plan)
        body = {"name": name or folder.resolve().name, "size_bytes": total}
        upload = UploadPublic.model_validate(
            self._check(self._paced("POST", "/v1/uploads", retries, json=body)).json()
        )
        self.last_upload_id = upload.id
        size = max(1, min(part_bytes, upload.max_part_bytes))
        whole = hashlib.sha256()
        done = 0
        for number, data in enumerate(_parts(tar_stream(plan), size), start=1):
            whole.update(data)
            self._put_part(upload, number, data, hashlib.sha256(data).hexdigest(), retries)
            done += len(data)
            if on_progress is not None:
                on_progress(done, total)
        return self._complete(upload, name, whole.hexdigest(), preprocessing, retries)

    def _complete(
        self,
        upload: UploadPublic,
        name: str | None,
        sha256: str,
        preprocessing: PreprocessingArg,
        retries: int,
    ) -> DatasetPublic:
        body: dict[str, Any] = {"name": name} if name else {}
        spec = _spec(preprocessing)
        if spec is not None:
            body["preprocessing"] = spec
        path = f"{self._transfer_base(upload)}/v1/uploads/{upload.id}:complete"
        response = self._paced("POST", path, retries, json={**body, "sha256": sha256})
        return DatasetPublic.model_validate(self._check(response).json())

    def _upload(self, upload_id: str) -> UploadPublic:
        response = self._check(self._send("GET", f"/v1/uploads/{upload_id}"))
        return UploadPublic.model_validate(response.json())

    def _put_part(
        self, upload: UploadPublic, number: int, data: bytes, sha256: str, retries: int
    ) -> None:
        for attempt in range(retries + 1):
            try:
                response = self.request(
                    "PUT",
                    f"{self._transfer_base(upload)}/v1/uploads/{upload.id}/parts/{number}",
                    content=data,
                    headers={
                        "Content-Type": "application/octet-stream",
                        "X-Content-SHA256": sha256,
                    },
                )
            except httpx.TransportError:
                if attempt == retries:
                    raise
                time.sleep(min(2.0**attempt, 30.0))
                continue
            wait = _rate_wait_s(response)
            if wait is None or attempt == retries:
                self._check(response)
                return
            time.sleep(wait)

    def _transfer_base(self, upload: UploadPublic) -> str:
        """Where the upload's parts and completion go: the API processes the operator runs for
        upload bytes, if the upload names them, else this client's API (an empty prefix);
        ``TransferUrlError`` for a transfer_url this client sends no key to (NOTE [ Where the
        key goes ])."""
        if upload.transfer_url is None:
            return ""
        base = upload.transfer_url.rstrip("/")
        target, api = httpx.URL(base), self.http.base_url
        if target.scheme == api.scheme and (
            target.host == api.host or target.host in self.transfer_hosts
        ):
            return base
        raise TransferUrlError(
            f"upload {upload.id} names transfer_url {base}, which is not on the API's own "
            f"scheme and host ({api.scheme}://{api.host}): this client sends its API key only "
            f"there; if {target.host} is where the operator runs the API for upload bytes, allow "
            f"it with Client(transfer_hosts=[{target.host!r}]) or {TRANSFER_HOSTS_ENV}="
            f"{target.host}, else tell the operator (BNADAPT_UPLOADS_URL)"
        )

    def _send(self, method: str, path: str, **options: Any) -> httpx.Response:
        """:meth:`request`, paced by the tenant's request rate (``rate_retries``)."""
        return self._paced(method, path, self.rate_retries, **options)

    @contextlib.contextmanager
    def _stream(self, method: str, path: str, **options: Any) -> Iterator[httpx.Response]:
        """A streamed response, once its status is a success: an error's body is read and
        raised as :class:`ApiClientError`, and a request refused by the tenant's request rate
        is sent again after its Retry-After, up to ``rate_retries`` times."""
        for attempt in range(self.rate_retries + 1):
            with self.http.stream(method, path, **options) as response:
                if response.is_success:
                    yield response
                    return
                response.read()  # the error's problem body, for its detail
                wait = _rate_wait_s(response) if attempt < self.rate_retries else None
                if wait is None:
                    yield self._check(response)  # raises; a 304 would be answered as it is
                    return
            time.sleep(wait)
        raise AssertionError("unreachable: the last attempt answers or raises")

    def _paced(self, method: str, path: str, retries: int, **options: Any) -> httpx.Response:
        """:meth:`request`, sent again after the wait a 429 of the tenant's request rate asks
        for (its Retry-After), up to ``retries`` times; the last answer as it came. Files in
        ``files`` are sent from their start each time."""
        for _ in range(retries):
            response = self.request(method, path, **options)
            wait = _rate_wait_s(response)
            if wait is None:
                return response
            time.sleep(wait)
            _rewind(options)
        return self.request(method, path, **options)

    def submit(
        self,
        kind: str,
        model_id: str,
        dataset_id: str,
        params: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
        tags: Mapping[str, str] | None = None,
        priority: int = 0,
    ) -> JobPublic:
        body: dict[str, Any] = {"kind": kind, "model_id": model_id, "dataset_id": dataset_id}
        body["params"] = params or {}
        if tags:
            body["tags"] = dict(tags)
        if priority:
            body["priority"] = priority
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        response = self._send("POST", "/v1/jobs", json=body, headers=headers)
        return JobPublic.model_validate(self._check(response).json())

    def job(self, job_id: str) -> JobPublic:
        return JobPublic.model_validate(self._check(self._send("GET", f"/v1/jobs/{job_id}")).json())

    def jobs(
        self,
        page_size: int = 50,
        page_token: str | None = None,
        status: str | None = None,
        *,
        kind: str | None = None,
        model_id: str | None = None,
        dataset_id: str | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> Page[JobPublic]:
        """Newest first; every filter given must match (``tags``: each pair)."""
        params: dict[str, Any] = {"page_size": page_size}
        given = {
            "page_token": page_token,
            "status": status,
            "kind": kind,
            "model_id": model_id,
            "dataset_id": dataset_id,
        }
        params |= {name: value for name, value in given.items() if value}
        if tags:
            params["tag"] = [f"{k}:{v}" for k, v in tags.items()]
        response = self._check(self._send("GET", "/v1/jobs", params=params))
        return Page[JobPublic].model_validate(response.json())

    def datasets(self, page_size: int = 50, page_token: str | None = None) -> Page[DatasetPublic]:
        params: dict[str, Any] = {"page_size": page_size}
        if page_token:
            params["page_token"] = page_token
        response = self._check(self._send("GET", "/v1/datasets", params=params))
        return Page[DatasetPublic].model_validate(response.json())

    def delete_dataset(self, dataset_id: str) -> None:
        self._check(self._send("DELETE", f"/v1/datasets/{dataset_id}"))

    def delete_model(self, model_id: str) -> None:
        self._check(self._send("DELETE", f"/v1/models/{model_id}"))

    def delete_job(self, job_id: str) -> None:
        self._check(self._send("DELETE", f"/v1/jobs/{job_id}"))

    def logs(self, job_id: str, after: int = 0) -> JobLogPage:
        response = self._check(
            self._send("GET", f"/v1/jobs/{job_id}/logs", params={"after": after})
        )
        return JobLogPage.model_validate(response.json())

    def events(self, job_id: str, logs: bool = False, after: int = 0) -> Iterator[JobEvent]:
        """The job's server-sent events (``status``, ``progress``, ``epoch``, ``log``,
        ``end``) until it ends: NOTE [ Job events ] in service/api/routes/jobs.py."""
        params = {"logs": "true" if logs else "false", "after": after}
        with self._stream(
            "GET", f"/v1/jobs/{job_id}/events", params=params, timeout=httpx.Timeout(None)
        ) as response:
            yield from _sse_events(response.iter_lines())

    def follow_logs(self, job_id: str, after: int = 0) -> Iterator[JobLogEntry]:
        """The job's log entries as they come, until it ends."""
        for event, data in self.events(job_id, logs=True, after=after):
            if event == "log":
                yield JobLogEntry.model_validate(data)

    def cancel(self, job_id: str) -> JobPublic:
        response = self._check(self._send("POST", f"/v1/jobs/{job_id}:cancel"))
        return JobPublic.model_validate(response.json())

    def wait(
        self,
        job_id: str,
        on_progress: Callable[[JobPublic], None] | None = None,
        timeout_s: float | None = None,
    ) -> JobPublic:
        """Follows the job's events until it ends; ``on_progress`` sees the job at every
        change of status or progress. Reconnects when the stream breaks; with ``timeout_s``,
        polls instead (a stream cannot be given a deadline)."""
        if timeout_s is not None:
            return self._poll(job_id, on_progress, timeout_s)
        while True:
            try:
                job: JobPublic | None = None
                for event, data in self.events(job_id):
                    if event in ("status", "end"):
                        job = JobPublic.model_validate(data)
                    elif event == "progress" and job is not None:
                        job = job.model_copy(update={"progress": Progress.model_validate(data)})
                    if job is not None and on_progress is not None:
                        on_progress(job)
                    if event == "end" and job is not None:
                        return job
            except (httpx.TransportError, httpx.RemoteProtocolError):
                time.sleep(RECONNECT_DELAY_S)
            # The stream ended without an end event (the API restarted): read on.
            current = self.job(job_id)
            if current.status.is_terminal:
                return current

    def _poll(
        self,
        job_id: str,
        on_progress: Callable[[JobPublic], None] | None,
        timeout_s: float,
    ) -> JobPublic:
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.job(job_id)
            if on_progress is not None:
                on_progress(job)
            if job.status.is_terminal:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is still {job.status.value} after {timeout_s} s")
            time.sleep(POLL_INTERVAL_S)

    def report(self, job_id: str) -> Report:
        response = self._check(self._send("GET", f"/v1/jobs/{job_id}/report"))
        return Report.model_validate(response.json())

    def download_weights(self, model_id: str, path: Path) -> Path:
        """Streams the weights to ``path`` (written whole or not at all)."""
        partial = path.with_name(path.name + ".part")
        # An S3 store answers 307 to a presigned URL: httpx drops our key on the way there.
        with (
            self._stream(
                "GET", f"/v1/models/{model_id}/weights", follow_redirects=True
            ) as response,
            partial.open("wb") as file,
        ):
            for chunk in response.iter_bytes():
                file.write(chunk)
        partial.replace(path)
        return path


# The longest Retry-After of a 429 that an upload waits out; a longer one is answered as an
# error (a tenant's bucket that refills that slowly is a limit to raise, not to wait for).
_MAX_RATE_WAIT_S: Final = 60


def _rate_wait_s(response: httpx.Response) -> int | None:
    """The seconds a 429 of the request rate (``rate_per_s``) asks to wait before sending
    again, None for any other answer. The other quotas' 429s (open uploads, stored bytes)
    free up only when the tenant acts: waiting would not help."""
    retry_after = response.headers.get("retry-after", "")
    if response.status_code != 429 or not retry_after.isdigit():
        return None
    if int(retry_after) > _MAX_RATE_WAIT_S:
        return None
    try:
        detail = str(response.json().get("detail", ""))
    except (ValueError, AttributeError):
        return None
    # Every quota's 429 names it first (QuotaSpec.exceeded in service/records/tenancy/quotas.py).
    return int(retry_after) if detail.startswith("quota rate_per_s ") else None


def _rewind(options: Mapping[str, Any]) -> None:
    """The open files among a request's ``files`` back at their start, to be sent again."""
    for entry in (options.get("files") or {}).values():
        content = entry[1] if isinstance(entry, tuple) else entry
        if hasattr(content, "seek"):
            content.seek(0)


def _parts(chunks: Iterator[bytes], size: int) -> Iterator[bytes]:
    """``chunks`` regrouped into parts of ``size`` bytes (the last one shorter), holding one
    part at a time."""
    part = bytearray()
    for chunk in chunks:
        part += chunk
        while len(part) >= size:
            yield bytes(part[:size])
            del part[:size]
    if part:
        yield bytes(part)


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1024 * 1024):
            digest.update(chunk)
    return digest.hexdigest()
