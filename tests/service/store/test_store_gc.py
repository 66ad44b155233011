"""Store garbage collection (NOTE [ Store garbage collection ] in service/store/gc.py): the
rules on a real directory and a real Redis-compatible server, each interleaving with a writer
that the rename-and-recheck exists for, and the collection a running service does on its own."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import safetensors.torch

from harness.servers import wait_for
from harness.stack import Stack, npz_bytes, running_stack
from service.local.embedded import RedisServer
from service.records import keys
from service.records.connection import redis_client
from service.store.gc import collect_garbage, collect_if_due, collect_now
from service.store.local import LocalStore
from workers.models.architectures import build_model

HOUR_S = 3600.0
LONG_AGO = time.time() - 10 * HOUR_S


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    conn = redis_client(redis_server.url)
    try:
        yield conn
    finally:
        conn.close()


def object_path(store: LocalStore, sha256: str) -> Path:
    return store.root / "objects" / sha256[:2] / sha256


def age(store: LocalStore, sha256: str, when: float = LONG_AGO) -> None:
    os.utime(object_path(store, sha256), (when, when))


def never_used(sha256: str) -> bool:
    return False


def trash(store: LocalStore) -> list[Path]:
    folder = store.root / "trash"
    return sorted(folder.iterdir()) if folder.is_dir() else []


# --- the store's part ---------------------------------------------------------------------


def test_writing_an_existing_object_marks_it_as_just_written(store: LocalStore) -> None:
    sha256 = store.put_bytes(b"weights")
    age(store, sha256)
    before = time.time()
    assert store.put_bytes(b"weights") == sha256
    assert object_path(store, sha256).stat().st_mtime >= before - 1
    assert [(o.sha256, o.size) for o in store.objects()] == [(sha256, 7)]


def test_remove_unused_deletes_only_old_unused_objects(store: LocalStore) -> None:
    old, fresh, used = (store.put_bytes(data) for data in (b"old", b"fresh", b"used"))
    age(store, old)
    age(store, used)
    cutoff = time.time() - HOUR_S
    assert store.remove_unused(old, cutoff, never_used)
    assert not store.remove_unused(fresh, cutoff, never_used)
    assert not store.remove_unused(used, cutoff, lambda sha: sha == used)
    assert not store.remove_unused(old, cutoff, never_used)  # already gone: not an error
    assert not store.exists(old)
    assert store.exists(fresh) and store.exists(used)
    assert trash(store) == []


def writer_at_check(store: LocalStore, call: int) -> tuple[Callable[[str], bool], list[bool]]:
    """An ``in_use`` that always answers 'unused' and, at its ``call``-th call, writes the
    object's bytes again as a concurrent upload would; the list records whether the writer
    found the object under its name."""
    calls: list[bool] = []

    def in_use(sha256: str) -> bool:
        calls.append(store.exists(sha256))
        if len(calls) == call:
            assert store.put_bytes(b"weights") == sha256
        return False

    return in_use, calls


def test_a_writer_touching_the_object_during_the_checks_keeps_it(store: LocalStore) -> None:
    sha256 = store.put_bytes(b"weights")
    age(store, sha256)
    # After the mtime check, before the move: the writer finds the object and touches it.
    in_use, calls = writer_at_check(store, call=1)
    assert not store.remove_unused(sha256, time.time() - HOUR_S, in_use)
    # The moved file carries the writer's mtime: put back without asking about references.
    assert calls == [True]
    assert store.exists(sha256) and trash(store) == []


def test_a_reference_added_during_the_move_keeps_the_object(store: LocalStore) -> None:
    sha256 = store.put_bytes(b"weights")
    age(store, sha256)
    answers = iter([False, True])  # unused at the first check, referenced at the second
    assert not store.remove_unused(sha256, time.time() - HOUR_S, lambda sha: next(answers))
    assert store.exists(sha256) and trash(store) == []
    assert object_path(store, sha256).read_bytes() == b"weights"


def test_a_writer_after_the_move_writes_the_object_anew(store: LocalStore) -> None:
    sha256 = store.put_bytes(b"weights")
    age(store, sha256)
    # The object is in the trash: the writer finds nothing and installs its own copy.
    in_use, calls = writer_at_check(store, call=2)
    assert store.remove_unused(sha256, time.time() - HOUR_S, in_use)
    assert calls == [True, False]
    assert store.exists(sha256), "the writer's new copy survives the deletion of the old one"
    assert object_path(store, sha256).read_bytes() == b"weights"
    assert trash(store) == []


def test_settle_trash_finishes_a_dead_collectors_work(store: LocalStore) -> None:
    gone, kept = store.put_bytes(b"gone"), store.put_bytes(b"kept")
    (store.root / "trash").mkdir()
    for sha256 in (gone, kept):
        age(store, sha256)
        object_path(store, sha256).rename(store.root / "trash" / f"{sha256}.abcd")
    deleted = store.settle_trash(time.time() - HOUR_S, lambda sha: sha == kept)
    assert deleted == 1
    assert not store.exists(gone)
    assert object_path(store, kept).read_bytes() == b"kept"
    assert trash(store) == []


# --- the collection, against Redis -------------------------------------------------------


def test_collect_garbage_applies_all_three_rules(store: LocalStore, client: redis.Redis) -> None:
    shas = {name: store.put_bytes(name.encode()) for name in ("referenced", "orphan", "fresh")}
    shas |= {name: store.put_bytes(name.encode()) for name in ("dropped_now", "dropped_long_ago")}
    for name in ("referenced", "orphan", "dropped_now", "dropped_long_ago"):
        age(store, shas[name])
    client.sadd(keys.sha_refs(shas["referenced"]), "mdl_a")
    client.zadd(
        keys.STORE_RELEASED,
        {shas["dropped_now"]: time.time(), shas["dropped_long_ago"]: LONG_AGO},
    )
    stale_temp = store.root / "tmp" / "dead-writer.part"
    stale_temp.parent.mkdir(parents=True, exist_ok=True)
    stale_temp.write_bytes(b"half")
    os.utime(stale_temp, (LONG_AGO - 30 * HOUR_S,) * 2)

    done = collect_garbage(client, store, grace_s=HOUR_S)

    assert done.objects == 5
    assert done.deleted == 2
    assert done.deleted_bytes == len(b"orphan") + len(b"dropped_long_ago")
    assert done.kept_in_use == 2  # referenced, dropped_now
    assert done.kept_recent == 1
    assert done.temp_files_removed == 1
    left = {o.sha256 for o in store.objects()}
    assert left == {shas["referenced"], shas["fresh"], shas["dropped_now"]}
    # Drops older than the grace period are forgotten, recent ones kept.
    assert client.zrange(keys.STORE_RELEASED, 0, -1) == [shas["dropped_now"].encode()]


def test_one_collection_at_a_time_and_one_per_interval(
    store: LocalStore, client: redis.Redis
) -> None:
    orphan = store.put_bytes(b"orphan")
    age(store, orphan)
    holder = client.lock(keys.STORE_GC_LOCK, timeout=60)
    assert holder.acquire(blocking=False)
    assert collect_now(client, store, HOUR_S) is None
    assert store.exists(orphan)
    holder.release()
    first = collect_if_due(client, store, HOUR_S, interval_s=60)
    assert first is not None and first.deleted == 1
    store.put_bytes(b"another")
    age(store, hashlib.sha256(b"another").hexdigest())
    assert collect_if_due(client, store, HOUR_S, interval_s=60) is None  # not due yet
    assert collect_now(client, store, HOUR_S) is not None  # on demand it runs


def test_negative_grace_is_refused(store: LocalStore, client: redis.Redis) -> None:
    with pytest.raises(ValueError, match="grace_s must be >= 0"):
        collect_garbage(client, store, grace_s=-1)


# --- a running service ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    settings = {"BNADAPT_STORE_GC_INTERVAL_S": "0.5", "BNADAPT_WORKER_THREADS": "1"}
    with running_stack(tmp_path_factory.mktemp("stack"), settings) as stack:
        yield stack


def stack_store(stack: Stack) -> LocalStore:
    return LocalStore(stack.data_dir / "store")


def age_everywhere(stack: Stack, sha256: str) -> None:
    """As if the object was written, and last dropped, hours ago."""
    age(stack_store(stack), sha256)
    conn = redis_client(stack.redis.url)
    conn.zadd(keys.STORE_RELEASED, {sha256: LONG_AGO}, xx=True)
    conn.close()


def collect(stack: Stack) -> dict[str, Any]:
    """``bnadapt store gc`` with the service's settings; retried while the service's own
    collection holds the lock."""

    def run() -> subprocess.CompletedProcess[str] | None:
        result = subprocess.run(
            [sys.executable, "-m", "service.local.cli", "store", "gc"],
            env=stack.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if result.returncode == 1 and "another store collection" in result.stderr:
            return None
        return result

    result = wait_for(run, timeout_s=60, what="a store collection of our own")
    assert result.returncode == 0, result.stderr
    done: dict[str, Any] = json.loads(result.stdout)
    return done


def weights_bytes(seed: int) -> bytes:
    import torch

    torch.manual_seed(seed)
    model = build_model("digits_cnn", {"width": 4})
    return safetensors.torch.save(model.state_dict())


def registered(response: Any, status: int = 201) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    return body


@pytest.mark.slow
def test_weights_stay_while_any_model_uses_them(stack: Stack) -> None:
    api = stack.client("gc-models")
    weights = weights_bytes(seed=1)
    first = registered(api.add_model("digits_cnn", {"width": 4}, weights))
    second = registered(api.add_model("digits_cnn", {"width": 4}, weights))
    sha256 = first["sha256"]
    assert second["sha256"] == sha256 == hashlib.sha256(weights).hexdigest()

    assert api.http.delete(f"/v1/models/{first['id']}").status_code == 204
    age_everywhere(stack, sha256)
    collect(stack)
    download = api.http.get(f"/v1/models/{second['id']}/weights")
    assert download.status_code == 200 and download.content == weights

    assert api.http.delete(f"/v1/models/{second['id']}").status_code == 204
    age(stack_store(stack), sha256)  # written long ago, but the reference dropped just now
    collect(stack)
    assert stack_store(stack).exists(sha256)
    age_everywhere(stack, sha256)
    collect(stack)
    assert not stack_store(stack).exists(sha256)


@pytest.mark.slow
def test_a_job_keeps_its_inputs_and_refused_uploads_are_collected(stack: Stack) -> None:
    api = stack.client("gc-jobs")
    model = registered(api.add_model("digits_cnn", {"width": 4}, weights_bytes(seed=2)))
    x = np.random.default_rng(0).random((16, 1, 8, 8)).astype(np.float32)  # (N, 1, 8, 8)
    dataset = registered(api.add_dataset(npz_bytes(x=x)))
    job = registered(
        api.submit({"kind": "adapt", "model_id": model["id"], "dataset_id": dataset["id"]}), 202
    )
    done = api.wait(job["id"])
    assert done["status"] == "succeeded", done
    for path in (f"/v1/models/{model['id']}", f"/v1/datasets/{dataset['id']}"):
        assert api.http.delete(path).status_code == 204

    refused_weights = b"\x80\x04 not safetensors at all"
    refused = api.add_model("digits_cnn", {"width": 4}, refused_weights)
    assert refused.status_code == 422, refused.text
    refused_sha = hashlib.sha256(refused_weights).hexdigest()
    assert stack_store(stack).exists(refused_sha)  # left for the collector, not deleted at once

    for sha256 in (model["sha256"], dataset["sha256"], refused_sha):
        age_everywhere(stack, sha256)
    collect(stack)
    store = stack_store(stack)
    assert store.exists(model["sha256"]) and store.exists(dataset["sha256"])  # the job's
    assert not store.exists(refused_sha)
    report = api.http.get(f"/v1/jobs/{job['id']}/report")
    assert report.status_code == 200
    output = api.http.get(done["result"]["weights_url"])
    assert output.status_code == 200
    assert safetensors.torch.load(output.content)  # readable weights


@pytest.mark.slow
def test_the_service_collects_on_its_own(stack: Stack) -> None:
    store = stack_store(stack)
    orphan = store.put_bytes(b"written by a process that died")
    age(store, orphan)
    wait_for(lambda: not store.exists(orphan), timeout_s=60, what="the periodic collection")


def test_a_collection_stops_between_batches_when_asked(
    store: LocalStore, client: redis.Redis
) -> None:
    orphans = [store.put_bytes(f"orphan {i}".encode()) for i in range(3)]
    for sha256 in orphans:
        age(store, sha256)
    stopped = collect_garbage(client, store, HOUR_S, keep_going=lambda: False)
    assert (stopped.complete, stopped.deleted, stopped.objects) == (False, 0, 3)
    assert all(store.exists(sha256) for sha256 in orphans)
    stop = threading.Event()
    stop.set()  # the process is stopping: the lock is taken and given back, nothing deleted
    done = collect_now(client, store, HOUR_S, stop)
    assert done is not None and not done.complete
    assert client.exists(keys.STORE_GC_LOCK) == 0
    finished = collect_now(client, store, HOUR_S)
    assert finished is not None and finished.complete and finished.deleted == 3
