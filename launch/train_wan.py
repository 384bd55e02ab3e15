"""Train a Wan 2.1 DiT with DeepSpeed and the AdaptiveLoad scheduler (docs/training.md): the script form of
`python -m ds_adaptiveload train` (ds_adaptiveload/train_cli.py), for `deepspeed ... launch/train_wan.py` from a
checkout.

    deepspeed --num_gpus 8 launch/train_wan.py --deepspeed_config configs/ds_zero3_bf16.json \
        --model-config configs/wan_1_3b.yaml --data data/manifest.jsonl --max-steps 1000
    deepspeed --num_gpus 2 launch/train_wan.py --deepspeed_config configs/ds_tiny_cpu.json \
        --model-config configs/wan_tiny.yaml --synthetic --max-steps 4          # CPU smoke run
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from ds_adaptiveload.train_cli import main, parse_args  # noqa: E402  (after the path) parse_args: for scripts

if __name__ == "__main__":
    from ds_adaptiveload.train.failures import leave

    leave(main())  # atexit handlers run (logging's flush), interpreter teardown does not
