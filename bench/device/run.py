"""One runner for the GPU machine: installs the carried wheels once, JIT-builds the op once, runs the asked stages
(each a subprocess under its own time limit, drawn from one time budget), tees their logs and packs everything
into at most 6 files under --out (the device tool returns 8 files of 16 MiB at most, 2 folder levels).

    python bench/device/run.py --stages env,calib+kernel_test,sp2 --out $OUT --budget-s 540
    python bench/device/run.py --stages e2e=400 --args e2e="--variants balanced,equal-tokens" --out $OUT
    python bench/device/run.py --stages calib,e2e --args e2e="--profile $OUT/calib/h200-wan1.3b-zero3.yaml"
    python bench/device/run.py --list                       # the stages, their seconds and commands
    python bench/device/run.py --ref .ref --stages build+build-ref,verify16,verify16-ref --out $OUT
        # A-B on one machine: .ref is another tree of the repository (git archive main | tar -x -C .ref)

--stages: comma list in order; a+b runs a and b side by side (e.g. calibration on GPU 0 beside the kernel
tests on GPU 1); name=S gives a stage S seconds instead of its default. A stage whose seconds do not fit what
is left of --budget-s is skipped and reported as skipped, so what ran still comes back. Stages that need the
op get the build stage in front of them. Each stage writes into OUT/<stage>/ (its log: stage.log; $OUT is
that folder too); at the end OUT holds summary.txt, report.json and the stages' folders as .tgz files.
On a warm machine /tmp persists: the wheels (/tmp/site), the op's JIT cache and synthetic data are reused.
"""
import argparse
import datetime
import glob
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SITE = "/tmp/site"
MAX_TARS = 4  # + summary.txt + report.json = 6 files


@dataclass
class Stage:
    """cmds: argv lists run one after another within the stage's limit; placeholders (in cmds and env)
    {py} (this Python), {out} (the stage's folder), {date}, {gpu1} (1 on a machine of 2+ GPUs, else 0),
    {limit} (the stage's seconds), {inner} (limit - margin: a time budget for a tool that should end by
    itself, e.g. calibrate --time-budget, before the runner cuts it)."""
    cmds: list
    seconds: int
    doc: str = ""
    env: dict = field(default_factory=dict)
    op: bool = False            # uses the fused op: the build stage runs first
    needs_file: str = None      # skipped with a note while this file is absent (stages that need an optional file)
    margin: int = 0
    collect: tuple = ()         # globs copied into the stage folder afterwards (logs of runs kept in /tmp)
    root: str = None            # the tree it runs in (--ref's stages NAME-ref); None: this checkout


REF_EXTENSIONS = "/tmp/dsal-ref-extensions"  # the reference tree's JIT-built op, apart from this checkout's


def with_ref(stages, ref_dir):
    """stages plus NAME-ref for each: NAME's commands run in ref_dir, another tree of the repository (e.g. `git
    archive main | tar -x -C .ref`, carried), with ref_dir's package first on the path and its op JIT-built into
    REF_EXTENSIONS, so a kernel change and its reference are built and timed on one machine in one call."""
    from dataclasses import replace

    root = os.path.abspath(ref_dir)
    if not os.path.isfile(os.path.join(root, "ds_adaptiveload", "__init__.py")):
        raise SystemExit(f"error: --ref {ref_dir}: no ds_adaptiveload package there (a tree of this repository)")
    ref = {f"{n}-ref": replace(st, root=root, env={**st.env, "TORCH_EXTENSIONS_DIR": REF_EXTENSIONS})
           for n, st in stages.items()}
    return {**stages, **ref}


def py(*args):
    return ["{py}", *args]


def train(name, ds, launcher, sp=1, *more):
    return [py("bench/e2e/train_steps.py", "--name", name, "--ds-base", ds, "--sp", str(sp), "--launcher-args",
               launcher, "--out", "{out}", *more)]


CAL = ("-m", "ds_adaptiveload", "calibrate", "--model-config", "configs/wan_1_3b.yaml")
PYTEST = ("-m", "pytest", "-q", "-p", "no:cacheprovider")
SANITIZE = ("compute-sanitizer", "--print-limit", "20", "{py}", "bench/kernel/device_stage.py", "--driver")
E2E_RUNS = "/tmp/bench_e2e_runs"
# {gpu1}: GPU 1 where there are two (a stage beside a calibration on GPU 0), else GPU 0
GPU0, GPU1 = {"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "{gpu1}"}
QUIET_HOST = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "OMP_NUM_THREADS": "4"}  # beside a calibration

STAGES = {
    "env": Stage([py("bench/harness.py", "env", "--out", "{out}/env.json")], 30, "versions, GPUs, git commit"),
    "build": Stage([py("bench/kernel/build_op.py", "--resource-usage", "{out}/resource.log")], 200,
                   "JIT-build the op once (later processes load it from the cache)"),
    "kernel_test": Stage([py(*PYTEST, "--maxfail=30", "tests/test_ln_modulate.py", "tests/test_op_builder.py")],
                         170, "the op's CUDA tests", {**GPU1, **QUIET_HOST}, op=True),
    "memcheck": Stage([[SANITIZE[0], "--tool", "memcheck", *SANITIZE[1:]]], 80, "compute-sanitizer memcheck",
                      GPU1, op=True),
    "racecheck": Stage([[SANITIZE[0], "--tool", "racecheck", *SANITIZE[1:]]], 60, "compute-sanitizer racecheck",
                       GPU1, op=True),
    "kernel": Stage([py("bench/kernel/device_stage.py", "--apex-src", ".carry/apex", "--out", "{out}", "--total-s",
                        "{inner}")], 480, "build, CUDA tests, sanitizers, apex build and the benchmark (device_stage.py)",
                    op=True, margin=20),
    "verify": Stage([py(*PYTEST, "--maxfail=10", "tests/test_ln_modulate.py"),
                     py("bench/kernel/ln_modulate.py", "--out", "{out}/ln_modulate-verify.json", "--shapes",
                        "1x75600x5120,8x4680x1536", "--dtypes", "bfloat16", "--no-host", "--budget-s", "0")], 150,
                    "short check after a kernel change: the CUDA tests, ours at two shapes", op=True),
    "verify16": Stage([py(*PYTEST, "--maxfail=10", "-k", "float16 or match", "tests/test_ln_modulate.py"),
                       py("bench/kernel/ln_modulate.py", "--out", "{out}/ln_modulate-fp16.json", "--dtypes", "float16",
                          "--no-host", "--budget-s", "0")], 150,
                      "short check of the fp16 paths: their CUDA tests, every shape's rows in fp16", op=True),
    "bench": Stage([py("bench/kernel/ln_modulate.py", "--out", "{out}/ln_modulate.json", "--apex-src", ".carry/apex")],
                   480, "the op's benchmark alone, every baseline (--dtypes, --layouts, --shapes, --baselines as args)",
                   op=True),
    "resid": Stage([py(*PYTEST, "--maxfail=10", "tests/test_ln_modulate_residual.py"),
                    py("bench/kernel/ln_modulate_residual.py", "--out", "{out}", "--budget-s", "200")], 400,
                   "the gated-residual op: its CUDA tests, then its benchmark (fused, unfused, compiled, eager)",
                   op=True),
    "tile_sweep": Stage([py("bench/kernel/ln_modulate.py", "--out", "{out}/ln_modulate-tiles.json", "--tile-sweep",
                            "--no-host", "--budget-s", "0")], 300,
                        "every compile-time tile in a stream (--shapes, --dtypes, --layouts as args)", op=True),
    "model_test": Stage([py(*PYTEST, "-m", "cuda", "tests/test_compile_blocks.py", "tests/test_compile_regions.py")],
                        200, "the model's CUDA tests (compiled blocks and regions against eager, inductor on the GPU)"),
    "packed_test": Stage([py(*PYTEST, "-m", "cuda", "tests/test_packed_ops.py", "tests/test_compile_regions.py")], 150,
                         "packed micro-batches' whole-tensor steps on the GPU (the kernel into the groups' rows, "
                         "compiled gated adds) and the compiled regions against eager", op=True),
    "numerics": Stage([py("bench/model/compile_numerics.py", "--out", "{out}")], 150,
                      "which gradients are right, eager or compiled? each variant vs an fp32 reference, per parameter"),
    "ncu": Stage([py("bench/kernel/ncu_ln_modulate.py", "--out", "{out}")], 150, "Nsight Compute sections", op=True),
    "calib": Stage([py(*CAL, "--deepspeed_config", "configs/ds_zero3_bf16.json", "--out",
                       "{out}/h200-wan1.3b-zero3.yaml", "--json", "{out}/calibrate.json", "--time-budget",
                       "{inner}", "--train-world-size", "2")], 330, "calibrate on GPU 0",
                   {**GPU0, "MASTER_PORT": "29631"}, op=True, margin=90),
    "calib_z2": Stage([py(*CAL, "--deepspeed_config", "configs/ds_zero2_bf16.json", "--out",
                          "{out}/h200-wan1.3b-zero2-calibrated.yaml", "--json", "{out}/calibrate-zero2.json",
                          "--time-budget", "{inner}", "--train-world-size", "1")], 330,
                      "calibrate configs/ds_zero2_bf16.json on GPU 0 for one-GPU runs (open-block fields included)",
                      {**GPU0, "MASTER_PORT": "29633"}, op=True, margin=90),
    # --no_local_rank: the launcher would put --local_rank=N before the subcommand, which the CLI rejects.
    "calib_sp2": Stage([["{py}", "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", "29632",
                         "--no_local_rank", "--module", *CAL[1:], "--deepspeed_config", "configs/ds_zero3_bf16_sp2.json",
                         "--out", "{out}/h200-wan1.3b-zero3-sp2.yaml", "--json", "{out}/calibrate-sp2.json",
                         "--time-budget", "{inner}"]], 330, "calibrate on 2 GPUs, Ulysses sp = 2", op=True, margin=90),
    "one": Stage(train("one", "configs/ds_zero3_bf16.json", "--include localhost:{gpu1} --master_port 29611"), 150,
                 "1.3B, ZeRO-3, bf16, fused op: 20 steps on GPU 1", op=True),
    "sp2": Stage(train("sp2", "configs/ds_zero3_bf16_sp2.json", "--num_gpus 2 --master_port 29612", 2), 160,
                 "the same on 2 GPUs, Ulysses sp = 2", op=True),
    "dp2": Stage(train("dp2", "configs/ds_zero3_bf16.json", "--num_gpus 2 --master_port 29613"), 160,
                 "the same on 2 GPUs, data parallel 2", op=True),
    "budget": Stage(train("budget", "configs/ds_zero3_bf16_sp2.json", "--num_gpus 2 --master_port 29641", 2,
                          "--budget-images", "configs/profiles/h200-wan1.3b-zero3-sp2.yaml", "--policy",
                          "equal-tokens", "--steps", "2", "--per-step"), 420,
                    "2 steps at the calibrated sp = 2 budget, micro-batches of images", op=True),
    "oom": Stage([py("bench/e2e/oom_check.py", "--out", "{out}")], 240, "adaptive_load.on_oom skip / error, GPU 0",
                 {**GPU0, "DS_ADAPTIVELOAD_LN_MODULATE": "torch"}),
    "accum": Stage([py("bench/e2e/accum_memory.py", "--ga", "1,2,4", "--out", "{out}/zero2"),
                    py("bench/e2e/accum_memory.py", "--config", "configs/ds_zero3_bf16.json", "--out", "{out}/zero3")],
                   300, "what G > 1 holds beyond calibrate's steps of one micro-batch (ZeRO-2, ZeRO-3)",
                   {**GPU0, "DS_ADAPTIVELOAD_LN_MODULATE": "torch"}),
    "alloc": Stage([py("bench/e2e/alloc_check.py"), py("bench/e2e/alloc_check.py", "--off")], 60,
                   "expandable_segments in effect?", GPU0),
    "e2e": Stage([py("bench/e2e/train_e2e.py", "--profile", "configs/profiles/h200-wan1.3b-zero3.yaml", "--num",
                     "120", "--epoch", "--warmup", "1", "--grad-accum", "4", "--variants", "balanced,equal-tokens",
                     "--time-budget", "{inner}", "--out-dir", "{out}", "--work", E2E_RUNS, "--tag",
                     "train_e2e-{date}-h200x2")], 420, "policies side by side over one epoch (bench/e2e/train_e2e.py)",
                 op=True, margin=40, collect=(f"{E2E_RUNS}/*/train.log", f"{E2E_RUNS}/*/steps.rank*.jsonl",
                                              f"{E2E_RUNS}/*/ds.json", f"{E2E_RUNS}/profile.yaml")),
    # Registered by name for the scripts other work adds; they run once the file exists.
    "packed_model": Stage([py("bench/model/packed_model.py", "--out", "{out}", "--budget-s", "{inner}")], 300,
                          "packed micro-batches vs one shape per micro-batch, memory vs the profile", op=True,
                          margin=60),
    "packed_engine": Stage([py("bench/model/packed_engine.py", "--out", "{out}", "--budget-s", "{inner}")], 400,
                           "packed vs one-shape micro-batches as micro-steps of the shipped config's engine", op=True,
                           margin=60),
    "packed_profile": Stage([py("bench/model/packed_profile.py", "--out", "{out}")], 150,
                            "GPU kernel time of a packed micro-batch vs the same samples one shape per micro-batch",
                            op=True),
    "ckpt_policy": Stage([py("bench/model/ckpt_policy.py", "--out", "{out}", "--budget-s", "{inner}")], 360,
                         "a checkpointed block keeping its FFN output too, against the attention policy (bare model)",
                         op=True, margin=60),
    "optim_step": Stage([py("bench/model/optim_step.py", "--out", "{out}")], 300,
                        "engine.step() with torch's foreach and fused AdamW and DeepSpeed's FusedAdam"),
    "attn_test": Stage([py(*PYTEST, "-m", "cuda", "tests/test_attention_cuda.py")], 150,
                       "FlashAttention-4 in the model: kernels, packed model, checkpointing, compiled block (--fa4)"),
    "attn_backends": Stage([py("bench/model/attn_backends.py", "--out", "{out}")], 240,
                           "self-attention kernels at the model's shapes: SDPA cuDNN / flash against FlashAttention-4"),
    "fa4_shapes": Stage([py("bench/model/fa4_shapes.py", "--out", "{out}")], 150,
                        "FlashAttention-4 at every per-sample shape of the video- and image-heavy mixes, n = 1 and a "
                        "micro-batch's worth, each call synchronized, against SDPA (--fa4)"),
    "gemm_rows": Stage([py("bench/model/gemm_rows.py", "--out", "{out}")], 90,
                       "the block's GEMMs at a packed micro-batch's rows vs the separate ones' (cuBLAS, cuBLASLt)"),
    "fp8_test": Stage([py(*PYTEST, "-m", "cuda", "tests/test_fp8.py")], 120,
                      "--fp8 linear on the GPU: torchao float8 layers in compiled regions, one training step"),
    "fp8_speed": Stage([py("bench/model/fp8_bench.py", "--parts", "speed", "--budget-s", "{inner}", "--out", "{out}")],
                       560, "bf16 vs --fp8 linear: the 1.3B micro-step at 480p 81f, 720p 81f, 32 images", margin=40),
    "fp8_numerics": Stage([py("bench/model/fp8_bench.py", "--parts", "numerics", "--budget-s", "{inner}", "--out",
                              "{out}")], 570, "300 steps bf16 s0, bf16 s1, fp8 s0 and the held-out loss (one run "
                                               "per call: --args fp8_numerics=\"--parts numerics-fp8-s0\")", margin=30),
    "mfu": Stage([py("bench/mfu.py")], 300, "model FLOPs utilisation", op=True, needs_file="bench/mfu.py"),
    "shipped": Stage([py("bench/e2e/shipped_configs.py", "--out", "{out}", "--budget-s", "{inner}")], 570,
                     "the README's command for the shipped ZeRO-2 and ZeRO-3 configs, profile auto, 20 steps each "
                     "(one config per call: --args shipped=\"--configs configs/ds_zero3_bf16.json\"; the run "
                     "JIT-builds the op itself where no build is cached, as a user's first run does)", margin=20),
    "replay": Stage([py("bench/e2e/replay.py", "--compile-blocks", "regions", "--checkpoint-policy", "attention",
                        "--repeat", "2", "--budget-s", "{inner}", "--out", "{out}", "--record", "{out}/staging.csv")],
                    560,
                    "balance measured on one GPU: W virtual ranks' micro-batches through the trainer's engine "
                    "(bench/e2e/replay.py; --args replay=\"--mix image-heavy --ranks 8:2 --grad-accum 1\")",
                    margin=120),
    "encode": Stage([py("bench/data/encode_bench.py", "--out", "{out}", "--budget-s", "{inner}")], 240,
                    "encode: full-size Wan VAE + umT5-XXL (random weights), clips/s and peak memory", margin=40),
}


class Budget:
    """The call's one time budget: every stage's limit is drawn from what is left of it."""

    def __init__(self, total_s):
        self.total, self.t0 = total_s, time.monotonic()

    def elapsed(self):
        return time.monotonic() - self.t0

    def left(self):
        return self.total - self.elapsed()

    def fits(self, seconds):
        return seconds <= self.left()


class Log:
    """summary.txt lines with the call's elapsed seconds, echoed to stdout."""

    def __init__(self, path, budget):
        self.path, self.budget = path, budget

    def __call__(self, msg):
        line = f"[{self.budget.elapsed():4.0f} s] {msg}"
        print(line, flush=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")


def install_wheels(out, budget, log, wheel_dir):
    """The wheels the machine lacks (wheel_dir: .whl/ from ../shared/device/prepare-wheels.sh) into /tmp/site once per
    machine (a warm one keeps /tmp); returns the environment that uses them, None when pip failed."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    wheels = sorted(glob.glob(os.path.join(wheel_dir, "*.whl")))
    path = [ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if wheels and not os.path.exists(f"{SITE}/.done"):
        os.makedirs(f"{out}/install", exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", SITE, *wheels]
        with open(f"{out}/install/install.log", "w") as f:
            try:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=max(budget.left(), 1)).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        if rc != 0:
            log(f"wheel install failed ({rc}): {tail(f'{out}/install/install.log', 5)}")
            return None
        open(f"{SITE}/.done", "w").close()
        log(f"installed {len(wheels)} wheels into {SITE}")
    if os.path.exists(f"{SITE}/.done"):
        path.insert(0, SITE)
        env["PATH"] = f"{SITE}/bin{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(path)
    return env


def tail(path, n):
    try:
        with open(path, errors="replace") as f:
            return " | ".join(ln.rstrip()[:200] for ln in f.readlines()[-n:])
    except OSError:
        return ""


def _pump(proc, log_file, prefix):
    for line in proc.stdout:
        log_file.write(line)
        log_file.flush()
        print(prefix + line, end="", flush=True)


def _run_cmd(argv, env, limit, log_file, prefix, cwd=ROOT):
    """One command in its own session (a cut command's children go with it); exit code or 'timeout'."""
    log_file.write("$ " + shlex.join(argv) + "\n")
    log_file.flush()
    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", start_new_session=True)
    except OSError as e:  # e.g. compute-sanitizer not on PATH
        log_file.write(f"cannot start: {e}\n")
        return 127
    pump = threading.Thread(target=_pump, args=(proc, log_file, prefix), daemon=True)
    pump.start()
    try:
        rc = proc.wait(timeout=max(limit, 1))
    except subprocess.TimeoutExpired:
        rc = "timeout"
        for sig, grace in ((15, 10), (9, 5)):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=grace)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
    pump.join(timeout=5)  # a grandchild in a session of its own may hold the pipe: do not wait on it
    return rc


def compile_caches(stage: str) -> dict:
    """Inductor and Triton caches of the stage's own. Inductor picks a dynamic graph's kernels (split reductions,
    autotuned configs) from the sizes of its first call, and reuses them across processes from its disk caches:
    a stage that runs after the CUDA tests would otherwise time kernels made for the tests' tiny shapes."""
    root = os.path.join(tempfile.gettempdir(), "dsal-compile-caches", stage)
    return {"TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor"), "TRITON_CACHE_DIR": os.path.join(root, "triton")}


def run_stage(name, st, limit, out, env, extra):
    """The stage's commands one after another until its deadline; a failed command does not stop the next
    (a failed test run still leaves the benchmark to run). Returns its report record."""
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    subs = {"{py}": sys.executable, "{out}": d, "{date}": datetime.date.today().isoformat(),
            "{limit}": str(int(limit)), "{inner}": str(max(int(limit - st.margin), 10)),
            "{gpu1}": "1" if gpu_count() > 1 else "0"}
    env = {**env, **{k: _sub(v, subs) for k, v in st.env.items()}, "OUT": d, **compile_caches(name)}
    if st.root:  # the reference tree's package instead of this checkout's
        env["PYTHONPATH"] = os.pathsep.join(st.root if p == ROOT else p for p in env["PYTHONPATH"].split(os.pathsep))
    cmds = [list(c) for c in st.cmds]
    cmds[-1] += extra
    t0 = time.monotonic()
    status, rc = "ok", 0
    with open(os.path.join(d, "stage.log"), "w") as f:
        for argv in cmds:
            argv = [_sub(a, subs) for a in argv]
            r = _run_cmd(argv, env, limit - (time.monotonic() - t0), f, f"[{name}] ", st.root or ROOT)
            if r == "timeout":
                status, rc = f"timeout after {limit:.0f} s", r
                break
            if r != 0:
                status, rc = f"failed (exit {r})", r
    for pattern in st.collect:  # runs' logs kept outside the folder (their data is too big to pack)
        for src in glob.glob(pattern):
            dst = os.path.join(d, "collected", os.path.basename(os.path.dirname(src)), os.path.basename(src))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copy(src, dst)
    return {"stage": name, "status": status, "rc": rc, "seconds": round(time.monotonic() - t0, 1),
            "limit_s": round(limit), "tail": tail(os.path.join(d, "stage.log"), 3)}


def gpu_count():
    """GPUs nvidia-smi lists (0 without it), read without importing torch."""
    if not shutil.which("nvidia-smi"):
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return sum(ln.startswith("GPU ") for ln in out.splitlines())


def _sub(arg, subs):
    for k, v in subs.items():
        arg = arg.replace(k, v)
    return arg


def parse_stages(spec, stages):
    """'env,calib=300+kernel_test' -> [[('env', None)], [('calib', 300), ('kernel_test', None)]]; the build
    stage goes first when a stage needs the op and it is not asked for."""
    groups = []
    for group in filter(None, spec.split(",")):
        g = []
        for item in group.split("+"):
            name, _, secs = item.partition("=")
            if name not in stages:
                raise SystemExit(f"error: unknown stage {name!r}; stages: {', '.join(stages)}")
            g.append((name, float(secs) if secs else None))
        groups.append(g)
    names = [n for g in groups for n, _ in g]
    present = [n for n in names if not stages[n].needs_file or os.path.exists(stage_file(stages[n]))]
    for build, ref in (("build-ref", True), ("build", False)):  # this checkout's build first, then the reference's
        if build in stages and build not in names and any(stages[n].op and bool(stages[n].root) == ref
                                                          for n in present):
            groups.insert(0, [(build, None)])
    return groups


def stage_file(st):
    """The stage's needs_file in the tree it runs in."""
    return os.path.join(st.root or ROOT, st.needs_file)


def pack(out, names, log):
    """Stage folders -> at most MAX_TARS .tgz files (the largest alone, the rest together), folders removed."""
    dirs = [n for n in dict.fromkeys(names) if os.path.isdir(os.path.join(out, n))]
    size = {n: sum(os.path.getsize(p) for p in glob.glob(os.path.join(out, n, "**"), recursive=True)
                   if os.path.isfile(p)) for n in dirs}
    if len(dirs) > MAX_TARS:
        alone = sorted(dirs, key=lambda n: -size[n])[:MAX_TARS - 1]
        groups = [(f"{n}.tgz", [n]) for n in alone] + [("stages.tgz", [n for n in dirs if n not in alone])]
    else:
        groups = [(f"{n}.tgz", [n]) for n in dirs]
    for tar_name, members in groups:
        with tarfile.open(os.path.join(out, tar_name), "w:gz") as tar:
            for n in members:
                tar.add(os.path.join(out, n), arcname=n)
        for n in members:
            shutil.rmtree(os.path.join(out, n))
        mib = os.path.getsize(os.path.join(out, tar_name)) / 2**20
        log(f"packed {tar_name} ({', '.join(members)}; {mib:.1f} MiB)"
            + (" - over the 16 MiB the device returns" if mib > 16 else ""))
    return [g[0] for g in groups]


def run_group(group, stages, budget, out, env, extra, log):
    """The group's stages side by side (threads, each its own subprocesses); those that do not fit are
    skipped. Returns the records in the group's order."""
    records, threads = {}, []
    for name, secs in group:
        st = stages[name]
        limit = secs or st.seconds
        if st.needs_file and not os.path.exists(stage_file(st)):
            records[name] = {"stage": name, "status": f"skipped: {st.needs_file} not there yet"}
        elif not budget.fits(limit):
            records[name] = {"stage": name, "status": f"skipped: needs {limit:.0f} s, {budget.left():.0f} s left"}
        else:
            log(f"{name}: start ({st.doc}; limit {limit:.0f} s)")
            t = threading.Thread(target=lambda n=name, s=st, lim=limit: records.__setitem__(
                n, run_stage(n, s, lim, out, env, extra.get(n, []))))
            t.start()
            threads.append(t)
    for t in threads:
        t.join()
    for name, _ in group:
        r = records[name]
        log(f"{name}: {r['status']}" + (f" in {r['seconds']:.0f} s" if "seconds" in r else "")
            + (f" | {r['tail']}" if r.get("tail") and r["status"] != "ok" else ""))
    return [records[n] for n, _ in group]


FA4_SITE, FA4_PARTS = "/tmp/fa4site", "/tmp/fa4parts"


def _joined_parts(fa4_dir):
    """cu13.tar.xz, or its parts cu13.tar.xz.part* (by name) from fa4_dir and FA4_PARTS: a working tree that travels
    holds 64 MiB, so an earlier call on the same warm machine may leave the first part in FA4_PARTS."""
    import io

    whole = os.path.join(fa4_dir, "cu13.tar.xz")
    if os.path.exists(whole):
        return open(whole, "rb")
    parts = sorted(glob.glob(os.path.join(fa4_dir, "cu13.tar.xz.part*")) + glob.glob(f"{FA4_PARTS}/cu13.tar.xz.part*"),
                   key=os.path.basename)
    names = [os.path.basename(p) for p in parts]
    if not parts or names != [f"cu13.tar.xz.part{i:02d}" for i in range(len(parts))]:  # split -d's names, none missing
        raise FileNotFoundError(f"cu13.tar.xz: found parts {names} in {fa4_dir} and {FA4_PARTS}, "
                                f"expected part00, part01, ...")
    return io.BytesIO(b"".join(open(p, "rb").read() for p in parts))


def install_fa4(fa4_dir, env, log):
    """FlashAttention-4 (model/attention.py) from fa4_dir: its wheels (flash_attn_4, quack_kernels,
    nvidia_cutlass_dsl, -libs-base, -libs-core, apache_tvm_ffi, torch_c_dlpack_ext) and cu13.tar.xz, the
    nvidia_cutlass_dsl_libs_cu13 wheel's files (92 MB as a wheel, 64 MB in xz, so it may come in parts), into
    FA4_SITE once per machine. Adds FA4_SITE and the CuTe DSL's packages (what the wheel's .pth adds) to
    env's PYTHONPATH; False when it failed."""
    try:
        if not os.path.exists(f"{FA4_SITE}/.done"):
            wheels = sorted(glob.glob(os.path.join(fa4_dir, "*.whl")))
            if not wheels:
                raise FileNotFoundError(f"no wheels in {fa4_dir}")
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--no-cache-dir", "--upgrade", "--target", FA4_SITE, *wheels], check=True)
            with tarfile.open(fileobj=_joined_parts(fa4_dir), mode="r:xz") as tar:
                tar.extractall(FA4_SITE, filter="data")
            open(f"{FA4_SITE}/.done", "w").close()
            log(f"installed FlashAttention-4 into {FA4_SITE}")
    except (OSError, subprocess.SubprocessError, tarfile.TarError) as e:
        log(f"FlashAttention-4 install failed: {type(e).__name__}: {e}")
        return False
    paths = [FA4_SITE, f"{FA4_SITE}/nvidia_cutlass_dsl/dsl_packages"]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return True


def main(argv=None, stages=None):
    stages = STAGES if stages is None else stages
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="stages: " + ", ".join(stages))
    ap.add_argument("--stages", default="env", help="comma list; a+b side by side; name=S seconds")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--budget-s", type=float, default=540, help="seconds for the whole call (install included)")
    ap.add_argument("--args", action="append", default=[], metavar="STAGE=ARGS",
                    help="more arguments for the stage's last command, one shell-quoted string")
    ap.add_argument("--wheels", default=os.path.join(ROOT, ".whl"), help="folder of wheels to install first")
    ap.add_argument("--fa4", default="", metavar="DIR", help="install FlashAttention-4 from DIR first (install_fa4)")
    ap.add_argument("--ref", default="", metavar="DIR",
                    help="another tree of the repository: stages NAME-ref run NAME there, with its own op build")
    ap.add_argument("--list", action="store_true", help="print the stages and exit")
    a = ap.parse_args(argv)
    if a.ref:
        stages = with_ref(stages, a.ref)
    if a.list:
        for n, st in stages.items():
            print(f"{n:13s} {st.seconds:4d} s  {st.doc}\n" + "".join(f"{'':20s}{shlex.join(c)}\n" for c in st.cmds))
        return 0
    groups = parse_stages(a.stages, stages)
    extra = {k: shlex.split(v) for k, _, v in (s.partition("=") for s in a.args)}
    budget = Budget(a.budget_s)
    os.makedirs(a.out, exist_ok=True)
    log = Log(os.path.join(a.out, "summary.txt"), budget)
    log(f"stages {a.stages} (budget {a.budget_s:.0f} s), {ROOT}")
    env = install_wheels(a.out, budget, log, a.wheels)
    if env is not None and a.fa4 and not install_fa4(a.fa4, env, log):
        env = None
    records = [] if env is not None else [{"stage": "install", "status": "failed"}]
    for group in groups if env is not None else []:
        records += run_group(group, stages, budget, a.out, env, extra, log)
        if group[0][0] == "build" and records[-1]["status"] != "ok" and "skipped" not in records[-1]["status"]:
            # every later process would retry the build: they run the PyTorch chain, and say so (a failed
            # build-ref is left to the reference's stages, which retry it and fail on their own)
            env = {**env, "DS_ADAPTIVELOAD_LN_MODULATE": "torch"}
            log("op build failed: later stages run with DS_ADAPTIVELOAD_LN_MODULATE=torch")
    tars = pack(a.out, ["install"] + [r["stage"] for r in records], log)
    failed = [r["stage"] for r in records if r["status"].startswith(("failed", "timeout"))]
    skipped = [r["stage"] for r in records if r["status"].startswith("skipped")]
    log(f"done: {len(records) - len(failed) - len(skipped)} ok, failed {failed or '-'}, skipped {skipped or '-'}")
    with open(os.path.join(a.out, "report.json"), "w") as f:
        json.dump({"stages_asked": a.stages, "budget_s": a.budget_s, "elapsed_s": round(budget.elapsed(), 1),
                   "records": records, "files": ["summary.txt", "report.json", *tars]}, f, indent=1)
    return 1 if failed or env is None else 0


if __name__ == "__main__":
    sys.exit(main())
