"""Dataset `report`: the plots and the Markdown summary over the lead's planner."""
import argparse
import json
import os
import random
import re

import pytest

pytest.importorskip("matplotlib")

from ds_adaptiveload.data import report  # noqa: E402
from ds_adaptiveload.errors import UserError  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILE = os.path.join(ROOT, "tests", "data", "h200-wan1.3b-blocks.yaml")
SHAPES = [(1, 480, 832), (1, 720, 1280), (17, 624, 624), (33, 480, 832), (81, 480, 832), (81, 720, 1280)]
SECTIONS = ["# Dataset report", "## Samples", "## Token lengths", "## Buckets", "## Predicted per-rank load",
            "## Idle fraction by policy and world size"]
PNG = b"\x89PNG\r\n\x1a\n"


def write_manifest(path, n=400, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            fr, h, w = rng.choice(SHAPES)
            f.write(json.dumps(dict(id=f"s{i}", frames=fr, height=h, width=w)) + "\n")


def report_args(**kw):
    p = argparse.ArgumentParser()
    report.add_arguments(p)
    argv = []
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return p.parse_args(argv)


def test_report_writes_plots_and_sections(tmp_path):
    m = tmp_path / "m.jsonl"
    write_manifest(m)
    out = tmp_path / "rep"
    assert report.run(report_args(manifest=m, profile=PROFILE, world_size=4, out=out, grad_accum=2)) == 0
    for name in ("tokens_hist.png", "load_per_rank.png", "idle_fraction.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 10_000, name
    md = (out / "report.md").read_text()
    pos = [md.index(s) for s in SECTIONS]
    assert pos == sorted(pos)
    for name in ("tokens_hist.png", "load_per_rank.png", "idle_fraction.png"):
        assert f"]({name})" in md
    # Bucket table: one row per shape; equal-tokens B = floor(M_mem / S) with M_mem = 75600.
    # the longest clip fills M_mem, so the derived compute cap equals the memory cap (docs/scheduler.md)
    assert re.search(r"^\| 81x480x832 \| \d+ \| 32760 \| 2 \| 2 \| ", md, re.M)
    assert re.search(r"^\| 81x720x1280 \| \d+ \| 75600 \| 1 \| 1 \| 1 \|", md, re.M)
    assert sum(line.startswith(f"| {f}x{h}x{w} |") for line in md.splitlines() for f, h, w in SHAPES) == 6
    # Idle table: every policy at 8, 64, 1024 and the requested world size.
    for w in ("4 (--world-size)", "8", "64", "1024"):
        for p in ("equal-tokens", "dual", "balanced", "packed"):  # packed: the default policy
            assert re.search(rf"^\| {re.escape(w)} \| {p} \| \d+ \| [\d.]+% \|", md, re.M), (w, p)


def test_report_lists_every_policy_the_planner_has():
    from ds_adaptiveload.schedule.policies import POLICIES
    assert sorted(report.POLICIES) == sorted(POLICIES) and report.POLICIES[0] == "equal-tokens"


def test_p90_stays_within_the_data(tmp_path):
    """Three samples of 1,560, 29,120 and 31,200 tokens: statistics' default percentile extrapolated p90 to 32,448,
    above the max. Interpolated between the data (as numpy's default), p90 is 29,120 + 0.8 x 2,080 = 30,784."""
    m = tmp_path / "m.jsonl"
    m.write_text("".join(json.dumps(dict(id=f"s{i}", frames=f, height=h, width=w)) + "\n"
                         for i, (f, h, w) in enumerate([(1, 480, 832), (49, 640, 896), (17, 832, 1920)])))
    out = tmp_path / "rep"
    report.run(report_args(manifest=m, profile=PROFILE, world_size=2, out=out))
    row = re.search(r"^\| 3 \| 1 \| 2 \| 3 \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|", (out / "report.md").read_text(), re.M)
    assert row and [int(x) for x in row.groups()] == [1560, 29120, 30784, 31200]
    assert report.percentile([5], 90) == 5.0


def test_report_sp_skips_indivisible_world_sizes(tmp_path):
    m = tmp_path / "m.jsonl"
    write_manifest(m, n=60)
    out = tmp_path / "rep"
    report.run(report_args(manifest=m, profile=PROFILE, world_size=6, sp=3, out=out))
    md = (out / "report.md").read_text()
    assert "Not planned (not divisible by sp=3): world size 8, 64, 1024" in md
    assert "| 6 (--world-size) | balanced |" in md


def test_report_needs_its_arguments(tmp_path):
    with pytest.raises(UserError, match="--profile"):
        report.run(report_args(manifest=tmp_path / "m.jsonl", world_size=8, out=tmp_path))


def test_scan_then_report(tmp_path):
    """End to end: a folder of real files -> manifest -> report."""
    av = pytest.importorskip("av")
    from test_dataset_scan import scan_args, write_video

    from ds_adaptiveload.data import scan
    media = tmp_path / "media"
    media.mkdir()
    write_video(media / "v.mp4", "mpeg4", 16, 40, 96, 64)
    write_video(media / "w.mkv", "ffv1", 24, 90, 64, 64)
    write_video(media / "i.png", "png", 1, 1, 64, 64, pix_fmt="rgb24", fmt="image2")
    assert av  # used by write_video
    m = tmp_path / "m.jsonl"
    scan.run(scan_args(media, m, workers=1, allow_empty_caption=True))
    out = tmp_path / "rep"
    report.run(report_args(manifest=m, profile=PROFILE, world_size=2, out=out))
    md = (out / "report.md").read_text()
    assert "| 3 | 1 | 2 | 3 |" in md  # samples, images, videos, shapes
    assert "| 37x272x368 |" in md and "| 57x320x320 |" in md and "| 1x320x320 |" in md


def test_report_subcommands_and_the_older_forms(tmp_path, capsys):
    from ds_adaptiveload.cli import main

    m = tmp_path / "m.jsonl"
    write_manifest(m, n=60)
    out = tmp_path / "r"
    base = ["--manifest", str(m), "--profile", PROFILE, "--world-size", "2", "--out", str(out)]
    assert main(["report", "data", *base]) == 0 and (out / "report.md").exists()
    (out / "report.md").unlink()
    assert main(["report", *base]) == 0 and (out / "report.md").exists()  # the older form
    assert main(["report", "data"]) == 2
    assert "report data needs --manifest" in capsys.readouterr().err
    assert main(["report", "op", *base]) == 2
    assert "report op takes no --manifest" in capsys.readouterr().err
