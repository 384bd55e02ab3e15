"""bench/mfu.py's CPU-checkable parts: the levers it switches between measurements through the model's own
attributes (k blocks checkpointed: those and only those recompute, same outputs and gradients), the arithmetic of
e2e_mfu / recompute_frac / per_shape, and the trainer variants of its e2e part."""
import json
import os
import subprocess
import sys

import pytest
import torch

from ds_adaptiveload.model import WanConfig, WanModel
from ds_adaptiveload.shipped import config_profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "bench", "e2e"))
import mfu  # noqa: E402



def tiny():
    cfg = WanConfig(dim=64, ffn_dim=96, num_heads=2, num_layers=4, text_dim=32, text_len=8, freq_dim=32)
    torch.manual_seed(0)
    m = WanModel(cfg)
    with torch.no_grad():
        m.head.head.weight.normal_(std=0.02)
    return m


def fwd_bwd(m):
    g = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(2, 16, 2, 4, 6, generator=g), torch.randn(2, 5, 32, generator=g)
    m.zero_grad(set_to_none=True)
    y = m(x, torch.tensor([10.0, 900.0]), ctx)
    y.square().sum().backward()
    return y.detach(), [p.grad.clone() for p in m.parameters()]


def test_levers_checkpoint_exactly_the_first_k_blocks():
    m = tiny()
    y0, g0 = fwd_bwd(m)
    calls = [0] * 4
    for i, b in enumerate(m.blocks):
        b.ffn.register_forward_pre_hook(lambda mod, args, i=i: calls.__setitem__(i, calls[i] + 1))
    lev = mfu.Levers(m, None, "aot_eager")
    assert lev.num_layers == 4
    for k, policy in ((0, "full"), (1, "full"), (3, "attention"), (4, "full")):
        calls[:] = [0] * 4
        lev.set(k, False, policy)
        y, g = fwd_bwd(m)
        # a checkpointed block runs its FFN again in backward (under "attention" too: only attention is kept)
        assert calls == [2] * k + [1] * (4 - k), (k, policy, calls)
        torch.testing.assert_close(y, y0)
        for a, b in zip(g, g0):
            torch.testing.assert_close(a, b)


def test_e2e_summary_weights_steps_by_their_wall_and_skips_warmup():
    recs = [{"step": i, "samples": 2, "tokens": 100, "step_ms": ms, "mfu": u, "mem_peak_gib": 10.0 + i,
             "mem_capacity_gib": 139.8} for i, (ms, u) in enumerate([(9000, 0.01), (1000, 0.5), (3000, 0.3)])]
    out = mfu.e2e_summary(recs + [{"step": 3, "skipped": {}}], warmup=1, peak_tflops=989)
    assert out["steps"] == 2 and out["skipped_steps"] == 1
    assert out["e2e_mfu"] == pytest.approx((0.5 * 1000 + 0.3 * 3000) / 4000)  # FLOPs over wall, not a mean of MFUs
    assert out["tokens_per_s"] == pytest.approx(200 / 4.0) and out["mem_peak_gib_max"] == 12.0
    assert "e2e_mfu" not in mfu.e2e_summary(recs[:1], warmup=1, peak_tflops=989)
    recs[1].update(compute_ms=[950.0], data_ms=[3.0])  # the step log's per-rank times come through where logged
    per_step = mfu.e2e_summary(recs, warmup=1, peak_tflops=989)["per_step"]
    assert per_step[1]["compute_ms"] == [950.0] and per_step[1]["data_ms"] == [3.0] and "data_ms" not in per_step[2]


def test_recompute_frac_and_best_per_shape():
    rows = [{"shape": "a", "mode": "eager", "k": 30, "tokens": 10, "ms": 100.0, "status": "ok", "mfu": 0.3, "B": 1,
             "peak_gib": 1.0},
            {"shape": "a", "mode": "eager", "k": 0, "tokens": 10, "ms": 80.0, "status": "ok", "mfu": 0.375, "B": 1,
             "peak_gib": 2.0},
            {"shape": "b", "mode": "eager", "k": 30, "tokens": 99, "ms": 10.0, "status": "oom"},
            {"shape": "a", "mode": "compile", "k": 0, "tokens": 10, "ms": 50.0, "status": "ok", "mfu": 0.6, "B": 1,
             "peak_gib": 1.5}]
    assert mfu.recompute_frac(rows, "eager", 30) == pytest.approx(0.2)
    assert mfu.recompute_frac(rows, "compile", 30) is None
    best = mfu.best_per_shape(rows)
    assert best == [{"shape": "a", "B": 1, "mfu": 0.6, "ms": 50.0, "mode": "compile", "policy": "full", "k": 0,
                     "peak_gib": 1.5}]
    assert "| a |" in mfu.tables({"rows": rows, "e2e": []})


def test_shapes_part_smoke_on_cpu(tmp_path, monkeypatch):
    """The shapes part end to end on the tiny model, in this process on the CPU (no peak memory there, so the
    memory fields are 0 and k = 0), with the shipped ZeRO-2 config: every row runs and the document is written."""
    monkeypatch.setattr(mfu, "SHAPES", {"img32": (2, 1, 4, 4), "480p81": (1, 3, 4, 6)})
    monkeypatch.setattr(mfu, "PROBES", ((1, 1, 4, 4), (1, 2, 4, 4)))
    monkeypatch.setattr(mfu, "SAMPLE_PROBE", (2, 1, 4, 4))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rc = mfu.main(["--parts", "shapes", "--model-config", "configs/wan_tiny.yaml", "--shapes", "img32,480p81",
                   "--modes", "eager,compile,regions-attn", "--compile-backend", "aot_eager", "--reps", "2", "--out", str(tmp_path),
                   "--work", str(tmp_path / "work")])
    assert rc == 0
    doc = json.loads(next(tmp_path.glob("mfu-*-h200.json")).read_text())
    rows = doc["rows"]
    assert {(r["shape"], r["mode"], r["k"]) for r in rows} == {(s, m, k) for s in ("img32", "480p81")
                                                              for m in ("eager", "compile", "regions-attn")
                                                              for k in (2, 0)}
    assert all(r["status"] == "ok" and r["ms"] > 0 and 0 < r["mfu"] < 1 for r in rows)
    assert {p["shape"] for p in doc["per_shape"]} == {"img32", "480p81"}
    assert set(doc["proposed_profile"]) == {"eager", "compile", "regions-attn"}
    assert doc["compile_stats"]["block_graphs"] >= 1 and doc["torch"] and "e2e" in doc


def test_z3_part_smoke_on_cpu(tmp_path, monkeypatch):
    """The z3 part on the tiny model: built partitioned (zero.Init), trained under ZeRO-3 with and without
    WanBlock as a leaf module."""
    monkeypatch.setattr(mfu, "SHAPES", {"480p81": (1, 3, 4, 6)})
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    rc = mfu.main(["--parts", "z3", "--z3-model-config", "configs/wan_tiny.yaml", "--z3-layers", "2", "--reps", "1",
                   "--out", str(tmp_path), "--work", str(tmp_path / "work")])
    assert rc == 0
    z3 = json.loads(next(tmp_path.glob("mfu-*-h200.json")).read_text())["z3"]
    assert z3["num_layers"] == 2 and len(z3["rows"]) == 4
    assert all(r["partitioned_at_construction"] and r["ms"] > 0 for r in z3["rows"])
    assert {r["leaf_blocks"] for r in z3["rows"]} == {True, False}


def test_e2e_summary_counts_warm_steps_from_the_graph_counts():
    """warm_mfu covers the steps after which the block graph count did not rise (no compile in them)."""
    recs = [{"step": i, "samples": 1, "tokens": 10, "step_ms": ms, "mfu": u, "block_graphs": g}
            for i, (ms, u, g) in enumerate([(9000, 0.01, 2), (5000, 0.1, 4), (1000, 0.4, 4), (2000, 0.2, 5),
                                            (1000, 0.5, 5)])]
    out = mfu.e2e_summary(recs, warmup=1, peak_tflops=989)
    assert out["warm_steps"] == 2 and out["warm_mfu"] == pytest.approx((0.4 * 1000 + 0.5 * 1000) / 2000)
    assert out["per_step"][0]["block_graphs"] == 2
    assert "warm_mfu" not in mfu.e2e_summary([{k: v for k, v in r.items() if k != "block_graphs"} for r in recs],
                                             warmup=1, peak_tflops=989)


def test_trainer_profile_takes_the_probed_memory_fields(tmp_path):
    from ds_adaptiveload.schedule.profile import CostProfile

    mem = {"capacity_bytes": None, "safety": 0.8, "fixed_bytes": 2.3e10, "bytes_per_token": 166275.0,
           "block_bytes_per_token": 79506.0, "attention_bytes_per_token": 5068.0}
    mfu.write_trainer_profile(tmp_path / "p.yaml", "configs/ds_zero2_bf16.json", mem)
    prof = CostProfile.load(tmp_path / "p.yaml")
    base = CostProfile.load(config_profile(os.path.join(ROOT, "configs", "ds_zero2_bf16.json")))
    assert (prof.budget_tokens, prof.per_token_ms, prof.floor_ms) == (base.budget_tokens, base.per_token_ms, base.floor_ms)
    assert {k: prof.memory[k] for k in mem if k != "capacity_bytes"} == {k: v for k, v in mem.items()
                                                                        if k != "capacity_bytes"}
    assert prof.memory["capacity_bytes"] == base.memory["capacity_bytes"]  # None leaves the profile's
    # the fixed bytes were measured on one GPU under the config's ZeRO-2: the trainer must not move them again
    from ds_adaptiveload.schedule.zero import for_run

    assert (prof.meta["zero_stage"], prof.meta["train_world_size"]) == (2, 1) and for_run(prof, 2, 1) == (prof, [])


def test_e2e_ds_json_asks_for_what_the_trainer_accepts(tmp_path):
    """bench/e2e/train_e2e.write_ds_json with a profile: OOM steps skipped under ZeRO-3 only (the trainer refuses
    on_oom skip at stage 0-2, which ended the H200's train-regions-attn-packed run before its first step)."""
    from types import SimpleNamespace

    from train_e2e import write_ds_json

    from ds_adaptiveload.train.setup import read_config

    prof = os.path.join(ROOT, "configs", "profiles", "h200-wan1.3b-zero3.yaml")
    for base, want in (("ds_zero2_bf16.json", "error"), ("ds_zero3_bf16.json", "skip")):
        path = str(tmp_path / base)
        write_ds_json(path, os.path.join(ROOT, "configs", base), prof, "packed", grad_accum=4)
        with open(path) as f:
            assert json.load(f)["adaptive_load"]["on_oom"] == want
        args = SimpleNamespace(deepspeed_config=path, model_config=os.path.join(ROOT, "configs", "wan_1_3b.yaml"),
                               checkpoint_policy="attention" if want == "error" else "full", fault=None,
                               checkpoint_blocks="auto", compile_blocks="regions", compile_cache=None)
        read_config(args, 1, 0)  # no UserError


def test_trainer_e2e_variants_launch_what_train_wan_accepts(tmp_path, monkeypatch):
    """Each train-* e2e variant's DeepSpeed JSON and flags pass train_wan's parser and config checks (the check that
    ended the H200 run above before its first step), and --e2e-epochs asks for whole epochs of each variant's plan."""
    import importlib.util
    from types import SimpleNamespace

    import train_steps

    from ds_adaptiveload.schedule.mixes import make_mix
    from ds_adaptiveload.schedule.profile import CostProfile
    from ds_adaptiveload.train.setup import read_config

    spec = importlib.util.spec_from_file_location("train_wan", os.path.join(ROOT, "launch", "train_wan.py"))
    train_wan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_wan)
    calls = []
    monkeypatch.setattr(train_steps, "launch", lambda ds, manifest, steps, run, log, la, flags, model_cfg, **kw:
                        calls.append((ds, manifest, steps, flags)) or 0)
    manifest = train_steps.write_data(str(tmp_path / "data"), make_mix("video-heavy", 6, seed=0), text_dim=8,
                                      text_len=4)
    args = mfu.parse_args(["--parts", "e2e", "--e2e-epochs", "2", "--out", str(tmp_path), "--work", str(tmp_path),
                           "--e2e-recompute", "0.22,0.16", "--e2e-soak-s", "30"])
    memory = mfu.e2e_memory(args, SimpleNamespace(doc={}))
    for name in mfu.TRAINER_E2E:
        out = mfu.e2e_variant(args, name, manifest, memory, deadline=1e12)
        assert out["rc"] == 0 and out["steps_asked"] == calls[-1][2] >= 2
        # the soak ran beside the launch and was ended with it: the mock logs no step, so it is killed (or, on a
        # CPU, it found no CUDA first)
        assert out["soak"]["stopped"] in ("killed",) + (() if torch.cuda.is_available() else ("no CUDA",)), out
        ds, _, steps, flags = calls[-1]
        a = train_wan.parse_args(["--deepspeed_config", ds, "--model-config", os.path.join(ROOT, args.model_config),
                                  "--data", manifest, "--max-steps", str(steps), *flags])
        assert a.compile_blocks == ("regions" if "regions" in name else "block")
        read_config(a, 1, 0)  # no UserError
        run = os.path.dirname(ds)
        keys = mfu.TRAINER_KEYS.get(name, {})
        assert read_config(a, 1, 0).al.pack_tokens == keys.get("pack_tokens")
        prof = CostProfile.load(f"{run}/profile.yaml")
        assert (prof.recompute_frac, prof.attention_recompute_frac) == (0.22, 0.16)
        assert steps == 2 * out["plan"]["steps_per_epoch"] == 2 * mfu.epoch_steps(
            f"{run}/profile.yaml", manifest, mfu.TRAINER_E2E[name], 4, checkpoint="auto", checkpoint_policy="attention",
            **keys)
        assert out["plan"]["recompute"] == (0.22, 0.16)
        if mfu.TRAINER_E2E[name] == "packed":
            assert out["plan"]["pack_tokens"] <= prof.budget_tokens


def test_every_e2e_variant_is_the_trainers_own_flags():
    """The e2e part's levers are train_wan flags: each variant's parse, with the compiled kind and policy it names."""
    from ds_adaptiveload.train_cli import parse_args

    for name, (compiled, flags, policy) in mfu.E2E.items():
        a = parse_args(["--deepspeed_config", "configs/ds_zero2_bf16.json", "--model-config", "configs/wan_1_3b.yaml",
                        "--synthetic", "--max-steps", "1", *flags])
        assert a.compile_blocks == {False: None, True: "block", "regions": "regions"}[compiled], name
        assert a.checkpoint_policy == policy and a.checkpoint_blocks in (True, "auto"), name


def test_e2e_profile_config_trains_with_the_configs_own_profile(tmp_path, monkeypatch):
    """--e2e-profile config: the trainer's profile is the JSON's own, byte for byte (no probed memory fields, no
    --e2e-recompute), as a user's run of the shipped config plans."""
    from types import SimpleNamespace

    import train_steps

    from ds_adaptiveload.schedule.mixes import make_mix

    calls = []
    monkeypatch.setattr(train_steps, "launch", lambda ds, manifest, steps, run, log, la, flags, model_cfg, **kw:
                        calls.append(ds) or 0)
    manifest = train_steps.write_data(str(tmp_path / "data"), make_mix("video-heavy", 6, seed=0), text_dim=8,
                                      text_len=4)
    args = mfu.parse_args(["--parts", "e2e", "--e2e-epochs", "1", "--out", str(tmp_path), "--work", str(tmp_path),
                           "--e2e-profile", "config", "--e2e-recompute", "0.22,0.16"])
    out = mfu.e2e_variant(args, "train-regions-attn-packed", manifest, mfu.e2e_memory(args, SimpleNamespace(doc={})),
                          deadline=1e12)
    with open(calls[-1]) as f:
        used = json.load(f)["adaptive_load"]["profile"]
    shipped = config_profile(os.path.join(ROOT, "configs", "ds_zero2_bf16.json"))
    with open(used, "rb") as a, open(shipped, "rb") as b:
        assert a.read() == b.read()
    assert out["rc"] == 0 and out["plan"]["recompute"] == "profile"


def test_e2e_memory_warns_when_a_mode_and_its_attn_mode_come_from_different_sources(tmp_path):
    """A --memory-json that measured regions-attn but not regions: the -attn plan takes regions' (estimated) base, so
    the doc and stdout say so (the fifth session's call 2 planned k with the eager estimate this way)."""
    from types import SimpleNamespace

    def fields(per_token, per_block):
        return {"memory": {"fixed_bytes": 2.3e10, "bytes_per_token": per_token, "block_bytes_per_token": per_block,
                           "block_bytes_per_sample": 4e6}}

    attn_only = {"proposed_profile": {"regions-attn": fields(3.3e5, 5.1e4)}}
    both = {"proposed_profile": {"regions-attn": fields(3.3e5, 5.1e4), "regions": fields(1.8e5, 5.6e4)}}
    for doc_json, warned in ((attn_only, True), (both, False)):
        (tmp_path / "m.json").write_text(json.dumps(doc_json))
        args = mfu.parse_args(["--parts", "e2e", "--memory-json", str(tmp_path / "m.json"), "--out", str(tmp_path)])
        doc = SimpleNamespace(doc={})
        memory = mfu.e2e_memory(args, doc)
        assert any("regions and regions-attn" in w for w in doc.doc.get("warnings", [])) == warned
        if not warned:  # the -attn plan: regions' base plus what keeping the attention adds per block
            assert memory["regions-attn"]["block_bytes_per_token"] == 5.6e4
            assert memory["regions-attn"]["attention_bytes_per_token"] == pytest.approx((3.3e5 - 1.8e5) / 30)


def test_memory_fields_recover_the_per_token_and_per_sample_terms():
    """The probes of memory_fields against a device whose peak follows schedule/memory.py's model exactly: every
    term comes back, block_bytes_per_sample included (what an open block holds per sample)."""
    from types import SimpleNamespace

    L, F, a, b, c, d = 30, 20e9, 180e3, 77e3, 30e6, 9e6
    cfg = WanConfig.from_yaml(os.path.join(ROOT, "configs", "wan_1_3b.yaml"))

    def measure(shape, k, mode, reps):
        n, t = shape[0], shape[0] * mfu.tokens_of(shape, cfg)
        return {"status": "ok", "peak_gib": (F + t * (a + (L - k) * b) + n * (c + (L - k) * d)) / mfu.GIB}

    bench = SimpleNamespace(levers=SimpleNamespace(num_layers=L), cfg=cfg, measure=measure, capacity=140e9,
                            args=SimpleNamespace(safety=0.9))
    mem, probe = mfu.memory_fields(bench, "regions", {"bytes_per_sample": 21e6})
    assert mem["bytes_per_token"] == pytest.approx(a, rel=1e-6)
    assert mem["block_bytes_per_token"] == pytest.approx(b, rel=1e-6)
    assert mem["block_bytes_per_sample"] == pytest.approx(d, rel=1e-6)
    assert mem["fixed_bytes"] == pytest.approx(F + c, rel=1e-6) and mem["bytes_per_sample"] == 21e6
    assert probe["bytes_per_sample_all"] == pytest.approx(c, rel=1e-6)


def test_steady_summary_starts_at_the_first_step_at_the_power_state():
    """bench/mfu_e2e.steady_summary: steps 2-3 at 636 W (full clock), then 686-691 W at the cap: the steady MFU is over
    steps 4 on, wall-weighted; step 1 never counts; no GPU samples, no figure."""
    from mfu_e2e import steady_summary

    recs = [{"step": i, "tokens": 100, "step_ms": ms, "mfu": u}
            for i, (ms, u) in enumerate([(80000, 0.3), (50000, 0.48), (50000, 0.48), (55000, 0.44), (60000, 0.43)], 1)]
    gpu = [{"step": i, "power_w": w} for i, w in enumerate([690.0, 636.0, 637.0, 686.0, 691.0], 1)]
    out = steady_summary(recs, gpu)
    assert out["steady_steps"] == [4, 5]
    assert out["steady_mfu"] == pytest.approx((0.44 * 55000 + 0.43 * 60000) / 115000)
    assert out["steady_tokens_per_s"] == pytest.approx(200 / 115.0)
    assert steady_summary(recs, []) == {}


def test_gpu_per_step_joins_nvidia_smi_samples_with_the_step_log(tmp_path):
    """bench/mfu_e2e.gpu_per_step: the samples inside each step's [end_time - step_ms, end_time] (nvidia-smi's CSV as
    the fifth session's H200 run wrote it), their mean SM clock and power, and the power-cap throttle bit."""
    import datetime

    csv = tmp_path / "gpu.csv"
    rows = ["timestamp, clocks.current.sm [MHz], clocks.current.memory [MHz], temperature.gpu, power.draw [W], "
            "utilization.gpu [%], memory.used [MiB], clocks_event_reasons.active"]
    t0 = datetime.datetime(2026, 12, 1, 22, 4, 0, tzinfo=datetime.timezone.utc)
    for i, (mhz, watts, reason) in enumerate([(1965, 620.0, 0), (1965, 624.0, 4), (1650, 690.0, 4), (1700, 692.0, 4)]):
        t = t0 + datetime.timedelta(seconds=2 * i)
        rows.append(f"{t.strftime('%Y/%m/%d %H:%M:%S.%f')[:-3]}, {mhz} MHz, 3201 MHz, 58, {watts:.2f} W, 100 %, "
                    f"132839 MiB, 0x{reason:016x}")
    csv.write_text("\n".join(rows) + "\n")
    start = t0.timestamp()
    recs = [{"step": 1, "step_ms": 2500.0, "end_time": start + 2.5},
            {"step": 2, "step_ms": 3000.0, "end_time": start + 6.1},
            {"step": 3, "step_ms": 1000.0}]  # no end_time (an older log): left out
    import mfu_e2e

    got = mfu_e2e.gpu_per_step(str(csv), recs)
    assert got == [{"step": 1, "sm_mhz": 1965, "power_w": 622.0, "power_capped": True, "samples": 2},
                   {"step": 2, "sm_mhz": 1675, "power_w": 691.0, "power_capped": True, "samples": 2}]
    assert mfu_e2e.gpu_per_step(str(tmp_path / "missing.csv"), recs) == []


def test_gpu_monitor_writes_whole_samples_until_stopped(tmp_path, monkeypatch):
    """bench/mfu_e2e.gpu_monitor with a stand-in nvidia-smi on PATH: the header and then one whole line per sample,
    every sample up to the stop in the file (a looping nvidia-smi lost its last 4 KB block), which gpu_per_step
    reads; a driver without the throttle-reasons field falls back to the fields without it; none: None."""
    import stat
    import time

    import mfu_e2e

    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    # rejects the reasons field (an older driver); each call prints the header unless noheader, then one row
    fake.write_text("#!/bin/sh\ncase \"$*\" in *clocks_event_reasons*) exit 6;; esac\n"
                    "case \"$*\" in *noheader*) ;; *) echo 'timestamp, clocks.current.sm [MHz], x, y, power.draw [W], "
                    "u, m';; esac\n"
                    "echo \"$(date -u '+%Y/%m/%d %H:%M:%S.000'), 1700 MHz, 3201 MHz, 58, 690.00 W, 100 %, 5 MiB\"\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    csv = tmp_path / "gpu.csv"
    t0 = time.time()
    mon = mfu_e2e.gpu_monitor(str(csv), interval=0.2)
    assert mon is not None and "clocks_event_reasons" not in mon.fields
    time.sleep(1.5)
    mon.terminate()
    lines = csv.read_text().splitlines()
    assert lines[0].startswith("timestamp") and len(lines) >= 4, lines
    assert all(line.endswith("5 MiB") for line in lines[1:]), lines
    step = {"step": 1, "step_ms": 1e3 * (time.time() - t0 + 2), "end_time": time.time() + 1}
    got = mfu_e2e.gpu_per_step(str(csv), [step])
    assert got[0]["samples"] == len(lines) - 1 and got[0]["sm_mhz"] == 1700 and not got[0]["power_capped"]
    fake.write_text("#!/bin/sh\nexit 9\n")
    assert mfu_e2e.gpu_monitor(str(tmp_path / "none.csv")) is None


def test_gpu_soak_loads_until_the_step_log_has_a_line(tmp_path):
    """bench/gpu_soak.py (bench/mfu.py --e2e-soak-s): it keeps loading the device while the watched file is absent or
    empty, stops once the file has a line and says why; asked for CUDA where there is none, it stops at once."""
    import select
    import time

    from harness import last_json

    until = tmp_path / "steps.rank0.jsonl"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "gpu_soak.py"), "--until", str(until), "--max-s", "120"]
    p = subprocess.Popen(cmd + ["--device", "cpu", "--size", "64"], stdout=subprocess.PIPE, text=True)
    try:
        assert select.select([p.stdout], [], [], 120)[0], "the soak never started"
        assert last_json(p.stdout.readline(), "SOAK ") == {"soaking": "cpu", "size": 64}
        until.write_text("")  # the trainer opened its step log but logged no step yet
        time.sleep(1.0)
        assert p.poll() is None
        until.write_text('{"step": 1}\n')
        out, _ = p.communicate(timeout=60)
    finally:
        p.kill()
    rec = last_json(out, "SOAK ")
    assert rec["stopped"] == "file" and rec["gemms"] > 0 and rec["soak_s"] >= 1.0, rec
    if not torch.cuda.is_available():
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
        assert last_json(res.stdout, "SOAK ")["stopped"] == "no CUDA"
