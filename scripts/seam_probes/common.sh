# Sourced by the probes in this folder: a scratch worktree of HEAD to add a change to, and the
# checks every probe runs on it. Nothing is left behind.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="$REPO/.venv/bin/python"
SCRATCH="$(mktemp -d)"
WT="$SCRATCH/wt"
trap 'git -C "$REPO" worktree remove --force "$WT"; rm -rf "$SCRATCH"' EXIT
git -C "$REPO" worktree add -q "$WT" HEAD
cd "$WT"

# The whole change as git counts it, then ruff, mypy --strict and the import contracts on it,
# then the change at work (check.py NAME: over HTTP against the API in process).
verify() {
    "$PY" -m ruff check -q --fix . >/dev/null || true
    "$PY" -m ruff format -q .
    git add -A >/dev/null
    echo "== diff stat (the whole change)"
    git diff --cached --stat
    "$PY" -m ruff check -q . && echo "ruff: clean"
    "$PY" -m mypy 2>&1 | tail -n 1
    PYTHONPATH="$WT" "$REPO/.venv/bin/lint-imports" 2>&1 | grep "^Contracts:"
    echo "== the change at work"
    PYTHONPATH="$WT" "$PY" "$REPO/scripts/seam_probes/check.py" "$1"
}
