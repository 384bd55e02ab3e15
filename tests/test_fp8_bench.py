"""bench/model/fp8_bench.py's CPU smoke path (fp8 off: no FP8 GEMMs on a CPU): a speed part and the numerics runs on
the tiny model in this process, their rows through harness.record, and the seed-spread verdict's arithmetic."""
import csv
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench", "model"))
import fp8_bench  # noqa: E402


def test_verdict_compares_fp8_with_the_bf16_seed_spread():
    runs = {"numerics-bf16-s0": {"heldout": 1.00, "steps": 300}, "numerics-bf16-s1": {"heldout": 1.02, "steps": 300}}
    assert fp8_bench.verdict(runs) is None  # no fp8 run yet
    within, gap, spread = fp8_bench.verdict({**runs, "numerics-fp8-s0": {"heldout": 0.99, "steps": 300}})
    assert within and round(gap, 6) == 0.01 and round(spread, 6) == 0.02
    assert not fp8_bench.verdict({**runs, "numerics-fp8-s0": {"heldout": 1.03, "steps": 300}})[0]
    assert fp8_bench.verdict({**runs, "numerics-fp8-s0": {"heldout": 0.99, "steps": 200}}) is None  # cut short


def test_smoke_parts_run_on_cpu_and_record_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = fp8_bench.parse_args(["--smoke", "--steps", "2", "--timed-steps", "1", "--out", str(tmp_path)])
    rows = [fp8_bench.run_part(p, args) for p in ("speed-bf16", "numerics-bf16-s0", "numerics-fp8-s0")]
    speed = rows[0]["shapes"]["tiny"]
    assert speed["status"] == "ok" and len(speed["step_s"]) == 1 and 0 < speed["mfu"] < 1
    for r in rows[1:]:
        assert r["status"] == "ok" and r["steps"] == 2 and len(r["losses"]) == 2 and not r["fp8"]
        assert len(r["heldout_per_t"]) == 8 and r["heldout"] > 0
    # the same init, data and seed: the smoke's "fp8" run (fp8 off) repeats bf16 seed 0 exactly
    assert rows[1]["losses"] == rows[2]["losses"] and rows[1]["heldout"] == rows[2]["heldout"]
    seed1 = {**rows[1], "part": "numerics-bf16-s1", "seed": 1, "heldout": rows[1]["heldout"] + 0.01}
    env = {"device": "cpu", "date": "2026-12-06"}
    table = fp8_bench.record_rows(rows + [seed1], args, "bench/results/fp8-2026-12-06-smoke.json", env)
    got = {(r["variant"], r["metric"]): r for r in csv.DictReader(open(table))}
    assert ("bf16, tiny", "MFU") in got and ("bf16, tiny", "step time") in got
    assert ("bf16-s1", "held-out loss (8 fixed t)") in got and ("fp8-s0", "held-out loss (8 fixed t)") in got
    verdict = got[("fp8 vs bf16 seed spread", "held-out loss, |fp8 s0 - bf16 s0|")]
    assert float(verdict["value"]) == 0 and float(verdict["baseline"]) == 0.01 and "within" in verdict["note"]
