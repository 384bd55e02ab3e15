"""bench/e2e/replay.py: its lockstep arithmetic by hand, and one CPU replay of the tiny model (W=4, 2 steps, G=1 and
2, run twice) whose every planned micro-batch ran once and whose predicted side is the planner's own numbers."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench", "e2e"))
import replay  # noqa: E402


def test_lockstep_sums_the_slowest_rank_of_each_round():
    # step 0: ranks [3, 1] and [2, 4] -> rounds max 3 + max 4, plus 1 fixed = 8; ranks busy 5 and 7
    # step 1: ranks [1, 1] and [1, 1] -> 2 + 0 fixed; no idle
    got = replay.lockstep([[[3, 1], [2, 4]], [[1, 1], [1, 1]]], [1, 0])
    assert got["wall_ms"] == [8, 2]
    assert got["rank_ms"] == [[5, 7], [2, 2]]
    assert got["idle_fraction"] == pytest.approx(1 - (6 + 2) / (8 + 2))


def test_quantiles_chosen_steps_and_flags():
    q = replay.quantiles([4.0, 1.0, 3.0, 2.0, 5.0])
    assert (q["p5"], q["p50"], q["max"]) == (1.0, 3.0, 5.0)
    assert replay.chosen_steps(5, None, 0) == [0, 1, 2, 3, 4]
    picked = replay.chosen_steps(100, 20, 0)
    assert len(set(picked)) == 20 and picked == sorted(picked) and picked == replay.chosen_steps(100, 20, 0)
    assert replay.rank_list("8,64:20") == [(8, None), (64, 20)]
    from ds_adaptiveload.errors import UserError

    with pytest.raises(UserError, match="--ranks 8,x: 'x' is not W or W:S"):
        replay.rank_list("8,x")
    comm = replay.comm_ms(1_000_000_000, 8, 100.0)  # 2 GB of bf16 gradients, 7/8 of them moved at 100 GB/s
    assert comm["reduce_scatter_ms_per_micro_batch"] == pytest.approx(2e9 * 7 / 8 / 100e9 * 1000)


@pytest.fixture(scope="module")
def tiny_replay(tmp_path_factory):
    out = tmp_path_factory.mktemp("replay")
    cmd = [sys.executable, "-W", "ignore", os.path.join(ROOT, "bench", "e2e", "replay.py"), "--deepspeed_config",
           "configs/ds_tiny_cpu.json", "--model-config", "configs/wan_tiny.yaml", "--mix", "tiny", "--samples", "64",
           "--ranks", "4:2", "--grad-accum", "1,2", "--policies", "packed,equal-tokens", "--repeat", "2",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (raw,) = [f for f in os.listdir(out) if f.endswith(".json")]
    with open(out / raw) as f:
        return json.load(f)


def test_every_planned_micro_batch_runs_once_per_repeat(tiny_replay):
    assert [(r["ranks"], r["grad_accum"]) for r in tiny_replay["runs"]] == [(4, 1), (4, 2)]
    for run in tiny_replay["runs"]:
        for p in run["policies"]:
            assert p["steps_run"] == len(p["steps"]) == min(2, p["steps_planned"])
            planned = sorted(tuple(mb) for step in p["planned"] for rank in step for mb in rank)
            assert len(planned) == len(p["steps"]) * 4 * run["grad_accum"]
            assert sorted(tuple(mb) for mb in p["executed"]) == planned
            assert len(p["measured_ms"]) == 2 and p["run_to_run"] is not None  # --repeat 2: the noise check
            assert all(t > 0 for run_ms in p["measured_ms"] for step in run_ms for rank in step for t in rank)


def test_predicted_side_is_the_planners_and_measured_side_is_recomputed(tiny_replay):
    for run in tiny_replay["runs"]:
        by = {p["policy"]: p for p in run["policies"]}
        for p in by.values():
            for s, step in enumerate(p["predicted_ms"]):
                rounds = sum(max(rank[g] for rank in step) for g in range(run["grad_accum"]))
                fixed = p["planned_rank_ms"][s][0] - sum(step[0])
                for r, rank in enumerate(step):  # the plan's per-rank totals are its micro-batches' costs
                    assert fixed + sum(rank) == pytest.approx(p["planned_rank_ms"][s][r])
                assert fixed + rounds == pytest.approx(p["planned_wall_ms"][s])
                assert p["predicted"]["wall_ms"][s] == pytest.approx(p["planned_wall_ms"][s])
            measured, opt = replay.best_of(p["measured_ms"]), p["optimizer_ms"]
            walls = [o + sum(max(rank[g] for rank in step) for g in range(run["grad_accum"]))
                     for step, o in zip(measured, opt)]
            assert p["measured"]["wall_ms"] == pytest.approx(walls)
            busy = sum(o + sum(map(sum, step)) / len(step) for step, o in zip(measured, opt))
            assert p["measured"]["idle_fraction"] == pytest.approx(1 - busy / sum(walls))
            # the epoch: the plan's predicted wall, and that times measured / predicted over the steps run
            plan_s = p["plan_summary"]["predicted_wall_s"]
            assert p["predicted"]["epoch_wall_s"] == pytest.approx(plan_s)
            assert p["measured"]["epoch_wall_s"] == pytest.approx(
                plan_s * sum(walls) / sum(p["predicted"]["wall_ms"]))
            if p["steps_run"] == p["steps_planned"]:  # every step ran: the measured epoch itself
                assert p["measured"]["epoch_wall_s"] == pytest.approx(sum(walls) / 1000)
                assert plan_s == pytest.approx(sum(p["planned_wall_ms"]) / 1000)
        for side in ("measured", "predicted"):
            assert by["equal-tokens"][side]["speedup_over_equal_tokens"] == 1.0
            assert by["packed"][side]["speedup_over_equal_tokens"] == pytest.approx(
                by["equal-tokens"][side]["epoch_wall_s"] / by["packed"][side]["epoch_wall_s"])


def test_epoch_is_the_plans_wall_corrected_by_the_steps_run():
    """2 ranks, G = 1. Two of four planned steps ran, one light and one heavy: the epoch is the plan's predicted wall
    times measured / predicted on them (1.1 here), not the two steps scaled by count; with every step run it is
    the measured sum; without the plan's wall (older raw files) the steps are scaled by count."""
    pred = [[[100.0], [90.0]], [[400.0], [380.0]]]
    meas = [[[110.0], [99.0]], [[440.0], [418.0]]]
    got = replay.score(pred, [0.0, 0.0], meas, [0.0, 0.0], 4, plan_wall_s=2.0)
    assert got["predicted"]["epoch_wall_s"] == 2.0
    assert got["measured"]["epoch_wall_s"] == pytest.approx(2.0 * 550 / 500)
    every = replay.score(pred, [0.0, 0.0], meas, [0.0, 0.0], 2, plan_wall_s=0.5)
    assert every["measured"]["epoch_wall_s"] == pytest.approx(0.55)
    old = replay.score(pred, [0.0, 0.0], meas, [0.0, 0.0], 4)
    assert old["predicted"]["epoch_wall_s"] == pytest.approx(1.0)
    assert old["measured"]["epoch_wall_s"] == pytest.approx(1.1)


def test_best_of_takes_each_micro_batch_least_time_and_rescore_repeats_the_numbers(tiny_replay):
    runs = [[[[5.0, 1.0], [2.0, 9.0]]], [[[4.0, 3.0], [2.5, 1.0]]]]  # 2 repeats of 1 step, 2 ranks, G = 2
    assert replay.best_of(runs) == [[[4.0, 1.0], [2.0, 1.0]]]
    doc = json.loads(json.dumps(tiny_replay))
    for run in doc["runs"]:
        for p in run["policies"]:
            p["measured"] = p["predicted"] = p["measured_over_predicted"] = None  # computed again from the times
    replay.rescore(doc)
    for got, want in zip(doc["runs"], tiny_replay["runs"]):
        for p, q in zip(got["policies"], want["policies"]):
            assert p["measured_over_predicted"] == pytest.approx(q["measured_over_predicted"])
            for side in ("measured", "predicted"):
                assert p[side]["wall_ms"] == pytest.approx(q[side]["wall_ms"]), (p["policy"], side)
                for key in ("idle_fraction", "epoch_wall_s", "speedup_over_equal_tokens"):
                    assert p[side][key] == pytest.approx(q[side][key]), (p["policy"], side, key)


def test_a_spent_deadline_stops_after_the_first_step_and_repeats_the_same_micro_batches(monkeypatch):
    calls = []

    def fake_rank_steps(trainer, plan, s):
        return [f"s{s}r{r}" for r in range(2)]

    def fake_run(trainer, s, rs, executed):
        calls.append(rs)
        executed.append(rs)
        return [1.0, 2.0], [None, None], 0.5

    monkeypatch.setattr(replay, "rank_steps", fake_rank_steps)
    monkeypatch.setattr(replay, "run_rank_step", fake_run)
    runs, opt, _, executed, done = replay.replay_policy(None, None, [3, 5, 7], 2, deadline=0.0)
    assert done == [3]  # one step, however late
    assert calls == ["s3r0", "s3r1", "s3r0", "s3r1"] and executed == ["s3r0", "s3r1"]
    assert runs == [[[[1.0, 2.0], [1.0, 2.0]]]] * 2 and opt == [0.5]
    runs, _, _, _, done = replay.replay_policy(None, None, [3, 5, 7], 1)
    assert done == [3, 5, 7] and len(runs[0]) == 3


def test_record_rows_pass_the_results_table_checks(tiny_replay, tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import harness

    staging = str(tmp_path / "staging.csv")
    for run in tiny_replay["runs"]:  # the rows a GPU run writes (hardware named as it would be)
        replay.record_rows(run, "bench/results/replay-x.json", staging, "1x H100 80GB", "python3 bench/e2e/replay.py")
    rows = harness.read_results(staging)  # record() checked each row as a staging table takes it
    # per (W, G) and policy: idle and speed-up, measured and predicted, the measured/predicted median and the
    # run-to-run difference (--repeat 2)
    assert len(rows) == len(tiny_replay["runs"]) * 2 * 6
    run = tiny_replay["runs"][1]
    packed = next(p for p in run["policies"] if p["policy"] == "packed")
    idle = next(r for r in rows if r["variant"] == "packed" and r["metric"] == "idle" and "G=2" in r["experiment"])
    assert float(idle["value"]) == pytest.approx(100 * packed["measured"]["idle_fraction"], abs=0.005)
    assert idle["section"] == "replay" and idle["status"] == "ok" and idle["better"] == "lower"
    noise = next(r for r in rows if r["variant"] == "packed" and r["metric"].startswith("run-to-run")
                 and "G=2" in r["experiment"])
    assert float(noise["value"]) == pytest.approx(100 * packed["run_to_run"]["p50"], abs=0.005)
