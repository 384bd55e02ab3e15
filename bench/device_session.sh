#!/usr/bin/env bash
# Device runs on nvidia-h200-x2, in stages that fit one call each (a call may run 600 s):
#   calib  python -m ds_adaptiveload calibrate on GPU 0 (default grid and held-out shapes, CAL_BUDGET s)
#   calib_sp2  the same on both GPUs with Ulysses sp = 2 (configs/ds_zero3_bf16_sp2.json), after calib
#   one    1.3B, ZeRO-3, bf16, fused op: 20 steps on one GPU (GPU 1; beside calib when both are asked)
#   kernel bench/device_kernel.sh on GPU 1 (beside calib)
#   verify bench/device_verify.sh on GPU 1 (beside calib; VERIFY_* knobs pass through)
#   sp2    the same on both GPUs with Ulysses sp = 2
#   dp2    the same on both GPUs, data parallel 2
#   ncu    bench/ncu_ln_modulate.sh: Nsight Compute sections of the op's kernels (if ncu is there)
#   e2e    bench/train_e2e.py --epoch: balanced vs equal-tokens over the same samples (E2E_* knobs)
#   run (kind nvidia-h200-x2, carry [".snap"]):  cd .snap && STAGES=calib,one,sp2 bash bench/device_session.sh
#   (.snap: `git archive HEAD` plus .whl/ from ../shared/device/prepare-wheels.sh)
# A warm machine keeps /tmp: the wheels, the op's JIT cache and the synthetic data are reused by later calls.
# Results in $OUT: session-summary.txt, session-logs.tgz, and the calibration / e2e files.
set -uo pipefail
OUT=${OUT:-/tmp/session_out}; mkdir -p "$OUT"
L=/tmp/session_logs; rm -rf "$L"; mkdir -p "$L"
T0=$(date +%s); TOTAL=${TOTAL:-560}; STAGES=",${STAGES:-calib,one,sp2,dp2},"
el() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/session-summary.txt"; }
left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
cap() { local l; l=$(left); echo $(( $1 < l ? $1 : (l > 5 ? l : 5) )); }  # min(stage cap, time left)
want() { [[ $STAGES == *",$1,"* ]]; }
source bench/device_env.sh && install_wheels "$L/install.log" || exit 1
{ nvidia-smi --query-gpu=name,memory.total --format=csv
  python3 -c "import torch, deepspeed; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__)"; } > "$L/env.log" 2>&1
cat "$L/env.log"
DS=/tmp/session_ds; mkdir -p $DS

el "op build / cache load || synthetic data"
( timeout "$(cap 150)" python3 -c "from ds_adaptiveload.ops.builder import LNModulateBuilder; LNModulateBuilder().load()" \
    > "$L/build.log" 2>&1; echo "rc=$?" >> "$L/build.log" ) &
BUILD=$!
python3 - "$DS" > "$L/data.log" 2>&1 <<'PY'
import json, os, sys
from ds_adaptiveload.schedule.mixes import make_mix
from ds_adaptiveload.data.latents import write_synthetic
ds_dir = sys.argv[1]
for d, n, seed in (("/tmp/session_data", 96, 5), ("/tmp/session_e2e", int(os.environ.get("E2E_NUM", 120)), 0)):
    if not os.path.exists(f"{d}/manifest.jsonl"):
        write_synthetic(d, make_mix("video-heavy", n, seed=seed), text_dim=4096, max_text_len=512, dtype="bf16")
for name, base in (("one", "configs/ds_zero3_bf16.json"), ("dp2", "configs/ds_zero3_bf16.json"),
                   ("sp2", "configs/ds_zero3_bf16_sp2.json")):
    ds = json.load(open(base))
    ds["gradient_accumulation_steps"] = 1
    ds["csv_monitor"]["enabled"] = False
    json.dump(ds, open(f"{ds_dir}/{name}.json", "w"), indent=1)
print("data ok")
PY
el "data: $(tail -1 "$L/data.log")"
wait $BUILD; el "op: $(tail -1 "$L/build.log")"

train() {  # name "launcher args" cap  (--include picks GPUs: the launcher overrides CUDA_VISIBLE_DEVICES)
  timeout "$(cap "$3")" deepspeed $2 launch/train_wan.py --deepspeed_config "$DS/$1.json" \
    --model-config configs/wan_1_3b.yaml --data /tmp/session_data/manifest.jsonl --max-steps 20 \
    --checkpoint-blocks --no-final-save --num-workers 2 --output "/tmp/session_run_$1" > "$L/train_$1.log" 2>&1
  el "$1: exit $?"
}
if want calib; then
  el "calibrate on GPU 0 (time budget ${CAL_BUDGET:-240} s)"
  ( CUDA_VISIBLE_DEVICES=0 MASTER_PORT=29631 timeout "$(cap $(( ${CAL_BUDGET:-240} + 90 )))" python3 -m ds_adaptiveload \
      calibrate --model-config configs/wan_1_3b.yaml --deepspeed_config configs/ds_zero3_bf16.json \
      --out "$OUT/h200-wan1.3b-calibrated.yaml" --json "$OUT/calibrate.json" --time-budget "${CAL_BUDGET:-240}" \
      --train-world-size 2 > "$L/calibrate.log" 2>&1; echo "rc=$?" >> "$L/calibrate.log" ) &
  CAL=$!
fi
want one && { el "1.3B, 1 GPU (GPU 1), 20 steps"; train one "--include localhost:1 --master_port 29611" 150; }
if want kernel; then  # bench/device_kernel.sh on GPU 1 beside calib (tests, sanitizers, benchmark; KERNEL_* caps)
  el "kernel tests + sanitizers + benchmark on GPU 1"
  CUDA_VISIBLE_DEVICES=1 OUT="$OUT/kernel" TORCHINDUCTOR_COMPILE_THREADS=1 OMP_NUM_THREADS=4 \
    timeout "$(cap 480)" bash bench/device_kernel.sh > "$L/kernel.log" 2>&1
  el "kernel: exit $?"; tail -30 "$L/kernel.log" | cut -c1-250
fi
if want verify; then  # bench/device_verify.sh on GPU 1 beside calib (inductor on one thread: calib's host stays free)
  el "kernel verify on GPU 1"
  CUDA_VISIBLE_DEVICES=1 OUT="$OUT/verify" TORCHINDUCTOR_COMPILE_THREADS=1 OMP_NUM_THREADS=4 \
    timeout "$(cap 330)" bash bench/device_verify.sh > "$L/verify.log" 2>&1
  el "verify: exit $?"; tail -14 "$L/verify.log" | cut -c1-250
fi
if want calib; then wait $CAL; el "calibrate: $(tail -1 "$L/calibrate.log")"; tail -25 "$L/calibrate.log" | cut -c1-200; fi
if want calib_sp2; then
  # --no_local_rank: the launcher would put --local_rank=N before the subcommand, which the CLI rejects.
  # The time budget shrinks to what this call has left (start-up and exit need ~90 s beyond it), so that
  # the calibration ends by itself and writes its profile rather than being killed by `timeout`.
  CB=$(( $(left) - 90 )); CB=$(( ${CAL_BUDGET:-240} < CB ? ${CAL_BUDGET:-240} : CB ))
  if [ "$CB" -lt 60 ]; then el "calibrate sp2: skipped, ${CB} s of time budget left"; else
  el "calibrate on 2 GPUs, sp=2 (time budget $CB s)"
  timeout "$(cap $(( CB + 90 )))" deepspeed --num_gpus 2 --master_port 29632 --no_local_rank --module ds_adaptiveload \
    calibrate --model-config configs/wan_1_3b.yaml --deepspeed_config configs/ds_zero3_bf16_sp2.json \
    --out "$OUT/h200x2-wan1.3b-sp2-calibrated.yaml" --json "$OUT/calibrate-sp2.json" --time-budget "$CB" \
    > "$L/calibrate_sp2.log" 2>&1
  el "calibrate sp2: exit $?"; grep -E "time_|memory_|budget_tokens|wrote|out of memory|^error|Error" \
    "$L/calibrate_sp2.log" | cut -c1-300 | tail -12
  fi
fi
want ncu && { el "ncu"; NCU_CAP=$(cap 150) OUT=$OUT bash bench/ncu_ln_modulate.sh 2>&1 | tee -a "$L/ncu.log" | tail -40; }
want sp2 && { el "1.3B, 2 GPUs, Ulysses sp=2, 20 steps"; train sp2 "--num_gpus 2 --master_port 29612" 160; }
want dp2 && { el "1.3B, 2 GPUs, data parallel 2, 20 steps"; train dp2 "--num_gpus 2 --master_port 29613" 160; }
if want e2e; then
  el "e2e: ${E2E_VARIANTS:-balanced,equal-tokens}, one epoch each of $(wc -l < /tmp/session_e2e/manifest.jsonl) samples"
  timeout "$(cap 560)" python3 bench/train_e2e.py --profile "${E2E_PROFILE:-configs/profiles/h200-wan1.3b-calibrated.yaml}" \
    --data /tmp/session_e2e/manifest.jsonl --num "$(wc -l < /tmp/session_e2e/manifest.jsonl)" --epoch --warmup 1 \
    --grad-accum "${E2E_G:-4}" --variants "${E2E_VARIANTS:-balanced,equal-tokens}" --time-budget "$(( $(left) - 30 ))" \
    --out-dir "$OUT" --work /tmp/session_e2e_runs --tag "${E2E_TAG:-train_e2e-$(date +%F)-h200x2}" \
    > "$L/train_e2e.log" 2>&1
  el "e2e: exit $?"; grep -E "^\[e2e\]|^error" "$L/train_e2e.log" | cut -c1-300
  for d in /tmp/session_e2e_runs/*/; do
    [ -d "$d" ] && { mkdir -p "$L/e2e/$(basename "$d")"; cp "$d"/train.log "$d"/steps.rank*.jsonl "$d"/ds.json "$L/e2e/$(basename "$d")/" 2>/dev/null; }
  done
fi
for n in one sp2 dp2; do
  [ -d /tmp/session_run_$n ] || continue
  for f in /tmp/session_run_$n/steps.rank*.jsonl; do cp "$f" "$L/${n}_$(basename "$f")"; done
  python3 - "$n" <<'PY'
import json, sys, statistics
n = sys.argv[1]
recs = [json.loads(l) for l in open(f"/tmp/session_run_{n}/steps.rank0.jsonl")]
recs = [r for r in recs if "skipped" not in r]
keys = [k for k in ("loss", "samples_per_s", "tokens_per_s", "mfu", "step_ms", "mem_peak_gib", "idle_fraction",
                    "pred_idle_fraction") if recs and k in recs[-1]]
print(n, "steps", len(recs), {k: round(statistics.median(r[k] for r in recs[2:] or recs), 4) for k in keys})
PY
done 2>&1 | tee -a "$OUT/session-summary.txt"
grep -h "^error\|Error" "$L"/train_*.log 2>/dev/null | cut -c1-300 | head -5 | tee -a "$OUT/session-summary.txt"
tar -czf "$OUT/session-logs.tgz" -C "$L" .
# The device tool returns at most 8 files per call: the kernel / verify stages' folders go back as one file each.
for d in kernel verify; do
  [ -d "$OUT/$d" ] && tar -czf "$OUT/$d.tgz" -C "$OUT" "$d" && rm -rf "${OUT:?}/$d"
done
el "done"
