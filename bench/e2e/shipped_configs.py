"""The shipped configs out of the box on one GPU: the README's command for configs/ds_zero2_bf16.json and
configs/ds_zero3_bf16.json (adaptive_load.profile "auto"), 20 steps of the 1.3B model on 96 video-heavy synthetic
samples; MFU, tokens/s and peak memory as a share of the GPU's, recorded with bench/harness.record into a staging table.

    python bench/e2e/shipped_configs.py --configs configs/ds_zero2_bf16.json --out OUT
    python bench/device/run.py --wheels .whl --budget-s 590 --stages shipped=570 \\
        --args shipped="--configs configs/ds_zero3_bf16.json"

OUT gets per config: the launcher's log (which profile auto took, what moved), the step log, and results-staging.csv
(merge: python bench/harness.py merge OUT/results-staging.csv). Steps 1-2 (compilation, allocator warm-up) are left out
of the numbers: MFU is their median (the time-weighted mean in the note). A run cut by its time limit (ZeRO-3 steps of
~1M tokens took 73-80 s on an H100) is recorded with the steps that ran, and the note says so.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import harness  # noqa: E402
from train_steps import run_logged  # noqa: E402  (bench/e2e, this script's folder)

WARMUP = 2
# The README's command, per config: the attention checkpoint policy needs ZeRO-0/1/2 (train/setup.py).
POLICY = {2: "attention", 3: "full"}


# the trainer's log names the kernels --attention resolved to; the results table's names for them
ATTENTION_NAMES = {"sdpa": "SDPA", "fa4": "FlashAttention-4"}


def command(config, stage, steps, num, work, model="configs/wan_1_3b.yaml", mix="video-heavy", attention=None,
            profile=None):
    """The README's command; `attention` adds --attention (else the trainer's default, auto), `profile`
    --profile-steps."""
    return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "launch/train_wan.py",
            "--deepspeed_config", config, "--model-config", model, "--synthetic", "--synthetic-mix",
            mix, "--synthetic-num", str(num), "--checkpoint-blocks", "auto", "--checkpoint-policy",
            POLICY[stage], "--compile-blocks", "regions", "--max-steps", str(steps), "--no-final-save", "--output",
            work] + (["--attention", attention] if attention else []) + (["--profile-steps", profile] if profile else [])


def summarize(recs, warmup=WARMUP):
    """Of the steps after `warmup`: the median MFU (and the time-weighted mean), tokens/s over their time, and the peak
    memory share of all steps; OOM-skipped steps counted, not averaged."""
    import statistics

    trained = [r for r in recs if "skipped" not in r]
    # --profile-steps; a step that compiled new block graphs spent host time compiling: not a steady step's share
    busy = [r["gpu_busy_frac"] for prev, r in zip([{}] + trained, trained)
            if "gpu_busy_frac" in r and r.get("block_graphs") == prev.get("block_graphs")]
    # the profiled steps pay for the GPU timeline: speed comes from the others
    body = [r for r in trained[warmup:] if "gpu_busy_frac" not in r] or trained[warmup:] or trained
    ms = sum(r["step_ms"] for r in body)
    # a CPU run (a smoke run of this script) logs no memory
    peak, cap = max(r.get("mem_peak_gib", 0.0) for r in trained), trained[0].get("mem_capacity_gib")
    return {"steps": len(trained), "skipped": len(recs) - len(trained), "measured_steps": len(body),
            "mfu": 100 * statistics.median(r["mfu"] for r in body),
            "mfu_weighted": 100 * sum(r["mfu"] * r["step_ms"] for r in body) / ms,
            "tokens_per_s": sum(r["tokens"] for r in body) / ms * 1e3,
            "peak_gib": peak, "capacity_gib": cap, "peak_share": 100 * peak / cap if cap else None,
            "gpu_busy": [round(100 * b, 1) for b in busy]}


def hardware(device):
    """The results table's hardware name of one GPU of torch's `device` name."""
    return "1x H100 80GB" if "H100" in device else "1x H200" if "H200" in device else f"1x {device}"


def log_line(log_path, marker):
    """The first line of the launcher's log with `marker`, without its logging prefix ("" where none has it)."""
    with open(log_path, errors="replace") as f:
        return next((ln.split("] ", 1)[-1].strip() for ln in f if marker in ln), "")


def auto_line(log_path):
    return log_line(log_path, "adaptive_load.profile auto:")


def attention_of(log_path):
    """(backend, its line) as the trainer logged it, e.g. ("fa4", "attention: fa4 (--attention auto; ...)")."""
    line = log_line(log_path, "[train_wan] attention: ")
    return (line.split("attention: ", 1)[1].split()[0] if line else ""), line


def run_fields(stage, num, mix, steps, device, cmd, raw, attention):
    """The columns every row of one run shares: its experiment (a run of other than the README's 20 steps is another
    experiment), the attention the trainer logged as the variant, hardware, command and raw files."""
    length = "" if steps == 20 else f", {steps} steps"
    return dict(experiment=f"train_wan.py with the shipped ZeRO-{stage} config, profile auto, {num} {mix} "
                           f"samples{length}",
                variant=f"packed, {ATTENTION_NAMES.get(attention[0], attention[0])}", hardware=hardware(device),
                zero_stage=stage, policy="packed", model="Wan2.1 1.3B", command=" ".join(cmd), raw_file=raw)


def record(staging, config, stage, s, device, cmd, raw, profile_line, steps, num=96, mix="video-heavy", limit=None,
             attention=("sdpa", "")):
    """The run's rows, named as the results table names this experiment (upserted over an earlier run's); a run of
    other than 20 steps is another experiment. `attention`: (backend, the trainer's line) of the run."""
    cut = f" (the run was cut at its {limit:.0f} s limit)" if s["steps"] < steps and limit else ""
    but = f" but the {len(s['gpu_busy'])} profiled" if s.get("gpu_busy") else ""
    note = (f"{s['steps']} of {steps} steps{cut}, {s['skipped']} skipped (OOM); steps {WARMUP + 1}-{s['steps']}{but}; "
            + "; ".join(t for t in (profile_line, attention[1]) if t))
    section = "headline" if steps == 20 else "training"
    common = run_fields(stage, num, mix, steps, device, cmd, raw, attention)
    harness.record(staging, metric="MFU, whole step", unit="%", value=round(s["mfu"], 1), section=section,
                   note=f"median; time-weighted mean {s['mfu_weighted']:.1f}%; {note}", **common)
    if s["peak_share"] is not None:
        harness.record(staging, metric="peak memory, share of capacity", unit="%", value=round(s["peak_share"], 1),
                       section=section, note=f"{s['peak_gib']:.1f} of {s['capacity_gib']:.1f} GiB; target >= 90%; "
                                                f"{note}", **common)
    harness.record(staging, metric="throughput", unit="tokens/s", value=round(s["tokens_per_s"]), section="training",
                   note=note, **common)
    if s.get("gpu_busy"):
        harness.record(staging, metric="GPU busy, share of step wall time", unit="%",
                       value=min(s["gpu_busy"]), section="training",
                       note=f"the least of the {len(s['gpu_busy'])} recorded steps that compiled nothing "
                            f"({', '.join(map(str, s['gpu_busy']))}%); the rest of a step the GPU waits on the host; "
                            f"MFU and tokens/s are of the other steps; {note}", **common)


def record_crash(staging, stage, device, cmd, raw, done, steps, num, mix, attention, error):
    """A run that stopped with an error: a crash row in place of its MFU."""
    harness.record(staging, metric="MFU, whole step", unit="%", status="crash", section="training",
                   note=f"stopped after {done} of {steps} steps: {error[:300]}; {attention[1]}",
                   **run_fields(stage, num, mix, steps, device, cmd, raw, attention))


def run_config(args, config, device, date, timeout, attention=None):
    """One README command for `config` (with --attention `attention` where given); its summary."""
    from ds_adaptiveload.train.config import read_json_object, zero_stage

    stage = zero_stage(read_json_object(os.path.join(ROOT, config), "DeepSpeed config"))
    name = os.path.splitext(os.path.basename(config))[0] + (f"-{attention}" if attention else "")
    work = os.path.join(args.work, name)
    shutil.rmtree(work, ignore_errors=True)
    cmd = command(config, stage, args.steps, args.num, work, args.model_config, args.mix, attention, args.profile_steps)
    tag = f"shipped-{date}-{'h100' if 'H100' in device else 'h200' if 'H200' in device else 'gpu'}-{name}"
    log = os.path.join(args.out, f"{tag}.log")
    rc = run_logged(cmd, log, timeout)
    steps_file = os.path.join(work, "steps.rank0.jsonl")
    recs = [json.loads(ln) for ln in open(steps_file)] if os.path.exists(steps_file) else []
    raw = os.path.join(args.out, f"{tag}-steps.jsonl")
    if recs:
        shutil.copy(steps_file, raw)
    used = attention_of(log)
    print(f"{config}: exit {rc}, {len(recs)} step(s) logged, {used[1] or 'no attention line'} ({log})", flush=True)
    if rc != 0 and rc != "timeout":  # a crash is a result: its row says where it stopped and why
        with open(log, errors="replace") as f:
            error = harness.last_error(f.read())
        record_crash(args.staging, stage, device, cmd, f"bench/results/{os.path.basename(log)}", len(recs),
                     args.steps, args.num, args.mix, used, error)
    if (rc != 0 and rc != "timeout") or len(recs) <= WARMUP:
        return {"config": config, "attention": used[0], "exit": rc, "steps": len(recs)}
    s = summarize(recs)  # a run cut by the time limit: the steps that ran, the note says how many
    # the staging table names the raw files where the repository keeps them (bench/results/)
    record(args.staging, config, stage, s, device, cmd, f"bench/results/{os.path.basename(raw)};"
           f"bench/results/{os.path.basename(log)}", auto_line(log), args.steps, args.num, args.mix, timeout, used)
    return {"config": config, "attention": used[0], "exit": rc, **s}


def attention_runs(asked, last):
    """--attentions' next entry as a trainer flag: "other" is the backend the previous run did not take (after an
    auto run that took fa4: sdpa); "" leaves the flag out."""
    if asked == "other":
        return "sdpa" if last == "fa4" else "fa4"
    return "" if asked == "default" else asked


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="configs/ds_zero2_bf16.json,configs/ds_zero3_bf16.json",
                    help="comma list of shipped DeepSpeed JSONs")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--num", type=int, default=96, help="synthetic samples")
    ap.add_argument("--mix", default="video-heavy", help="their shape mix (a CPU smoke run: tiny)")
    ap.add_argument("--model-config", default="configs/wan_1_3b.yaml", help="(a CPU smoke run: configs/wan_tiny.yaml)")
    ap.add_argument("--attentions", default="default", help="comma list of runs per config: default (no "
                    "--attention flag: the trainer's auto), auto, sdpa, fa4, or other (the one the run before did not "
                    "take), e.g. auto,other: auto's pick against the other backend on the same machine")
    ap.add_argument("--profile-steps", metavar="A-B", help="the trainer's --profile-steps: GPU busy share of steps A-B")
    ap.add_argument("--timeout", type=float, default=560, help="seconds per run")
    ap.add_argument("--budget-s", type=float, default=None, help="total seconds (the device runner's {inner})")
    ap.add_argument("--work", default="/tmp/bench_shipped")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    args.staging = os.path.join(args.out, "results-staging.csv")
    os.makedirs(args.out, exist_ok=True)
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    date, start, results = time.strftime("%Y-%m-%d", time.gmtime()), time.monotonic(), []
    runs = args.attentions.split(",")
    for config in args.configs.split(","):
        last = ""
        for i, asked in enumerate(runs):
            left = args.budget_s - (time.monotonic() - start) if args.budget_s else args.timeout
            if left < 120:
                results.append({"config": config, "attention": asked, "skipped": "time budget"})
                continue
            # the runs of one config share what is left equally (a run that ends early leaves more to the next)
            results.append(run_config(args, config, device, date, min(args.timeout, left / (len(runs) - i)),
                                      attention_runs(asked, last)))
            last = results[-1].get("attention", "")
    with open(os.path.join(args.out, "shipped-configs.json"), "w") as f:
        json.dump({"env": harness.environment(), "device": device, "runs": results}, f, indent=1)
    print(json.dumps(results), flush=True)
    return 0 if all(r.get("exit") in (0, "timeout") and r.get("measured_steps") for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
