"""bench/RESULTS.md's current-figures table is what ``python -m bench.results`` makes of the
records in bench/figures/ (NOTE [ Figures in one place ] in bench/results.py), within its bounds,
and every record names a bench that exists and writes it. Runs no bench."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
from pathlib import Path

import pytest

from bench.recording import (
    FIGURES,
    MAX_CELL_CHARS,
    Figure,
    Measured,
    add_record_options,
    load_figures,
    write_figures,
)
from bench.results import MAX_TABLE_LINES, RESULTS, TABLE_MARKERS, rewritten, table


@pytest.fixture(scope="module")
def figures() -> list[Figure]:
    return load_figures(FIGURES)


def test_results_md_is_the_generators_output(figures: list[Figure]) -> None:
    text = RESULTS.read_text()
    assert text == rewritten(text, figures), "bench/RESULTS.md is stale: python -m bench.results"


def test_table_opens_results_md_within_its_bounds(figures: list[Figure]) -> None:
    text = RESULTS.read_text()
    begin, end = TABLE_MARKERS
    shown = text.split(begin + "\n", 1)[1].split("\n" + end, 1)[0]
    assert shown == table(figures)
    lines = shown.splitlines()
    assert 2 < len(lines) <= MAX_TABLE_LINES
    assert text.index(begin) < text.index("## History")
    for line in lines:
        cells = re.split(r"(?<!\\)\|", line)[1:-1]  # the pipes a cell does not escape
        assert len(cells) == 6, line
        assert max(len(cell.strip()) for cell in cells) <= MAX_CELL_CHARS, line


def test_every_record_names_a_bench_module(figures: list[Figure]) -> None:
    assert figures
    for figure in figures:
        leaf = figure.module.rsplit(".", 1)[-1]
        assert not leaf.startswith("_"), f"{figure.name}: {figure.module} is a helper, not a bench"
        assert importlib.util.find_spec(figure.module) is not None, (
            f"{figure.name}: no module {figure.module}"
        )


def _written_names(module: str) -> set[str]:
    """The string constants of ``module``'s source when it calls ``write_figures`` (the record
    names it can write), else none: read, not imported or run."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, f"no module {module}"
    tree = ast.parse(Path(spec.origin).read_text())
    calls = {
        node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
    }
    if "write_figures" not in calls:
        return set()
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


def test_every_record_is_written_by_the_bench_its_command_names(figures: list[Figure]) -> None:
    """A record no bench writes would stay in the table, its figure never measured again."""
    for figure in figures:
        assert figure.name in _written_names(figure.module), (
            f"{figure.name}: {figure.module} does not write it; give its figures to "
            "bench.recording.write_figures with the name as a string, or retire the record"
        )


def test_a_record_over_the_bounds_is_refused() -> None:
    fields = {
        "name": "x",
        "figure": "f",
        "value": 1.0,
        "unit": "",
        "target": "none",
        "command": "python -m bench.data.shards",
        "date": "2026-01-01",
        "machine": "m",
    }
    Figure(**fields)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="over 120"):
        Figure(**{**fields, "figure": "f" * 121})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="python -m bench"):
        Figure(**{**fields, "command": "python bench/data/shards.py"})  # type: ignore[arg-type]


def test_a_bench_writes_its_figures_only_when_asked(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_record_options(parser)
    measured = [Measured("shards-scaling", "2 shards / 1 worker", 1.49, "none")]
    plain = parser.parse_args([])
    assert write_figures("bench.data.shards", plain, measured, [], tmp_path) == []
    asked = parser.parse_args(["--record", "--machine", "CPU, 2 cores, quiet"])
    argv = ["--samples", "64", "--record", "--machine", "CPU, 2 cores, quiet"]
    written = write_figures("bench.data.shards", asked, measured, argv, tmp_path)
    assert [path.name for path in written] == ["shards-scaling.json"]
    (figure,) = load_figures(tmp_path)
    assert figure.command == "python -m bench.data.shards --samples 64"
    assert (figure.value, figure.machine, figure.module) == (
        1.49,
        "CPU, 2 cores, quiet",
        "bench.data.shards",
    )
    assert "shards-scaling" in table([figure])
