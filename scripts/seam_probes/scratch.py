"""A scratch copy of the repository's ``HEAD`` for a probe to change: its files from
``git archive``, committed in a throwaway repository of their own, so that ``git status``
there lists exactly what the probe touched and nothing is ever written to this repository.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

__all__ = ["REPO", "Scratch", "scratch_copy"]

REPO: Final = Path(__file__).resolve().parents[2]
CHECK_SCRIPT: Final = Path(__file__).with_name("check.py")
_GIT_IDENTITY: Final = ("-c", "user.name=seam probe", "-c", "user.email=probe@localhost")


def _run(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    """Runs ``argv``; its stdout, or an error with its output if it fails."""
    # The argv is always the probe's own: git, ruff, mypy, lint-imports and check.py.
    done = subprocess.run(  # noqa: S603
        argv, cwd=cwd, env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(argv)} exited {done.returncode} in {cwd}:\n{done.stdout}{done.stderr}"
        )
    return done.stdout


class Scratch:
    """The copy at ``root``; ``touched`` maps each file a probe wrote or edited (relative
    path) to what it is, for the table."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.touched: dict[str, str] = {}
        # Its own modules first: the project is installed editable from this repository.
        self.env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}

    def note(self, path: Path, role: str) -> None:
        """Records that the probe changed ``path`` (under the root), as ``role``."""
        self.touched[path.relative_to(self.root).as_posix()] = role

    def write(self, path: Path, text: str, role: str) -> None:
        """A new file of the change."""
        if path.exists():
            raise FileExistsError(f"{path} already exists in HEAD; the probe adds a new file")
        path.write_text(text.lstrip())
        self.note(path, role)

    def changed_files(self) -> list[str]:
        """What git counts as changed against HEAD: modified and new files, ignored ones
        (caches) left out."""
        status = _run(["git", "status", "--porcelain=v1", "-z", "--untracked-files=all"], self.root)
        return sorted(entry[3:] for entry in status.split("\0") if entry)

    def tidy(self) -> None:
        """``ruff check --fix`` and ``ruff format`` on the touched files (NOTE [ Edits by
        structure ] in edits.py)."""
        files = sorted(self.touched)
        python = sys.executable
        _run([python, "-m", "ruff", "check", "--quiet", "--fix", "--exit-zero", *files], self.root)
        _run([python, "-m", "ruff", "format", "--quiet", *files], self.root)

    def verify(self) -> None:
        """The checks every change of the project passes: ruff, ``mypy --strict`` and the
        import contracts, over the whole copy."""
        python = sys.executable
        _run([python, "-m", "ruff", "check", "--quiet", "."], self.root)
        _run([python, "-m", "ruff", "format", "--check", "--quiet", "."], self.root)
        _run([python, "-m", "mypy"], self.root, self.env)
        lint_imports = Path(python).with_name("lint-imports")
        _run([str(lint_imports)], self.root, self.env)

    def at_work(self, check: str) -> list[str]:
        """Runs ``check.py check`` on the copy; what it saw (each line a finding it asserted)."""
        with tempfile.TemporaryDirectory() as out:
            findings = Path(out) / "findings.json"
            # -P: check.py's folder stays off sys.path (its resource.py would hide the
            # standard library's `resource`).
            argv = [sys.executable, "-P", str(CHECK_SCRIPT), check, str(findings)]
            _run(argv, self.root, self.env)
            seen: list[str] = json.loads(findings.read_text())
        return seen


@contextmanager
def scratch_copy() -> Iterator[Scratch]:
    """A fresh copy of HEAD, removed on exit."""
    with tempfile.TemporaryDirectory(prefix="seam-probe-") as parent:
        root = Path(parent) / "repo"
        root.mkdir()
        archive = Path(parent) / "head.tar"
        _run(["git", "archive", "--format=tar", f"--output={archive}", "HEAD"], REPO)
        with tarfile.open(archive) as tar:
            tar.extractall(root, filter="data")
        _run(["git", "init", "--quiet"], root)
        _run(["git", "add", "--all"], root)
        _run(["git", *_GIT_IDENTITY, "commit", "--quiet", "--no-verify", "-m", "HEAD"], root)
        yield Scratch(root)
