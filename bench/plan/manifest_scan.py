"""Files per second of `python -m ds_adaptiveload manifest` on synthetic videos written with PyAV.

    python bench/plan/manifest_scan.py [--small 200] [--large 16] [--out bench/results/manifest_scan-<date>-cpu.json]

Two sets: `small` (128x96, 33 frames, half mp4/mpeg4 with a frame count in the container, half
webm/vp8 without one: open + header cost dominates) and `480p` (480x832, 81 frames, libx264 with its
default GOP, so --verify end decodes up to a whole clip). Each set is scanned with every --verify mode at
1 and at all workers, into a fresh manifest each time (pool start-up included). Raw JSON with date,
machine and versions goes to --out.
"""
import argparse
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import av
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bench.harness import environment  # noqa: E402
from ds_adaptiveload.data import scan  # noqa: E402


def write_video(path, codec, fps, n, width, height):
    rng = np.random.default_rng(0)
    base = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
    with av.open(path, "w") as c:
        s = c.add_stream(codec, rate=fps)
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        for i in range(n):
            frame = np.roll(base, 4 * i, axis=1)  # moving texture: real motion for the encoder
            for p in s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def make_sets(root, n_small, n_large):
    sets = {}
    d = os.path.join(root, "small")
    os.makedirs(d)
    for i in range(n_small):
        ext, codec = ("mp4", "mpeg4") if i % 2 == 0 else ("webm", "libvpx")
        write_video(os.path.join(d, f"{i:05d}.{ext}"), codec, 24, 33, 128, 96)
    sets["small"] = dict(dir=d, files=n_small, desc="128x96, 33 frames @24 fps; half mp4/mpeg4, half webm/vp8")
    if n_large:
        d = os.path.join(root, "480p")
        os.makedirs(d)
        for i in range(n_large):
            write_video(os.path.join(d, f"{i:05d}.mp4"), "libx264", 24, 81, 832, 480)
        sets["480p"] = dict(dir=d, files=n_large, desc="832x480, 81 frames @24 fps, mp4/libx264 (default GOP)")
    return sets


def time_scan(d, out, workers, verify):
    p = argparse.ArgumentParser()
    scan.add_arguments(p)
    args = p.parse_args([d, "--out", out, "--workers", str(workers), "--verify", verify, "--allow-empty-caption"])
    t = time.perf_counter()
    scan.run(args)
    dt = time.perf_counter() - t
    with open(out) as f:
        ok = sum(1 for _ in f)
    return dt, ok


def machine():
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return dict(cpu=cpu, cores=os.cpu_count(), platform=platform.platform())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", type=int, default=200, help="files in the small set")
    ap.add_argument("--large", type=int, default=16, help="files in the 480p set (0 = skip)")
    ap.add_argument("--out", default=None, help="result JSON (default bench/results/manifest_scan-<date>-cpu.json)")
    a = ap.parse_args()
    date = datetime.date.today().isoformat()
    out = a.out or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results",
                                f"manifest_scan-{date}-cpu.json")
    root = tempfile.mkdtemp(prefix="manifest_scan_")
    try:
        t = time.perf_counter()
        sets = make_sets(root, a.small, a.large)
        gen_s = time.perf_counter() - t
        rows = []
        for name, s in sets.items():
            for verify in ("first", "end", "full"):
                for workers in sorted({1, os.cpu_count() or 1}):
                    mf = os.path.join(root, f"{name}-{verify}-{workers}.jsonl")
                    dt, ok = time_scan(s["dir"], mf, workers, verify)
                    rows.append(dict(set=name, verify=verify, workers=workers, files=s["files"], ok=ok,
                                     seconds=round(dt, 3), files_per_s=round(s["files"] / dt, 1)))
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result = dict(
        bench="manifest_scan", date=date, device="cpu", machine=machine(), env=environment(),
        versions=dict(python=platform.python_version(), av=av.__version__,
                      ffmpeg={k: ".".join(map(str, v)) for k, v in av.library_versions.items()},
                      numpy=np.__version__),
        sets={k: dict(files=v["files"], desc=v["desc"]) for k, v in sets.items()},
        generate_s=round(gen_s, 1), rows=rows,
        note="files/s = files / wall time of one scan.run() into a fresh manifest, process pool start-up "
             "included; one run per row.")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
