"""What fits where for LoRA training: model x resolution x frames x GPU memory, predicted by the memory model (one clip
per micro-batch, one GPU, ZeRO-2, bf16, LoRA rank 32 on every projection, every block checkpointed), with and without
the checkpointed blocks' inputs offloaded to host memory; rows measured by bench/lora/lora_bench.py are marked.

    python bench/lora/fits.py            # the Markdown table docs/training.md holds (tests/test_lora_memory.py checks)

Memory model (schedule/zero.state_bytes, schedule/memory.py): peak = state + other + tokens * bytes_per_token
+ bytes_per_sample, against capacity * 0.9 (the planner's safety). state: the frozen bf16 base and the adapters'
weights, gradients and Adam state. other, bytes_per_token and bytes_per_sample: the 1.3B model's, from its H100 ZeRO-2
profile (configs/profiles/h100-wan1.3b-zero2.yaml, every block checkpointed): bytes_per_token = the checkpointed
blocks' inputs (L x dim x 2) + one block's working set; for the 14B model the inputs are its own and the working set
is the 1.3B one's scaled by dim (5120 / 1536), a prediction until measured. Offload takes the inputs off the device.
"""
import csv
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from ds_adaptiveload.model.config import WanConfig  # noqa: E402
from ds_adaptiveload.schedule.profile import CostProfile  # noqa: E402
from ds_adaptiveload.schedule.zero import state_bytes  # noqa: E402
from ds_adaptiveload.train.config import LoraSettings  # noqa: E402

PROFILE = "configs/profiles/h100-wan1.3b-zero2.yaml"
MODELS = {"1.3B": "configs/wan_1_3b.yaml", "14B": "configs/wan_14b.yaml"}
RESOLUTIONS = {"480p": (480, 832), "720p": (720, 1280)}
FRAMES = (33, 81, 121)
GPUS = {"80 GB": 85_017_493_504, "141 GB": 150_109_880_320}  # H100 80GB, H200: capacity_bytes of their profiles
SAFETY = 0.9
RANK = 32
MEASURED = {("14B", "720p", 81): "14b"}  # rows bench/lora/lora_bench.py measures: its part


def tokens(frames: int, height: int, width: int) -> int:
    return ((frames - 1) // 4 + 1) * (height // 16) * (width // 16)


def base_terms():
    """(other bytes, working-set bytes per token per unit of dim, bytes per sample) from the 1.3B profile."""
    prof = CostProfile.load(os.path.join(ROOT, PROFILE))
    small = WanConfig.from_yaml(os.path.join(ROOT, MODELS["1.3B"]))
    mem = prof.memory
    other = mem["fixed_bytes"] - state_bytes(small.num_params(), 2, 1)
    inputs = small.num_layers * small.dim * 2
    return other, (mem["bytes_per_token"] - inputs) / small.dim, mem.get("bytes_per_sample", 0)


def predicted_gib(cfg: WanConfig, n_tokens: int, offload: bool) -> float:
    other, working_per_dim, per_sample = base_terms()
    lora = cfg.lora_params(RANK, LoraSettings(rank=RANK).modules())
    inputs = 0 if offload else cfg.num_layers * cfg.dim * 2
    return (state_bytes(cfg.num_params(), 2, 1, lora) + other + per_sample
            + n_tokens * (inputs + working_per_dim * cfg.dim)) / 2**30


def measured(results_csv=os.path.join(ROOT, "bench", "results", "results.csv")) -> dict:
    """{(part, hardware): peak GiB} of the lora rows in the results table."""
    if not os.path.exists(results_csv):
        return {}
    with open(results_csv) as f:
        return {(r["variant"], r["hardware"]): float(r["value"]) for r in csv.DictReader(f)
                if r["experiment"] == "lora" and r["metric"] == "peak memory" and r["status"] == "ok" and r["value"]}


def table() -> str:
    seen = measured()
    lines = ["| model | resolution | frames | tokens | GPU memory | peak, GiB | fits | source |", "|" + "---|" * 8]
    for name, path in MODELS.items():
        cfg = WanConfig.from_yaml(os.path.join(ROOT, path))
        for res, (h, w) in RESOLUTIONS.items():
            for f in FRAMES:
                n = tokens(f, h, w)
                for gpu, cap in GPUS.items():
                    limit = cap * SAFETY / 2**30
                    keep, off = predicted_gib(cfg, n, False), predicted_gib(cfg, n, True)
                    fits = "yes" if keep <= limit else "with offload" if off <= limit else "no"
                    peak = f"{keep:.1f}" if fits == "yes" else f"{keep:.1f} ({off:.1f} offloaded)"
                    hw = "1x H100 80GB" if gpu == "80 GB" else "1x H200"
                    part = MEASURED.get((name, res, f))
                    got = seen.get((part, hw)) if part else None
                    source = f"measured: {got:.1f} GiB peak (docs/results.md)" if got is not None else "predicted"
                    lines.append(f"| {name} | {res} | {f} | {n:,} | {gpu} | {peak} | {fits} | {source} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(table())
