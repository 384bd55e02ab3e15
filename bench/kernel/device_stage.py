"""One GPU-machine call for the fused LayerNorm-Modulate op: JIT-build it, run the CUDA tests, compute-sanitizer
memcheck and racecheck on small shapes of every kernel path (the flat row space for B >= 2, the per-sample grid,
the general kernels), then the benchmark (apex contrib FastLayerNorm built from --apex-src). At most four files
under --out: stage.log (steps, timings, environment), pytest.log, sanitizer.log, ln_modulate.json.

    python bench/kernel/device_stage.py --apex-src DIR --out "$OUT"
Each step has its own time cap so that a slow one cannot eat the others' results (~8 minutes in all)."""
import argparse
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)


def driver():
    """Small shapes through every path, forward and backward (what the sanitizer watches)."""
    import torch

    import ln_tuning as _tuning  # bench/kernel, beside this script
    from ds_adaptiveload.ops import ln_modulate
    from ds_adaptiveload.ops import layernorm_modulate as lnm

    torch.manual_seed(0)
    cases = [(3, 37, 1536, torch.bfloat16, "sample"), (3, 37, 1536, torch.float16, "sample"),
             (5, 700, 1536, torch.float16, "global"),
             (4, 300, 5120, torch.bfloat16, "sample"), (40, 3, 1536, torch.bfloat16, "sample"),
             (61, 7, 2048, torch.float16, "sample"),
             (2, 33, 1536, torch.bfloat16, "token"), (1, 300, 5120, torch.float16, "token"),
             (1, 500, 5120, torch.bfloat16, "sample")]
    for path in ("auto", "grid", "flat"):
        with _tuning.tuned(batch_path=path):
            for B, S, D, dt, lay in cases:
                x = torch.randn(B, S, D, device="cuda", dtype=dt, requires_grad=True)
                shp = {"sample": (B, 1, D), "token": (B, S, D), "global": (D,)}[lay]
                sc = torch.randn(shp, device="cuda", requires_grad=True)
                sh = torch.randn(shp, device="cuda", requires_grad=True)
                y = ln_modulate(x, sc, sh)
                y.backward(torch.randn_like(y))
                y = lnm.ln_modulate_op(x, sc, sh, None, None, 1e-6, dt)[0]  # the custom op's path
                y.backward(torch.randn_like(y))
    torch.cuda.synchronize()
    print("driver ok")


def run(cmd, log, cap, env):
    """Run cmd, append its tail to `log`; returns (rc, seconds). rc 124: it ran past `cap`."""
    t = time.time()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=cap)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as err:
        rc, out = 124, (err.stdout or b"").decode(errors="replace") + (err.stderr or b"").decode(errors="replace")
    except OSError as err:  # the tool is missing (e.g. compute-sanitizer): a result, not a crash of the stage
        rc, out = 127, f"{type(err).__name__}: {err}"
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}  (rc {rc}, {time.time() - t:.0f} s)\n{out[-20000:]}\n")
    return rc, time.time() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--apex-src", required=False, help="apex/contrib/csrc/layer_norm's files")
    ap.add_argument("--total-s", type=float, default=470, help="time for all steps (a command on the GPU machine may run 600 s)")
    ap.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.driver:
        return driver()
    os.makedirs(args.out, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    stage, t0 = os.path.join(args.out, "stage.log"), time.time()

    def note(msg):
        with open(stage, "a") as f:
            f.write(f"[{time.time() - t0:.0f} s] {msg}\n")
        print(msg, flush=True)

    py = sys.executable
    deadline = t0 + args.total_s

    def cap(step_s):  # a step's time cap: its own, or what is left of the call's total
        return max(10, min(step_s, deadline - time.time()))

    rc, s = run(["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.mem,temperature.gpu", "--format=csv"], stage, 30, env)
    apex = None  # apex builds beside the op (its JIT cache is then warm for the benchmark's load)
    if args.apex_src:
        apex_log = open(os.path.join(args.out, ".apex-build.txt"), "w+")  # folded into stage.log, then removed
        apex = subprocess.Popen([py, "bench/kernel/ln_modulate.py", "--apex-only", "--apex-src", args.apex_src], cwd=ROOT,
                                env=env, stdout=apex_log, stderr=subprocess.STDOUT, text=True)
    rc, s = run([py, "-c", "import sys, time; t = time.time(); from ds_adaptiveload.ops.layernorm_modulate import "
                 "load_op, op_error; m = load_op(); print('op', m and m.__file__, op_error(), f'{time.time() - t:.0f} s');"
                 " sys.exit(m is None)"], stage, cap(240), env)
    note(f"build rc {rc} in {s:.0f} s")
    # 200 s: the trimmed suite passed all 458 tests in ~170 s on H200 (2026-12-01); --durations names what to cut next.
    rc, s = run([py, "-m", "pytest", "-q", "--maxfail=30", "-p", "no:cacheprovider", "--durations=12",
                 "tests/test_ln_modulate.py"], os.path.join(args.out, "pytest.log"), cap(200), env)
    note(f"pytest rc {rc} in {s:.0f} s")
    san = shutil.which("compute-sanitizer") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"),
                                                            "bin", "compute-sanitizer")
    for tool in ("memcheck", "racecheck"):
        rc, s = run([san, "--tool", tool, "--error-exitcode", "3", py, __file__, "--driver"],
                    os.path.join(args.out, "sanitizer.log"), cap(100), env)
        note(f"sanitizer {tool} rc {rc} in {s:.0f} s")
    if apex is not None:
        try:
            apex.wait(timeout=cap(120))
        except subprocess.TimeoutExpired:
            apex.kill()
            apex.wait()
        apex_log.seek(0)
        out = apex_log.read()[-3000:] + ("" if apex.returncode == 0 else f" (apex build exit {apex.returncode})")
        apex_log.close()
        os.remove(apex_log.name)
        with open(stage, "a") as f:
            f.write(out + "\n")
    left = cap(1e9)  # the benchmark saves its JSON after every row, so a cut run still reports what it timed
    bench = [py, "bench/kernel/ln_modulate.py", "--out", os.path.join(args.out, "ln_modulate.json"),
             "--budget-s", str(int(left * 0.6))]
    rc, s = run(bench + (["--apex-src", args.apex_src] if args.apex_src else []), stage, left, env)
    note(f"bench rc {rc} in {s:.0f} s; total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
