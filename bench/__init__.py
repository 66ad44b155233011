"""The benchmarks, run from the repository root as modules: ``python -m bench.<concern>.<name>``
(``--help`` on each says what it measures). Folders by concern: ``checkpoint`` (the checkpoint
wrapper against torch's), ``training`` (train jobs: compiled, in several processes, their
checkpoints), ``adaptation`` (estimators, quality, the benchmark of record, zoo models), ``data``
(datasets, decoding, the S3 store, uploads off the request path, sharded jobs) and ``service``
(the API and the workers around the computation: overhead, noisy neighbours, chaos).

A bench that yields a current figure writes it with ``--record`` (bench/recording.py) under
bench/figures/; ``python -m bench.results`` rewrites the table at the top of bench/RESULTS.md
from them. The benches import the test stack from ``harness``, never from ``tests``.
"""

from pathlib import Path

__all__ = ["REPO"]

# The repository root: where a bench's child processes run (``python -m bench...`` needs it as
# their working directory) and what their PYTHONPATH names.
REPO = Path(__file__).resolve().parent.parent
