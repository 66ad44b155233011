"""One probe: a change made in a scratch copy of HEAD, checked like any change of the project,
run at work, and counted; its row of docs/architecture.md's change-cost table."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from scripts.seam_probes.edits import Definitions
from scripts.seam_probes.scratch import Scratch, scratch_copy

__all__ = ["Probe", "Row", "measure"]

# What every probe's change passes before it runs, ahead of what its check saw.
PASSES_CHECKS: Final = "ruff, `mypy --strict` and `lint-imports` pass"


@dataclass(frozen=True)
class Probe:
    """``make`` writes the change into the copy (new files written whole, existing ones edited
    by structure: edits.py), recording each file's role; ``check`` names its function in
    check.py."""

    change: str
    check: str
    make: Callable[[Scratch, Definitions], None]


@dataclass(frozen=True)
class Row:
    change: str
    files: dict[str, str]  # path -> its role in the change
    findings: list[str]

    def markdown(self) -> str:
        files = "; ".join(f"`{path}` ({role})" for path, role in self.files.items())
        seen = "; ".join([PASSES_CHECKS, *self.findings])
        return f"| {self.change} | **{len(self.files)}** | {files} | {seen} |"


def measure(probe: Probe) -> Row:
    """Makes the probe's change in a fresh copy of HEAD and counts the files git sees changed;
    an error if they are not the files the probe meant to touch, or if a check fails."""
    with scratch_copy() as scratch:
        probe.make(scratch, Definitions(scratch.root))
        scratch.tidy()
        changed = scratch.changed_files()
        if changed != sorted(scratch.touched):
            raise AssertionError(
                f"the {probe.check} probe meant to touch {sorted(scratch.touched)}, "
                f"git sees {changed} changed"
            )
        scratch.verify()
        findings = scratch.at_work(probe.check)
        return Row(probe.change, dict(scratch.touched), findings)
