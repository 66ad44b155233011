#!/usr/bin/env bash
# Creates .venv (if missing) and installs bnadapt into it with the extras given (default: dev).
#   bash scripts/install.sh              # everything, tests included
#   bash scripts/install.sh worker,embedded,demo
# torch is installed first, so the project's `torch>=2.10` range adds nothing: TORCH_SPEC picks
# the build (default torch==2.13.0, which pip finds as a local CPU wheel on our machines). For a
# CUDA machine, install the CUDA build of torch into .venv first (see pytorch.org), then run
# this with TORCH_SPEC=torch.
set -euo pipefail
cd "$(dirname "$0")/.."

EXTRAS="${1:-dev}"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PY=.venv/bin/python
"$PY" -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
"$PY" -m pip install --quiet -e ".[${EXTRAS}]"
