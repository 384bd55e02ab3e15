"""bench/e2e/train_e2e.py: the reductions the end-to-end benchmark reports, its SP profile and its step choice."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _e2e():
    sys.path.insert(0, os.path.join(ROOT, "bench", "e2e"))
    import train_e2e
    return train_e2e


def test_e2e_reduce_run_idle_throughput_and_simulator_error():
    e2e = _e2e()
    def rec(step, compute, pred, samples, mem):
        return {"step": step, "compute_ms": compute, "step_ms": max(compute) + 100, "pred_ms": pred,
                "samples": samples, "tokens": samples * 1000, "mfu": 0.4,
                "idle_fraction": 1 - sum(compute) / 2 / max(compute),
                "pred_idle_fraction": 1 - sum(pred) / 2 / max(pred),  # as the trainer logs it
                "loss": 1.0, "mem_peak_gib": mem, "mem_capacity_gib": 100.0}
    warm = rec(1, [5000, 100], [900, 900], 1, 50)
    logs = [[warm, rec(2, [1000, 500], [1000, 400], 10, 40), rec(3, [800, 800], [900, 900], 6, 60)],
            [warm, rec(2, [1000, 500], [1000, 400], 10, 30), rec(3, [800, 800], [900, 900], 6, 20)]]
    r = e2e.reduce_run(logs, warmup=1, dp_size=2)
    assert r["measured_steps"] == 2 and r["samples"] == 16
    assert r["idle_fraction"] == pytest.approx(1 - (750 + 800) / (1000 + 800))  # sum mean / sum max
    assert r["samples_per_s"] == pytest.approx(16 / 2.0)  # step_ms 1100 + 900
    assert r["pred_wall_s"] == pytest.approx(1.9) and r["pred_wall_err"] == pytest.approx(1.9 / 2.0 - 1)
    assert r["pred_idle_fraction"] == pytest.approx(1 - (700 + 900) / (1000 + 900))
    assert r["mem_frac_mean"] == pytest.approx(0.375) and r["mem_peak_gib_max"] == 60
    # epoch 0 whole (warm-up included): the same-samples comparison of --epoch runs; steps without an
    # "epoch" key count as epoch 0, a step of epoch 1 does not
    logs[0][2]["epoch"] = 1
    r = e2e.reduce_run(logs, warmup=1, dp_size=2)
    assert (r["epoch0_steps"], r["epoch0_samples"]) == (2, 11) and r["epoch0_wall_s"] == pytest.approx(5.1 + 1.1)
    assert r["epoch0_pred_wall_s"] == pytest.approx(1.9)
    # under lockstep the logged step prediction (pred_wall_ms) is the one compared
    for log in logs:
        for x in log:
            x["pred_wall_ms"] = max(x["pred_ms"]) + 50
    r = e2e.reduce_run(logs, warmup=1, dp_size=2)
    assert r["pred_wall_s"] == pytest.approx(2.0) and r["pred_step_ms"] == [1050, 950]


def test_e2e_sp_variant_plans_with_a_converted_profile(tmp_path):
    e2e = _e2e()
    from ds_adaptiveload.schedule.profile import CostProfile

    src = tmp_path / "p.yaml"
    CostProfile.load("configs/profiles/h200-wan1.3b-zero3.yaml").to_yaml(src)
    assert e2e.profile_for(1, str(src), "configs/wan_1_3b.yaml") == str(src)
    sp2 = CostProfile.load(e2e.profile_for(2, str(src), "configs/wan_1_3b.yaml"))
    base = CostProfile.load(src)
    assert sp2.meta["sp"] == 2 and sp2.per_token_sq_ms == pytest.approx(2 * base.per_token_sq_ms)
    assert sp2.per_token_ms > base.per_token_ms


def test_e2e_choose_steps_keeps_variants_before_steps():
    e2e = _e2e()
    costs = {n: (lambda m, c=c: c * m) for n, c in (("a", 5.0), ("b", 6.0), ("c", 5.0), ("d", 3.0))}
    m, kept = e2e.choose_steps(costs, budget=250, overhead=40, warmup=2, max_measured=12, min_measured=4)
    assert kept == ["a", "b", "c"] and m == 6  # with d, 4 x 40 + 19 x 6 = 274 > 250 even at 4 steps
    assert sum(40 + costs[n](2 + m) for n in kept) <= 250 < sum(40 + costs[n](3 + m) for n in kept)
    m, kept = e2e.choose_steps(costs, budget=10, overhead=40, warmup=2, max_measured=12, min_measured=4)
    assert kept == ["a"] and m == 4  # nothing fits: still the first variant, at the minimum
