"""Per-step metrics: one small all-gather of each rank's counters, then throughput, balance and MFU.

compute_ms is the wall time of this rank's forward+backward calls (after a device synchronize). Under
ZeRO-3 those calls contain collectives (parameter all-gathers, gradient reduce-scatters) in which a fast
rank waits for a slow one, so measured compute partly absorbs the imbalance and the measured idle fraction
is a lower bound; the plan's predicted idle fraction (pred_ms) is the other half of the comparison.
"""
import json
import os

import torch
import torch.distributed as dist

# Per-rank counters gathered every step, in this order.
FIELDS = ("compute_ms", "data_ms", "loss_sum", "samples", "tokens", "flops", "nonfinite", "oom")


def gather_counters(values: dict, device) -> list:
    """All-gather FIELDS from every rank -> list (per rank) of dicts."""
    t = torch.tensor([float(values[k]) for k in FIELDS], dtype=torch.float64, device=device)
    out = torch.empty(dist.get_world_size() * len(FIELDS), dtype=torch.float64, device=device)
    dist.all_gather_into_tensor(out, t)  # flat: gloo wants the output 1-D like the input
    return [dict(zip(FIELDS, row)) for row in out.view(-1, len(FIELDS)).tolist()]


def idle_fraction(ms, wall=None) -> float:
    """1 - mean/wall: the share of the step the average rank waits. wall defaults to the slowest rank's
    time; under lockstep (ZeRO-2/3) the predicted step wall is longer than any rank's total (Plan.pred_wall_ms)."""
    m = max(ms) if wall is None else wall
    return max(0.0, 1 - sum(ms) / len(ms) / m) if m > 0 else 0.0


def step_metrics(ranks: list, sp: int, step_s: float, peak_tflops: float, device) -> dict:
    """Global metrics from the gathered counters. SP peers train the same samples, so samples, tokens,
    loss and FLOPs are counted on one rank of each SP group (each peer reports them; divide by sp)."""
    samples = sum(r["samples"] for r in ranks) / sp
    tokens = sum(r["tokens"] for r in ranks) / sp
    flops = sum(r["flops"] for r in ranks) / sp
    compute = [r["compute_ms"] for r in ranks]
    m = {
        "loss": sum(r["loss_sum"] for r in ranks) / sp / max(samples, 1),
        "samples": int(round(samples)),
        "tokens": int(round(tokens)),
        "step_ms": step_s * 1000,
        "samples_per_s": samples / step_s,
        "tokens_per_s": tokens / step_s,
        "compute_ms": compute,
        "data_ms": [r["data_ms"] for r in ranks],
        "idle_fraction": idle_fraction(compute),
        # Model FLOPs (no recompute) over the peak of every GPU in the job for the whole step.
        "mfu": flops / (step_s * len(ranks) * peak_tflops * 1e12),
    }
    if device.type == "cuda":
        m["mem_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        m["mem_capacity_gib"] = torch.cuda.get_device_properties(device).total_memory / 2**30
    return m


# An fp8 run's MFU is still bf16-equivalent model FLOPs over the bf16 peak (docs/training.md), and named so wherever
# it is shown: the step log's mfu_basis, the monitor's metric name, benchmark rows.
MFU_BF16_EQUIVALENT = "bf16-equivalent"


def mfu_name(fp8: bool, name: str = "mfu(%)") -> str:
    """The MFU metric's name: `name`, or with ", bf16-equivalent" inside its unit's brackets in an fp8 run."""
    if not fp8:
        return name
    return name[:-1] + f", {MFU_BF16_EQUIVALENT})" if name.endswith(")") else f"{name} ({MFU_BF16_EQUIVALENT})"


def monitor_events(m: dict, step: int, lr: float, fp8: bool = False) -> list:
    """(name, value, step) tuples for DeepSpeed's monitor (tensorboard / csv / wandb per the JSON); fp8: the MFU
    metric is named as bf16-equivalent (mfu_name)."""
    ev = [("train/loss", m["loss"]), ("train/lr", lr), ("throughput/samples_per_s", m["samples_per_s"]),
          ("throughput/tokens_per_s", m["tokens_per_s"]), ("time/step_ms", m["step_ms"]),
          ("balance/idle_fraction", m["idle_fraction"]), ("balance/pred_idle_fraction", m["pred_idle_fraction"]),
          (mfu_name(fp8), 100 * m["mfu"])]
    if "mem_peak_gib" in m:
        ev.append(("memory/max_allocated(GiB)", m["mem_peak_gib"]))
    return [(name, float(v), step) for name, v in ev]


class StepLog:
    """One JSONL file per rank, one line per optimizer step (append: a resumed run continues the file;
    read it back with read_step_log)."""

    def __init__(self, out_dir: str, rank: int):
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, f"steps.rank{rank}.jsonl")
        self.f = open(self.path, "a+")
        self.f.seek(0, os.SEEK_END)
        if self.f.tell():  # a killed run may have left half a line: end it so the next record parses
            self.f.seek(self.f.tell() - 1)
            last = self.f.read(1)
            if last != "\n":
                self.f.write("\n")

    def write(self, rec: dict) -> None:
        self.f.write(json.dumps(rec) + "\n")
        self.f.flush()

    def close(self):
        self.f.close()


def read_step_log(path) -> list:
    """The records of the steps that reached the final weights, in step order.

    A resumed run appends to the log from the checkpoint's step on, so the steps a crashed run trained
    after its last checkpoint appear twice. Rule: reading in file order, a record for step s discards every
    kept record with step >= s (that run was rewound to the checkpoint before s); what is left is, for each
    step, the entry of the last run that trained it. A half-written last line of a killed run is ignored."""
    kept = []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # only a killed writer leaves these (StepLog ends them with a newline)
            while kept and kept[-1]["step"] >= rec["step"]:
                kept.pop()
            kept.append(rec)
    return kept


def any_rank(count: int, device) -> int:
    """All-reduce (sum) of a per-rank count: every rank gets the same answer, so every rank takes the
    same branch (a rank that skipped alone would leave its peers waiting in a collective)."""
    t = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(t)
    return int(t.item())
