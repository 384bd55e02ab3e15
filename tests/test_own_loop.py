"""The own-loop entry point (ds_adaptiveload.loop): the adaptive_load section in DeepSpeed's data-efficiency
section, the timestep loss weighting, LR scaling against DeepSpeed's own, the loader in one process, and
examples/train_diffusers_wan.py on 2 CPU ranks: its gradient against a single process, and its resume
(3 launches, ~30 s each on 2 idle cores)."""
import importlib.util
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.schedule.mixes import make_mix
from ds_adaptiveload.train import config, flow
from ds_adaptiveload.train.lr_scaling import BatchSizeLR, scale_lr
from tests.launcher import DEEPSPEED, launcher_env, master_port, needs_launcher, spawn_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILE = os.path.join(ROOT, "configs", "profiles", "tiny-cpu.yaml")


# ----------------------------------------------------------------------------------------------------
# Config: top level or data_efficiency.data_sampling.adaptive_load


def write(tmp_path, cfg):
    path = tmp_path / f"ds_{len(os.listdir(tmp_path))}.json"
    path.write_text(json.dumps(cfg))
    return path


def test_section_at_the_top_level_or_in_data_efficiency(tmp_path):
    section = {"profile": PROFILE, "policy": "dual", "seed": 3}
    ds, al = config.load_ds_config(write(tmp_path, {"gradient_accumulation_steps": 2, "adaptive_load": section}))
    assert "adaptive_load" not in ds and al.policy == "dual" and al.seed == 3
    nested = {"data_efficiency": {"seed": 7, "data_sampling": {"num_workers": 1, "adaptive_load": {"profile": PROFILE}}}}
    ds, al = config.load_ds_config(write(tmp_path, nested))
    assert al.seed == 7 and al.profile == PROFILE  # data_efficiency.seed is the seed
    assert ds["data_efficiency"] == {"seed": 7, "data_sampling": {"num_workers": 1}}  # ours removed, the rest kept
    # data_efficiency.seed applies to the top-level form too, and may repeat an equal adaptive_load.seed
    _, al = config.load_ds_config(write(tmp_path, {"adaptive_load": {"profile": PROFILE, "seed": 5},
                                                   "data_efficiency": {"seed": 5}}))
    assert al.seed == 5


@pytest.mark.parametrize("cfg, match", [
    ({"adaptive_load": {"profile": "p"}, "data_efficiency": {"data_sampling": {"adaptive_load": {"profile": "p"}}}},
     "given twice"),
    ({"data_efficiency": {"seed": 1, "data_sampling": {"adaptive_load": {"profile": "p", "seed": 2}}}},
     "adaptive_load.seed 2 and data_efficiency.seed 1 differ"),
    ({"data_efficiency": {"data_sampling": {}}}, "data_efficiency.data_sampling.adaptive_load"),
    ({"adaptive_load": {"profile": "p", "loss_weighting": "sigmoid"}}, "adaptive_load.loss_weighting"),
    ({"adaptive_load": {"profile": "p", "lr_scaling_method": "cubic"}}, "adaptive_load.lr_scaling_method"),
    ({"adaptive_load": {"profile": "p", "lr_reference_batch_size": 0}}, "adaptive_load.lr_reference_batch_size"),
])
def test_bad_sections_name_the_key(tmp_path, cfg, match):
    with pytest.raises(UserError, match=re.escape(match)):
        config.load_ds_config(write(tmp_path, cfg))


# ----------------------------------------------------------------------------------------------------
# Loss weighting


def diffsynth_table(shift):
    """DiffSynth-Studio's Wan training weights, from its description: 1000 timesteps sigma * 1000 with
    sigma = shift(linspace(1, 0, 1001)[:-1]); y = exp(-2 ((x - 500) / 1000)^2); y - min(y), scaled to mean 1."""
    sigma = flow.shift_t(torch.linspace(1, 0, 1001, dtype=torch.float64)[:-1], shift)
    y = torch.exp(-2 * ((sigma * 1000 - 500) / 1000) ** 2)
    y = y - y.min()
    return sigma, y * (1000 / y.sum())


@pytest.mark.parametrize("shift", [1.0, 5.0])
def test_bell_weights_are_diffsynth_studios_at_its_timesteps(shift):
    sigma, table = diffsynth_table(shift)
    torch.testing.assert_close(flow.timestep_weight(sigma.float(), "bell", shift), table.float(), rtol=1e-5, atol=1e-6)
    w = flow.timestep_weight(torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0]), "bell", shift)
    assert w[4] == 0 and w[2] == w.max() and w[1] == pytest.approx(float(w[3]))  # bell centred on t = 0.5
    # mean 1 over the timesteps training draws (draw_noise: shifted uniform)
    x0 = torch.zeros(4000, 1)
    _, t = flow.draw_noise(x0, range(4000), seed=0, epoch=0, shift=shift)
    assert float(flow.timestep_weight(t, "bell", shift).mean()) == pytest.approx(1.0, abs=0.03)


def test_no_weighting_is_ones_and_unknown_names_the_key():
    assert torch.equal(flow.timestep_weight(torch.rand(5), "none", 5.0), torch.ones(5))
    losses, t = torch.rand(5), torch.rand(5)
    assert flow.weighted_sum(losses, None, "none", 5.0) == losses.sum()
    assert flow.weighted_sum(losses, t, "bell", 5.0) == pytest.approx(float((losses * flow.timestep_weight(t, "bell", 5.0)).sum()))
    with pytest.raises(UserError, match="adaptive_load.loss_weighting"):
        flow.timestep_weight(torch.rand(5), "snr", 5.0)


# ----------------------------------------------------------------------------------------------------
# LR scaling: DeepSpeed's dynamic-batching semantics


def test_scale_lr_matches_deepspeeds():
    from deepspeed.runtime.data_pipeline.data_sampling import variable_batch_size_and_lr as vbs

    for method in ("linear", "sqrt", "none"):
        for n in (1, 7, 32, 100):
            assert scale_lr(3e-4, n, 32, method) == pytest.approx(vbs.scale_lr(32, n, 3e-4, method), rel=1e-12)
    assert scale_lr(1e-4, 64, 16, "linear") == pytest.approx(4e-4)
    assert scale_lr(1e-4, 64, 16, "sqrt") == pytest.approx(2e-4)
    with pytest.raises(UserError, match="lr_scaling_method"):
        scale_lr(1e-4, 1, 1, "log")


def warmup(opt):
    from deepspeed.runtime.lr_schedules import WarmupLR

    return WarmupLR(opt, warmup_min_lr=1e-5, warmup_max_lr=1e-4, warmup_num_steps=4, warmup_type="linear")


def sgd(lr=1e-4):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def applied_lrs(lr, opt, sizes, set_size=True):
    """The LR each update used, with the calls in the order the loader and DeepSpeed's engine make them
    (set_size False: a scheduler that knows the sizes itself, or none)."""
    out = []
    for n in sizes:
        if set_size:
            lr.set_batch_size(n)
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        lr.step()
    return out


@pytest.mark.parametrize("method", ["linear", "sqrt", "none"])
def test_each_update_uses_the_schedules_lr_scaled_by_its_batch_size(method):
    sizes = [12, 40, 3, 25, 25, 8]
    plain_opt = sgd()
    unscaled = applied_lrs(warmup(plain_opt), plain_opt, sizes, set_size=False)
    opt = sgd()
    lr = BatchSizeLR(opt, warmup(opt), method, reference=20)
    got = applied_lrs(lr, opt, sizes)
    want = [scale_lr(u, n, 20, method) for u, n in zip(unscaled, sizes)]
    assert got == pytest.approx(want, rel=1e-12)
    assert unscaled[0] < unscaled[-1]  # the warmup advanced underneath, as it does unwrapped


@pytest.mark.parametrize("method", ["linear", "sqrt", "none"])
def test_rates_equal_deepspeeds_variable_batch_size_lr(method):
    # DeepSpeed's VariableBatchSizeLR, given the step sizes up front. With a constant base LR: its wrapper
    # steps a wrapped schedule once at construction (step(0)), which would put a warmup one iteration ahead
    # of the unwrapped schedule; ours leaves the schedule's own sequence (test above).
    from deepspeed.runtime.data_pipeline.data_sampling import variable_batch_size_and_lr as vbs

    sizes = [12, 40, 3, 25, 25, 8]
    ds_opt = sgd()
    ds_lr = vbs.lr_scheduler_for_variable_batch_size(20, sizes, None, ds_opt, lr_scaling_method=method)
    theirs = applied_lrs(ds_lr, ds_opt, sizes, set_size=False)
    opt = sgd()
    assert applied_lrs(BatchSizeLR(opt, None, method, reference=20), opt, sizes) == pytest.approx(theirs, rel=1e-12)


def test_constant_lr_and_state_round_trip():
    opt = sgd(2e-4)
    lr = BatchSizeLR(opt, None, "sqrt", reference=4)
    assert applied_lrs(lr, opt, [16, 1]) == pytest.approx([4e-4, 1e-4])
    opt2 = sgd()
    lr2 = BatchSizeLR(opt2, warmup(opt2), "linear", reference=10)
    applied_lrs(lr2, opt2, [10, 10])
    state = lr2.state_dict()
    opt3 = sgd()
    lr3 = BatchSizeLR(opt3, warmup(opt3), "linear", reference=10)
    lr3.load_state_dict(json.loads(json.dumps(state)))  # plain data
    assert applied_lrs(lr3, opt3, [5, 20]) == pytest.approx(applied_lrs(lr2, opt2, [5, 20]), rel=1e-12)
    with pytest.raises(UserError, match="LR scheduler state"):
        lr.load_state_dict(state)  # saved with a wrapped schedule, this one has none


# ----------------------------------------------------------------------------------------------------
# The loader in one process (a stand-in engine: dp = 1, ZeRO-0)


class ShapeDataset(torch.utils.data.Dataset):
    """Any map-style Dataset: a tensor whose length is the sample's frame count, and its index."""

    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return {"x": torch.full((self.samples[i].frames,), float(i)), "i": i}


def stand_in_engine(section, G=2, lr=1e-4):
    opt = sgd(lr)
    return SimpleNamespace(gradient_accumulation_steps=lambda: G, zero_optimization_stage=lambda: 0,
                           train_batch_size=lambda: G, optimizer=opt, lr_scheduler=None,
                           _config=SimpleNamespace(_param_dict={"data_efficiency": {"seed": 1, "data_sampling": {
                               "adaptive_load": {"profile": PROFILE, "policy": "balanced", **section}}}}))


def test_loader_yields_weighted_steps_covering_the_epoch_and_resumes():
    from ds_adaptiveload import get_dataloader_and_lr_scheduler

    samples = make_mix("tiny", 30, seed=0)
    engine = stand_in_engine({"lr_scaling_method": "linear", "lr_reference_batch_size": 10})
    loader, lr = get_dataloader_and_lr_scheduler(engine, ShapeDataset(samples), samples)
    assert engine.lr_scheduler is lr and lr.base is None and lr.reference == 10
    _, again = get_dataloader_and_lr_scheduler(engine, ShapeDataset(samples), samples)
    assert engine.lr_scheduler is again and again.base is None  # the original schedule, not a wrapper
    seen = []
    for _ in range(len(loader)):
        step = next(loader)
        assert len(step) == 2 and lr.get_lr()[0] == pytest.approx(1e-4 * step.global_samples / 10)
        for mb in step:
            assert mb.batch["i"].tolist() == mb.indices  # the Dataset's items, default_collate'd
            assert mb.weight == (0.0 if mb.pad else pytest.approx(2 / step.global_samples))  # D*G/N, D = 1
            seen += [] if mb.pad else mb.indices
        engine.optimizer.step()
        lr.step()
    assert sorted(seen) == list(range(30))  # one epoch trains every sample once
    state = loader.state_dict()
    after = [mb.indices for mb in next(loader)]
    fresh, _ = get_dataloader_and_lr_scheduler(stand_in_engine({}), ShapeDataset(samples), samples)
    fresh.load_state_dict(json.loads(json.dumps(state)))
    assert [mb.indices for mb in next(fresh)] == after


def test_loss_applies_weighting_and_weight():
    from ds_adaptiveload import get_dataloader_and_lr_scheduler

    samples = make_mix("tiny", 12, seed=0)
    loader, _ = get_dataloader_and_lr_scheduler(stand_in_engine({"loss_weighting": "bell"}), ShapeDataset(samples),
                                                samples, timestep_shift=3.0)
    mb = next(m for m in next(loader) if not m.pad)
    eps, t = mb.noise(torch.zeros(len(mb.indices), 4))
    ref_eps, ref_t = flow.draw_noise(torch.zeros(len(mb.indices), 4), mb.indices, seed=1, epoch=0, shift=3.0)
    assert torch.equal(t, ref_t) and torch.equal(eps, ref_eps)  # data_efficiency.seed 1
    losses = torch.rand(len(mb.indices))
    want = (losses * flow.timestep_weight(t, "bell", 3.0)).sum() * mb.weight
    assert float(mb.loss(losses, t)) == pytest.approx(float(want), rel=1e-6)
    with pytest.raises(UserError, match="the timesteps are needed"):
        mb.loss(losses)


def test_refusals_name_the_key():
    from ds_adaptiveload import get_dataloader_and_lr_scheduler

    samples = make_mix("tiny", 8, seed=0)
    with pytest.raises(UserError, match="adaptive_load.on_oom"):
        get_dataloader_and_lr_scheduler(stand_in_engine({"on_oom": "skip"}), ShapeDataset(samples), samples)
    with pytest.raises(UserError, match="differ in length"):
        get_dataloader_and_lr_scheduler(stand_in_engine({}), ShapeDataset(samples[:5]), samples)
    # packed (the default) with a Dataset that torch's default_collate would have to stack in mixed shapes
    with pytest.raises(UserError, match="adaptive_load.policy to \"balanced\""):
        get_dataloader_and_lr_scheduler(stand_in_engine({"policy": "packed"}), ShapeDataset(samples), samples)


class FailingDataset(ShapeDataset):
    """ShapeDataset whose sample `bad` is bad input on rank `rank` only (a shard one node reads damaged)."""

    def __init__(self, samples, bad, rank):
        super().__init__(samples)
        self.bad, self.rank = bad, rank

    def __getitem__(self, i):
        if i == self.bad and self.rank == 1:
            raise UserError(f"shard.safetensors: sample {i} latent has 1 NaN/Inf value(s)")
        return super().__getitem__(i)


def _agreeing_worker(rank, world, port, out):
    """Read every step of an epoch; the error each rank ends with, in out/rank<R>.json."""
    import torch.distributed as dist

    from ds_adaptiveload import get_dataloader_and_lr_scheduler
    from ds_adaptiveload.train.failures import AgreedError

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    samples = make_mix("tiny", 16, seed=0)
    loader, _ = get_dataloader_and_lr_scheduler(stand_in_engine({}), FailingDataset(samples, 5, rank), samples)
    got = None
    try:
        for _ in range(len(loader)):
            next(loader)
    except AgreedError as e:
        got = {"error": str(e), "code": e.code}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(got, f)


def test_a_bad_sample_on_one_rank_ends_every_rank_with_the_same_error(tmp_path):
    """The loader API agrees each step's read over ranks: rank 1's bad sample raises the same AgreedError (exit code 2)
    on both ranks in the same step. Before, rank 1 raised alone and rank 0 went on into the step's collectives."""
    spawn_ranks(_agreeing_worker, 2, master_port(), str(tmp_path))
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert got[0] == got[1] and got[0]["code"] == 2, got
    assert re.fullmatch(r"rank 1: shard.safetensors: sample 5 latent has 1 NaN/Inf value\(s\)", got[0]["error"]), got


def test_import_stays_torch_free():
    code = "import sys, ds_adaptiveload; assert 'torch' not in sys.modules; ds_adaptiveload.get_dataloader_and_lr_scheduler"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))


# ----------------------------------------------------------------------------------------------------
# examples/train_diffusers_wan.py: 2 ranks, ZeRO-3; the step's gradient is the weighted mean-loss gradient


def load_example():
    spec = importlib.util.spec_from_file_location("train_diffusers_wan", os.path.join(ROOT, "examples",
                                                                                      "train_diffusers_wan.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def launch_example(out, *extra):
    """`deepspeed --num_gpus 2 examples/train_diffusers_wan.py ...` -> the finished process."""
    env = launcher_env()
    return subprocess.run([DEEPSPEED, "--num_gpus", "2", "--master_port", str(master_port()),
                           "examples/train_diffusers_wan.py", "--output", str(out), *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def run_example(out, *extra):
    """The example's step lines (step, loss, samples, lr) of a run that must succeed."""
    proc = launch_example(out, *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return re.findall(r"^step (\d+) loss (\S+) samples (\d+) lr (\S+)$", proc.stdout, re.M)




@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """The example for 2 steps, dumping the last step's gradient; leaves its checkpoint in out/checkpoints."""
    out = tmp_path_factory.mktemp("example") / "run"
    dump = out.parent / "grads.pt"
    return out, dump, run_example(out, "--steps", "2", "--dump-grads", str(dump))


@needs_launcher
def test_diffusers_example_gradient_equals_one_big_batch(two_steps):
    from ds_adaptiveload.data.latents import LatentDataset
    from ds_adaptiveload.schedule.geometry import Geometry
    from ds_adaptiveload.schedule.manifest import load_manifest

    out, dump, lines = two_steps
    assert [int(s) for s, *_ in lines] == [1, 2]
    for _, loss, n, lr in lines:  # linear scaling, reference 16, constant base LR 1e-4
        assert float(loss) > 0 and float(lr) == pytest.approx(1e-4 * int(n) / 16, rel=1e-5)

    ex = load_example()
    d = torch.load(dump)
    ids0, ids1 = d["indices"]
    assert not set(ids0) & set(ids1) and len(ids0) + len(ids1) == int(lines[-1][2])
    manifest = str(out / "data" / "manifest.jsonl")
    samples = load_manifest(manifest)
    dataset = LatentDataset(samples, manifest, Geometry(), ex.TEXT_LEN, ex.MODEL["text_dim"])
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(**ex.MODEL)
    model.load_state_dict(d["params"])
    total = 0
    for i in ids0 + ids1:  # one sample at a time: independent of how the run grouped them
        b = dataset.__getitems__([i])
        eps, t = flow.draw_noise(b["latent"], [i], seed=0, epoch=0, shift=5.0)
        total = total + (ex.flow_loss(model, b["latent"], b["text"], eps, t) * flow.timestep_weight(t, "bell", 5.0)).sum()
    (total / len(ids0 + ids1)).backward()
    for name, p in model.named_parameters():
        got, want = d["grads"][name], p.grad
        err = (got - want).norm() / want.norm().clamp_min(1e-12)
        assert err < 1e-4 or (got - want).abs().max() < 1e-8, (name, float(err))
    assert sum(p.grad.norm() > 0 for p in model.parameters()) > len(d["grads"]) // 2


@needs_launcher
def test_diffusers_example_resumes_where_it_stopped(two_steps, tmp_path):
    out, _, first = two_steps
    resumed = run_example(out, "--steps", "3", "--resume")
    straight = run_example(tmp_path / "straight", "--steps", "3")
    assert [int(s) for s, *_ in resumed] == [3]
    assert first[0][2:] == straight[0][2:] and resumed[0][2:] == straight[2][2:]  # same samples, same LR
    assert float(resumed[0][1]) == pytest.approx(float(straight[2][1]), rel=1e-5)


@needs_launcher
def test_diffusers_example_trains_on_bf16_shards(two_steps, tmp_path):
    """`encode` writes bf16 latents and text; the example's fp32 engine stopped on them with "mat1 and mat2 must have
    the same dtype". The same data as the fp32 run's, rounded to bf16: the same samples and LR, the loss within the
    rounding."""
    from ds_adaptiveload.data.latents import write_synthetic

    ex = load_example()
    manifest = write_synthetic(str(tmp_path / "data"), make_mix("tiny", 48, seed=0), text_dim=ex.MODEL["text_dim"],
                               max_text_len=ex.TEXT_LEN, dtype="bf16")
    lines = run_example(tmp_path / "run", "--steps", "2", "--data", manifest)
    _, _, fp32 = two_steps
    assert [int(s) for s, *_ in lines] == [1, 2] and [x[2:] for x in lines] == [x[2:] for x in fp32]
    for (_, loss, _, _), (_, want, _, _) in zip(lines, fp32):
        assert float(loss) == pytest.approx(float(want), rel=0.02)


@needs_launcher
def test_diffusers_example_ends_every_rank_with_one_error(tmp_path):
    """A manifest that does not exist: one `error:` line naming it, exit 2, no traceback from either rank."""
    proc = launch_example(tmp_path / "run", "--steps", "1", "--data", str(tmp_path / "missing.jsonl"))
    errors = [x for x in proc.stderr.splitlines() if "error:" in x]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-5000:]
    assert len(errors) == 1 and errors[0].startswith("error: ") and "missing.jsonl" in errors[0], proc.stderr[-5000:]
