#!/usr/bin/env bash
# The training run at the calibrated budget: launch/train_wan.py on both GPUs with Ulysses sp = 2 and the
# committed sp = 2 profile, equal-tokens policy (micro-batches filled to memory.budget_tokens), on images of
# the calibration's smallest shape (1x480x832: the most samples per micro-batch, so the per-sample memory
# counts most). Two optimizer steps (the second carries the Adam state the first allocates). Prints each
# step's samples, tokens and peak memory; files in $OUT: budget-run.log, steps.rank0.jsonl.
#   run (kind nvidia-h200-x2, carry [".snap"]):  cd .snap && bash bench/device_budget_run.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source bench/device_env.sh && install_wheels "$OUT/install.log" || exit 1
PROFILE=${PROFILE:-configs/profiles/h200x2-wan1.3b-sp2-calibrated.yaml}
D=/tmp/budget_run; mkdir -p $D
python3 - "$D" "$PROFILE" <<'PY' || exit 1
import json, sys
from ds_adaptiveload.schedule.manifest import Sample
from ds_adaptiveload.schedule.profile import CostProfile
from ds_adaptiveload.data.latents import write_synthetic
d, profile = sys.argv[1:]
prof = CostProfile.load(profile)
b = prof.mem_batch(780)  # per-GPU tokens of a 1x480x832 image at sp = 2
print(f"profile budget {prof.budget_tokens} tokens -> B = {b} images per micro-batch", flush=True)
write_synthetic(f"{d}/data", [Sample(f"img-{i:05d}", 1, 480, 832, {}) for i in range(2 * b)],
                text_dim=4096, max_text_len=512, dtype="bf16")
ds = json.load(open("configs/ds_zero3_bf16_sp2.json"))
ds["gradient_accumulation_steps"] = 1
ds["csv_monitor"]["enabled"] = False
ds["adaptive_load"].update(profile=profile, policy="equal-tokens")
json.dump(ds, open(f"{d}/ds.json", "w"), indent=1)
PY
timeout "${RUN_CAP:-400}" deepspeed --num_gpus 2 --master_port 29641 launch/train_wan.py --deepspeed_config $D/ds.json \
  --model-config configs/wan_1_3b.yaml --data $D/data/manifest.jsonl --max-steps 2 --checkpoint-blocks \
  --no-final-save --num-workers 2 --output $D/run > "$OUT/budget-run.log" 2>&1
echo "train exit $?"
cp $D/run/steps.rank0.jsonl "$OUT/" 2>/dev/null
python3 - "$D/run/steps.rank0.jsonl" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print({k: r.get(k) for k in ("step", "samples", "tokens", "mem_peak_gib", "step_ms", "oom", "loss")})
PY
grep -E "^error|OutOfMemory|out of memory" "$OUT/budget-run.log" | cut -c1-300 | head -5
