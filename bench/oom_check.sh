#!/usr/bin/env bash
# Real-GPU check of adaptive_load.on_oom (docs/reliability.md), one device call, 1 GPU, < 2 minutes:
# the 1.3B architecture without --checkpoint-blocks and the H200 profile, whose budget_tokens (75,600:
# one 720p 81-frame clip) only fits with per-block checkpointing, so a full micro-batch runs out of memory.
#   1. on_oom "skip": 2 clips + 2 images; each clip step OOMs, is skipped and reported, the image step
#      trains; exit 0, OUT/skip/skipped.json lists the OOM steps.
#   2. on_oom "error": clips only; the first step exits 2 with the micro-batch's shape and budget.
#
#   run (kind nvidia-h200, carry [".whl"], timeout_s 300):  bash bench/oom_check.sh
#   (prepare .whl/ first, here: bash ../shared/device/prepare-wheels.sh)
set -uo pipefail
OUT=${OUT:-/tmp/oom_out}; mkdir -p "$OUT/skip" "$OUT/error"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
if [ "${OOM_CPU_SMOKE:-0}" != 1 ]; then
  source bench/device_env.sh && install_wheels "$OUT/install.log" || exit 1
fi
export PYTHONUNBUFFERED=1
W=/tmp/oom_work; rm -rf "$W"; mkdir -p "$W"
python3 - "$W" <<'PY' || exit 1
import json, sys
from ds_adaptiveload.schedule.manifest import Sample
from ds_adaptiveload.data.latents import write_synthetic
w = sys.argv[1]
clip, image = (81, 720, 1280), (1, 480, 832)
for name, shapes in (("mixed", [clip, clip, image, image]), ("clips", [clip, clip])):
    write_synthetic(f"{w}/{name}", [Sample(f"{name}-{i}", *s) for i, s in enumerate(shapes)], text_dim=4096,
                    max_text_len=512, dtype="bf16")
ds = json.load(open("configs/ds_zero3_bf16.json"))
ds["gradient_accumulation_steps"] = 1
ds["optimizer"]["params"]["torch_adam"] = True  # FusedAdam's JIT build crashes on 9.0a (NOTES.md)
ds["csv_monitor"]["enabled"] = False
for policy in ("skip", "error"):
    ds["adaptive_load"].update(on_oom=policy, profile="configs/profiles/h200-wan1.3b-blocks.yaml")
    json.dump(ds, open(f"{w}/ds_{policy}.json", "w"), indent=1)
PY
el "data written"
train() {  # policy manifest steps
  timeout 110 deepspeed --num_gpus 1 launch/train_wan.py --deepspeed_config "$W/ds_$1.json" \
    --model-config configs/wan_1_3b.yaml --data "$W/$2/manifest.jsonl" --max-steps "$3" --no-final-save \
    --num-workers 1 --output "$W/run_$1" > "$OUT/$1/train.log" 2>&1
}
train skip mixed 3; rc_skip=$?
el "on_oom=skip: exit $rc_skip"
cp "$W"/run_skip/steps.rank0.jsonl "$W"/run_skip/skipped.json "$OUT/skip/" 2>/dev/null
grep -h "skipped on every rank\|summary:" "$OUT/skip/train.log" | cut -c1-400
train error clips 1; rc_err=$?
el "on_oom=error: exit $rc_err"
grep -h "^error:" "$OUT/error/train.log" | cut -c1-400
python3 - "$OUT" "$rc_skip" "$rc_err" <<'PY'
import json, sys
out, rc_skip, rc_err = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
try:
    recs = [json.loads(l) for l in open(f"{out}/skip/steps.rank0.jsonl")]
except OSError:
    recs = []
ooms = [r["step"] for r in recs if r.get("skipped", {}).get("reason") == "oom"]
trained = [r["step"] for r in recs if "skipped" not in r]
err = open(f"{out}/error/train.log").read()
checks = {"skip run exits 0": rc_skip == 0, "skip run skipped >= 1 OOM step": len(ooms) >= 1,
          "skip run trained >= 1 step after/besides them": len(trained) >= 1,
          "error run exits 2": rc_err == 2, "error names the micro-batch": "out of memory in micro-batch" in err}
for k, v in checks.items():
    print(("PASS " if v else "FAIL ") + k)
json.dump({"oom_steps": ooms, "trained_steps": trained, "checks": checks}, open(f"{out}/oom_check.json", "w"), indent=1)
sys.exit(0 if all(checks.values()) else 1)
PY
