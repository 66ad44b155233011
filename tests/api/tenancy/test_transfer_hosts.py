"""The client sends its API key only where the API is (NOTE [ Where the key goes ] in
service/client.py): an upload's ``transfer_url`` on another host is refused before a byte
goes there, unless the user allowed that host (``Client(transfer_hosts=...)`` or
``BNADAPT_TRANSFER_HOSTS``). The API in process over HTTP, naming itself under another host
name (``localhost`` where the client was given ``127.0.0.1``) as its uploads API."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.digits import digits_npz
from harness.inprocess import InProcessApi, running_api
from service.client import TRANSFER_HOSTS_ENV, Client, TransferUrlError

pytestmark = pytest.mark.slow  # servers of its own for the transfer hosts


@pytest.fixture
def api(tmp_path: Path) -> Iterator[InProcessApi]:
    with running_api(tmp_path / "api", tenant_rate_per_s=0) as api:
        # What BNADAPT_UPLOADS_URL says; the port is the API's own, known once it listens.
        api.settings.uploads_url = f"http://localhost:{api.port}"
        yield api


def test_a_transfer_url_on_another_host_gets_no_key(
    api: InProcessApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TRANSFER_HOSTS_ENV, raising=False)
    key = api.records().create_api_key("transfer-hosts").key
    path = tmp_path / "data.npz"
    path.write_bytes(digits_npz(n=50))
    client = Client(api.url, key)
    with pytest.raises(TransferUrlError) as refused:
        client.upload_dataset(path, retries=0)
    message = str(refused.value)
    for phrase in (f"http://localhost:{api.port}", "http://127.0.0.1", "transfer_hosts"):
        assert phrase in message, message
    assert TRANSFER_HOSTS_ENV in message
    # Nothing reached the transfer_url (the same API here): the upload holds no part.
    upload = client.request("GET", f"/v1/uploads/{client.last_upload_id}").json()
    assert upload["transfer_url"] == f"http://localhost:{api.port}"
    assert upload["parts"] == []

    # Allowed by the user, as an argument or in the environment: the upload goes there.
    allowed = Client(api.url, key, transfer_hosts=["localhost"])
    assert allowed.upload_dataset(path, retries=0).size_bytes == path.stat().st_size
    monkeypatch.setenv(TRANSFER_HOSTS_ENV, "uploads.example, localhost")
    assert Client(api.url, key).upload_dataset(path, retries=0).size_bytes > 0
    # The API's own host, on another port or the same: no list needed.
    monkeypatch.delenv(TRANSFER_HOSTS_ENV)
    same_host = Client(f"http://localhost:{api.port}", key)
    assert same_host.upload_dataset(path, retries=0).size_bytes > 0


def test_a_transfer_url_of_another_scheme_gets_no_key(
    api: InProcessApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TRANSFER_HOSTS_ENV, raising=False)
    api.settings.uploads_url = f"https://127.0.0.1:{api.port}"
    path = tmp_path / "data.npz"
    path.write_bytes(digits_npz(n=50))
    client = Client(api.url, api.records().create_api_key("transfer-scheme").key)
    with pytest.raises(TransferUrlError, match="not on the API's own scheme and host"):
        client.upload_dataset(path, retries=0)
