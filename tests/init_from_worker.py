"""Worker of tests/test_init_export.py, one per rank under the deepspeed launcher (CPU, gloo): builds the tiny model
under ZeRO-3 without Wan's init, loads an --init-from folder into its partitions (model/init_from.py), and writes what
the rank read and how each gathered parameter compares with the file."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ds_adaptiveload.model import WanConfig  # noqa: E402
from ds_adaptiveload.model import init_from  # noqa: E402
from ds_adaptiveload.train.build import build_model  # noqa: E402


def main(src_dir, out):
    import torch.distributed as dist
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters
    from safetensors.torch import load_file

    from ds_adaptiveload.model.checkpoint import resolve_files
    from ds_adaptiveload.model.convert import from_diffusers
    from ds_adaptiveload.train.engine import init_distributed

    _, rank, world = init_distributed()
    torch.set_num_threads(1)
    cfg = WanConfig.from_yaml("configs/wan_tiny.yaml")
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3}}
    model = build_model(cfg, ds, seed=5, init_weights=False)
    src = init_from.prepare(src_dir, model, cfg, "configs/wan_tiny.yaml")
    stats = init_from.load(src, model)
    held = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters())
    ref = {}
    for f in resolve_files(src_dir):
        ref.update(load_file(str(f)))
    ref = from_diffusers(ref)
    diffs = {}
    for name, p in model.named_parameters():
        with GatheredParameters([p]):
            diffs[name] = (p.detach().float() - ref[name].float()).abs().max().item()
    full = sum(v.numel() * v.element_size() for v in ref.values())
    doc = {"world": world, "full_bytes": full, "partition_bytes": held, **stats, "max_abs_diff": diffs}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(doc, f)
    dist.barrier()


if __name__ == "__main__":
    from ds_adaptiveload.train.failures import leave, teardown

    main(sys.argv[-2], sys.argv[-1])
    teardown()
    leave(0)
