#!/usr/bin/env bash
# Set up (.venv with the test extras) and run the whole test suite. CUDA tests skip with a reason on a CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/env.sh test
# Tests import the installed package; run from the repo root so configs/ and bench/ paths resolve.
python -m pytest -q -p no:cacheprovider tests "$@"
