#!/usr/bin/env bash
# A short device call after a kernel change: JIT build, the CUDA tests of the default kernels (tiles,
# overrides, the reference check at D = 1536 / 5120), and ours vs the baseline kernels at (1, 75600, 5120)
# bf16 through autograd. Each step capped so that what ran comes back in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source bench/device_env.sh && install_wheels "$OUT/install.log" || exit 1
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
el "JIT build"
timeout "${BUILD_CAP:-170}" python3 -c "
import time; t = time.time()
from ds_adaptiveload.ops.builder import LNModulateBuilder
LNModulateBuilder().load(verbose=False); print(f'built in {time.time() - t:.0f} s')" 2>&1 | tail -3 | tee "$OUT/build.log"
el "pytest"
timeout "${PYTEST_CAP:-45}" python3 -m pytest -q --maxfail=10 -p no:cacheprovider tests/test_ln_modulate.py \
  -k "fast_tiles or launch_overrides or (matches_reference and (1536 or 5120))" 2>&1 | tail -25 > "$OUT/pytest.log"
tail -3 "$OUT/pytest.log"
el "bench"
# VERIFY_SWEEP="--sweep-shapes ..." times every tile there (JSON only); VERIFY_BASELINE_S > 0 times the
# baselines too (torch.compile, F.layer_norm, ...) for that many seconds.
timeout "${BENCH_CAP:-40}" python3 bench/ln_modulate.py --out "$OUT/ln_modulate-verify.json" \
  --shapes "${VERIFY_SHAPES:-1x75600x5120}" --dtypes bfloat16 ${VERIFY_SWEEP:---no-sweep} --variants 0,2 \
  --budget-s "${VERIFY_BASELINE_S:-0}" 2>&1 | grep -v Warning | tail -8 | tee "$OUT/bench.log"
el "done"
