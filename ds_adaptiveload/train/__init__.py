"""Training glue for `deepspeed launch/train_wan.py` (docs/training.md): config, data, flow-matching loss,
sequence parallelism, metrics and checkpoints. Modules import torch lazily where the CLI needs them cheap."""
