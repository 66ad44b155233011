"""A job's log is its tenant's to read, so it holds what service/public_text.py allows (NOTE
[ What a job's log shows its tenant ] in workers/running/logs.py): a job that fails with a
traceback, run by a real worker, shows its tenant no hostname, no file path and no traceback,
and still says why it failed; the worker's own log keeps all of it. The real stack."""

from __future__ import annotations

import re
import socket

import numpy as np
import pytest

from harness.answers import created
from harness.stack import REPO, Stack, npz_bytes

pytestmark = pytest.mark.slow

# An absolute path: a slash that starts a word, then a name and another slash.
_ABSOLUTE_PATH = re.compile(r"(?<![\w./~-])/[\w.@%+=,-]+/")


def _names_this_host(text: str) -> bool:
    hostname = socket.gethostname()
    return re.search(rf"(?<![\w-]){re.escape(hostname)}(?![\w-])", text) is not None


def test_a_failed_jobs_log_names_no_host_path_or_traceback(shared_stack: Stack) -> None:
    client = shared_stack.client("public-logs")
    model = created(client.add_model("digits_cnn", {"width": 4}, seed=1))
    # Finite inputs whose convolutions overflow: the worker fails the job (non-finite
    # statistics), an exception raised deep in the worker's modules.
    huge = np.full((16, 1, 8, 8), 3e38, np.float32)
    dataset = created(client.add_dataset(npz_bytes(x=huge)))
    body = {
        "kind": "adapt",
        "model_id": model["id"],
        "dataset_id": dataset["id"],
        "params": {"batch_size": 8, "estimator": "cumulative"},
    }
    job = created(client.submit(body), 202)
    assert client.wait(job["id"])["status"] == "failed"

    entries = client.http.get(f"/v1/jobs/{job['id']}/logs").json()["items"]
    text = "\n".join(entry["message"] for entry in entries)
    assert any("started" in entry["message"] for entry in entries), text
    assert not _names_this_host(text), text
    assert str(REPO) not in text and "site-packages" not in text, text
    assert _ABSOLUTE_PATH.search(text) is None, text
    assert "Traceback" not in text and 'File "' not in text, text
    # Still clear: which job failed, the exception's type and its message.
    failed = next(entry for entry in entries if "failed" in entry["message"])
    assert failed["level"] == "ERROR", failed
    assert job["id"] in failed["message"] and "non-finite" in failed["message"], failed

    # The operator's log (the worker's own logging) keeps the host and the traceback.
    operator = shared_stack.worker_log.read_text(errors="replace")
    assert _names_this_host(operator)
    assert "Traceback (most recent call last)" in operator
    assert str(REPO) in operator
