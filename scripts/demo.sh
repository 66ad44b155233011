#!/usr/bin/env bash
# The main job on a fresh machine: installs bnadapt into .venv, then runs `bnadapt demo`
# (starts Redis, the API and a worker under ./data, trains the digits CNN through the service,
# BN-adapts it to shifted digits, downloads the adapted weights and prints the results).
# Extra arguments go to `bnadapt demo`, e.g. --port 8001.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh worker,embedded,demo
exec .venv/bin/bnadapt demo "$@"
