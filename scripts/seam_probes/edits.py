"""Edits to the project's Python found by structure: the probes find the table, class or call a
change extends with the ``ast`` module and insert at that node's position, so reformatting,
reordering or moving the code around it does not break them.

NOTE [ Edits by structure ]
Every edit is an insertion at a node's end (``end_lineno``, ``end_col_offset``, which count
UTF-8 bytes): a new item after the last one of a dict, tuple or class's bases (``, item``: the
trailing comma, if any, then follows the new item), a line after a statement or after the
last top-level import. The result is only roughly laid out; the probe then runs
``ruff check --fix`` and ``ruff format`` on the files it touched, which sort the imports
(merging a new ``from x import y`` into the one already there) and lay out the rest, as an
engineer's editor would. Where a thing lives is read from the code too (:class:`Definitions`:
the module that defines a name), so a module that moves takes its probe's edit with it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = ["Definitions", "ProbeEditError", "SourceFile"]

# The packages whose top-level names Definitions indexes: the product, not its tests.
PRODUCT_PACKAGES: Final = ("api_schemas", "service", "workers", "bnadapt")


class ProbeEditError(Exception):
    """The code no longer has the node a probe extends; the message names what was looked for
    and where."""


@dataclass(frozen=True)
class Definition:
    """A top-level class, function or assignment of the product."""

    module: str
    path: Path
    node: ast.stmt


def _top_level_names(statement: ast.stmt) -> Iterator[str]:
    if isinstance(statement, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
        yield statement.name
    elif isinstance(statement, ast.Assign):
        for target in statement.targets:
            if isinstance(target, ast.Name):
                yield target.id
    elif isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
        yield statement.target.id


class Definitions:
    """Where each top-level name of the product packages under ``root`` is defined."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._by_name: dict[str, list[Definition]] = {}
        for package in PRODUCT_PACKAGES:
            for path in sorted((root / package).rglob("*.py")):
                relative = path.relative_to(root).with_suffix("")
                parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
                module = ".".join(parts)
                for statement in ast.parse(path.read_bytes(), str(path)).body:
                    for name in _top_level_names(statement):
                        found = Definition(module, path, statement)
                        self._by_name.setdefault(name, []).append(found)

    def find(self, name: str) -> Definition:
        """The one definition of ``name``; an error if there is none or several."""
        found = self._by_name.get(name, [])
        if len(found) != 1:
            where = ", ".join(d.module for d in found) or "no module"
            raise ProbeEditError(
                f"{name!r} is defined in {where}; a probe needs exactly one definition of it "
                f"under {', '.join(PRODUCT_PACKAGES)} (rename the probe's use, or its new code)"
            )
        return found[0]

    def folder(self, name: str) -> Path:
        """The one folder whose modules define ``name`` (as every router module defines
        ``router``)."""
        folders = {d.path.parent for d in self._by_name.get(name, [])}
        if len(folders) != 1:
            raise ProbeEditError(f"{name!r} is defined in the folders {sorted(folders)}, not one")
        return folders.pop()

    def imports(self, *names: str) -> str:
        """``from <module> import <name>`` lines for ``names``, from their defining modules."""
        return "\n".join(f"from {self.find(name).module} import {name}" for name in names)

    def package(self, folder: Path) -> str:
        """The dotted name of a folder under the root."""
        return ".".join(folder.relative_to(self.root).parts)


class SourceFile:
    """One module's text and syntax tree; each insertion rewrites the file and parses it again."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.text = path.read_text()
        self.tree = ast.parse(self.text, str(path))

    def _offset(self, line: int, col_bytes: int) -> int:
        """The character offset of an AST position (1-based line, UTF-8 byte column)."""
        lines = self.text.splitlines(keepends=True)
        before = sum(len(text) for text in lines[: line - 1])
        return before + len(lines[line - 1].encode()[:col_bytes].decode())

    def _insert_at_end(self, node: ast.expr | ast.stmt, text: str) -> None:
        if node.end_lineno is None or node.end_col_offset is None:
            raise ProbeEditError(f"{self.path}: line {node.lineno} has no end position")
        at = self._offset(node.end_lineno, node.end_col_offset)
        self.text = self.text[:at] + text + self.text[at:]
        self.tree = ast.parse(self.text, str(self.path))
        self.path.write_text(self.text)

    # Finding nodes.

    def assignment(self, name: str) -> ast.expr:
        """The value of the module's top-level assignment to ``name``."""
        for statement in self.tree.body:
            if name in _top_level_names(statement) and isinstance(
                statement, ast.Assign | ast.AnnAssign
            ):
                if statement.value is None:
                    break
                return statement.value
        raise ProbeEditError(f"{self.path} assigns no {name} at its top level")

    def class_def(self, name: str) -> ast.ClassDef:
        for statement in self.tree.body:
            if isinstance(statement, ast.ClassDef) and statement.name == name:
                return statement
        raise ProbeEditError(f"{self.path} defines no class {name}")

    def entry_constructor(self, table: ast.expr) -> str:
        """What a dict display's first entry is built with (``EstimatorSpec``): a new entry is
        built the same way."""
        if isinstance(table, ast.Dict) and table.values and isinstance(table.values[0], ast.Call):
            return ast.unparse(table.values[0].func)
        raise ProbeEditError(f"{self.path}: line {table.lineno} is not a dict of calls")

    # Inserting.

    def append_item(self, last: ast.expr, item: str) -> None:
        """Adds ``item`` after ``last``, the last item of a dict, tuple, list or class's
        bases (NOTE [ Edits by structure ])."""
        self._insert_at_end(last, f", {item}")

    def append_entry(self, table: ast.expr, key: str, value: str) -> None:
        """Adds ``key: value`` as the last entry of a dict display."""
        if not isinstance(table, ast.Dict) or not table.values:
            raise ProbeEditError(f"{self.path}: line {table.lineno} is not a non-empty dict")
        self.append_item(table.values[-1], f"{key}: {value}")

    def append_base(self, cls: ast.ClassDef, base: str) -> None:
        if not cls.bases:
            raise ProbeEditError(f"{self.path}: class {cls.name} has no bases to add to")
        self.append_item(cls.bases[-1], base)

    def add_line_after(self, statement: ast.stmt, line: str) -> None:
        """Adds ``line`` after ``statement``, at its indentation."""
        indent = " " * statement.col_offset
        self._insert_at_end(statement, f"\n{indent}{line}")

    def add_import(self, line: str) -> None:
        """Adds an import after the module's last top-level one; ruff then sorts it in."""
        imports = [s for s in self.tree.body if isinstance(s, ast.Import | ast.ImportFrom)]
        if not imports:
            raise ProbeEditError(f"{self.path} has no top-level import to add one after")
        self.add_line_after(imports[-1], line)
