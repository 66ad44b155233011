#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (about 6-8 minutes on one GPU): the GPU tests
# (the checkpoint wrapper's CUDA paths, compiled on CUDA, SyncBatchNorm over NCCL, bf16
# autocast, and a compiled train job end to end on a CUDA worker), then the checkpoint bench's
# eager, launch-bound, adaptation and compiled rows on CUDA. Run from the repository root
# with the project's dependencies importable; PYTHON picks the interpreter (default python3).
# Exits non-zero if any test fails; the bench tables go to stdout.
set -uo pipefail
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_checks: torch sees no CUDA device; nothing to run" >&2
    exit 2
fi
"$PYTHON" -c 'import torch; print("torch", torch.__version__, "on", torch.cuda.get_device_name(0))'
status=0
"$PYTHON" -m pytest -m gpu -q -p no:cacheprovider -o log_level=WARNING \
    tests/checkpoint/test_checkpoint_gpu.py tests/e2e/test_compile_e2e.py || status=$?
(cd bench && "$PYTHON" checkpoint_bench.py --measure train control launch adapt --pairs 100) \
    || status=$?
(cd bench && "$PYTHON" checkpoint_bench.py --measure compiled --pairs 100) || status=$?
exit "$status"
