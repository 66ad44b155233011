#!/usr/bin/env bash
# Creates .venv-zoo (if missing), the environment of the zoo tests (tests/zoo, marked `zoo`),
# beside the main .venv, which stays as scripts/install.sh makes it.
#   bash scripts/install_zoo.sh
#   .venv-zoo/bin/python -m pytest -m zoo tests/zoo
# torchvision and timm from PyPI are built against the CUDA build of torch (their compiled
# operators need libtorch_cuda.so), which runs on a CPU-only machine too. PIP_FIND_LINKS points
# at an empty folder so that pip does not pick a local `+cpu` torch wheel; the CUDA build is
# about 5 GB with its NVIDIA libraries. The project is installed after, its torch range already
# satisfied.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TORCHVISION_VERSION="${TORCHVISION_VERSION:-0.28.0}"
TIMM_VERSION="${TIMM_VERSION:-1.0.31}"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv-zoo/bin/python ]; then
    "$PYTHON" -m venv .venv-zoo
fi
PY=.venv-zoo/bin/python
EMPTY="$(mktemp -d)"
trap 'rmdir "$EMPTY"' EXIT
PIP_FIND_LINKS="$EMPTY" "$PY" -m pip install --quiet "torch==${TORCH_VERSION}" \
    "torchvision==${TORCHVISION_VERSION}" "timm==${TIMM_VERSION}"
"$PY" -m pip install --quiet -e ".[dev,zoo]"
"$PY" -c 'import torch, torchvision, timm; print(torch.__version__, torchvision.__version__, timm.__version__)'
