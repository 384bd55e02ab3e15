"""The benchmark harness every bench/ script shares (as Liger's benchmark/scripts/utils.py): timing with warm-up
and quantiles (CUDA events or perf_counter), the environment a result was measured in, the raw results written
as JSON rows plus a Markdown table, and `record()`, the only writer of the results table
bench/results/results.csv (one row per measured number; docs/results.md is generated from it).

    python bench/harness.py env [--out env.json]     # the environment as JSON (bench/device/run.py stage env)
    python bench/harness.py merge STAGING.csv        # upsert rows a GPU machine recorded into its own table
    python bench/harness.py check [TABLE.csv]        # every row valid, its raw files present, the file as written
"""
import argparse
import contextlib
import csv
import datetime
import fcntl
import hashlib
import math
import re
import tempfile
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


def run_part(argv, prefix, log_path):
    """run_child, with the child's stdout and stderr kept in log_path (a bench of parts keeps one log per part)."""
    row, proc = run_child(argv, prefix)
    with open(log_path, "w") as f:
        f.write(proc.stdout + proc.stderr)
    return row, proc


def last_error(stderr: str) -> str:
    """The exception line of a crashed child's stderr (`[rank0]: RuntimeError: ...` without the rank prefix): the
    last line naming an Error or Exception, else the last line (a warning printed at exit may come after it)."""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", ln).strip() for ln in stderr.strip().splitlines()]
    errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception)\b", ln)]
    return (errors or lines or [""])[-1]


def save_parts(out, stem, rows, args, record_rows, smoke=False):
    """The end of a bench of parts: the raw file OUT/STEM-DATE-DEVICE.json (-smoke for a smoke run), the staging
    rows from record_rows(rows, args, the raw file's name in the repository, env), and a line naming both."""
    env = environment(gpu=True)
    tag = "smoke" if smoke else env.get("device", "cpu").replace(" ", "-").lower()
    raw = os.path.join(out, f"{stem}-{env['date']}-{tag}.json")
    write_results(raw, rows, meta={"args": vars(args)})
    csv = record_rows(rows, args, RAW_DIR + os.path.basename(raw), env)
    print(f"raw rows: {raw}; staging table: {csv}")


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


# The results table. One row per measured (or predicted, or not yet measured) number; rows are upserted on KEY,
# so a new measurement of the same thing on the same hardware replaces the old one (git keeps the old row).
RESULTS_CSV = os.path.join(ROOT, "bench", "results", "results.csv")
COLUMNS = ("experiment", "variant", "metric", "unit", "value", "baseline", "ratio", "status", "hardware", "gpus",
           "zero_stage", "policy", "model", "commit", "date", "command", "raw_file", "section", "better", "note")
KEY = ("experiment", "variant", "metric", "hardware")
STATUSES = ("ok", "crash", "oom", "predicted", "not-measured")
# docs/results.md shows the sections in this order, after its headline, predicted and not-yet-measured tables.
SECTIONS = ("headline", "training", "packing", "kernel", "calibration", "scheduler", "replay", "data")
UNITS = ("%", "x", "s", "ms", "us", "GiB", "tokens/s", "samples/s", "files/s", "clips/s", "TFLOP/s", "GB/s")
LOWER_IS_BETTER_UNITS = ("s", "ms", "us", "GiB")
PREDICTED = " (predicted)"  # a predicted row's metric ends so: it pairs with the measured row of the same metric
RAW_DIR = "bench/results/"
_REQUIRED = ("experiment", "variant", "metric", "unit", "hardware", "section", "date", "status")
_COMMIT = re.compile(r"^([0-9a-f]{7,40}(-dirty)?)?$")
_HARDWARE_GPUS = re.compile(r"^(\d+)x ")


def _user_error():
    # The checkout's own package: scripts run as `python bench/x.py` may have no installed one (a GPU machine's env
    # stage), and errors.py imports nothing heavy.
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if checkout not in sys.path:
        sys.path.insert(0, checkout)
    from ds_adaptiveload.errors import UserError

    return UserError


def _fail(msg):
    raise _user_error()(msg)


def _num(row, col):
    """The column as a float, None where empty."""
    v = row.get(col, "")
    if v == "":
        return None
    try:
        f = float(v)
    except ValueError:
        f = math.nan
    if not math.isfinite(f):
        _fail(f"results row {_label(row)}: {col} {v!r} is not a finite number")
    return f


def _label(row):
    return "/".join(str(row.get(k, "")) for k in KEY)


def _git_commit():
    head = _git("rev-parse", "--short", "HEAD")
    return head + ("-dirty" if head and _git("status", "--porcelain", "--untracked-files=no") else "")


def _complete(given):
    """The row as strings in COLUMNS, the environment's fields filled where not given (an explicit "" stays: a
    commit not known), the ratio computed where it can be: how many times better than the baseline
    (baseline / value where lower is better)."""
    unknown = sorted(set(given) - set(COLUMNS))
    if unknown:
        _fail(f"results row: unknown column(s) {unknown}; the columns are {', '.join(COLUMNS)}")
    row = {k: "" if given.get(k) is None else str(given[k]) for k in COLUMNS}
    if "status" not in given:
        row["status"] = "ok"
    if "date" not in given:
        row["date"] = datetime.date.today().isoformat()
    if "commit" not in given:
        row["commit"] = _git_commit()
    row["better"] = row["better"] or ("lower" if row["unit"] in LOWER_IS_BETTER_UNITS else "higher")
    hw = _HARDWARE_GPUS.match(row["hardware"])
    if row["gpus"] == "":
        row["gpus"] = hw.group(1) if hw else "0"
    if row["status"] == "predicted" and not row["metric"].endswith(PREDICTED):
        row["metric"] += PREDICTED
    for col in ("value", "baseline", "ratio"):
        f = _num(row, col)
        row[col] = "" if f is None else repr(f)  # the shortest text that reads back as the same float
    if row["ratio"] == "":
        row["ratio"] = _ratio(row)
    return row


def _ratio(row):
    """How many times better the value is than the baseline, '' where either is missing or a division by 0."""
    value, base = _num(row, "value"), _num(row, "baseline")
    if value is None or base is None:
        return ""
    num, den = (base, value) if row["better"] == "lower" else (value, base)
    return repr(float(format(num / den, ".6g"))) if den else ""


def _check_row(row, check_files):
    """UserError naming the row and the column for anything a results row must not be."""
    where = f"results row {_label(row)}"
    for col in _REQUIRED:
        if not row[col]:
            _fail(f"{where}: {col} is required")
    for col, v in row.items():
        if "\n" in v or "\r" in v:
            _fail(f"{where}: {col} holds a line break")
    for col, allowed in (("unit", UNITS), ("status", STATUSES), ("section", SECTIONS),
                         ("better", ("higher", "lower"))):
        if row[col] not in allowed:
            _fail(f"{where}: {col} {row[col]!r} is not one of {', '.join(allowed)}")
    _check_values(row, where)
    _check_environment(row, where)
    _check_sources(row, where, check_files)


def _check_values(row, where):
    measured = row["status"] in ("ok", "predicted")
    if measured and row["value"] == "":
        _fail(f"{where}: status {row['status']} needs a value")
    if row["status"] == "not-measured" and row["value"] != "":
        _fail(f"{where}: status not-measured takes no value")
    if row["metric"].endswith(PREDICTED) != (row["status"] == "predicted"):
        _fail(f"{where}: a metric ends with {PREDICTED!r} exactly when its status is predicted")
    ratio, expected = _num(row, "ratio"), _ratio(row)
    if ratio is not None and ratio <= 0:
        _fail(f"{where}: ratio must be above 0")
    # A given ratio must say what value and baseline say, in the row's direction (a flipped ratio is a typo).
    if ratio is not None and expected and abs(ratio / float(expected) - 1) > 0.02:
        _fail(f"{where}: ratio {row['ratio']} disagrees with value and baseline ({expected}, {row['better']} is "
              "better)")


def _check_environment(row, where):
    try:
        datetime.date.fromisoformat(row["date"])
    except ValueError:
        _fail(f"{where}: date {row['date']!r} is not YYYY-MM-DD")
    if not _COMMIT.match(row["commit"]):
        _fail(f"{where}: commit {row['commit']!r} is not a git hash (optionally with -dirty) or empty")
    if not row["gpus"].isdigit():
        _fail(f"{where}: gpus {row['gpus']!r} is not a count")
    hw = _HARDWARE_GPUS.match(row["hardware"])
    if not hw and not row["hardware"].startswith("CPU"):
        _fail(f"{where}: hardware {row['hardware']!r} is neither 'Nx GPU' (1x H200, 2x H100 80GB) nor 'CPU...'")
    if hw and hw.group(1) != row["gpus"]:
        _fail(f"{where}: hardware {row['hardware']!r} says {hw.group(1)} GPUs, gpus says {row['gpus']}")
    if row["zero_stage"] not in ("", "0", "1", "2", "3"):
        _fail(f"{where}: zero_stage {row['zero_stage']!r} is not 0-3 or empty")


def _check_sources(row, where, check_files):
    if row["status"] != "not-measured" and not row["command"]:
        _fail(f"{where}: command is required (the command that made the number)")
    if row["status"] in ("ok", "crash", "oom") and not (row["raw_file"] or row["note"]):
        _fail(f"{where}: raw_file is required, or a note saying why there is none")
    for f in raw_files(row):
        if not f.startswith(RAW_DIR) or ".." in f.split("/"):
            _fail(f"{where}: raw_file {f!r} is not under {RAW_DIR}")
        if check_files and not os.path.isfile(os.path.join(ROOT, f)):
            _fail(f"{where}: raw_file {f} does not exist")


def raw_files(row):
    """The raw files a row cites (its raw_file column holds them separated by ';')."""
    return [f.strip() for f in row["raw_file"].split(";") if f.strip()]


def read_results(path=None):
    """The rows of a results table, as dicts of strings in COLUMNS ([] where the file does not exist). Columns a
    later version added read as ''; a column this version does not know is an error."""
    path = path or RESULTS_CSV
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        unknown = sorted(set(reader.fieldnames or ()) - set(COLUMNS))
        if unknown:
            _fail(f"{path}: unknown column(s) {unknown}")
        return [{k: r.get(k) or "" for k in COLUMNS} for r in reader]


def _sort_key(row):
    return (SECTIONS.index(row["section"]) if row["section"] in SECTIONS else len(SECTIONS),
            *(row[k] for k in KEY))


def _table_text(rows):
    """The table's text: the header, then the rows by section and KEY (what check compares the file with)."""
    import io

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(COLUMNS)
    w.writerows([r[k] for k in COLUMNS] for r in sorted(rows, key=_sort_key))
    return buf.getvalue()


@contextlib.contextmanager
def _locked(path):
    """One writer at a time per table: benchmark scripts may record from parallel processes."""
    name = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:16]
    with open(os.path.join(tempfile.gettempdir(), f"dsal-results-{name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def record(path=None, **row):
    """Upsert one number into the results table (bench/results/results.csv, or `path`: a staging table, e.g. under
    $OUT on a GPU machine, merged later with `python bench/harness.py merge`). Keyword arguments are COLUMNS:
    experiment, variant, metric, unit, value, hardware ("1x H200", "2x H200", "1x H100 80GB", "CPU"), section
    and command are needed; status defaults to ok, date to today, commit to this checkout's HEAD, gpus to the
    hardware's count, better to the unit's direction, ratio to the value against the baseline. A predicted row
    gets " (predicted)" on its metric and names the hardware it predicts for. Rows of the repository's table must
    name raw files that exist under bench/results/ (or say in the note why there is none). Bad input raises
    UserError naming the row and the column. Returns the row as written."""
    path = path or RESULTS_CSV
    row = _complete(row)
    _check_row(row, check_files=os.path.abspath(path) == os.path.abspath(RESULTS_CSV))
    with _locked(path):
        rows = {tuple(r[k] for k in KEY): r for r in read_results(path)}
        rows[tuple(row[k] for k in KEY)] = row
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", newline="") as f:
            f.write(_table_text(rows.values()))
        os.replace(tmp, path)  # readers never see half a table
    return row


def forget(path=None, **match):
    """Remove the rows whose columns equal every given value (a superseded experiment whose key changed: record()
    upserts, so rows of the old key would stay). Returns how many went."""
    path = path or RESULTS_CSV
    unknown = sorted(set(match) - set(COLUMNS))
    if unknown:
        _fail(f"forget: unknown column(s) {unknown}")
    with _locked(path):
        rows = read_results(path)
        keep = [r for r in rows if any(r[k] != v for k, v in match.items())]
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", newline="") as f:
            f.write(_table_text(keep))
        os.replace(tmp, path)
    return len(rows) - len(keep)


def check_results(path=None):
    """Every row of a table valid with its raw files present, and the file exactly as record() writes it (so no
    hand edit slipped in). Returns the rows."""
    path = path or RESULTS_CSV
    if not os.path.isfile(path):
        _fail(f"{path}: no such results table")
    rows = read_results(path)
    keys = [tuple(r[k] for k in KEY) for r in rows]
    if len(set(keys)) != len(keys):
        _fail(f"{path}: two rows share a key ({', '.join(KEY)})")
    for row in rows:
        _check_row(row, check_files=True)
    with open(path, newline="") as f:
        if f.read() != _table_text(rows):
            _fail(f"{path}: not as record() writes it (sorted rows, every column); re-record or merge the rows")
    return rows


def merge_results(staging, path=None):
    """Upsert every row of a staging table (one a GPU machine wrote) into the results table through record()."""
    if not os.path.isfile(staging):
        _fail(f"{staging}: no such results table")
    rows = read_results(staging)
    for row in rows:
        record(path, **row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    env_p = sub.add_parser("env", help="the environment as JSON")
    env_p.add_argument("--out", help="also write the JSON here")
    merge_p = sub.add_parser("merge", help="upsert a staging table's rows into bench/results/results.csv")
    merge_p.add_argument("staging", help="a results table written with record(path=...)")
    check_p = sub.add_parser("check", help="validate a results table (default bench/results/results.csv)")
    check_p.add_argument("table", nargs="?", default=RESULTS_CSV)
    args = ap.parse_args(argv)
    if args.what == "env":
        _print_env(args.out)
        return 0
    try:
        if args.what == "merge":
            print(f"merged {len(merge_results(args.staging))} rows into {RESULTS_CSV}")
        else:
            print(f"{args.table}: {len(check_results(args.table))} rows ok")
    except _user_error() as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _print_env(out):
    env = {**environment(gpu=True), "nvidia_smi": gpu_query()}
    text = json.dumps(env, indent=1)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
