"""A bench's current figures as records under bench/figures/, one JSON file a figure.

A bench run with ``--record`` (:func:`add_record_options`) writes, besides its tables on stdout,
one :class:`Figure` per figure it yields: what was measured, the value, its target, the command
that measured it, the date and the machine. ``python -m bench.results`` rewrites the table at
the top of bench/RESULTS.md from every record there, so the table shows the newest run of each
figure and nothing else carries one (NOTE [ Figures in one place ] in bench/results.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from bench import REPO

__all__ = [
    "FIGURES",
    "MAX_CELL_CHARS",
    "Figure",
    "Measured",
    "add_record_options",
    "load_figures",
    "met",
    "spread",
    "threads_text",
    "write_figures",
]

FIGURES: Final = REPO / "bench" / "figures"
# A cell of the table in bench/RESULTS.md: longer than this, a figure is a paragraph, which
# belongs in the bench's own output (and bench/history/), not in the table.
MAX_CELL_CHARS: Final = 120
NAME = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
COMMAND = re.compile(r"python -m (bench(\.[a-z][a-z0-9_]*)+)( .*)?")


@dataclass(frozen=True)
class Figure:
    """One current figure: ``name`` is its file's stem under bench/figures/ (and how docs point
    at it); ``value`` a number in ``unit``, or a short text where a figure has several parts
    (``"1.000 (0.980-1.016) at 1 thread; 0.998 at 2"``); ``target`` what it must meet, and
    whether it did (``"<= 1.01: met"``, or ``"none"``)."""

    name: str
    figure: str
    value: float | str
    unit: str
    target: str
    command: str
    date: str
    machine: str

    def __post_init__(self) -> None:
        if not NAME.fullmatch(self.name):
            raise ValueError(f"figure name {self.name!r}: use lowercase words joined by '-'")
        if not DATE.fullmatch(self.date):
            raise ValueError(f"figure {self.name}: date {self.date!r} is not YYYY-MM-DD")
        if not COMMAND.fullmatch(self.command):
            raise ValueError(
                f"figure {self.name}: command {self.command!r} does not start with "
                "'python -m bench.'; record the command that measured it"
            )
        for field, text in self.cells().items():
            if len(text) > MAX_CELL_CHARS:
                raise ValueError(
                    f"figure {self.name}: its {field} is {len(text)} characters, over "
                    f"{MAX_CELL_CHARS}; shorten it (the details go in the bench's output)"
                )

    @property
    def module(self) -> str:
        """The bench module the command runs (``bench.service.overhead``)."""
        found = COMMAND.fullmatch(self.command)
        assert found is not None  # checked when built
        return found.group(1)

    def value_text(self) -> str:
        value = f"{self.value:g}" if isinstance(self.value, float | int) else self.value
        return f"{value} {self.unit}" if self.unit else value

    def cells(self) -> dict[str, str]:
        """The table's cells of this figure, by column."""
        return {
            "figure": f"`{self.name}`: {self.figure}",
            "value": self.value_text(),
            "target": self.target,
            "bench": f"`{self.command}`",
            "machine": self.machine,
            "date": self.date,
        }


@dataclass(frozen=True)
class Measured:
    """What a bench knows of a figure it measured; :func:`write_figures` adds the rest."""

    name: str
    figure: str
    value: float | str
    target: str
    unit: str = ""


def spread(median: float, low: float, high: float, digits: int = 3) -> str:
    """A ratio as the records give it: the median, its spread in brackets (``1.002
    (0.985-1.024)``)."""
    return f"{median:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def threads_text(threads: int) -> str:
    """``"1 thread"``, ``"2 threads"``: how a figure names the threads it ran on."""
    return f"{threads} thread{'' if threads == 1 else 's'}"


def met(goal: str, holds: bool) -> str:
    """A record's target: the goal and whether this run met it (``"<= 1.02: met"``)."""
    return f"{goal}: {'met' if holds else 'missed'}"


def add_record_options(parser: argparse.ArgumentParser) -> None:
    """``--record`` and ``--machine``, the options every recording bench takes."""
    parser.add_argument(
        "--record",
        action="store_true",
        help="also write this run's current figures to bench/figures/ (then `python -m "
        "bench.results` puts them in the table of bench/RESULTS.md)",
    )
    parser.add_argument(
        "--machine",
        default=None,
        help="the machine as the record gives it, e.g. 'CPU, 2 cores, quiet' (default: the "
        "architecture and core count; say whether other work ran beside the bench)",
    )


def default_machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores"


def write_figures(
    module: str,
    args: argparse.Namespace,
    measured: Sequence[Measured],
    argv: Sequence[str] | None = None,
    folder: Path = FIGURES,
) -> list[Path]:
    """Write ``measured`` as records of this run in ``folder`` when ``args.record`` is set
    (else nothing); the command is ``python -m module`` with this run's arguments (``argv``,
    by default the command line's) less ``--record``."""
    if not args.record:
        return []
    options = _measuring_options(sys.argv[1:] if argv is None else argv)
    command = " ".join(["python -m", module, *map(shlex.quote, options)])
    machine = args.machine or default_machine()
    today = datetime.date.today().isoformat()
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for one in measured:
        figure = Figure(command=command, date=today, machine=machine, **dataclasses.asdict(one))
        path = folder / f"{figure.name}.json"
        path.write_text(json.dumps(dataclasses.asdict(figure), indent=2) + "\n")
        written.append(path)
        print(f"recorded {path}", file=sys.stderr)
    return written


def _measuring_options(argv: Sequence[str]) -> list[str]:
    """``argv`` less the recording options: the options that shaped the measurement."""
    options: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--machine":
            skip = True
        elif arg != "--record" and not arg.startswith("--machine="):
            options.append(arg)
    return options


def load_figures(folder: Path = FIGURES) -> list[Figure]:
    """Every record in ``folder``, by name; a record whose name is not its file's stem is an
    error (two files would claim one figure)."""
    figures = []
    for path in sorted(folder.glob("*.json")):
        data: dict[str, Any] = json.loads(path.read_text())
        figure = Figure(**data)
        if figure.name != path.stem:
            raise ValueError(f"{path}: holds figure {figure.name!r}; rename one to match")
        figures.append(figure)
    return figures
