#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (about 6-8 minutes on one GPU): the GPU tests
# (the checkpoint wrapper's CUDA paths, compiled on CUDA, SyncBatchNorm over NCCL, bf16
# autocast, bnadapt's SyncBatchNorm in 2 ranks (NCCL on 2 GPUs, gloo on one) against torch's,
# its collectives checkpointed and not counted alike, a compiled train job end to end on a
# CUDA worker, and, with 2 GPUs or more,
# SyncBatchNorm train jobs over 2 GPUs), then the checkpoint bench's eager, launch-bound,
# adaptation and compiled rows on CUDA, and, with 2 GPUs or more, a train job on 1 GPU against
# the same on N (bench/training/processes.py). Issue 30's rows: the adapt pipeline's GPU tests
# (pinned, prefetched batches; nvJPEG decoding within 2/255 of the CPU path; bf16 statistics
# within their bounds on CUDA; a job decoding on the GPU against one decoding on the CPU) and
# the benchmark of record (bench/adaptation/record.py) at a budget of about 2 minutes,
# data generation included: 10,000 photos of 500 x 375 and 256 of 4000 x 3000 (the record's
# own defaults are 50,000 and 2,000), cut off at 240 s. Run from the repository root with the
# project's dependencies importable; PYTHON picks the interpreter (default python3).
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
    tests/checkpoint/test_checkpoint_gpu.py tests/e2e/training/test_compile_e2e.py \
    tests/e2e/training/test_processes_gpu.py tests/checkpoint/test_sync_batchnorm.py \
    tests/workers/passes/test_device_batches.py tests/workers/passes/test_gpu_decoding.py \
    tests/workers/estimators/test_adapt_precision.py || status=$?
if "$PYTHON" -c 'import torchvision' 2>/dev/null; then
    timeout 240 "$PYTHON" -m bench.adaptation.record --images 10000 --large-images 256 \
        || status=$?
else
    echo "gpu_checks: torchvision does not import: no ResNet-50 benchmark of record" >&2
fi
"$PYTHON" -m bench.checkpoint.wrapper --measure train control launch adapt --pairs 100 \
    || status=$?
"$PYTHON" -m bench.checkpoint.wrapper --measure compiled --pairs 100 || status=$?
# A train job on 1 GPU against the same job on N ranks, one a GPU (NCCL), when there are N.
gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')
if [ "$gpus" -ge 2 ]; then
    counts=$(seq 2 "$gpus" | tr '\n' ' ')
    # shellcheck disable=SC2086 # one argument a count
    "$PYTHON" -m bench.training.processes --device cuda --processes $counts || status=$?
else
    echo "gpu_checks: $gpus GPU: the 1-vs-N GPU train rows need 2 or more" >&2
fi
exit "$status"
