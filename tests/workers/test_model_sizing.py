"""A model measured on the meta device before it is built, the limits an inspection holds it to
(NOTE [ Bounded builds ] in workers/models/sizing.py), and the inspector's turns between
tenants over a real Redis-compatible server (NOTE [ Inspection turns ] in
workers/processes/inspector.py)."""

from __future__ import annotations

import math
import os
import threading
from typing import Any

import pytest
import redis

from api_schemas.inspection import InspectFailure, InspectRequest, InspectSuccess
from harness.servers import wait_for
from service.records import keys
from service.records.connection import redis_client
from service.settings import Settings
from service.store.local import LocalStore
from workers.errors import ArchitectureError
from workers.models.architectures import (
    ACTIVATION_PROBE_SIDE,
    activation_footprint,
    build_model,
    parameter_count,
    registry,
    resolve_kwargs,
)
from workers.models.sizing import WEIGHT_COPIES, BuildLimits, ModelSize, check_size, measure
from workers.processes.inspector import (
    LARGE_BUILD_NICENESS,
    Builder,
    InspectionTurns,
    Taken,
    build_and_check,
)

GIB = 1024**3


def measured(name: str, kwargs: dict[str, Any]) -> ModelSize:
    size = measure(name, kwargs)
    assert size is not None
    return size


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("digits_cnn", {"width": 4}),
        ("resnet", {"depth": 3, "width": 8}),
        ("mlp", {"in_features": 12, "hidden": 7, "depth": 3}),
    ],
)
def test_the_meta_measure_is_the_real_model_s(
    name: str, kwargs: dict[str, Any], one_torch_thread: None
) -> None:
    size = measured(name, kwargs)
    model = build_model(name, kwargs)
    assert size.parameter_count == parameter_count(model)
    state = model.state_dict().values()
    assert size.weights_bytes == sum(t.numel() * t.element_size() for t in state)
    # The probe's tensors are the tensor part of the footprint, which takes the larger of that
    # and the allocator's peak.
    shape = registry()[name].input_shape(resolve_kwargs(name, kwargs))
    elements = 2 * math.prod(ACTIVATION_PROBE_SIDE if d is None else d for d in shape)
    footprint = activation_footprint(model, list(shape))
    assert size.probe_bytes is not None
    assert 0 < size.probe_bytes <= footprint["backward_bytes_per_element"] * elements
    assert size.needed_bytes() == WEIGHT_COPIES * size.weights_bytes + size.probe_bytes


def test_past_the_weights_limit_names_the_numbers_and_the_largest_that_fits() -> None:
    limits = BuildLimits(max_weights_bytes=1024 * 1024, memory_bytes=GIB)
    kwargs = {"in_features": 64, "hidden": 1024, "depth": 2}
    with pytest.raises(ArchitectureError) as refused:
        check_size("mlp", kwargs, limits)
    text = str(refused.value)
    size = measured("mlp", kwargs)
    assert f"has {size.parameter_count:,} parameters" in text, text
    assert "past this service's limit of 1.0 MiB (BNADAPT_MAX_WEIGHTS_BYTES)" in text, text
    assert "at most 262,144 float32 parameters" in text, text
    hidden = int(text.split("hidden <= ")[1].split()[0])
    assert measured("mlp", {**kwargs, "hidden": hidden}).weights_bytes <= limits.max_weights_bytes
    assert measured("mlp", {**kwargs, "hidden": hidden + 1}).weights_bytes > 1024 * 1024
    # depth 1 holds a 64 x 1024 layer, within the limit: named too.
    assert "depth <= 1" in text, text
    # Within both limits: measured, not refused.
    assert check_size("mlp", {**kwargs, "hidden": hidden}, limits) is not None


def test_past_the_memory_names_what_building_needs() -> None:
    kwargs = {"depth": 4, "width": 64}
    size = measured("resnet", kwargs)
    limits = BuildLimits(max_weights_bytes=GIB, memory_bytes=size.needed_bytes() - 1)
    with pytest.raises(ArchitectureError, match="BNADAPT_INSPECT_MEMORY_BYTES") as refused:
        check_size("resnet", kwargs, limits)
    text = str(refused.value)
    assert f"({size.parameter_count:,} parameters" in text, text
    assert f"held {WEIGHT_COPIES} times" in text and "probe batch of 2" in text, text
    width = int(text.split("width <= ")[1].split()[0])
    assert limits.fits(measured("resnet", {**kwargs, "width": width}))
    assert not limits.fits(measured("resnet", {**kwargs, "width": width + 1}))


def test_an_inspection_refuses_a_huge_model_without_building_it(tmp_path: Any) -> None:
    """1.2 TiB of weights: answered from the meta device's measure, nothing allocated."""
    request = InspectRequest(
        request_id="huge",
        architecture="mlp",
        kwargs={"in_features": 1_000_000, "hidden": 65_536, "depth": 64},
    )
    settings = Settings(redis_url="redis://127.0.0.1:1/0", data_dir=tmp_path)
    limits = BuildLimits(settings.max_weights_bytes, settings.inspect_memory_limit)
    answer = build_and_check(request, LocalStore(tmp_path / "store"), limits)
    assert isinstance(answer, InspectFailure)
    assert answer.status == 422
    assert "336,127,983,626 parameters" in answer.detail, answer.detail
    assert "use hidden <= 519" in answer.detail, answer.detail


def _priority_after(request: InspectRequest, tmp_path: Any) -> tuple[int, int]:
    """The priority of the thread that ran ``build_and_check(request)`` (the part of an
    inspection a builder runs in a thread of its own), read in that thread right after, and
    that of this thread."""
    settings = Settings(redis_url="redis://127.0.0.1:1/0", data_dir=tmp_path)
    limits = BuildLimits(settings.max_weights_bytes, settings.inspect_memory_limit)
    found: list[int] = []

    def run() -> None:
        build_and_check(request, LocalStore(tmp_path / "store"), limits)
        found.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return found[0], os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_a_large_build_lowers_its_own_thread_s_priority_and_a_small_one_does_not(
    tmp_path: Any,
) -> None:
    """NOTE [ Large builds yield ]: a small build beside a large one takes the processor."""
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    small = InspectRequest(request_id="s", architecture="mlp", kwargs={"hidden": 16})
    # 2048 x 2048 x 2: about 32 MiB of weights, three copies past SMALL_BUILD_BYTES.
    large = InspectRequest(
        request_id="l", architecture="mlp", kwargs={"in_features": 2048, "hidden": 2048}
    )
    assert _priority_after(small, tmp_path) == (before, before)
    assert _priority_after(large, tmp_path) == (min(19, before + LARGE_BUILD_NICENESS), before)


# --- Turns --------------------------------------------------------------------------------


def push(client: redis.Redis, tenant: str, request_id: str) -> None:
    """What the API does (service/api/inspection.py): the tenant's list, then its turn."""
    body = InspectRequest(request_id=request_id, architecture="mlp", kwargs={})
    client.rpush(keys.inspect_requests(tenant), body.model_dump_json())
    client.zadd(keys.INSPECT_TENANTS, {tenant: 0}, nx=True)


def served(turns: InspectionTurns) -> list[str]:
    """The request ids taken until none is left, each released before the next take."""
    order = []
    while (taken := turns.take()) is not None:
        order.append(InspectRequest.model_validate_json(taken.raw).request_id)
        release(turns, taken)
    return order


def release(turns: InspectionTurns, taken: Taken) -> None:
    pipe = turns.client.pipeline()
    turns.release(pipe, taken)
    pipe.execute()


def test_tenants_take_turns_one_build_in_flight_each(redis_url: str) -> None:
    client = redis_client(redis_url)
    turns = InspectionTurns(client, lease_s=60)
    for i in range(3):
        push(client, "ten_a", f"a{i}")
    first = turns.take()
    assert first is not None and first.tenant == "ten_a"
    # A's next waits while its first is in flight, whoever asks; B's does not.
    push(client, "ten_b", "b0")
    second = turns.take()
    assert second is not None and second.tenant == "ten_b"
    assert turns.take() is None
    release(turns, first)
    release(turns, second)
    assert served(turns) == ["a1", "a2"]


def test_an_idle_tenant_comes_back_at_the_clock(redis_url: str) -> None:
    client = redis_client(redis_url)
    turns = InspectionTurns(client, lease_s=60)
    for i in range(3):
        push(client, "ten_a", f"a{i}")
        push(client, "ten_b", f"b{i}")
    assert served(turns) == ["a0", "b0", "a1", "b1", "a2", "b2"]
    for i in range(3):
        push(client, "ten_a", f"a{3 + i}")
    push(client, "ten_c", "c0")
    # C, new, is at the clock; A's turn is past it, though A pushed first.
    assert served(turns) == ["c0", "a3", "a4", "a5"]


def test_a_busy_mark_lapses_after_its_lease(redis_url: str) -> None:
    """An inspector that died with a build leaves its tenant's mark: it lapses."""
    client = redis_client(redis_url)
    turns = InspectionTurns(client, lease_s=0.5)
    push(client, "ten_a", "a0")
    push(client, "ten_a", "a1")
    assert turns.take() is not None  # never released
    assert 0 < int(client.pttl(keys.inspect_busy("ten_a"))) <= 500
    assert turns.take() is None
    taken = wait_for(turns.take, timeout_s=30, what="the busy mark to lapse")
    assert InspectRequest.model_validate_json(taken.raw).request_id == "a1"


def test_a_builder_profiles_on_one_thread_build_after_build(
    tmp_path: Any, capfd: pytest.CaptureFixture[str]
) -> None:
    """The activation probe's profiler runs on the builder's one main thread (NOTE [ Large
    builds yield ]): torch's profiler, started from another thread than the first, prints an
    error line into the worker's output (which breaks its JSON lines)."""
    settings = Settings(redis_url="redis://127.0.0.1:1/0", data_dir=tmp_path)
    builder = Builder(settings)
    try:
        assert builder.ready(lambda: None, threading.Event())
        answers = [
            builder.answer(
                InspectRequest(
                    request_id=f"r{i}", architecture="resnet", kwargs={"width": 8, "depth": 2}
                ),
                120,
                lambda: None,
            )
            for i in range(3)
        ]
    finally:
        builder.close()
    assert all(isinstance(answer, InspectSuccess) for answer in answers), answers
    footprints = [answer.activations for answer in answers if isinstance(answer, InspectSuccess)]
    assert footprints[0] is not None
    assert footprints[1] == footprints[0] == footprints[2]
    assert "registerClient" not in capfd.readouterr().err
