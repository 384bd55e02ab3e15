# Sourced by launch/quickstart.sh and tests/run.sh: one virtual environment (.venv) with torch and this
# package installed. Reuses an existing .venv; set DSAL_VENV to use another folder.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DSAL_VENV:-$ROOT/.venv}"
EXTRAS="${1:-}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install -q torch
  else
    # No GPU: the CPU build is enough and far smaller than a CUDA one.
    "$PY" -m pip install -q "torch==2.13.0" || "$PY" -m pip install -q torch
  fi
fi
"$PY" -m pip install -q "$ROOT${EXTRAS:+[$EXTRAS]}" 2>&1 | grep -v "^WARNING: Location" || true
"$PY" -c "import ds_adaptiveload, deepspeed, torch" 2>/dev/null || { echo "installation failed" >&2; exit 1; }
export PATH="$VENV/bin:$PATH"
