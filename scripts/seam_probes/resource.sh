#!/usr/bin/env bash
# Probe: a new tenant-owned API resource ("notes": create, read, list), added to a scratch
# worktree of HEAD; prints the diff stat, then checks lint, types, import contracts, and the
# routes over HTTP in process (owner reads it, another tenant gets 404).
source "$(dirname "$0")/common.sh"

cat > api_schemas/notes.py <<'EOF'
"""Notes (a probe of the resource seam): a tenant's short texts."""

from datetime import datetime

from pydantic import BaseModel, Field

from api_schemas.common import RequestModel


class NoteCreate(RequestModel):
    text: str = Field(min_length=1, max_length=1000)


class NotePublic(BaseModel):
    id: str
    text: str
    created_at: datetime
EOF
cat > service/records/notes.py <<'EOF'
"""Tenants' notes (a probe), in the layout of service/records/stored/resources.py."""

from api_schemas import Page
from api_schemas.notes import NotePublic
from service.records.stored.resources import TenantResources


class NoteRecords(TenantResources):
    def put_note(self, tenant_id: str, note: NotePublic) -> None:
        pipe = self.client.pipeline()
        self._put(pipe, tenant_id, "note", note.id, note, note.created_at)
        pipe.execute()

    def get_note(self, tenant_id: str, note_id: str) -> NotePublic | None:
        return self._get(tenant_id, "note", note_id, NotePublic)

    def list_notes(self, tenant_id: str, page_size: int, token: str | None) -> Page[NotePublic]:
        return self._list(tenant_id, "note", NotePublic, page_size, token)
EOF
cat > service/api/routes/notes.py <<'EOF'
"""/v1/notes (a probe of the resource seam)."""

import secrets
from datetime import UTC, datetime

from fastapi import APIRouter

from api_schemas import Page
from api_schemas.notes import NoteCreate, NotePublic
from service.api.deps import RecordsDep, TenantDep
from service.api.problems import not_found

router = APIRouter(prefix="/v1/notes", tags=["notes"])


@router.post("", status_code=201)
def create_note(body: NoteCreate, tenant: TenantDep, records: RecordsDep) -> NotePublic:
    note = NotePublic(
        id=f"note_{secrets.token_hex(8)}", text=body.text, created_at=datetime.now(UTC)
    )
    records.put_note(tenant, note)
    return note


@router.get("")
def list_notes(tenant: TenantDep, records: RecordsDep) -> Page[NotePublic]:
    return records.list_notes(tenant, 50, None)


@router.get("/{note_id}")
def get_note(note_id: str, tenant: TenantDep, records: RecordsDep) -> NotePublic:
    note = records.get_note(tenant, note_id)
    if note is None:
        raise not_found("note", note_id)
    return note
EOF
python3 - <<'EOF'
import re
def edit(p, old, new):
    s = open(p).read()
    assert old in s, (p, old)
    open(p, "w").write(s.replace(old, new, 1))
edit("service/records/keys.py", 'ResourceKind = Literal["model", "dataset", "job"]',
     'ResourceKind = Literal["model", "dataset", "job", "note"]')
edit("service/records/sync.py", "from service.records.stored.models import ModelRecords\n",
     "from service.records.stored.models import ModelRecords\nfrom service.records.notes import NoteRecords\n")
edit("service/records/sync.py", "    IdempotencyKeys,\n):", "    IdempotencyKeys,\n    NoteRecords,\n):")
edit("service/api/app.py", "        direct_uploads.router,\n    ):", "        direct_uploads.router,\n        notes.router,\n    ):")
s = open("service/api/app.py").read()
s = re.sub(r"(from service\.api\.routes import \([^)]*?)(\n\))", r"\1\n    notes,\2", s, count=1)
open("service/api/app.py", "w").write(s)
EOF
verify resource
