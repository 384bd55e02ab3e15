#!/usr/bin/env bash
# Nsight Compute look at the op's forward and backward kernels at (1, 75600, 5120) bf16, beside torch's copy
# kernel on the same bytes: DRAM throughput, issue activity and warp stall reasons (where the time goes).
#   run on the GPU machine after the op is built: OUT=... bash bench/ncu_ln_modulate.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/nsight-compute*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "ncu: not found on this machine" | tee "$OUT/ncu.txt"; exit 0; }
cat > /tmp/ncu_target.py <<'PY'
import torch
from ds_adaptiveload.ops import ln_modulate
x = torch.randn(1, 75600, 5120, device="cuda", dtype=torch.bfloat16, requires_grad=True)
sc = torch.randn(1, 1, 5120, device="cuda", requires_grad=True)
sh = torch.randn(1, 1, 5120, device="cuda", requires_grad=True)
dy = torch.randn_like(x)
z = torch.empty_like(x)
for it in range(2):  # the second iteration is profiled (the first builds/loads and warms up)
    if it == 1:
        torch.cuda.synchronize(); torch.cuda.profiler.start()
    y = ln_modulate(x, sc, sh)
    torch.autograd.grad(y, [x, sc, sh], dy)
    z.copy_(x)  # the copy kernel, same bytes as the forward
torch.cuda.synchronize(); torch.cuda.profiler.stop()
PY
timeout "${NCU_CAP:-150}" "$NCU" --target-processes all --profile-from-start off -k 'regex:fwd_vec|bwd_vec|copy' \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
  --section LaunchStats --section SchedulerStats python3 /tmp/ncu_target.py > "$OUT/ncu.txt" 2>&1
echo "ncu rc=$?"; grep -E "^  [a-z_].*\(|DRAM Throughput|Duration|Issue Slots|Achieved Occupancy|Registers Per|Stall|One or More|No Eligible" "$OUT/ncu.txt" | head -60
