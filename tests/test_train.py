"""launch/train_wan.py on CPU with 2 ranks and the tiny model, through the real `deepspeed` launcher:
the documented command, loss normalization against one big batch (dp=2 and Ulysses sp=2), exact resume,
and a non-finite loss stopping the run. Each launch takes ~20 s on 2 cores."""
import json
import os
import subprocess

import pytest
import torch

from ds_adaptiveload.schedule.geometry import Geometry
from ds_adaptiveload.schedule.manifest import load_manifest
from ds_adaptiveload.model import WanConfig, WanModel
from ds_adaptiveload.data import latents as data
from ds_adaptiveload.train import flow
from tests.launcher import DEEPSPEED, launcher_env, master_port, needs_launcher

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "wan_tiny.yaml")
pytestmark = needs_launcher


def launch(out, *extra, config=None, port=None, timeout=240):
    """`deepspeed --num_gpus 2 launch/train_wan.py ...` from the repo root; config None: the documented
    command exactly (plus --output), else 1 DataLoader worker to spare the 2 cores. port None: a free one."""
    cmd = [DEEPSPEED, "--num_gpus", "2", "--master_port", str(port or master_port()), "launch/train_wan.py",
           "--deepspeed_config", str(config or "configs/ds_tiny_cpu.json"), "--model-config", "configs/wan_tiny.yaml",
           "--output", str(out), *(() if config is None else ("--num-workers", "1")), *extra]
    env = launcher_env()
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def steps(out, rank=0):
    with open(os.path.join(out, f"steps.rank{rank}.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_config(tmp_path, **changes):
    """ds_tiny_cpu.json (its profile "auto": tiny-cpu.yaml from any folder), the monitor in tmp_path, and `changes`."""
    with open(os.path.join(ROOT, "configs", "ds_tiny_cpu.json")) as f:
        cfg = json.load(f)
    cfg["csv_monitor"]["output_path"] = str(tmp_path / "monitor")
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path = tmp_path / f"ds_{len(os.listdir(tmp_path))}.json"
    path.write_text(json.dumps(cfg))
    return path


test_config.__test__ = False  # a helper, not a test


def check(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


# ----------------------------------------------------------------------------------------------------
# Loss normalization, pure arithmetic: what DeepSpeed does to our scaled losses equals one big batch.


def test_default_alloc_conf_sets_expandable_segments_unless_the_user_chose(monkeypatch):
    from ds_adaptiveload.train.config import ALLOC_CONF, default_alloc_conf

    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(var, raising=False)
    assert default_alloc_conf() == ALLOC_CONF == os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    assert default_alloc_conf() == "max_split_size_mb:512"  # the user's own setting is kept
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    assert default_alloc_conf() == "expandable_segments:False" and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


def test_loss_scale_equals_one_big_batch_in_one_process():
    torch.manual_seed(0)
    cfg = WanConfig.from_yaml(TINY)
    model = WanModel(cfg)
    with torch.no_grad():
        model.head.head.weight.normal_(std=0.02)  # zero-init head would zero every other gradient
    shapes = [(1, 8, 8)] * 5 + [(2, 8, 8)] * 3 + [(1, 8, 12)] * 2
    xs = [torch.randn(16, *s) for s in shapes]
    ctx = torch.randn(len(xs), 5, cfg.text_dim)

    def losses(idx):
        x0 = torch.stack([xs[i] for i in idx])
        eps, t = flow.draw_noise(x0, idx, seed=3, epoch=0, shift=5.0)
        return flow.flow_matching_loss(model, x0, ctx[idx], eps, t)

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    # one big batch: mean loss over all 10 samples (per shape, summed)
    groups = [[0, 1, 2, 3, 4], [5, 6, 7], [8, 9]]
    ref = grads(sum(losses(g).sum() for g in groups) / len(xs))
    # dp=2 ranks x G=2 micro-batches, uneven, and one pad micro-batch with zero weight
    plan = [[[0, 1, 2], [8, 9]], [[5, 6, 7], [3, 4]]]
    dp, G, n = 2, 2, len(xs)
    acc = [torch.zeros_like(g) for g in ref]
    for rank_mbs in plan:
        for mb in rank_mbs:
            scaled = losses(mb).sum() * flow.loss_scale(dp, G, n)
            for a, g in zip(acc, grads(scaled / G)):  # DeepSpeed: loss / gas, then mean over dp
                a += g / dp
    pad = grads(losses([0]).sum() * 0.0)
    for a, r, p in zip(acc, ref, pad):
        torch.testing.assert_close(a + p, r, rtol=1e-5, atol=1e-7)
    assert sum(r.abs().sum() for r in ref) > 0


# ----------------------------------------------------------------------------------------------------
# The documented command and exact resume


def test_documented_command_runs(tmp_path):
    # The README command; its csv monitor writes to runs/monitor under the repo, as the config says.
    straight = tmp_path / "run"
    check(launch(straight, "--synthetic", "--max-steps", "4"))
    recs = steps(straight, 0)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for r in recs:
        assert r["loss"] > 0 and r["samples"] > 0 and r["tokens"] > 0
        assert len(r["compute_ms"]) == 2 and 0 <= r["idle_fraction"] < 1 and len(r["pred_ms"]) == 2
        assert len(r["ids"]) == 2  # G micro-batches
        # ds_tiny_cpu.json is ZeRO-3: the plan's step prediction is lockstep (rounds), never below a rank total
        assert r["pred_wall_ms"] >= max(r["pred_ms"]) * (1 - 1e-9)
        assert r["pred_idle_fraction"] == pytest.approx(1 - sum(r["pred_ms"]) / 2 / r["pred_wall_ms"], abs=1e-12)
    # the two ranks trained disjoint samples and agree on the global metrics
    r1 = steps(straight, 1)
    for a, b in zip(recs, r1):
        assert a["loss"] == b["loss"] and a["samples"] == b["samples"]
        ids_a = [i for g, mb in enumerate(a["ids"]) if g not in a["pad"] for i in mb]
        ids_b = [i for g, mb in enumerate(b["ids"]) if g not in b["pad"] for i in mb]
        assert not set(ids_a) & set(ids_b) and len(set(ids_a + ids_b)) == a["samples"]
    assert os.path.isfile(os.path.join(straight, "checkpoints", "latest"))


def straight_and_resumed(tmp_path, cfg):
    """(straight, resumed) output folders: 4 steps on 37 synthetic samples in one run, and in a run of 2 steps
    resumed to 4."""
    common = ("--synthetic", "--synthetic-num", "37")
    ref, out = tmp_path / "straight", tmp_path / "resumed"
    check(launch(ref, *common, "--max-steps", "4", config=cfg))
    check(launch(out, *common, "--max-steps", "2", config=cfg))
    check(launch(out, *common, "--max-steps", "4", "--resume", str(out / "checkpoints"), config=cfg))
    return ref, out


def test_resume_continues_with_the_same_micro_batches(tmp_path):
    # 37 synthetic samples: with tiny-cpu.yaml, G=2 and 2 ranks the plan's epoch 0 has 3 steps, the last
    # with pad micro-batches, so 4 steps cover a resume mid-epoch, pads and an epoch boundary.
    ref, out = straight_and_resumed(tmp_path, test_config(tmp_path))
    for rank in (0, 1):
        a, b = steps(ref, rank), steps(out, rank)
        assert [r["step"] for r in b] == [1, 2, 3, 4]
        assert [(r["epoch"], r["plan_step"], r["ids"], r["pad"]) for r in b] == \
            [(r["epoch"], r["plan_step"], r["ids"], r["pad"]) for r in a]
        for ra, rb in zip(a, b):
            assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5, abs=1e-7), (ra["step"], ra["loss"], rb["loss"])
            assert rb["lr"] == pytest.approx(ra["lr"])


# ----------------------------------------------------------------------------------------------------
# The gradient DeepSpeed applies equals the gradient of the mean loss over the global step


def reference_check(out, dump, sp):
    """Recompute the dumped step's gradient in one process from the dumped parameters."""
    d = torch.load(dump)
    step = d["step"]
    manifest = os.path.join(out, "synthetic", "manifest.jsonl")
    samples = load_manifest(manifest)
    index = {s.id: i for i, s in enumerate(samples)}
    cfg = WanConfig.from_yaml(TINY)
    ds = data.LatentDataset(samples, manifest, Geometry(), cfg.text_len, cfg.text_dim)
    ids = []
    for rank in range(0, 2, sp):  # one rank per SP group: peers train the same samples
        rec = steps(out, rank)[step - 1]
        assert rec["step"] == step
        ids += [i for g, mb in enumerate(rec["ids"]) if g not in rec["pad"] for i in mb]
    if sp > 1:
        assert steps(out, 1)[step - 1]["ids"] == steps(out, 0)[step - 1]["ids"]
    assert len(ids) == steps(out, 0)[step - 1]["samples"]
    model = WanModel(cfg)
    model.load_state_dict(d["params"])
    model.zero_grad()
    total = 0
    for i in (index[s] for s in ids):
        b = ds.__getitems__([i])
        eps, t = flow.draw_noise(b["latent"], [i], seed=0, epoch=0, shift=5.0)
        total = total + flow.flow_matching_loss(model, b["latent"], b["text"], eps, t).sum()
    (total / len(ids)).backward()
    nonzero = 0
    for name, p in model.named_parameters():
        got, want = d["grads"][name], p.grad
        err = (got - want).norm() / want.norm().clamp_min(1e-12)
        assert err < 1e-4 or (got - want).abs().max() < 1e-8, (name, float(err))
        nonzero += bool(want.norm() > 0)
    assert nonzero > len(d["grads"]) // 2  # most parameters get a gradient after the first update


@pytest.mark.parametrize("sp", [1, 2])
def test_gradient_equals_one_big_batch(tmp_path, sp):
    # lr 1e-3 without warmup so step 1 moves the zero-initialised head and step 2 has full gradients.
    cfg = test_config(tmp_path, sequence_parallel_size=sp, scheduler=None,
                      optimizer={"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}})
    out = tmp_path / "run"
    dump = tmp_path / "grads.pt"
    check(launch(out, "--synthetic", "--max-steps", "2", "--dump-grads", str(dump), config=cfg))
    reference_check(out, dump, sp)


# ----------------------------------------------------------------------------------------------------
# Bad input stops the run with an error naming it


def test_nonfinite_loss_names_step_and_samples(tmp_path):
    from safetensors.torch import load_file, save_file

    from ds_adaptiveload.schedule.mixes import make_mix

    cfg_model = WanConfig.from_yaml(TINY)
    d = tmp_path / "data"
    manifest = data.write_synthetic(str(d), make_mix("tiny", 32, 0), text_dim=cfg_model.text_dim,
                                    max_text_len=cfg_model.text_len, dtype="fp32")
    victim = load_manifest(manifest)[5]
    shard = d / victim.extra["shard"]
    tensors = load_file(str(shard))
    # finite but huge: passes the reader's NaN/Inf check, and its squared error overflows fp32
    tensors[victim.extra["latent_key"]][0, 0, 0, 0] = 1e30
    save_file(tensors, str(shard))
    proc = launch(tmp_path / "run", "--data", manifest, "--max-steps", "40", config=test_config(tmp_path))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "non-finite loss on rank" in proc.stderr and victim.id in proc.stderr, proc.stderr[-3000:]
    assert "stopped before the optimizer update" in proc.stderr


def test_missing_shard_exits_2_naming_it(tmp_path):
    cfg_model = WanConfig.from_yaml(TINY)
    from ds_adaptiveload.schedule.mixes import make_mix

    d = tmp_path / "data"
    manifest = data.write_synthetic(str(d), make_mix("tiny", 8, 0), text_dim=cfg_model.text_dim,
                                    max_text_len=cfg_model.text_len, dtype="fp32", shard_size=4)
    os.remove(d / "shard-00001.safetensors")
    proc = launch(tmp_path / "run", "--data", manifest, "--max-steps", "1", config=test_config(tmp_path))
    assert proc.returncode == 2
    assert "shard-00001.safetensors: shard missing (needed by sample 'tiny-0000004'" in proc.stderr


@pytest.mark.parametrize("sp", [1, 2])
def test_packed_gradient_equals_one_big_batch(tmp_path, sp):
    """The packed policy (micro-batches of several shapes, one packed forward each) under ZeRO-2: the step's
    gradient equals the mean-loss gradient of its samples in one process, with dp = 2 and with sp = 2."""
    with open(os.path.join(ROOT, "configs", "ds_tiny_cpu.json")) as f:
        al = json.load(f)["adaptive_load"]
    al.update(policy="packed")
    cfg = test_config(tmp_path, sequence_parallel_size=sp, scheduler=None, adaptive_load=al,
                      zero_optimization={"stage": 2},
                      optimizer={"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}})
    out = tmp_path / "run"
    dump = tmp_path / "grads.pt"
    check(launch(out, "--synthetic", "--max-steps", "2", "--dump-grads", str(dump), config=cfg))
    assert any(len({tuple(s) for s in shapes}) > 1 for shapes in _mb_shapes(out)), "no micro-batch mixed shapes"
    reference_check(out, dump, sp)


def _mb_shapes(out):
    """(frames, height, width) of each micro-batch's samples over the run, from the synthetic manifest."""
    with open(os.path.join(out, "synthetic", "manifest.jsonl")) as f:
        shape = {r["id"]: (r["frames"], r["height"], r["width"]) for r in map(json.loads, f)}
    return [[shape[i] for i in mb] for rec in steps(out, 0) for mb in rec["ids"]]


def test_bell_weighting_and_linear_lr_scaling_in_train_wan(tmp_path):
    """adaptive_load.loss_weighting "bell" and lr_scaling_method "linear" reach train_wan: each step's LR is
    the base LR times the step's sample count over the reference batch size."""
    with open(os.path.join(ROOT, "configs", "ds_tiny_cpu.json")) as f:
        al = json.load(f)["adaptive_load"]
    al.update(loss_weighting="bell", lr_scaling_method="linear",
              lr_reference_batch_size=16)
    cfg = test_config(tmp_path, scheduler=None, adaptive_load=al,
                      optimizer={"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}})
    out = tmp_path / "run"
    check(launch(out, "--synthetic", "--max-steps", "3", config=cfg))
    recs = steps(out, 0)
    assert len({r["samples"] for r in recs}) >= 1 and all(r["loss"] == r["loss"] for r in recs)
    for r in recs:
        assert r["lr"] == pytest.approx(1e-3 * r["samples"] / 16, rel=1e-6), r
