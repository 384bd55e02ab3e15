"""bench/e2e/shipped_configs.py on the CPU: the README's command per shipped config, and the numbers it records from a
step log (the H100 run of 2026-12-06 gives the 44.4% MFU of the results table)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench", "e2e"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import harness  # noqa: E402
import shipped_configs as sc  # noqa: E402


def test_the_commands_are_the_readmes_with_the_policy_each_stage_allows():
    z2 = sc.command("configs/ds_zero2_bf16.json", 2, 20, 32, "/w")
    z3 = sc.command("configs/ds_zero3_bf16.json", 3, 20, 32, "/w")
    assert z2[z2.index("--checkpoint-policy") + 1] == "attention" and z3[z3.index("--checkpoint-policy") + 1] == "full"
    for cmd in (z2, z3):
        assert cmd[cmd.index("--max-steps") + 1] == "20" and "--synthetic" in cmd and "launch/train_wan.py" in cmd
        assert cmd[cmd.index("--compile-blocks") + 1] == "regions" and cmd[cmd.index("--checkpoint-blocks") + 1] == "auto"


def test_summary_and_rows_of_a_step_log(tmp_path):
    import json

    path = os.path.join(ROOT, "bench", "results", "h100-2026-12-06-zero2-packed-steps.jsonl")
    recs = [json.loads(line) for line in open(path)]
    s = sc.summarize(recs)
    assert round(s["mfu_weighted"], 1) == 44.4 and s["measured_steps"] == 4 and s["skipped"] == 0
    assert round(s["mfu"], 1) == round((43.64 + 43.38) / 2, 1)  # the median of steps 3-6
    assert round(s["peak_share"], 1) == round(100 * 76.5 / 79.18, 1)
    staging = str(tmp_path / "staging.csv")
    sc.record(staging, "configs/ds_zero2_bf16.json", 2, s, "NVIDIA H100 80GB HBM3", ["cmd"], "bench/results/x.jsonl",
              "adaptive_load.profile auto: h100-wan1.3b-zero2", 20, limit=500)
    rows = harness.read_results(staging)
    assert {r["hardware"] for r in rows} == {"1x H100 80GB"} and len(rows) == 3
    assert {r["metric"]: r["value"] for r in rows}["MFU, whole step"] == str(round(s["mfu"], 1))
    assert all("profile auto: h100-wan1.3b-zero2" in r["note"] and "6 of 20 steps (the run was cut at its 500 s "
               "limit)" in r["note"] for r in rows)
    # named as the table's rows of the H100 run of 2026-12-06 (96 samples): a new run of the script replaces them
    sc.record(staging, "configs/ds_zero2_bf16.json", 2, s, "NVIDIA H100 80GB HBM3", ["cmd"], "bench/results/x.jsonl",
              "", 20, num=96)
    table = {tuple(r[k] for k in harness.KEY) for r in harness.read_results()}
    assert {tuple(r[k] for k in harness.KEY) for r in harness.read_results(staging) if "96" in r["experiment"]} <= table


def test_attention_runs_and_their_rows(tmp_path):
    """--attentions: `other` takes the backend the run before did not; the variant names what the trainer logged, and
    a run of other than 20 steps is another experiment (the 20-step rows of the table stay)."""
    assert sc.attention_runs("other", "fa4") == "sdpa" and sc.attention_runs("other", "sdpa") == "fa4"
    assert sc.attention_runs("default", "") == "" and sc.attention_runs("auto", "") == "auto"
    z2 = sc.command("configs/ds_zero2_bf16.json", 2, 8, 96, "/w", attention="sdpa")
    assert z2[-2:] == ["--attention", "sdpa"] and "--attention" not in sc.command("c", 2, 8, 96, "/w")
    log = tmp_path / "run.log"
    log.write_text("[rank0] noise\n[2026-12-07 10:00:00] [train_wan] attention: fa4 (--attention auto; "
                   "forward+backward at 32,760 tokens: sdpa 9.1 ms, fa4 7.9 ms)\n")
    used = sc.attention_of(str(log))
    assert used[0] == "fa4" and used[1].startswith("[train_wan] attention: fa4 (--attention auto")
    assert sc.attention_of(str(tmp_path / "run.log")) == used and sc.attention_of(_empty(tmp_path)) == ("", "")
    s = {"steps": 8, "skipped": 0, "mfu": 50.0, "mfu_weighted": 49.0, "tokens_per_s": 1.0, "peak_share": None}
    staging = str(tmp_path / "staging.csv")
    sc.record(staging, "configs/ds_zero2_bf16.json", 2, s, "NVIDIA H100 80GB HBM3", ["cmd"], "bench/results/x.jsonl", "", 8,
              attention=used)
    rows = harness.read_results(staging)
    assert {r["variant"] for r in rows} == {"packed, FlashAttention-4"}
    assert all(r["experiment"].endswith("96 video-heavy samples, 8 steps") and "fa4 (--attention auto" in r["note"]
               for r in rows)


def _empty(tmp_path):
    path = tmp_path / "empty.log"
    path.write_text("")
    return str(path)


def test_a_crashed_run_is_a_crash_row(tmp_path):
    """A run that stops with an error gets a crash row naming the step count and the error line, not no row."""
    staging = str(tmp_path / "staging.csv")
    log = "[rank0]: Traceback (most recent call last):\n[rank0]: RuntimeError: Expected mha_graph.execute(...) true\n"
    sc.record_crash(staging, 2, "NVIDIA H100 80GB HBM3", ["cmd"], "bench/results/x.log", 2, 8, 96, "image-heavy",
                    ("fa4", "[train_wan] attention: fa4 (--attention auto)"), harness.last_error(log))
    (row,) = harness.read_results(staging)
    assert row["status"] == "crash" and row["variant"] == "packed, FlashAttention-4" and row["value"] == ""
    assert row["experiment"] == ("train_wan.py with the shipped ZeRO-2 config, profile auto, 96 image-heavy samples, "
                                 "8 steps")
    assert row["note"].startswith("stopped after 2 of 8 steps: RuntimeError: Expected mha_graph")


def test_profiled_steps_give_a_busy_row_and_stay_out_of_speed(tmp_path):
    """--profile-steps: the steps with gpu_busy_frac are left out of MFU and tokens/s (the timeline costs them time)
    and give the busy-share row: the least busy of them."""
    recs = [{"mfu": 0.4, "step_ms": 1000.0, "tokens": 1000, "mem_peak_gib": 70.0, "mem_capacity_gib": 79.0}
            for _ in range(6)]
    recs[4].update(mfu=0.1, step_ms=4000.0, gpu_busy_frac=0.953)
    recs[5].update(mfu=0.1, step_ms=4000.0, gpu_busy_frac=0.9612)
    s = sc.summarize(recs + [dict(recs[5], gpu_busy_frac=0.5, block_graphs=30)])  # a step that compiled
    assert s["gpu_busy"] == [95.3, 96.1]
    s = sc.summarize(recs)
    assert s["measured_steps"] == 2 and s["mfu"] == 40.0 and s["tokens_per_s"] == 1000.0
    assert s["gpu_busy"] == [95.3, 96.1]
    staging = str(tmp_path / "staging.csv")
    sc.record(staging, "configs/ds_zero2_bf16.json", 2, s, "NVIDIA H100 80GB HBM3", ["cmd"], "bench/results/x.jsonl",
              "", 6, num=96)
    rows = {r["metric"]: r for r in harness.read_results(staging)}
    busy = rows["GPU busy, share of step wall time"]
    assert busy["value"] == "95.3" and "95.3, 96.1%" in busy["note"]
    assert "but the 2 profiled" in rows["MFU, whole step"]["note"]
    cmd = sc.command("configs/ds_zero2_bf16.json", 2, 6, 96, "/w", profile="5-6")
    assert cmd[-2:] == ["--profile-steps", "5-6"]
