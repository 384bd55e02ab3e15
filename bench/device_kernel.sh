#!/usr/bin/env bash
# Kernel stage of bench/device_session.sh: installs the wheels, then runs bench/kernel/device_stage.py (build, CUDA
# tests, compute-sanitizer, benchmark), which writes stage.log, pytest.log, sanitizer.log and ln_modulate.json to $OUT.
#   APEX_SRC=/path/to/apex/contrib/csrc/layer_norm bash bench/device_kernel.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source bench/device_env.sh && install_wheels "$OUT/install.log" || exit 1
exec python3 bench/kernel/device_stage.py --out "$OUT" ${APEX_SRC:+--apex-src "$APEX_SRC"}
