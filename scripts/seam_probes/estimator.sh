#!/usr/bin/env bash
# Probe: a new estimator ("ema_half": the train-mode loop at momentum 0.5), added to a scratch
# worktree of HEAD; prints the diff stat, then checks lint, types, import contracts, and an
# adapt job with it accepted by the API and run by a real RQ worker in process.
source "$(dirname "$0")/common.sh"

cat > workers/estimators/ema_half.py <<'EOF'
"""The ``ema_half`` estimator (a probe of the estimator seam): ``ema`` at momentum 0.5."""

from workers.estimators.base import AdaptStats, EstimatorTask, resolve_batchnorm
from workers.estimators.moving_averages import run_ema


def run(task: EstimatorTask) -> AdaptStats:
    selected = resolve_batchnorm(task.model, task.layers)
    momenta = [bn.momentum for bn in selected]
    try:
        for bn in selected:
            bn.momentum = 0.5
        return run_ema(task)
    finally:
        for bn, momentum in zip(selected, momenta, strict=True):
            bn.momentum = momentum
EOF
python3 - <<'EOF'
p = "api_schemas/jobs/adapt.py"
s = open(p).read()
anchor = '    "cumulative": EstimatorSpec(\n'
row = '''    "ema_half": EstimatorSpec(
        "the train-mode loop at momentum 0.5 (a probe)",
        "workers.estimators.ema_half:run",
        resets=False,
        sharding=None,
        sequential_reason="each batch updates the statistics the next batch starts from",
    ),
'''
assert anchor in s
open(p, "w").write(s.replace(anchor, row + anchor, 1))
EOF
verify estimator
