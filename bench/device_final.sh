#!/usr/bin/env bash
# One device call on nvidia-h200-x2 that checks on real GPUs what CPU tests cannot:
#   1. the fused op's CUDA tests on the final kernel source (GPU 1, after a JIT build);
#   2. adaptive_load.on_oom on one GPU (bench/oom_check.sh, GPU 0, PyTorch LN path so it need not wait
#      for the build);
#   3. the 1.3B model, ZeRO-3, bf16, fused op: 20 steps on one GPU (GPU 1), then 20 steps with Ulysses
#      sp = 2 on both GPUs.
#   run (kind nvidia-h200-x2, carry [".whl"], timeout_s 600):  bash bench/device_final.sh
# Everything lands in $OUT/final-logs.tgz plus a summary in $OUT/final-summary.txt.
set -uo pipefail
OUT=${OUT:-/tmp/final_out}; mkdir -p "$OUT"
L=/tmp/final_logs; rm -rf "$L"; mkdir -p "$L"
T0=$(date +%s); TOTAL=${FINAL_TOTAL:-400}
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/final-summary.txt"; }
cap() { local l=$(( TOTAL - ($(date +%s) - T0) )); echo $(( $1 < l ? $1 : (l > 5 ? l : 5) )); }  # min(cap, left)
source bench/device_env.sh && install_wheels "$L/install.log" || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$L/env.log" 2>&1
python3 -c "import torch, deepspeed; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__)" >> "$L/env.log" 2>&1
cat "$L/env.log"

el "build the fused op (background) || on_oom check on GPU 0"
( timeout "$(cap 150)" python3 -c "from ds_adaptiveload.ops.builder import LNModulateBuilder; LNModulateBuilder().load()" \
    > "$L/build.log" 2>&1; echo "rc=$?" >> "$L/build.log" ) &
BUILD=$!
( CUDA_VISIBLE_DEVICES=0 DS_ADAPTIVELOAD_LN_MODULATE=torch OUT="$L/oom" timeout "$(cap 200)" bash bench/oom_check.sh \
    > "$L/oom.log" 2>&1; echo "rc=$?" >> "$L/oom.log" ) &
OOM=$!
wait $BUILD; el "build: $(tail -1 "$L/build.log")"

el "kernel CUDA tests on GPU 1"
CUDA_VISIBLE_DEVICES=1 timeout "$(cap 90)" python3 -m pytest -q -p no:cacheprovider tests/test_ln_modulate.py \
  > "$L/kernel_pytest.log" 2>&1
el "kernel tests: $(tail -1 "$L/kernel_pytest.log")"

python3 - <<'PY' > "$L/data.log" 2>&1
import json
from ds_adaptiveload.schedule.mixes import make_mix
from ds_adaptiveload.data.latents import write_synthetic
write_synthetic("/tmp/final_data", make_mix("video-heavy", 96, seed=5), text_dim=4096, max_text_len=512, dtype="bf16")
for name, base, g in (("one", "configs/ds_zero3_bf16.json", 1), ("sp2", "configs/ds_zero3_bf16_sp2.json", 1)):
    ds = json.load(open(base))
    ds["gradient_accumulation_steps"] = g
    ds.get("csv_monitor", {})["enabled"] = False
    json.dump(ds, open(f"/tmp/final_data/ds_{name}.json", "w"), indent=1)
PY
el "data: $(tail -1 "$L/data.log")"
train() {  # name "launcher args" max_time  (--include picks GPUs: the launcher overrides CUDA_VISIBLE_DEVICES)
  timeout "$(cap "$3")" deepspeed $2 launch/train_wan.py --deepspeed_config "/tmp/final_data/ds_$1.json" \
    --model-config configs/wan_1_3b.yaml --data /tmp/final_data/manifest.jsonl --max-steps 20 \
    --checkpoint-blocks --no-final-save --num-workers 2 --output "/tmp/final_run_$1" > "$L/train_$1.log" 2>&1
  echo $?
}
el "1.3B, 1 GPU (GPU 1), 20 steps, while the on_oom check finishes on GPU 0"
rc_one=$(train one "--include localhost:1 --master_port 29611" 110)
el "one GPU: exit $rc_one"
wait $OOM; el "on_oom check: $(tail -1 "$L/oom.log")"; grep -E "^(PASS|FAIL)" "$L/oom.log" | tee -a "$OUT/final-summary.txt"
el "1.3B, 2 GPUs, Ulysses sp=2, 20 steps"
rc_sp=$(train sp2 "--num_gpus 2 --master_port 29612" 130)
el "sp=2: exit $rc_sp"
for n in one sp2; do
  cp /tmp/final_run_$n/steps.rank*.jsonl "$L/" 2>/dev/null
  for f in /tmp/final_run_$n/steps.rank*.jsonl; do [ -f "$f" ] && mv "$L/$(basename "$f")" "$L/${n}_$(basename "$f")"; done
  python3 - "$n" <<'PY'
import json, sys, glob, statistics
n = sys.argv[1]
recs = [json.loads(l) for f in sorted(glob.glob(f"/tmp/final_run_{n}/steps.rank0.jsonl")) for l in open(f)]
recs = [r for r in recs if "skipped" not in r]
if not recs:
    print(n, "no steps logged"); sys.exit()
keys = [k for k in ("loss", "samples_per_s", "tokens_per_s", "mfu", "step_ms", "mem_peak_gib", "idle_fraction",
                    "pred_idle_fraction") if k in recs[-1]]
print(n, "steps", len(recs), {k: round(statistics.median(r[k] for r in recs[2:] or recs), 4) for k in keys})
PY
done | tee -a "$OUT/final-summary.txt"
grep -h "^error" "$L"/train_*.log | cut -c1-300 | tee -a "$OUT/final-summary.txt"
tail -3 "$L/train_sp2.log" | cut -c1-300
tar -czf "$OUT/final-logs.tgz" -C "$L" .
el "done"
