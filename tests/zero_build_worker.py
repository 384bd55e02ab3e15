"""Worker of tests/test_build.py, one per rank under the deepspeed launcher (CPU, gloo): builds the tiny model
with train/build.py under ZeRO-3 and writes, per parameter, what its partition holds and how the gathered
weights compare with an unpartitioned WanModel of the same seed."""
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ds_adaptiveload.model import WanConfig, WanModel  # noqa: E402
from ds_adaptiveload.train.build import build_model  # noqa: E402


def main(out):
    import torch.distributed as dist
    from deepspeed.utils import z3_leaf_module
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    from ds_adaptiveload.train.engine import init_distributed

    _, rank, world = init_distributed()  # gloo on the CPU, and DeepSpeed's shm buffer unlinked
    torch.set_num_threads(1)
    cfg = WanConfig.from_yaml("configs/wan_tiny.yaml")
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3}}
    model = build_model(cfg, ds, seed=3)
    ref = WanModel(cfg) if torch.manual_seed(3) is not None else None
    rows = {}
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters()):
        row = {"local_numel": p.numel(), "ds_numel": getattr(p, "ds_numel", None),
               "partition_numel": p.ds_tensor.numel() if hasattr(p, "ds_tensor") else None,
               "expected_partition": math.ceil(r.numel() / world)}
        with GatheredParameters([p]):
            row["max_abs_diff"] = (p.detach().float() - r.float()).abs().max().item()
            row["std"], row["ref_std"] = p.float().std().item() if p.numel() > 1 else 0.0, \
                r.float().std().item() if r.numel() > 1 else 0.0
        rows[name] = row
    doc = {"world": world, "rows": rows, "leaf_blocks": [z3_leaf_module(b) for b in model.blocks]}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(doc, f)
    dist.barrier()


if __name__ == "__main__":
    from ds_adaptiveload.train.failures import leave, teardown

    main(sys.argv[-1])
    # As train_wan ends: the group destroyed, then no interpreter teardown, where rank 1 of a CI run aborted
    # after writing its file ("terminate called without an active exception", exit -6; 2026-12-05).
    teardown()
    leave(0)
