"""LoRA training under DeepSpeed on CPU: the optimizer holds only the adapters and the base stays bit-identical (one
process, ZeRO-2 and ZeRO-3); through launch/train_wan.py on 2 ranks, the adapters' gradient of a packed step equals the
one-process gradient of its samples (ZeRO-2, dp = 2 and Ulysses sp = 2, checkpointed blocks), and a resume is exact
(ZeRO-3)."""
import json
import os

import pytest
import torch

from ds_adaptiveload.model import WanConfig, WanModel
from tests.launcher import needs_launcher
from tests.test_train import _mb_shapes, check, launch, steps, straight_and_resumed, test_config

pytest.importorskip("peft")
from ds_adaptiveload.model.lora import apply_lora, is_adapter  # noqa: E402
from ds_adaptiveload.train.config import LoraSettings  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = WanConfig.from_yaml(os.path.join(ROOT, "configs", "wan_tiny.yaml"))


def _engine(stage):
    from ds_adaptiveload.train import engine as eng
    from ds_adaptiveload.train.build import build_model
    from ds_adaptiveload.train.config import derive_ds_config

    eng.single_process_env()
    eng.init_distributed()
    ds = derive_ds_config(os.path.join(ROOT, "configs", "ds_tiny_cpu.json"), zero_stage=stage, dp=1, grad_accum=1,
                          scheduler=None, csv_monitor=None, adaptive_load=None,
                          optimizer={"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}})
    ds.pop("adaptive_load", None)
    model = build_model(TINY, ds, seed=0, leaf_blocks=False)
    if stage == 3:  # the head starts at zero, so no gradient would reach the blocks
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        with GatheredParameters([model.head.head.weight], modifier_rank=0):
            torch.nn.init.normal_(model.head.head.weight, std=0.02)
    else:
        torch.nn.init.normal_(model.head.head.weight, std=0.02)
    apply_lora(model, LoraSettings(rank=4))
    return eng.build_engine(model, ds, mpu=None)


def _full_state(engine) -> dict:
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    params = list(engine.module.parameters())
    with GatheredParameters(params) if hasattr(params[0], "ds_id") else _nothing():
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_optimizer_holds_only_adapters_and_the_base_stays_bit_identical(stage):
    from ds_adaptiveload.train import engine as eng, flow

    engine = _engine(stage)
    adapters = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                   for n, p in engine.module.named_parameters() if is_adapter(n))
    assert adapters == TINY.lora_params(4, LoraSettings(rank=4).modules())
    before = _full_state(engine)
    g = torch.Generator().manual_seed(3)
    batch = {"latent": [torch.randn(TINY.in_dim, *s, generator=g) for s in ((1, 4, 4), (3, 4, 4), (1, 4, 4))],
             "text": [torch.randn(6, TINY.text_dim, generator=g) for _ in range(3)], "index": [0, 1, 2]}
    for _ in range(2):
        eng.micro_step(engine, batch, 1.0, device=torch.device("cpu"), dtype=torch.float32, seed=0, epoch=0,
                       shift=5.0)
        engine.step()
    # Adam's first moments: one per trained element (flat partitions: at most alignment padding more)
    held = sum(st["exp_avg"].numel() for st in engine.optimizer.optimizer.state.values())
    assert adapters <= held < adapters + 64, (held, adapters)
    after = _full_state(engine)
    moved = [n for n in before if not torch.equal(before[n], after[n])]
    assert moved and all(is_adapter(n) for n in moved), moved
    assert any(".lora_B." in n for n in moved)  # B starts at zero and moved


# -- 2 ranks through launch/train_wan.py ---------------------------------------------------------------------------


def lora_reference_check(out, dump, sp, settings):
    """The dumped step's adapter gradients recomputed in one process (tests/test_train.reference_check with adapters);
    the dumped base weights equal the seeded initial model's bit for bit."""
    from ds_adaptiveload.data import latents as data
    from ds_adaptiveload.schedule.geometry import Geometry
    from ds_adaptiveload.schedule.manifest import load_manifest
    from ds_adaptiveload.train import flow

    d = torch.load(dump)
    step = d["step"]
    torch.manual_seed(0)
    initial = WanModel(TINY).state_dict()
    for name, p in d["params"].items():
        if not is_adapter(name):
            assert torch.equal(p, initial[name.replace(".base_layer.", ".")]), name
    assert set(d["grads"]) == {n for n in d["params"] if is_adapter(n)}
    manifest = os.path.join(out, "synthetic", "manifest.jsonl")
    samples = load_manifest(manifest)
    index = {s.id: i for i, s in enumerate(samples)}
    ids = []
    for r in range(0, 2, sp):  # one rank per SP group: peers train the same samples
        rec = steps(out, r)[step - 1]
        ids += [i for g, mb in enumerate(rec["ids"]) if g not in rec["pad"] for i in mb]
    ds = data.LatentDataset(samples, manifest, Geometry(), TINY.text_len, TINY.text_dim)
    model = apply_lora(WanModel(TINY), settings)
    model.load_state_dict(d["params"])
    total = 0
    for i in (index[s] for s in ids):
        b = ds.__getitems__([i])
        eps, t = flow.draw_noise(b["latent"], [i], seed=0, epoch=0, shift=5.0)
        total = total + flow.flow_matching_loss(model, b["latent"], b["text"], eps, t).sum()
    (total / len(ids)).backward()
    nonzero = 0
    for name, got in d["grads"].items():
        want = model.get_parameter(name).grad
        err = (got - want).norm() / want.norm().clamp_min(1e-12)
        assert err < 1e-4 or (got - want).abs().max() < 1e-8, (name, float(err))
        nonzero += bool(want.norm() > 0)
    # The random base's head is zero (Wan's init) and frozen: the head's adapter moves first, the blocks' B in step 2,
    # so by step 3 every adapter has a gradient.
    assert nonzero == len(d["grads"]) and step == 3


def _packed_config(tmp_path, **changes):
    with open(os.path.join(ROOT, "configs", "ds_tiny_cpu.json")) as f:
        al = json.load(f)["adaptive_load"]
    al.update(policy="packed")
    return test_config(tmp_path, scheduler=None, adaptive_load=al,
                       optimizer={"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, **changes)


@pytest.mark.slow
@needs_launcher
@pytest.mark.parametrize("sp", [1, 2])
def test_lora_packed_gradient_equals_one_big_batch(tmp_path, sp):
    """ZeRO-2, packed micro-batches of several shapes, every block checkpointed, --lora-rank 4: the adapters' gradient
    of step 3 equals the mean-loss gradient of its samples, and the base is the initial one bit for bit."""
    cfg = _packed_config(tmp_path, sequence_parallel_size=sp, zero_optimization={"stage": 2})
    out, dump = tmp_path / "run", tmp_path / "grads.pt"
    proc = launch(out, "--synthetic", "--max-steps", "3", "--dump-grads", str(dump), "--lora-rank", "4",
                  "--lora-targets", "q,k,v,o,ffn,head", "--checkpoint-blocks", config=cfg)
    check(proc)
    settings = LoraSettings(rank=4, targets=["q", "k", "v", "o", "ffn", "head"])
    line = f"LoRA rank 4 on {', '.join(settings.modules())}: {TINY.lora_params(4, settings.modules()):,} trainable"
    assert line in proc.stdout, proc.stdout[-2000:]
    assert any(len({tuple(s) for s in shapes}) > 1 for shapes in _mb_shapes(out)), "no micro-batch mixed shapes"
    lora_reference_check(out, dump, sp, settings)


@pytest.mark.slow
@needs_launcher
def test_lora_resume_is_exact_under_zero3(tmp_path):
    """ZeRO-3 (the tiny config's), adapters in the JSON: 4 steps straight equal 2 steps, then a resume to 4; a resume
    with another rank is refused naming the key."""
    cfg = _packed_config(tmp_path)
    with open(cfg) as f:
        doc = json.load(f)
    doc["adaptive_load"]["lora"] = {"rank": 4, "alpha": 8.0, "targets": ["self_attn", "ffn", "head"]}
    cfg.write_text(json.dumps(doc))
    ref, out = straight_and_resumed(tmp_path, cfg)
    for rank in (0, 1):
        a, b = steps(ref, rank), steps(out, rank)
        assert [r["step"] for r in b] == [1, 2, 3, 4]
        assert [r["ids"] for r in b] == [r["ids"] for r in a]
        for ra, rb in zip(a, b):
            assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5, abs=1e-7), (ra["step"], ra["loss"], rb["loss"])
    proc = launch(out, "--synthetic", "--synthetic-num", "37", "--max-steps", "5", "--resume", str(out / "checkpoints"), "--lora-rank", "8",
                  config=cfg)
    assert proc.returncode == 2 and "lora" in proc.stderr, proc.stderr[-2000:]
