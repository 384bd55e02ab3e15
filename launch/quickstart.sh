#!/usr/bin/env bash
# Set up (.venv with torch, DeepSpeed and this package) and run the main job: a real, short training run
# of a tiny Wan 2.1 DiT on synthetic latents, 2 ranks, ZeRO-3, balanced batching. Runs on CPU when there
# is no GPU. Extra arguments go to train_wan.py (e.g. --max-steps 20). Each run starts afresh in runs/quickstart
# (--overwrite: the previous run's checkpoints there are deleted).
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/env.sh
# DeepSpeed builds its CPU all-reduce op under a lock file; one left by a killed job hangs every later start, so the
# build goes to this venv's own folder (as in tests/run.sh), not the shared ~/.cache/torch_extensions.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$VENV/torch_extensions}"
exec deepspeed --num_gpus 2 launch/train_wan.py --deepspeed_config configs/ds_tiny_cpu.json \
    --model-config configs/wan_tiny.yaml --synthetic --max-steps 4 --output runs/quickstart --overwrite "$@"
