"""`manifest` command: metadata, mapping rules, error file and resume, on real files written with PyAV."""
import argparse
import json
import os
import shutil

import pytest

av = pytest.importorskip("av")
np = pytest.importorskip("numpy")

from ds_adaptiveload.data import scan  # noqa: E402
from ds_adaptiveload.data.scan import (  # noqa: E402
    MapConfig, longest_4n1, resampled_frames, target_frames, target_size)
from ds_adaptiveload.errors import UserError  # noqa: E402
from ds_adaptiveload.schedule.geometry import Geometry  # noqa: E402


def write_video(path, codec, fps, n, width, height, pix_fmt="yuv420p", fmt=None):
    """n synthetic frames (a moving bar, so inter-frame codecs have something to encode)."""
    with av.open(str(path), "w", format=fmt) as c:
        s = c.add_stream(codec, rate=fps)
        s.width, s.height, s.pix_fmt = width, height, pix_fmt
        for i in range(n):
            a = np.zeros((height, width, 3), np.uint8)
            a[..., 0] = i * 7 % 255
            a[:, : i % width, 1] = 200
            for p in s.encode(av.VideoFrame.from_ndarray(a, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def has_encoder(name):
    try:
        av.codec.Codec(name, "w")
        return True
    except Exception:
        return False


# id -> (frames, height, width, source frames, source fps, frames_from) expected with default settings
EXPECTED = {
    "a.mp4": (21, 272, 368, 45, 30.0, "container"),     # 45 @ 30 fps = 1.5 s -> 24 @ 16 -> 21; 3:2 -> 272x368
    "sub/b.webm": (17, 320, 320, 30, 24.0, "duration"),  # 30 @ 24 -> 20 -> 17; square
    "c.mkv": (17, 416, 240, 20, 16.0, "duration"),       # 20 @ 16 -> 17; portrait
    "d.avi": (13, 240, 416, 25, 25.0, "container"),      # 25 @ 25 -> 16 -> 13; 5:3
    "img.png": (1, 240, 416, 1, None, "image"),          # 2:1 image
}
ERRORS = {"short.mp4": "too short", "trunc.mp4": "cannot open", "trunc.mkv": "truncated",
          "fake.mp4": "cannot open"}


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "sub").mkdir()
    write_video(d / "a.mp4", "mpeg4", 30, 45, 96, 64)
    write_video(d / "sub" / "b.webm", "libvpx", 24, 30, 64, 64)
    write_video(d / "c.mkv", "ffv1", 16, 20, 64, 112)
    write_video(d / "d.avi", "mjpeg", 25, 25, 80, 48, pix_fmt="yuvj420p")
    write_video(d / "img.png", "png", 1, 1, 100, 50, pix_fmt="rgb24", fmt="image2")
    write_video(d / "short.mp4", "libx264" if has_encoder("libx264") else "mpeg4", 60, 3, 64, 64)
    data = (d / "a.mp4").read_bytes()
    (d / "trunc.mp4").write_bytes(data[: len(data) // 2])  # mp4 index (moov) is at the end: lost
    write_video(d / "long.mkv", "ffv1", 16, 60, 64, 64)
    data = (d / "long.mkv").read_bytes()
    (d / "trunc.mkv").write_bytes(data[: len(data) // 3])  # headers intact, frames missing
    (d / "long.mkv").unlink()
    (d / "fake.mp4").write_text("not a video")
    (d / "notes.txt").write_text("ignored: no media extension")
    shutil.copy(d / "a.mp4", d / ".hidden.mp4")
    for sid in (*EXPECTED, "short.mp4"):  # sidecar captions; the broken files have none, their media fail first
        (d / sid).with_suffix(".txt").write_text(f"  caption of {sid}\n")
    return d


def scan_args(media, out, **kw):
    """Parsed `manifest` arguments; a keyword set to True is a flag (allow_empty_caption=True)."""
    p = argparse.ArgumentParser()
    scan.add_arguments(p)
    argv = [str(media), "--out", str(out)]
    for k, v in kw.items():
        flag = f"--{k.replace('_', '-')}"
        argv += [flag] if v is True else [flag, str(v)]
    return p.parse_args(argv)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------------------------------------------- rules


def test_longest_4n1():
    assert [longest_4n1(n) for n in (0, 1, 4, 5, 8, 9, 80, 81, 82)] == [0, 1, 1, 5, 5, 9, 77, 81, 81]


def test_frame_rules():
    cfg = MapConfig()
    assert resampled_frames(81, 16, 16) == 81
    assert resampled_frames(45, 30, 16) == 24
    assert resampled_frames(8, 8, 16) == 16  # slower source: frames repeat
    assert resampled_frames(45, 30, 0) == 45  # --fps 0 keeps the source rate
    assert target_frames(120, 24, cfg) == 77  # 80 -> 77
    assert target_frames(10 * 30, 30, cfg) == 81  # capped by --max-frames
    assert target_frames(10 * 30, 30, MapConfig(max_frames=49)) == 49
    assert target_frames(1, 30, cfg) == 0  # 1/30 s holds no frame at 16 fps
    assert target_frames(2, 30, cfg) == 1


@pytest.mark.parametrize("src, cfg, want", [
    ((480, 854), MapConfig(), (480, 832)),
    ((1080, 1920), MapConfig(), (480, 832)),               # capped at 480p by default
    ((1080, 1920), MapConfig(max_area=1280 * 720), (720, 1280)),
    ((1920, 1080), MapConfig(max_area=1280 * 720), (1280, 720)),
    ((480, 640), MapConfig(), (544, 720)),                  # 4:3, nearer 480p than 240p in area
    ((1000, 1000), MapConfig(), (624, 624)),
    ((64, 96), MapConfig(), (272, 368)),                    # tiny: 240p tier
])
def test_size_rule(src, cfg, want):
    assert target_size(*src, cfg) == want


def test_every_size_fits_the_grid():
    geo = Geometry()
    for h in range(16, 2200, 37):
        for w in range(16, 2200, 41):
            for area in (240 * 416, 480 * 832, 720 * 1280):
                geo.check(1, *target_size(h, w, MapConfig(max_area=area)))


def test_bad_settings():
    for cfg in (MapConfig(max_frames=80), MapConfig(fps=-1), MapConfig(max_area=1000)):
        with pytest.raises(UserError):
            scan.check_config(cfg)


# ---------------------------------------------------------------------------------------------------- scan


def test_scan_manifest_and_errors(media, tmp_path):
    out = tmp_path / "m.jsonl"
    assert scan.run(scan_args(media, out, workers=2)) == 0
    recs = {r["id"]: r for r in read_jsonl(out)}
    assert set(recs) == set(EXPECTED)
    geo = Geometry()
    for sid, (f, h, w, sf, sfps, how) in EXPECTED.items():
        r = recs[sid]
        assert (r["frames"], r["height"], r["width"]) == (f, h, w), sid
        geo.check(r["frames"], r["height"], r["width"])
        src = r["source"]
        assert (src["frames"], src["fps"], src["frames_from"]) == (sf, sfps, how), sid
        assert os.path.samefile(r["path"], media / sid)
    assert recs["a.mp4"]["source"]["codec"] == "mpeg4"
    assert recs["sub/b.webm"]["source"]["codec"] == "vp8"
    assert (recs["a.mp4"]["source"]["width"], recs["a.mp4"]["source"]["height"]) == (96, 64)
    assert recs["a.mp4"]["source"]["duration"] == pytest.approx(1.5)
    assert recs["a.mp4"]["fps"] == 16.0 and recs["img.png"]["fps"] is None
    assert all(recs[sid]["caption"] == f"caption of {sid}" for sid in EXPECTED)  # stripped

    errs = {e["id"]: e["reason"] for e in read_jsonl(str(out) + ".errors.jsonl")}
    assert set(errs) == set(ERRORS)
    for sid, word in ERRORS.items():
        assert word in errs[sid], (sid, errs[sid])

    # The lead's loader accepts what we wrote.
    from ds_adaptiveload.schedule.manifest import load_manifest
    assert len(load_manifest(out)) == len(EXPECTED)


def test_resume_is_exact(media, tmp_path):
    out = tmp_path / "m.jsonl"
    scan.run(scan_args(media, out, workers=1))
    full, full_err = out.read_text(), (tmp_path / "m.jsonl.errors.jsonl").read_text()
    # Second run: nothing new, nothing duplicated.
    scan.run(scan_args(media, out, workers=2))
    assert out.read_text() == full
    assert (tmp_path / "m.jsonl.errors.jsonl").read_text() == full_err
    # Killed mid-run: two lines lost and the next one torn; resuming gives the same manifest.
    lines = full.splitlines(keepends=True)
    out.write_text("".join(lines[:-2]) + lines[-2][:20])
    scan.run(scan_args(media, out, workers=2))
    assert out.read_text() == full


def test_resume_refuses_other_settings(media, tmp_path):
    out = tmp_path / "m.jsonl"
    scan.run(scan_args(media, out, workers=1))
    with pytest.raises(UserError, match="fps"):
        scan.run(scan_args(media, out, workers=1, fps=24))


def test_verify_full_counts_frames(media, tmp_path):
    out = tmp_path / "m.jsonl"
    scan.run(scan_args(media, out, workers=1, verify="full"))
    recs = {r["id"]: r for r in read_jsonl(out)}
    for sid, (f, h, w, sf, _, how) in EXPECTED.items():
        assert recs[sid]["frames"] == f and recs[sid]["source"]["frames"] == sf
        assert recs[sid]["source"]["frames_from"] == ("image" if how == "image" else "decode")
    errs = {e["id"] for e in read_jsonl(str(out) + ".errors.jsonl")}
    assert errs == set(ERRORS)


def test_fps_zero_keeps_source_rate(media, tmp_path):
    out = tmp_path / "m.jsonl"
    scan.run(scan_args(media, out, workers=1, fps=0))
    recs = {r["id"]: r for r in read_jsonl(out)}
    assert recs["a.mp4"]["frames"] == 45 and recs["a.mp4"]["fps"] == 30.0
    assert recs["d.avi"]["frames"] == 25
    assert "short.mp4" in recs and recs["short.mp4"]["frames"] == 1  # 3 frames -> 1 at its own rate


def test_not_a_folder(tmp_path):
    with pytest.raises(UserError, match="not a folder"):
        scan.run(scan_args(tmp_path / "missing", tmp_path / "m.jsonl"))


# ---------------------------------------------------------------------------------------------------- captions


def test_missing_caption_is_an_error_unless_allowed(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    write_video(d / "a.mkv", "ffv1", 16, 20, 64, 64)
    write_video(d / "b.mkv", "ffv1", 16, 20, 64, 64)
    (d / "b.txt").write_text("\n")  # empty counts as missing
    (d / "a.txt").write_bytes(b"\xff\xfe bad")
    out = tmp_path / "m.jsonl"
    scan.run(scan_args(d, out, workers=1))
    assert not out.read_text()
    errs = {e["id"]: e["reason"] for e in read_jsonl(str(out) + ".errors.jsonl")}
    assert errs == {"a.mkv": "caption a.txt is not UTF-8 text",
                    "b.mkv": "no caption (b.txt is empty); write one, or pass --allow-empty-caption"}
    out2 = tmp_path / "m2.jsonl"
    (d / "a.txt").unlink()
    scan.run(scan_args(d, out2, workers=1, allow_empty_caption=True))
    assert [r["caption"] for r in read_jsonl(out2)] == ["", ""]


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_captions_file(tmp_path, fmt):
    d = tmp_path / "m"
    (d / "sub").mkdir(parents=True)
    for sid in ("a.mkv", "sub/b.mkv", "c.mkv"):
        write_video(d / sid, "ffv1", 16, 20, 64, 64)
    (d / "a.txt").write_text("sidecar: ignored when --captions is given")
    rows = [("a.mkv", 'a, with "quotes"'), (str(d / "sub" / "b.mkv"), "b\nsecond line")]  # relative, absolute
    cap = tmp_path / f"caps.{fmt}"
    if fmt == "csv":
        import csv
        with open(cap, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["path", "caption"])
            w.writerows(rows)
    else:
        cap.write_text("".join(json.dumps(dict(path=p, caption=c)) + "\n" for p, c in rows))
    out = tmp_path / "m.jsonl"
    scan.run(scan_args(d, out, workers=1, captions=cap))
    assert {r["id"]: r["caption"] for r in read_jsonl(out)} == {"a.mkv": 'a, with "quotes"',
                                                                 "sub/b.mkv": "b\nsecond line"}
    errs = {e["id"]: e["reason"] for e in read_jsonl(str(out) + ".errors.jsonl")}
    assert errs == {"c.mkv": "no caption (no line for it in --captions); write one, or pass --allow-empty-caption"}


def test_bad_captions_file(tmp_path):
    (tmp_path / "m").mkdir()
    bad = {"x.csv": ("path,text\na,b\n", r"x.csv:1: the header needs the column\(s\) caption"),
           "y.jsonl": ('{"path": "a", "caption": "b"}\n[1]\n', "y.jsonl:2: expected a JSON object"),
           "z.jsonl": ('{"path": "a", "caption": "b"}\n{"path": "a", "caption": "c"}\n',
                       r"z.jsonl:2: second caption for 'a' \(first on line 1\)"),
           "w.txt": ("", "expected a .csv or .jsonl")}
    for name, (text, match) in bad.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(UserError, match=match):
            scan.run(scan_args(tmp_path / "m", tmp_path / "m.jsonl", captions=tmp_path / name))


# ---------------------------------------------------------------------------------------------------- nothing skipped silently


def test_symlinked_folders_followed_once(tmp_path):
    d, outside = tmp_path / "m", tmp_path / "outside"
    (d / "real").mkdir(parents=True)
    outside.mkdir()
    write_video(d / "real" / "a.mkv", "ffv1", 16, 20, 64, 64)
    write_video(outside / "b.mkv", "ffv1", 16, 20, 64, 64)
    os.symlink(outside, d / "linked")           # data outside the tree: followed
    os.symlink(d / "real", d / "zz_again")      # a second path to a scanned folder: reported
    os.symlink(d, d / "real" / "loop")          # a loop back to the root: reported, ends
    out = tmp_path / "m.jsonl"
    scan.run(scan_args(d, out, workers=1, allow_empty_caption=True))
    assert [r["id"] for r in read_jsonl(out)] == ["linked/b.mkv", "real/a.mkv"]
    errs = {e["id"]: e["reason"] for e in read_jsonl(str(out) + ".errors.jsonl")}
    assert set(errs) == {"real/loop", "zz_again"}
    assert errs["real/loop"].startswith("symlinked folder already scanned as '.'")
    assert errs["zz_again"].startswith("symlinked folder already scanned as 'real'")
    scan.run(scan_args(d, out, workers=1, allow_empty_caption=True))  # resume: nothing written twice
    assert len(read_jsonl(str(out) + ".errors.jsonl")) == 2


def test_unreadable_folder_is_an_error(tmp_path, monkeypatch):
    d = tmp_path / "m"
    (d / "locked").mkdir(parents=True)
    write_video(d / "locked" / "a.mkv", "ffv1", 16, 20, 64, 64)
    write_video(d / "b.mkv", "ffv1", 16, 20, 64, 64)
    real = os.scandir

    def scandir(path="."):  # as chmod 000 would (tests may run as root, which chmod does not stop)
        if os.fspath(path) == str(d / "locked"):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path)

    monkeypatch.setattr(os, "scandir", scandir)
    out = tmp_path / "m.jsonl"
    scan.run(scan_args(d, out, workers=1, allow_empty_caption=True))
    assert [r["id"] for r in read_jsonl(out)] == ["b.mkv"]
    assert read_jsonl(str(out) + ".errors.jsonl") == [
        dict(id="locked", path=str(d / "locked"), reason="cannot read folder: Permission denied")]


def test_empty_file_and_animated_webp(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "empty.mp4").write_bytes(b"")
    (d / "empty.png").write_bytes(b"")
    with av.open(str(d / "anim.webp"), "w", format="webp") as c:
        s = c.add_stream("libwebp_anim", rate=10)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        for i in range(3):
            for p in s.encode(av.VideoFrame.from_ndarray(np.full((48, 64, 3), i * 60, np.uint8), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    write_video(d / "still.webp", "libwebp", 1, 1, 64, 48, fmt="webp")  # a still WebP reads
    out = tmp_path / "m.jsonl"
    scan.run(scan_args(d, out, workers=1, allow_empty_caption=True))
    assert [(r["id"], r["frames"]) for r in read_jsonl(out)] == [("still.webp", 1)]
    errs = {e["id"]: e["reason"] for e in read_jsonl(str(out) + ".errors.jsonl")}
    assert errs["empty.mp4"] == errs["empty.png"] == "empty file (0 bytes)"
    assert errs["anim.webp"].startswith("animated WebP is not supported")



# The caller of the scan below: a thread of it holds PyAV's import lock for good (as a thread of a busy process
# may hold any lock at the moment of a fork), and its SIGTERM handler does not exit (as cli.main's on_sigterm
# stays in a test process that ran it). A worker forked from it deadlocked importing av and ignored
# pool.terminate; the CI run hung 20 min (2026-12-07). Spawned workers start clean.
_HELD_LOCK_CALLER = """
import argparse, importlib._bootstrap as b, signal, sys, threading
from ds_adaptiveload.data import scan
assert "av" not in sys.modules
signal.signal(signal.SIGTERM, lambda *a: None)
held, lock = threading.Event(), b._ModuleLockManager("av")  # referenced: the lock lives as long as its manager
def hold():
    lock.__enter__()
    held.set()
    threading.Event().wait()
threading.Thread(target=hold, daemon=True).start()
held.wait()
p = argparse.ArgumentParser()
scan.add_arguments(p)
sys.exit(scan.run(p.parse_args([sys.argv[1], "--out", sys.argv[2], "--workers", "2"])))
"""


def test_workers_start_clean_of_the_callers_threads_and_handlers(media, tmp_path):
    import importlib._bootstrap
    import subprocess
    import sys

    if not hasattr(importlib._bootstrap, "_ModuleLockManager"):
        pytest.skip("this Python has no importlib._bootstrap._ModuleLockManager")
    out = tmp_path / "m.jsonl"
    try:
        r = subprocess.run([sys.executable, "-c", _HELD_LOCK_CALLER, str(media), str(out)], capture_output=True,
                           text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    except subprocess.TimeoutExpired:
        pytest.fail("the scan did not end in 120 s: a worker inherited the caller's held lock")
    assert r.returncode == 0, r.stderr
    assert {rec["id"] for rec in read_jsonl(out)} == set(EXPECTED)
