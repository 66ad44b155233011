"""Probe: a new tenant-owned resource and its routes, ``notes`` (create, read, list): its schema
module, its records class, its router, and its name among the resource kinds, the records
facade's bases and the app's routers."""

from __future__ import annotations

import ast

from scripts.seam_probes.edits import Definitions, ProbeEditError, SourceFile
from scripts.seam_probes.probe import Probe
from scripts.seam_probes.scratch import Scratch

__all__ = ["PROBE"]

SCHEMA = '''
"""Notes (a probe of the resource seam): a tenant's short texts."""

from datetime import datetime

from pydantic import BaseModel, Field

{imports}


class NoteCreate(RequestModel):
    text: str = Field(min_length=1, max_length=1000)


class NotePublic(BaseModel):
    id: str
    text: str
    created_at: datetime
'''

RECORDS = '''
"""Tenants' notes (a probe of the resource seam), in the layout of ``TenantResources``."""

{imports}


class NoteRecords(TenantResources):
    def put_note(self, tenant_id: str, note: NotePublic) -> None:
        pipe = self.client.pipeline()
        self._put(pipe, tenant_id, "note", note.id, note, note.created_at)
        pipe.execute()

    def get_note(self, tenant_id: str, note_id: str) -> NotePublic | None:
        return self._get(tenant_id, "note", note_id, NotePublic)

    def list_notes(self, tenant_id: str, page_size: int, token: str | None) -> Page[NotePublic]:
        return self._list(tenant_id, "note", NotePublic, page_size, token)
'''

ROUTER = '''
"""/v1/notes (a probe of the resource seam)."""

import secrets
from datetime import UTC, datetime

from fastapi import APIRouter

{imports}

router = APIRouter(prefix="/v1/notes", tags=["notes"])


@router.post("", status_code=201)
def create_note(body: NoteCreate, tenant: TenantDep, records: RecordsDep) -> NotePublic:
    note = NotePublic(
        id=f"note_{{secrets.token_hex(8)}}", text=body.text, created_at=datetime.now(UTC)
    )
    records.put_note(tenant, note)
    return note


@router.get("")
def list_notes(tenant: TenantDep, records: RecordsDep) -> Page[NotePublic]:
    return records.list_notes(tenant, 50, None)


@router.get("/{{note_id}}")
def get_note(note_id: str, tenant: TenantDep, records: RecordsDep) -> NotePublic:
    note = records.get_note(tenant, note_id)
    if note is None:
        raise {not_found}("note", note_id)
    return note
'''


def not_found_error(found: Definitions) -> str:
    """What the routes' lookup of a model raises when it is not the caller's: the one 404 a
    note's lookup raises too."""
    lookup = found.find("owned_model")
    for node in ast.walk(lookup.node):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            return ast.unparse(node.exc.func)
    raise ProbeEditError(f"owned_model in {lookup.path} raises no error built by a call")


def include_router(app: SourceFile, module: str) -> None:
    """Adds ``module.router`` where the app's module includes the others: to the tuple a loop
    includes, or as a call of its own after the last ``include_router``."""
    for loop in ast.walk(app.tree):
        if not (isinstance(loop, ast.For) and isinstance(loop.target, ast.Name)):
            continue
        for call in ast.walk(loop):
            if (
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and call.func.attr == "include_router"
                and isinstance(call.args[0], ast.Name)
                and call.args[0].id == loop.target.id
                and isinstance(loop.iter, ast.Tuple | ast.List)
            ):
                app.append_item(loop.iter.elts[-1], f"{module}.router")
                return
    calls = [
        statement
        for statement in ast.walk(app.tree)
        if isinstance(statement, ast.Expr)
        and isinstance(statement.value, ast.Call)
        and isinstance(statement.value.func, ast.Attribute)
        and statement.value.func.attr == "include_router"
    ]
    if not calls:
        raise ProbeEditError(f"{app.path} includes no router")
    last = calls[-1].value
    assert isinstance(last, ast.Call)
    router = ast.Attribute(value=ast.Name(id=module), attr="router")
    app.add_line_after(calls[-1], ast.unparse(ast.Call(last.func, [router], last.keywords)))


def make(scratch: Scratch, found: Definitions) -> None:
    schemas = found.find("ModelPublic").path.parent
    schema_module = f"{found.package(schemas)}.notes"
    scratch.write(
        schemas / "notes.py",
        SCHEMA.format(imports=found.imports("RequestModel")),
        "new: `NoteCreate`, `NotePublic`",
    )
    resources = found.find("TenantResources").path.parent
    imports = found.imports("Page", "TenantResources")
    scratch.write(
        resources / "notes.py",
        RECORDS.format(imports=f"{imports}\nfrom {schema_module} import NotePublic"),
        "new: its records class on `TenantResources`: owner-checked reads, newest-first pages",
    )
    routes = found.folder("router")
    not_found = not_found_error(found)
    imports = found.imports("Page", "RecordsDep", "TenantDep", not_found)
    scratch.write(
        routes / "notes.py",
        ROUTER.format(
            imports=f"{imports}\nfrom {schema_module} import NoteCreate, NotePublic",
            not_found=not_found,
        ),
        "new: its router",
    )

    kinds = SourceFile(found.find("ResourceKind").path)
    literal = kinds.assignment("ResourceKind")
    if not (isinstance(literal, ast.Subscript) and isinstance(literal.slice, ast.Tuple)):
        raise ProbeEditError(f"{kinds.path}: ResourceKind is not a Literal of several names")
    kinds.append_item(literal.slice.elts[-1], '"note"')
    scratch.note(kinds.path, "its name in `ResourceKind`")

    facade = SourceFile(found.find("Records").path)
    facade.append_base(facade.class_def("Records"), "NoteRecords")
    facade.add_import(f"from {found.package(resources)}.notes import NoteRecords")
    scratch.note(facade.path, "its class among `Records`' bases")

    app = SourceFile(found.find("create_app").path)
    include_router(app, "notes")
    app.add_import(f"from {found.package(routes)} import notes")
    scratch.note(app.path, "its router's `include_router`")


PROBE = Probe("a new resource + route", "resource", make)
