"""The benchmark harness every bench/ script shares (as Liger's benchmark/scripts/utils.py): timing with warm-up
and quantiles (CUDA events or perf_counter), the environment a result was measured in, and the results written
as JSON rows plus a Markdown table.

    python bench/harness.py env [--out env.json]     # the environment as JSON (bench/device/run.py stage env)
"""
import argparse
import datetime
import importlib.metadata as md
import json
import os
import platform
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUANTILES = (0.2, 0.5, 0.8)


def quantile(xs, q):
    """Linear-interpolated quantile of xs (None when empty)."""
    xs = sorted(xs)
    if not xs:
        return None
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(times, quantiles=QUANTILES):
    """Median, min, max, mean and the named quantiles (p20, p80, ...) of a list of timings."""
    row = {"median": quantile(times, 0.5), "min": min(times), "max": max(times),
           "mean": sum(times) / len(times), "n": len(times)}
    row.update({f"p{round(q * 100)}": quantile(times, q) for q in quantiles if q != 0.5})
    return row


def time_cuda(fn, warmup=10, rep=40, quantiles=QUANTILES):
    """ms per call from CUDA events around each call (asynchronous launches are timed on the device, not by
    the host's clock); the caller rotates inputs if L2 should be cold."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(rep)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return summarize([s.elapsed_time(e) for s, e in zip(starts, ends)], quantiles)


def time_cpu(fn, warmup=1, rep=5, quantiles=QUANTILES):
    """ms per call by perf_counter (host work: planning, scanning)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rep):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return summarize(times, quantiles)


def _version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _git(*args):
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def environment(gpu=False):
    """Where and with what a result was measured. Versions come from package metadata, so a CPU script does
    not pay torch's import; device name and CUDA only where torch is imported: already (a GPU script), or here
    with gpu=True (a parent whose runs are subprocesses), where it is installed."""
    if gpu:
        try:
            import torch  # noqa: F401
        except ImportError:
            pass
    env = {"date": datetime.date.today().isoformat(),
           "utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "host": platform.node(), "machine": platform.machine(), "processor": platform.processor(),
           "cpus": os.cpu_count(), "python": platform.python_version(),
           "torch": _version("torch"), "deepspeed": _version("deepspeed"), "triton": _version("triton"),
           "git_commit": _git("rev-parse", "HEAD") or None, "git_dirty": bool(_git("status", "--porcelain"))}
    torch = sys.modules.get("torch")
    if torch is not None:
        env["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            env["device"] = torch.cuda.get_device_name(0)
            env["gpus"] = torch.cuda.device_count()
    env.setdefault("device", "cpu")
    return env


def run_child(argv, prefix, env=None):
    """[python, *argv] from the repo root as a job of its own: its single-process group (train/engine.
    single_process_env) takes a port of its own, not a MASTER_PORT this process inherited or set, whose store a
    group left alive here may still hold (EADDRINUSE); `env` overrides variables. Returns (the JSON after the last
    stdout line starting with `prefix`, or None; the CompletedProcess)."""
    env = {**{k: v for k, v in os.environ.items() if k != "MASTER_PORT"}, **(env or {})}
    p = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=ROOT, env=env)
    return last_json(p.stdout, prefix), p


def comma_choices(ap, flag, value, choices) -> list:
    """A comma list argument's items in the order given, each checked against `choices` (ap.error otherwise)."""
    items = list(dict.fromkeys(value.split(",")))
    bad = set(items) - set(choices)
    if bad:
        ap.error(f"{flag}: unknown {sorted(bad)}; choose from {', '.join(choices)}")
    return items


def last_json(text, prefix):
    """The JSON after `prefix` on the last line of `text` that starts with it (how a bench child reports), or None."""
    lines = [ln for ln in text.splitlines() if ln.startswith(prefix)]
    return json.loads(lines[-1][len(prefix):]) if lines else None


def gpu_query():
    """nvidia-smi's view of the GPUs (name, memory, clocks, temperature), '' where there is none."""
    if not shutil.which("nvidia-smi"):
        return ""
    q = "name,memory.total,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu"
    return subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv"], capture_output=True,
                          text=True).stdout.strip()


def markdown_table(rows, columns, headers=None, fmt=None):
    """rows: dicts; columns: keys in order; headers: column titles (default the keys); fmt: key -> format
    spec or callable. Missing values print as '-'."""
    fmt = fmt or {}
    headers = headers or columns

    def cell(row, key):
        v = row.get(key)
        if v is None:
            return "-"
        f = fmt.get(key)
        return f(v) if callable(f) else format(v, f) if f else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(r, k) for k in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_results(path, rows, meta=None, columns=None, **table_kw):
    """path.json: {"env": environment(), **meta, "rows": rows}; with columns also path.md, the table.
    Returns the document written."""
    doc = {"env": environment(), **(meta or {}), "rows": rows}
    base = path[:-5] if path.endswith(".json") else path
    os.makedirs(os.path.dirname(os.path.abspath(base)), exist_ok=True)
    with open(base + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    if columns:
        with open(base + ".md", "w") as f:
            f.write(markdown_table(rows, columns, **table_kw))
    return doc


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["env"])
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    env = {**environment(gpu=True), "nvidia_smi": gpu_query()}
    text = json.dumps(env, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
