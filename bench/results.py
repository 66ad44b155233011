"""Rewrite the current-figures table and the history index of bench/RESULTS.md.

    python -m bench.results            # rewrite both from bench/figures/ and bench/history/
    python -m bench.results --check    # exit 1 if bench/RESULTS.md is not what they give

NOTE [ Figures in one place ]
A measurement lives in one place: the record its bench wrote (bench/figures/<name>.json,
bench/recording.py), shown in the table at the top of bench/RESULTS.md. This module writes that
table, and the index of bench/history/ (each run's own account, one file a section, as it was
written), between marker lines; the prose around them is edited by hand. Code comments, the
README and docs/ explain a mechanism and point at a figure by its name (``service-overhead`` in
bench/RESULTS.md), never copy its number: a copy goes stale on the next run, the record does
not. tests/test_results_table.py checks that the table is this module's output, within its
bounds, and that every record's command names a bench that exists.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from bench import REPO
from bench.recording import FIGURES, Figure, load_figures

__all__ = [
    "HISTORY",
    "MAX_TABLE_LINES",
    "RESULTS",
    "history_index",
    "rewritten",
    "section",
    "table",
]

RESULTS: Final = REPO / "bench" / "RESULTS.md"
HISTORY: Final = REPO / "bench" / "history"
# The table is a summary a reader takes in at once; past this, figures belong in a history file.
MAX_TABLE_LINES: Final = 60
COLUMNS: Final = ("figure", "value", "target", "bench", "machine", "date")
TABLE_MARKERS: Final = (
    "<!-- figures: begin (python -m bench.results writes this table from bench/figures/) -->",
    "<!-- figures: end -->",
)
INDEX_MARKERS: Final = (
    "<!-- history: begin (python -m bench.results writes this list from bench/history/) -->",
    "<!-- history: end -->",
)


def _escape(cell: str) -> str:
    return cell.replace("|", "\\|").replace("\n", " ")


def table(figures: Sequence[Figure]) -> str:
    """The markdown table of ``figures``, one row each in name order."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for figure in sorted(figures, key=lambda f: f.name):
        cells = figure.cells()
        lines.append("| " + " | ".join(_escape(cells[c]) for c in COLUMNS) + " |")
    if len(lines) > MAX_TABLE_LINES:
        raise ValueError(
            f"{len(figures)} figures make a table of {len(lines)} lines, over {MAX_TABLE_LINES}: "
            "merge or retire figures (bench/figures/) rather than grow the table"
        )
    return "\n".join(lines)


def history_index(folder: Path = HISTORY) -> str:
    """One line a file of ``folder``, newest first: its date and heading, linked."""
    lines = []
    for path in sorted(folder.glob("*.md"), reverse=True):
        heading = path.read_text().split("\n", 1)[0].lstrip("#").strip()
        lines.append(f"- {path.name[:10]}: [{heading}](history/{path.name})")
    return "\n".join(lines)


def section(text: str, markers: tuple[str, str], body: str) -> str:
    """``text`` with what lies between the two marker lines replaced by ``body``."""
    begin, end = markers
    if text.count(begin) != 1 or text.count(end) != 1:
        raise ValueError(f"bench/RESULTS.md needs exactly one {begin!r} and one {end!r}")
    head, rest = text.split(begin + "\n", 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def rewritten(text: str, figures: Sequence[Figure], folder: Path = HISTORY) -> str:
    """bench/RESULTS.md's ``text`` with its table and history index made anew."""
    return section(
        section(text, TABLE_MARKERS, table(figures)), INDEX_MARKERS, history_index(folder)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if RESULTS.md is stale"
    )
    args = parser.parse_args()
    text = RESULTS.read_text()
    new = rewritten(text, load_figures(FIGURES))
    if args.check:
        if new != text:
            print("bench/RESULTS.md is stale: run `python -m bench.results`", file=sys.stderr)
            sys.exit(1)
        return
    if new != text:
        RESULTS.write_text(new)
        print(f"rewrote {RESULTS.relative_to(REPO)}", file=sys.stderr)


if __name__ == "__main__":
    main()
