#!/usr/bin/env bash
# One call on the GPU machine: JIT-build the op, CUDA tests, compute-sanitizer memcheck and racecheck on small
# shapes (every kernel choice and every tile at D = 1536 / 5120), then the benchmark with its sweep. Everything lands
# in $OUT (env.log, resource.log, pytest.log, sanitizer-*.log, bench.log, bench JSON). Each step has its own
# timeout so that a slow step cannot eat the others' results (one device call is budgeted at ~420 s).
#   run: bash bench/device_kernel.sh   (carry [".whl"]; the machine sets TORCH_CUDA_ARCH_LIST=9.0a)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source bench/device_env.sh && install_wheels "$OUT/install.log" || exit 1
BENCH_BUDGET=${BENCH_BUDGET:-120}
t0=$(date +%s); el() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv | tee "$OUT/env.log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.log"

el "JIT build"
python3 - <<'PY' 2>&1 | tail -5 | tee -a "$OUT/env.log"
import time; t = time.time()
from ds_adaptiveload.ops.builder import LNModulateBuilder
m = LNModulateBuilder().load(verbose=False)
print(f"built/loaded {m.__file__} in {time.time() - t:.0f} s")
PY
so=$(ls ~/.cache/torch_extensions/*/ln_modulate/*.so 2>/dev/null | head -1)
[ -n "$so" ] && cuobjdump --dump-resource-usage "$so" 2>/dev/null | grep -E "Function|REG" | paste - - | \
  sed -E 's/.*Function ([^ ]*).*REG:([0-9]+).*STACK:([0-9]+).*SHARED:([0-9]+).*/\1 REG \2 STACK \3/' | grep -i "bfloat16fS1_" > "$OUT/resource.log"

el "pytest"
timeout "${PYTEST_CAP:-170}" python3 -m pytest -q --maxfail=30 -p no:cacheprovider tests/test_ln_modulate.py tests/test_op_builder.py 2>&1 | tail -60 > "$OUT/pytest.log"
tail -5 "$OUT/pytest.log"

el "compute-sanitizer"
cat > /tmp/small.py <<'PY'
import torch
from ds_adaptiveload.ops import ln_modulate
from ds_adaptiveload.ops.layernorm_modulate import load_op
torch.manual_seed(0)
for variant in (0, 1, 2):  # every kernel choice under the sanitizer
  load_op().set_variant(variant, variant)
# The last two wrap each row group's shared-memory ring several times (staged row stream).
  for B, S, D, dt, aff, lay in [(2, 67, 1536, torch.bfloat16, False, "sample"), (2, 33, 100, torch.float16, True, "token"),
                              (1, 40, 5120, torch.bfloat16, True, "chunk"), (3, 9, 64, torch.float32, False, "global"),
                              (1, 2500, 5120, torch.bfloat16, False, "sample"), (2, 1500, 1536, torch.float32, True, "token"),
                              (3, 301, 2048, torch.float16, False, "global")]:
      x = torch.randn(B, S, D, device="cuda", dtype=dt, requires_grad=True)
      if lay == "chunk":
          base = torch.randn(B, S, 6, D, device="cuda", requires_grad=True); sc, sh = base[:, :, 1], base[:, :, 0]
      else:
          shp = {"sample": (B, 1, D), "token": (B, S, D), "global": (D,)}[lay]
          sc = torch.randn(shp, device="cuda", requires_grad=True); sh = torch.randn(shp, device="cuda", requires_grad=True)
      w = torch.randn(D, device="cuda", requires_grad=True) if aff else None
      b = torch.randn(D, device="cuda", requires_grad=True) if aff else None
      y = ln_modulate(x, sc, sh, weight=w, bias=b)
      y.backward(torch.randn_like(y))
# Every compile-time tile at D = 1536 and 5120 (op.set_tile), not only the defaults, with several rows per CTA
# (so that the rows-ahead ring and the barrier slots wrap).
op = load_op(); op.set_variant(0, 0)
for D, S in ((1536, 4000), (5120, 2500)):
  fi = [i for i, t in enumerate(op.fast_tiles(False)) if t[0] == D]
  bi = [i for i, t in enumerate(op.fast_tiles(True)) if t[0] == D]
  for k in range(max(len(fi), len(bi))):
    op.set_tile(fi[k] if k < len(fi) else -1, bi[k] if k < len(bi) else -1)
    x = torch.randn(2, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    sc = torch.randn(2, 1, D, device="cuda", requires_grad=True); sh = torch.randn(2, 1, D, device="cuda", requires_grad=True)
    ln_modulate(x, sc, sh).backward(torch.randn_like(x))
op.set_tile(-1, -1)
torch.cuda.synchronize(); print("small ok")
PY
san() {
  timeout "$2" compute-sanitizer --tool "$1" --print-limit 20 python3 /tmp/small.py > "$OUT/sanitizer-$1.log" 2>&1
  echo "$1 rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|small ok' "$OUT/sanitizer-$1.log" | tr '\n' ' ')"
}
san memcheck 80

el "racecheck"
san racecheck "${RACE_CAP:-45}"
if [ "${KERNEL_BENCH:-1}" = 1 ]; then  # KERNEL_BENCH=0: tests and sanitizers only (the benchmark on another GPU)
el "benchmark"
timeout 180 python3 bench/ln_modulate.py --out "$OUT/ln_modulate-$(date +%F)-h200.json" --budget-s "$BENCH_BUDGET" \
  --baseline-dtypes bfloat16 --variants "${BENCH_VARIANTS:-0,2}" ${BENCH_ARGS:-} 2>&1 | grep -v Warning > "$OUT/bench.log"
grep -E "^sweep" "$OUT/bench.log" | sed -E "s/'dtype': 'torch.bfloat16', //; s/'rpc': -1, //" | cut -c1-230
tail -18 "$OUT/bench.log"
fi

el "done"
