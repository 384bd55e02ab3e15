"""What gradient accumulation holds in memory beyond a step of one micro-batch: calibrate times and measures every
micro-batch as an optimizer step of its own (gradient_accumulation_steps 1), training takes G. One process per G
builds the model and engine as calibrate does (training's own pieces), runs a few steps of G micro-batches of one
small shape and records each micro-batch's peak and the allocated bytes after each step:

    python3 bench/e2e/accum_memory.py --out OUT [--config configs/ds_zero2_bf16.json] [--ga 1,4] [--steps 3]

The difference of the peaks from the second step on (Adam's states exist in both from the first optimizer step) is
what the profile's memory model misses at G > 1; OUT/accum-memory.json holds every reading."""
import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/, for harness
from harness import run_child  # noqa: E402


def child(args) -> dict:
    """One engine at gradient_accumulation_steps args.child: peaks per micro-batch, allocated after each step."""
    import torch

    from ds_adaptiveload.calibrate.engine import StepFn
    from ds_adaptiveload.model import WanConfig, WanModel
    from ds_adaptiveload.schedule.profile import CostProfile
    from ds_adaptiveload.shipped import config_profile
    from ds_adaptiveload.train import config as tconfig, engine as eng, sp as tsp

    g = args.child
    tconfig.default_alloc_conf()  # expandable segments, as training and calibrate run
    eng.single_process_env()
    accel, _, _ = eng.init_distributed()
    device = eng.pick_device(accel, 0)
    cfg = WanConfig.from_yaml(os.path.join(ROOT, args.model_config))
    base = os.path.join(ROOT, args.config)
    ds = tconfig.derive_ds_config(base, grad_accum=g, sp=1, dp=1, tensorboard=None, csv_monitor=None, wandb=None,
                                  steps_per_print=10**9)
    ds.pop("adaptive_load", None)
    mpu = tsp.init_sequence_parallel(tsp.ParallelDims(world=1, sp=1, rank=0))
    torch.manual_seed(0)
    model = WanModel(cfg, checkpoint_blocks=True)
    params = sum(p.numel() for p in model.parameters())  # before ZeRO-3 would partition them
    engine = eng.build_engine(model, ds, mpu)
    geo = CostProfile.load(config_profile(base, cfg)).geometry
    cuda = device.type == "cuda"  # CPU (a smoke run): no peak statistics
    fn = StepFn(engine, cfg, geo, None, device, eng.compute_dtype(engine), seed=0)
    point = argparse.Namespace(B=args.batch, shape=tuple(int(v) for v in args.shape.split("x")), role="fit")
    out = {"grad_accum": g, "params": params, "steps": []}
    for s in range(args.steps):
        # calibrate's own step (micro_step, then engine.step, which updates at the G-th micro-batch only): its peak
        peaks = [fn(point)[2] or 0 for _ in range(g)]
        out["steps"].append({"step": s + 1, "micro_peak_bytes": peaks,
                             "allocated_after_bytes": torch.cuda.memory_allocated(device) if cuda else 0})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default="configs/ds_zero2_bf16.json")
    ap.add_argument("--model-config", default="configs/wan_1_3b.yaml")
    ap.add_argument("--ga", default="1,4", help="gradient_accumulation_steps to compare, comma-separated")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--shape", default="1x480x832", help="frames x height x width of every sample (pixels)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("ACCUM " + json.dumps(child(args)), flush=True)
        return 0
    import torch

    os.makedirs(args.out, exist_ok=True)
    runs = []
    for g in (int(v) for v in args.ga.split(",")):
        t0 = time.time()
        run, p = run_child([os.path.abspath(__file__), *(argv or sys.argv[1:]), "--child", str(g)], "ACCUM ")
        run = run or {"grad_accum": g, "rc": p.returncode, "stderr_tail": p.stderr[-3000:]}
        run["seconds"] = round(time.time() - t0, 1)
        runs.append(run)
        print(json.dumps(run), flush=True)
    doc = {"what": __doc__.splitlines()[0], "config": args.config, "model_config": args.model_config,
           "shape": args.shape, "batch": args.batch,
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": runs}
    ok = [r for r in runs if "steps" in r and len(r["steps"]) > 1]
    if len(ok) >= 2:
        one = min(ok, key=lambda r: r["grad_accum"])

        def later_peak(r):  # the largest micro-batch peak from the second step on
            return max(max(s["micro_peak_bytes"]) for s in r["steps"][1:])

        doc["extra_peak_bytes"] = {str(r["grad_accum"]): later_peak(r) - later_peak(one) for r in ok}
        doc["extra_bytes_per_param"] = {k: v / one["params"] for k, v in doc["extra_peak_bytes"].items()}
        print(f"[accum] extra peak over G={one['grad_accum']}: "
              + ", ".join(f"G={k}: {v / 2**30:.2f} GiB" for k, v in doc["extra_peak_bytes"].items()), flush=True)
    with open(os.path.join(args.out, "accum-memory.json"), "w") as f:
        json.dump(doc, f, indent=1)
    return 0 if len(ok) == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
