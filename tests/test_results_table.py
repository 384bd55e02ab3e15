"""The results table (bench/results/results.csv, written only by bench/harness.record()) and docs/results.md,
generated from it: upsert on (experiment, variant, metric, hardware), validation of every column, a byte-stable
round trip, the committed table valid with every cited raw file present, and the committed page equal to what the
generator makes of the committed table."""
import os
import random
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import harness  # noqa: E402
import results_md  # noqa: E402
from ds_adaptiveload.errors import UserError  # noqa: E402

RAW = "bench/results/results.csv"  # a file that exists in every checkout, as a stand-in raw file


def row(**kw):
    base = dict(experiment="train_wan.py, 32 samples", variant="packed", metric="MFU, whole step", unit="%",
                value=51.2, hardware="1x H200", section="training", command="python bench/mfu.py --parts e2e",
                raw_file=RAW, date="2026-12-04", commit="2f6350b")
    return {**base, **kw}


def test_record_upserts_on_experiment_variant_metric_hardware(tmp_path):
    table = tmp_path / "results.csv"
    harness.record(table, **row())
    harness.record(table, **row(variant="balanced", value=43.6))
    harness.record(table, **row(hardware="1x H100 80GB", value=44.4))
    harness.record(table, **row(value=52.0, note="again"))  # same key as the first: replaces it
    rows = harness.read_results(table)
    assert len(rows) == 3
    by_key = {(r["variant"], r["hardware"]): r for r in rows}
    assert by_key[("packed", "1x H200")]["value"] == "52.0" and by_key[("packed", "1x H200")]["note"] == "again"
    assert by_key[("balanced", "1x H200")]["value"] == "43.6"
    assert by_key[("packed", "1x H100 80GB")]["gpus"] == "1"
    assert [(r["variant"], r["hardware"]) for r in rows] == sorted(by_key)  # sorted by the key


def test_forget_removes_only_the_rows_that_match_every_column(tmp_path):
    table = tmp_path / "results.csv"
    harness.record(table, **row())
    harness.record(table, **row(variant="balanced", value=43.6))
    harness.record(table, **row(metric="epoch wall", unit="s", value=129.0))
    assert harness.forget(table, metric="MFU, whole step", variant="balanced") == 1
    assert sorted((r["variant"], r["metric"]) for r in harness.read_results(table)) == [
        ("packed", "MFU, whole step"), ("packed", "epoch wall")]
    assert harness.forget(table, metric="no such metric") == 0
    with pytest.raises(UserError, match="unknown column"):
        harness.forget(table, colour="red")


def test_record_fills_environment_and_ratio(tmp_path):
    table = tmp_path / "results.csv"
    given = row()
    del given["date"], given["commit"]
    got = harness.record(table, **given, baseline=45.8)
    assert got["date"] == __import__("datetime").date.today().isoformat()
    assert got["commit"] == harness._git_commit() and got["commit"]  # this checkout's HEAD
    assert got["status"] == "ok" and got["gpus"] == "1" and got["better"] == "higher"
    assert float(got["ratio"]) == pytest.approx(51.2 / 45.8, rel=1e-5)
    # time is lower-is-better: the ratio is how many times faster than the baseline
    t = harness.record(table, **row(metric="epoch wall", unit="s", value=129.0, baseline=167.8, hardware="2x H200"))
    assert t["better"] == "lower" and t["gpus"] == "2" and float(t["ratio"]) == pytest.approx(167.8 / 129.0, rel=1e-5)
    # an explicit "" commit (not known for an old run) stays empty; a prediction's metric is marked
    p = harness.record(table, **row(status="predicted", commit="", raw_file="", note="planner"))
    assert p["commit"] == "" and p["metric"] == "MFU, whole step (predicted)"


@pytest.mark.parametrize("bad, column", [
    (dict(experiment=""), "experiment"),
    (dict(unit="furlongs"), "unit"),
    (dict(status="done"), "status"),
    (dict(section="misc"), "section"),
    (dict(value="abc"), "value"),
    (dict(value=float("nan")), "value"),
    (dict(value=None), "value"),                       # ok needs a value
    (dict(status="not-measured"), "value"),            # not-measured takes none
    (dict(date="2026-13-01"), "date"),
    (dict(commit="HEAD"), "commit"),
    (dict(hardware="2x H200", gpus=1), "hardware"),
    (dict(hardware="H200"), "hardware"),
    (dict(gpus="two"), "gpus"),
    (dict(zero_stage=4), "zero_stage"),
    (dict(baseline=45.8, ratio=0.89), "ratio"),        # the flipped ratio of 51.2 against 45.8
    (dict(metric="MFU (predicted)"), "metric"),        # marked predicted but measured
    (dict(command=""), "command"),
    (dict(raw_file="", note=""), "raw_file"),
    (dict(raw_file="/tmp/x.json"), "raw_file"),
    (dict(raw_file="bench/results/../../etc/passwd"), "raw_file"),
    (dict(note="two\nlines"), "note"),
    (dict(colour="red"), "colour"),
])
def test_record_rejects_bad_rows_and_keeps_the_table(tmp_path, bad, column):
    table = tmp_path / "results.csv"
    harness.record(table, **row(variant="kept"))
    before = table.read_text()
    with pytest.raises(UserError, match=column):
        harness.record(table, **row(**bad))
    assert table.read_text() == before


def test_repository_table_needs_raw_files_that_exist(tmp_path, monkeypatch):
    """Rows of the repository's table name raw files that are there; a staging table (another path, e.g. on a GPU
    machine) is checked when merged."""
    monkeypatch.setattr(harness, "ROOT", str(tmp_path))
    monkeypatch.setattr(harness, "RESULTS_CSV", str(tmp_path / "bench" / "results" / "results.csv"))
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "run.json").write_text("{}")
    harness.record(**row(raw_file="bench/results/run.json"))
    with pytest.raises(UserError, match="does not exist"):
        harness.record(**row(variant="b", raw_file="bench/results/missing.json"))
    staging = tmp_path / "staging.csv"
    harness.record(staging, **row(variant="b", raw_file="bench/results/missing.json"))  # fine until merged
    with pytest.raises(UserError, match="does not exist"):
        harness.merge_results(staging)
    (tmp_path / "bench" / "results" / "missing.json").write_text("{}")
    harness.merge_results(staging)
    assert {r["variant"] for r in harness.read_results()} == {"packed", "b"}


def test_round_trip_is_byte_stable(tmp_path):
    rows = [row(variant=f"v{i}", value=40 + i / 10, baseline=40.0, section=s, note=f"n, with \"quotes\" {i}")
            for i, s in enumerate(["training", "kernel", "headline", "packing", "kernel", "headline"])]
    rows.append(row(variant="nm", status="not-measured", value=None, raw_file="", command="", note="why"))
    written = [harness.record(tmp_path / "a.csv", **r) for r in rows]
    random.Random(0).shuffle(rows)
    for r in rows:
        harness.record(tmp_path / "b.csv", **r)
    assert (tmp_path / "a.csv").read_bytes() == (tmp_path / "b.csv").read_bytes()
    back = harness.read_results(tmp_path / "a.csv")
    assert sorted(back, key=harness._sort_key) == sorted(written, key=harness._sort_key)
    assert [r["section"] for r in back] == sorted((r["section"] for r in back), key=harness.SECTIONS.index)
    harness.merge_results(tmp_path / "a.csv", tmp_path / "c.csv")  # re-recording what was written changes nothing
    assert (tmp_path / "c.csv").read_bytes() == (tmp_path / "a.csv").read_bytes()
    assert len(harness.check_results(tmp_path / "a.csv")) == len(rows)
    assert (tmp_path / "a.csv").read_text().splitlines()[0] == ",".join(harness.COLUMNS)


def test_check_rejects_a_hand_edited_table(tmp_path):
    table = tmp_path / "results.csv"
    harness.record(table, **row())
    harness.record(table, **row(variant="balanced"))
    lines = table.read_text().splitlines()
    table.write_text("\n".join([lines[0], lines[2], lines[1]]) + "\n")  # rows out of order
    with pytest.raises(UserError, match="not as record"):
        harness.check_results(table)
    table.write_text("\n".join([lines[0], lines[1], lines[1]]) + "\n")  # a duplicated key
    with pytest.raises(UserError, match="share a key"):
        harness.check_results(table)


def test_cli_errors_are_one_line_exit_2(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("experiment,colour\nx,red\n")
    for args in (["check", str(bad)], ["merge", str(tmp_path / "none.csv")]):
        p = subprocess.run([sys.executable, "bench/harness.py", *args], cwd=ROOT, capture_output=True, text=True)
        assert p.returncode == 2, p.stderr
        assert p.stderr.startswith("error: ") and p.stderr.count("\n") == 1, p.stderr


def test_page_sections(tmp_path):
    table = tmp_path / "results.csv"
    exp = "train_e2e.py, 120 samples"
    harness.record(table, **row(experiment=exp, variant="balanced", metric="epoch wall", unit="s", value=129.0,
                                baseline=167.8, hardware="2x H200", section="headline"))
    harness.record(table, **row(experiment=exp, variant="equal-tokens", metric="epoch wall", unit="s", value=167.8,
                                hardware="2x H200", section="headline", command="other command"))
    harness.record(table, **row(experiment=exp, variant="balanced", metric="epoch wall", unit="s", value=123.3,
                                status="predicted", hardware="2x H200", section="headline"))
    harness.record(table, **row(variant="FP8", status="not-measured", value=None, raw_file="", command="",
                                note="no FP8 path yet"))
    harness.record(table, **row(variant="ds", status="crash", value=None, section="kernel", note="arch list"))
    pages = results_md.render_pages(harness.read_results(table))
    text, detail = pages[results_md.OUT], pages[results_md.DETAIL]
    heads = [ln for ln in text.splitlines() if ln.startswith("## ")]
    assert heads == ["## Headline", "## Measured against predicted", "## Not yet measured", "## Commands"]
    assert [ln for ln in detail.splitlines() if ln.startswith("## ")] == ["## Kernels", "## Commands"]
    headline = text.split("## Headline")[1].split("## Measured")[0]
    assert "| 129.0 s | 167.8 s, equal-tokens | 1.30x | 2x H200 | 2026-12-04 |" in headline
    predicted = text.split("## Measured against predicted")[1].split("## Not yet")[0]
    assert "| 129.0 s | 123.3 s | -4.4% |" in predicted
    assert "no FP8 path yet" in text.split("## Not yet measured")[1].split("## ")[0]
    assert "| crash |" in detail.split("## Kernels")[1] and "| crash |" not in text
    assert "- c1: `python bench/mfu.py --parts e2e`" in text and "- c2: `other command`" in text
    assert "- c1: `python bench/mfu.py --parts e2e`" in detail and "other command" not in detail
    assert f"[csv](../{RAW})" in headline


def test_committed_table_is_valid_and_its_raw_files_exist():
    rows = harness.check_results()
    assert any(r["section"] == "headline" for r in rows)
    assert {"predicted", "not-measured"} <= {r["status"] for r in rows}


def test_committed_pages_are_generated_from_the_committed_table():
    pages = results_md.render_pages(harness.read_results())
    for path, text in pages.items():
        with open(path) as f:
            assert f.read() == text, f"{path} is stale: run python bench/results_md.py"
    assert pages[results_md.OUT].count("\n") <= results_md.MAX_LINES


def test_raw_folder_holds_only_what_the_table_cites():
    """Raw files no row cites (as its raw file, or as an input its command reads) belong in bench/results/archive/,
    so the folder does not grow into a notebook again."""
    rows = harness.read_results()
    cited = {f for r in rows for f in harness.raw_files(r)}
    cited |= {w.strip("\"'") for r in rows for w in r["command"].split() if w.strip("\"'").startswith(harness.RAW_DIR)}
    folder = os.path.join(ROOT, harness.RAW_DIR)
    loose = sorted(f for f in os.listdir(folder) if os.path.isfile(os.path.join(folder, f))
                   and f != "results.csv" and harness.RAW_DIR + f not in cited)
    assert not loose, f"cite these in results.csv or git mv them to bench/results/archive/: {loose}"
