#!/usr/bin/env bash
# Prepare the carry folder .gpu/ for a lent GPU, and print the device calls that use it.
#   bash bench/gpu_session.sh prepare [--dry-run] | plan
# See bench/gpu_session.py.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m bench.gpu_session "$@"
