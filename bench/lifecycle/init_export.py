"""Time and peak memory of --init-from and `export` for the full-size Wan 2.1 1.3B and 14B architectures on one GPU,
with RANDOM weights (the released ones cannot be downloaded here; time and memory depend on the shapes, not the
values).

    python bench/lifecycle/init_export.py --arch 1.3b --out $OUT            # H100: ~3 min
    python bench/lifecycle/init_export.py --arch 14b --out $OUT             # H100: ~8 min
    python bench/lifecycle/init_export.py --arch tiny --out /tmp/b          # CPU smoke run

Per architecture, each part a subprocess of its own (its peak host memory is its own ru_maxrss):
  weights:    a random bf16 folder in the original Wan 2.1 layout (config.json, shards of 5 GB with an index)
  init:       --init-from as the trainer runs it: the model built under ZeRO-3 on one rank (world size 1: the rank
              holds every partition), the folder checked (prepare) and read tensor by tensor (load)
  checkpoint: deepspeed.initialize (ZeRO-3, bf16, AdamW) on those weights and a DeepSpeed checkpoint saved
  export:     `python -m ds_adaptiveload export --format diffusers --dtype bf16` of that checkpoint
14B: init reads all 40 blocks; the checkpoint and export use --export-layers blocks (default 8), since ZeRO-3's
training state of the 40-block model (16 bytes a parameter, 229 GB) fits neither one GPU nor the disk; export's time
and memory scale with the parameter count. Writes OUT/<date>-init-export-<arch>.json (raw) and OUT/staging.csv
(rows for bench/results/results.csv: `python bench/harness.py merge OUT/staging.csv` after copying the raw file
into bench/results/).
"""
import argparse
import datetime
import json
import os
import resource
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))  # harness
ARCHS = {"1.3b": ("configs/wan_1_3b.yaml", None), "14b": ("configs/wan_14b.yaml", 8),
         "tiny": ("configs/wan_tiny.yaml", None)}
PREFIX = "INIT_EXPORT "


def host_peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def device():
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def gpu_peak_gib(dev):
    import torch

    return round(torch.cuda.max_memory_allocated(dev) / 2**30, 3) if dev.type == "cuda" else None


def model_cfg(args):
    from ds_adaptiveload.model import WanConfig

    cfg = WanConfig.from_yaml(os.path.join(ROOT, ARCHS[args.arch][0]))
    if args.layers:
        cfg.num_layers = args.layers
    return cfg


class RandomTensor:
    """A lazy bf16 N(0, 0.02) tensor for model/export.write: drawn on the GPU when written, one at a time."""

    def __init__(self, shape, dev):
        self.shape, self.dev = tuple(shape), dev

    def contiguous(self):
        import torch

        return (torch.randn(self.shape, device=self.dev, dtype=torch.bfloat16) * 0.02).cpu()


def part_weights(args):
    """A random bf16 folder in the original Wan 2.1 layout."""
    import torch

    from ds_adaptiveload.model import WanModel
    from ds_adaptiveload.model.export import write

    cfg, dev = model_cfg(args), device()
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in WanModel(cfg).state_dict().items()}
    t0 = time.perf_counter()
    files = write({k: RandomTensor(s, dev) for k, s in shapes.items()}, cfg, "wan", args.dir, "bf16", "5GB")
    return {"params": sum(int(torch.Size(s).numel()) for s in shapes.values()), "files": len(files),
            "bytes": sum(os.path.getsize(os.path.join(args.dir, f)) for f in files),
            "seconds": time.perf_counter() - t0}


def ds_config(dev, optimizer=False):
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3},
           "bf16": {"enabled": dev.type == "cuda"}}
    if optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": True}}
    return cfg


def init_model(args, dev, optimizer=False):
    """--init-from as train/trainer.py runs it: build (ZeRO-3, no random init), prepare, load; with timings."""
    import torch

    from ds_adaptiveload.model import init_from
    from ds_adaptiveload.train.build import build_model
    from ds_adaptiveload.train.engine import init_distributed, single_process_env

    single_process_env()
    init_distributed()
    cfg = model_cfg(args)
    base = host_peak_gib()
    t0 = time.perf_counter()
    model = build_model(cfg, ds_config(dev, optimizer), init_weights=False)
    t1 = time.perf_counter()
    src = init_from.prepare(args.dir, model, cfg, ARCHS[args.arch][0])
    t2 = time.perf_counter()
    stats = init_from.load(src, model)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t3 = time.perf_counter()
    row = {"build_s": t1 - t0, "prepare_s": t2 - t1, "load_s": t3 - t2, "init_from_s": t3 - t1,
           "bytes_read": stats["bytes_read"], "read_gb_per_s": stats["bytes_read"] / 1e9 / (t3 - t2),
           "host_base_gib": base, "host_peak_gib": host_peak_gib(), "gpu_peak_gib": gpu_peak_gib(dev)}
    return model, row


def part_init(args):
    _, row = init_model(args, device())
    return row


def part_checkpoint(args):
    """deepspeed.initialize on the --init-from model, then a DeepSpeed checkpoint with the run's model config."""
    import deepspeed

    from ds_adaptiveload.model.export import MODEL_CONFIG_FILE

    dev = device()
    model, row = init_model(args, dev, optimizer=True)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                      config=ds_config(dev, optimizer=True))
    t0 = time.perf_counter()
    engine.save_checkpoint(args.ckpt, tag="global_step0")
    with open(os.path.join(args.ckpt, "global_step0", MODEL_CONFIG_FILE), "w") as f:
        json.dump(model_cfg(args).to_dict(), f)
    return {"save_s": time.perf_counter() - t0, "gpu_peak_gib": gpu_peak_gib(dev), "host_peak_gib": host_peak_gib()}


def part_export(args):
    from ds_adaptiveload import export_cli

    ns = argparse.Namespace(checkpoint=args.ckpt, tag=None, format="diffusers", out=args.dir, dtype="bf16", ema=False,
                            max_shard_size="5GB", model_config=None)
    base = host_peak_gib()
    t0 = time.perf_counter()
    export_cli.run(ns)
    return {"export_s": time.perf_counter() - t0, "host_base_gib": base, "host_peak_gib": host_peak_gib(),
            "bytes": sum(os.path.getsize(os.path.join(args.dir, f)) for f in os.listdir(args.dir))}


PARTS = {"weights": part_weights, "init": part_init, "checkpoint": part_checkpoint, "export": part_export}


# ---------------------------------------------------------------------------------------------------- the driver


def child(args, part, **kw) -> dict:
    """One part in a process of its own; its JSON line, or an exit naming the part and its stderr's tail."""
    import harness

    argv = [os.path.abspath(__file__), "--part", part, "--arch", args.arch]
    for k, v in kw.items():
        argv += [f"--{k}", str(v)]
    t0 = time.perf_counter()
    out, proc = harness.run_child(argv, PREFIX)
    if out is None:
        sys.exit(f"error: part {part} of {args.arch} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    out["wall_s"] = time.perf_counter() - t0
    print(f"[init_export] {args.arch} {part}: {json.dumps(out)}", flush=True)
    return out


def drop_page_cache() -> bool:
    """Write dirty pages and drop the page cache (root only): the next read comes from the disk."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def run_arch(args) -> dict:
    """weights -> init (every block); weights of --export-layers blocks where set -> checkpoint -> export."""
    work = os.path.join(args.work, args.arch)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    res, full = {}, os.path.join(work, "weights")
    res["weights"] = child(args, "weights", dir=full)
    res["cold_read"] = drop_page_cache()  # else init reads what the weights part just wrote, from memory
    res["init"] = child(args, "init", dir=full)
    layers = args.export_layers if args.export_layers is not None else ARCHS[args.arch][1]
    src = full
    if layers:
        shutil.rmtree(full)  # the disk holds one model at a time
        src = os.path.join(work, f"weights-{layers}")
        res["weights_export"] = child(args, "weights", dir=src, layers=layers)
    ckpt = os.path.join(work, "checkpoints")
    res["checkpoint"] = child(args, "checkpoint", dir=src, ckpt=ckpt, layers=layers or 0)
    shutil.rmtree(src)
    res["export"] = child(args, "export", dir=os.path.join(work, "export"), ckpt=ckpt, layers=layers or 0)
    res["export_layers"] = layers
    shutil.rmtree(work)
    return res


def hardware(env) -> str:
    name = env.get("device", "cpu")
    if "H100" in name:
        return "1x H100 80GB"
    if "H200" in name:
        return "1x H200"
    return "CPU" if name == "cpu" else f"1x {name}"


def record_rows(args, res, env, raw_name) -> None:
    """Rows into OUT/staging.csv: --init-from's time and peaks, export's time and host peak."""
    import harness

    total = ARCHS[args.arch][0]
    cmd = f"python bench/lifecycle/init_export.py --arch {args.arch} --out $OUT"
    common = dict(hardware=hardware(env), zero_stage=3, model=f"Wan 2.1 {args.arch}", command=cmd,
                  raw_file=f"bench/results/{raw_name}", section="training", date=env["date"])
    path = os.path.join(args.out, "staging.csv")
    init, exp = res["init"], res["export"]
    gb = res["weights"]["bytes"] / 1e9
    variant = f"{args.arch}, {gb:.1f} GB bf16 in {res['weights']['files']} file(s), ZeRO-3 on 1 GPU"
    note = (f"random weights ({total}); build {init['build_s']:.1f} s before it; read {init['read_gb_per_s']:.2f} "
            f"GB/s {'from disk (page cache dropped)' if res['cold_read'] else 'with the files in the page cache'}; "
            f"host memory is peak RSS, which counts the mapped file pages read")
    for metric, unit, value in (("time to check and load the weights", "s", init["init_from_s"]),
                                ("peak host memory", "GiB", init["host_peak_gib"]),
                                ("peak GPU memory", "GiB", init["gpu_peak_gib"])):
        if value is not None:
            harness.record(path, experiment="--init-from (original Wan layout)", variant=variant, metric=metric,
                           unit=unit, value=round(value, 3), note=note, **common)
    layers = res["export_layers"]
    variant = (f"{args.arch}{f' with {layers} of its blocks' if layers else ''}, ZeRO-3 checkpoint (AdamW) "
               f"-> diffusers bf16, {exp['bytes'] / 1e9:.1f} GB")
    note = ("random weights; fewer blocks: the 40-block model's ZeRO-3 training state (229 GB) fits neither one GPU "
            "nor the disk" if layers else "random weights")
    for metric, unit, value in (("time", "s", exp["export_s"]), ("peak host memory", "GiB", exp["host_peak_gib"])):
        harness.record(path, experiment="export", variant=variant, metric=metric, unit=unit, value=round(value, 3),
                       note=note, **common)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", choices=sorted(ARCHS), required=True)
    p.add_argument("--out", help="folder for the raw JSON and staging.csv (the driver)")
    p.add_argument("--work", default="/tmp/dsal-init-export", help="scratch folder for weights and checkpoints "
                   "(14B: ~45 GB at most; removed at the end)")
    p.add_argument("--export-layers", type=int, help="blocks of the model the checkpoint and export use (default: "
                   "8 for 14b, every block otherwise)")
    p.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)  # a child's part
    p.add_argument("--layers", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.part:
        print(PREFIX + json.dumps(PARTS[args.part](args)), flush=True)
        return 0
    if not args.out:
        p.error("--out is required")
    import harness

    os.makedirs(args.out, exist_ok=True)
    env = harness.environment(gpu=True)
    res = run_arch(args)
    gpu = hardware(env).split()[-2 if "80GB" in hardware(env) else -1].lower()
    raw_name = f"{datetime.date.today().isoformat()}-init-export-{args.arch}-{gpu}.json"
    with open(os.path.join(args.out, raw_name), "w") as f:
        json.dump({"bench": "init_export", "arch": args.arch, "env": env, "results": res}, f, indent=1)
    record_rows(args, res, env, raw_name)
    print(f"[init_export] wrote {os.path.join(args.out, raw_name)} and {os.path.join(args.out, 'staging.csv')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
