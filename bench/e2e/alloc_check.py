"""Is expandable_segments in effect under default_alloc_conf()? Three 1 GiB tensors: with expandable segments
they share one growing segment, without it each gets its own. Run with and without the setting:
    python3 bench/e2e/alloc_check.py            # default_alloc_conf() as the trainer calls it
    python3 bench/e2e/alloc_check.py --off      # PyTorch's default allocator"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if "--off" not in sys.argv:
    from ds_adaptiveload.train.config import default_alloc_conf

    default_alloc_conf()
import torch  # noqa: E402

xs = [torch.empty(2**30, dtype=torch.uint8, device="cuda") for _ in range(3)]
st = torch.cuda.memory_stats()
print(f"PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF')!r} torch {torch.__version__}: "
      f"segments {st['segment.all.current']}, reserved {torch.cuda.memory_reserved() / 2**30:.2f} GiB")
