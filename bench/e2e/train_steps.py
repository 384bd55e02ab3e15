"""A short training run on the GPU machine and its step-log summary: launch/train_wan.py under the deepspeed
launcher for --steps optimizer steps on synthetic data (cached between calls of a warm machine), then the
median of each logged metric over the steps after the first two. The device runner's stages one / sp2 / dp2
(20 steps of the 1.3B architecture) and budget (micro-batches at the calibrated budget) are this script.

    python bench/e2e/train_steps.py --name sp2 --ds-base configs/ds_zero3_bf16_sp2.json --sp 2 \\
        --launcher-args "--num_gpus 2 --master_port 29612" --out OUT
    python bench/e2e/train_steps.py --name budget --budget-images configs/profiles/h200-wan1.3b-zero3-sp2.yaml \\
        --ds-base configs/ds_zero3_bf16_sp2.json --sp 2 --policy equal-tokens --steps 2 --per-step --out OUT
"""
import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_e2e import read_steps, write_ds_json  # noqa: E402

SUMMARY_KEYS = ("loss", "samples_per_s", "tokens_per_s", "mfu", "step_ms", "mem_peak_gib", "idle_fraction",
                "pred_idle_fraction")
STEP_KEYS = ("step", "samples", "tokens", "mem_peak_gib", "step_ms", "oom", "loss")


def step_summary(recs, skip=2):
    """Medians of the trained steps' metrics, the first `skip` steps left out (start-up) where more remain;
    skipped (OOM, oversize) steps are counted, not averaged."""
    trained = [r for r in recs if "skipped" not in r]
    out = {"steps": len(trained), "skipped": len(recs) - len(trained)}
    if trained:
        body = trained[skip:] or trained
        out.update({k: round(statistics.median(r[k] for r in body), 4) for k in SUMMARY_KEYS if k in trained[-1]})
    return out


def error_lines(log_path, n=5):
    """The first lines that name an error or an out-of-memory in a launcher log."""
    with open(log_path, errors="replace") as f:
        hits = [ln.rstrip()[:300] for ln in f if ln.startswith("error") or "OutOfMemory" in ln
                or "out of memory" in ln]
    return hits[:n]


def write_data(d, samples, text_dim=4096, text_len=512, dtype="bf16"):
    """Synthetic latents once per folder: a warm machine keeps /tmp, so a later call reuses them."""
    from ds_adaptiveload.data.latents import write_synthetic

    manifest = os.path.join(d, "manifest.jsonl")
    if not os.path.exists(manifest):
        write_synthetic(d, samples, text_dim=text_dim, max_text_len=text_len, dtype=dtype)
    return manifest


def budget_images(profile_path, sp):
    """2 B images of 1x480x832 (the calibration's smallest shape), B = what the profile's budget fits: the
    most samples per micro-batch, so the per-sample memory counts most."""
    from ds_adaptiveload.schedule.manifest import Sample
    from ds_adaptiveload.schedule.profile import CostProfile

    prof = CostProfile.load(profile_path)
    b = prof.mem_batch(-(-1560 // sp))  # per-GPU tokens of a 1x480x832 image
    print(f"profile budget {prof.budget_tokens} tokens -> B = {b} images per micro-batch", flush=True)
    return [Sample(f"img-{i:05d}", 1, 480, 832, {}) for i in range(2 * b)]


def launch(ds_json, manifest, steps, work, log_path, launcher_args="--num_gpus 1", extra=(),
           model_config="configs/wan_1_3b.yaml", timeout=None, script=None):
    """launch/train_wan.py (or `script`, which takes its arguments) under the deepspeed launcher (--include
    picks GPUs: the launcher overrides CUDA_VISIBLE_DEVICES); returns the exit code ('timeout' when cut). Its
    own session, so that a cut run's rank processes go with it."""
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", *shlex.split(launcher_args), script or "launch/train_wan.py",
           "--deepspeed_config", ds_json, "--model-config", model_config, "--data", manifest,
           "--max-steps", str(steps), "--no-final-save", "--output", work, *extra]
    return run_logged(cmd, log_path, timeout)


def run_logged(cmd, log_path, timeout=None):
    """cmd from the repo root in a session of its own, its output into log_path; its exit code, or 'timeout' when
    cut after `timeout` s (its rank processes killed with it)."""
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            return "timeout"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--name", required=True, help="run name: file prefix in --out")
    ap.add_argument("--ds-base", default="configs/ds_zero3_bf16.json")
    ap.add_argument("--sp", type=int, default=1, help="Ulysses degree (the base's must agree)")
    ap.add_argument("--launcher-args", default="--num_gpus 1", help="deepspeed launcher arguments, one string")
    ap.add_argument("--model-config", default="configs/wan_1_3b.yaml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--mix", default="video-heavy")
    ap.add_argument("--num", type=int, default=96)
    ap.add_argument("--seed", type=int, default=5, help="of the mix")
    ap.add_argument("--budget-images", metavar="PROFILE",
                    help="instead of the mix: images that fill the profile's budget; the run uses that profile")
    ap.add_argument("--policy", help="adaptive_load.policy (default: the base's)")
    ap.add_argument("--text-dim", type=int, default=4096)
    ap.add_argument("--text-len", type=int, default=512)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--no-checkpoint-blocks", action="store_true")
    ap.add_argument("--per-step", action="store_true", help="also print each step's samples, tokens, memory")
    ap.add_argument("--work", default="/tmp/bench_train")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    from ds_adaptiveload.schedule.mixes import make_mix

    if a.budget_images:
        samples, data = budget_images(a.budget_images, a.sp), f"{a.work}/data_budget_sp{a.sp}"
        shutil.rmtree(data, ignore_errors=True)  # its size follows the profile
    else:
        samples, data = make_mix(a.mix, a.num, seed=a.seed), f"{a.work}/data_{a.mix}_{a.num}_{a.seed}"
    manifest = write_data(data, samples, a.text_dim, a.text_len, a.dtype)
    run = f"{a.work}/run_{a.name}"
    shutil.rmtree(run, ignore_errors=True)
    os.makedirs(run)
    adaptive = {k: v for k, v in (("profile", a.budget_images), ("policy", a.policy)) if v}
    write_ds_json(f"{run}/ds.json", a.ds_base, sp=a.sp, grad_accum=a.grad_accum, **adaptive)
    shutil.copy(f"{run}/ds.json", f"{a.out}/{a.name}_ds.json")
    extra = ["--num-workers", "2"] + ([] if a.no_checkpoint_blocks else ["--checkpoint-blocks"])
    log = f"{a.out}/{a.name}_train.log"
    rc = launch(f"{run}/ds.json", manifest, a.steps, run, log, a.launcher_args, extra, a.model_config)
    print(f"{a.name}: exit {rc}", flush=True)
    logs = sorted(f for f in os.listdir(run) if f.startswith("steps.rank") and f.endswith(".jsonl"))
    for f in logs:
        shutil.copy(f"{run}/{f}", f"{a.out}/{a.name}_{f}")
    rank0 = f"{run}/steps.rank0.jsonl"
    recs = read_steps(rank0) if os.path.exists(rank0) else []
    if a.per_step:
        for r in recs:
            print({k: r.get(k) for k in STEP_KEYS})
    summary = {"name": a.name, "rc": rc, **step_summary(recs)}
    print(a.name, json.dumps(summary), flush=True)
    with open(f"{a.out}/{a.name}_summary.json", "w") as f:
        json.dump(summary, f, indent=1)
    for ln in error_lines(log):
        print(ln)
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
