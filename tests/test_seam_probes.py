"""docs/architecture.md's change-cost table is the seam probes' output (scripts/seam_probes/):
each probe makes its change in a scratch copy of HEAD, checks it, runs it at work and counts
the files git sees changed, and the table's row must be what it prints now. The probes run in
the slow tier; that the table has exactly their rows is checked in the quick one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from scripts.seam_probes import PROBES, TABLE_HEADER
from scripts.seam_probes.scratch import REPO

ARCHITECTURE = REPO / "docs" / "architecture.md"


def rows(table: list[str]) -> dict[str, str]:
    """A table's rows by their first cell (the change)."""
    return {line.split("|")[1].strip(): line for line in table[2:]}


def files_column(row: str) -> str:
    return row.split("|")[2].strip()


def documented_table(document: Path) -> list[str]:
    """The lines of the table that opens with the probes' header."""
    lines = document.read_text().splitlines()
    start = lines.index(TABLE_HEADER.splitlines()[0])
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return lines[start:end]


def test_the_table_has_a_row_for_each_probe_in_order() -> None:
    table = documented_table(ARCHITECTURE)
    assert "\n".join(table[:2]) == TABLE_HEADER
    assert list(rows(table)) == [probe.change for probe in PROBES.values()]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PROBES))
def test_the_row_is_the_probes_output(name: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "scripts.seam_probes", name],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    printed = rows(done.stdout.splitlines())
    change = PROBES[name].change
    documented = rows(documented_table(ARCHITECTURE))[change]
    # The count first: the change's cost is the figure that must not drift.
    assert files_column(printed[change]) == files_column(documented), (
        f"{change}: the probe counts {files_column(printed[change])} files, "
        f"docs/architecture.md says {files_column(documented)}"
    )
    assert printed[change] == documented, (
        "docs/architecture.md's row is stale; paste in the output of "
        f"`python -m scripts.seam_probes {name}`"
    )
