"""Latent dataset format, `synthesize`, the micro-batch Dataset and its input checks; flow-matching noise."""
import argparse
import json
import os

import pytest
import torch

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.schedule.geometry import Geometry
from ds_adaptiveload.schedule.manifest import load_manifest
from ds_adaptiveload.data import latents as data
from ds_adaptiveload.train import flow

GEO = Geometry()


def synth(tmp_path, num=12, mix="tiny", text_dim=8, text_len=16):
    p = argparse.ArgumentParser()
    data.add_arguments(p)
    args = p.parse_args(["--out", str(tmp_path), "--num", str(num), "--mix", mix, "--text-dim", str(text_dim),
                         "--text-len", str(text_len), "--shard-size", "5", "--dtype", "fp32"])
    assert data.run(args) == 0
    path = os.path.join(tmp_path, "manifest.jsonl")
    return path, load_manifest(path, GEO)


def test_synthesize_writes_shapes_the_manifest_promises(tmp_path):
    path, samples = synth(tmp_path)
    assert len(samples) == 12
    assert len([f for f in os.listdir(tmp_path) if f.startswith("shard-")]) == 3  # shards of 5
    assert os.path.isfile(os.path.join(tmp_path, data.EMPTY_PROMPT_FILE))  # caption dropout's stand-in
    data.check_samples(samples, path, GEO, text_dim=8)
    ds = data.LatentDataset(samples, path, GEO, text_len=16, text_dim=8)
    by_shape = {}
    for i, s in enumerate(samples):
        by_shape.setdefault((s.frames, s.height, s.width), []).append(i)
    shape, idx = max(by_shape.items(), key=lambda kv: len(kv[1]))
    batch = ds.__getitems__(idx)
    assert batch["latent"].shape == (len(idx), 16, *GEO.latent_shape(*shape))
    assert batch["text"].shape == (len(idx), 16, 8)
    assert batch["ids"] == [samples[i].id for i in idx] and batch["index"] == idx
    # unpadded text lengths vary; the rest is zero padding
    assert (batch["text"].abs().sum(-1) == 0).any()


def test_dataloader_with_batch_sampler_and_workers(tmp_path):
    path, samples = synth(tmp_path, num=8)
    ds = data.LatentDataset(samples, path, GEO, text_len=16, text_dim=8)
    mbs = [[0], [1], [2, 3] if samples[2].frames == samples[3].frames and samples[2].height == samples[3].height
           and samples[2].width == samples[3].width else [2]]
    loader = torch.utils.data.DataLoader(ds, batch_sampler=mbs, collate_fn=data.first, num_workers=1)
    assert [b["index"] for b in loader] == mbs


def test_mixed_shape_micro_batch_comes_back_packed(tmp_path):
    """A micro-batch of several shapes: lists of latents and unpadded texts, samples of one shape contiguous
    (first-seen shape order, stable), ids and indices in that order; each entry as the sample alone reads."""
    path, samples = synth(tmp_path, num=12)
    ds = data.LatentDataset(samples, path, GEO, text_len=16, text_dim=8)
    shape = [(s.frames, s.height, s.width) for s in samples]
    a = [i for i in range(12) if shape[i] == shape[0]]
    b = [i for i in range(12) if shape[i] != shape[0]]
    assert len(a) >= 2 and len(b) >= 2
    mb = [a[0], b[0], a[1], b[1]]
    batch = ds.__getitems__(mb)
    want = [a[0], a[1]] + [i for i in (b[0], b[1]) if shape[i] == shape[b[0]]] + \
        [i for i in (b[0], b[1]) if shape[i] != shape[b[0]]]
    assert batch["index"] == want and batch["ids"] == [samples[i].id for i in want]
    assert isinstance(batch["latent"], list) and isinstance(batch["text"], list)
    for i, lat, txt in zip(want, batch["latent"], batch["text"]):
        alone = ds.__getitems__([i])
        assert torch.equal(lat, alone["latent"][0])
        assert txt.shape[1] == 8 and txt.shape[0] <= 16
        assert torch.equal(txt, alone["text"][0, : txt.shape[0]]) and not alone["text"][0, txt.shape[0]:].any()
    one = ds.__getitems__(a[:2])  # one shape: stacked tensors as before
    assert one["latent"].shape == (2, 16, *GEO.latent_shape(*shape[a[0]])) and one["index"] == a[:2]


def test_packed_plan_through_stream_and_dataloader(tmp_path):
    """The packed policy's micro-batches, through MicroBatchStream and a DataLoader, come back in the planned
    order (the planner emits samples of one shape contiguous), some of them mixed."""
    from ds_adaptiveload.schedule.planner import PlanConfig
    from ds_adaptiveload.schedule.profile import CostProfile
    from ds_adaptiveload.schedule.sampler import AdaptiveSampler

    path, samples = synth(tmp_path, num=24)
    profile = CostProfile.load("configs/profiles/tiny-cpu.yaml")
    sampler = AdaptiveSampler(samples, profile, PlanConfig("packed", 2, grad_accum=2, lockstep=True), 0)
    steps = sampler.plan.steps
    planned = [mb for step in steps for mb in step[0]]
    stream = data.MicroBatchStream(sampler)
    ds = data.LatentDataset(samples, path, GEO, text_len=16, text_dim=8)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=stream, collate_fn=data.first)
    got = [b for b, _ in zip(loader, planned)]
    assert [b["index"] for b in got] == planned
    assert any(isinstance(b["latent"], list) for b in got), "some micro-batch mixes shapes"
    assert [p.micro_batches for p in list(stream.pending)[:len(steps)]] == [step[0] for step in steps]


def _rewrite(path, fn):
    lines = [json.loads(line) for line in open(path)]
    fn(lines)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in lines)


def test_missing_shard_names_file_and_sample(tmp_path):
    path, samples = synth(tmp_path)
    os.remove(os.path.join(tmp_path, samples[6].extra["shard"]))
    with pytest.raises(UserError, match=r"shard-00001\.safetensors: shard missing.*'tiny-0000005'"):
        data.check_samples(samples, path, GEO, text_dim=8)
    ds = data.LatentDataset(samples, path, GEO, text_len=16, text_dim=8)
    with pytest.raises(UserError, match=r"shard-00001\.safetensors: shard missing \(sample 'tiny-0000006'"):
        ds.__getitems__([6])


def test_latent_shape_mismatch_names_file_and_sample(tmp_path):
    path, _ = synth(tmp_path)

    def grow(lines):  # claim 4 more frames than the stored latent has
        lines[3]["frames"] += 4
    _rewrite(path, grow)
    samples = load_manifest(path, GEO)
    with pytest.raises(UserError, match=r"shard-00000\.safetensors: sample 'tiny-0000003' latent has shape"):
        data.check_samples(samples, path, GEO, text_dim=8)
    ds = data.LatentDataset(samples, path, GEO, text_len=16, text_dim=8)
    with pytest.raises(UserError, match=r"'tiny-0000003' latent has shape .*manifest.jsonl:4\)"):
        ds.__getitems__([3])


def test_manifest_without_shard_keys_is_rejected(tmp_path):
    path, _ = synth(tmp_path)
    _rewrite(path, lambda lines: lines[0].pop("latent_key"))
    with pytest.raises(UserError, match=r"manifest.jsonl:1: sample 'tiny-0000000' lacks key\(s\) latent_key"):
        data.check_samples(load_manifest(path, GEO), path, GEO, text_dim=8)


def test_text_width_must_match_model(tmp_path):
    path, samples = synth(tmp_path)
    with pytest.raises(UserError, match=r"text embedding has shape \[\d+, 8\], the model needs \[L, 4096\]"):
        data.check_samples(samples, path, GEO, text_dim=4096)


def test_shifted_timesteps():
    u = torch.linspace(0, 1, 101)
    t = flow.shift_t(u, 5.0)
    assert t[0] == 0 and torch.isclose(t[-1], torch.tensor(1.0))
    assert (t[1:] > t[:-1]).all()
    assert torch.isclose(flow.shift_t(torch.tensor(0.5), 5.0), torch.tensor(5 / 6))  # median s/(s+1)
    assert torch.allclose(flow.shift_t(u, 1.0), u)


def test_noise_depends_on_sample_not_on_batching():
    x0 = torch.zeros(3, 2, 1, 2, 2)
    eps, t = flow.draw_noise(x0, [7, 8, 9], seed=1, epoch=0, shift=5.0)
    eps1, t1 = flow.draw_noise(x0[1:2], [8], seed=1, epoch=0, shift=5.0)
    assert torch.equal(eps[1], eps1[0]) and torch.equal(t[1], t1[0])
    eps2, _ = flow.draw_noise(x0[1:2], [8], seed=1, epoch=1, shift=5.0)
    assert not torch.equal(eps1, eps2)  # a new epoch draws new noise
