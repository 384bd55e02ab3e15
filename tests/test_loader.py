"""AdaptiveLoader (ds_adaptiveload/loader.py): its Steps carry the plan's decisions, single process, no engine."""
import pytest

from ds_adaptiveload.data import latents as data
from ds_adaptiveload.loader import AdaptiveLoader, Settings
from ds_adaptiveload.schedule.geometry import per_gpu_tokens
from ds_adaptiveload.schedule.memory import checkpoint_plan
from ds_adaptiveload.schedule.planner import PlanConfig
from ds_adaptiveload.schedule.profile import CostProfile
from ds_adaptiveload.schedule.sampler import AdaptiveSampler
from ds_adaptiveload.train import flow
from test_data import GEO, synth

L = 4


def _loader(tmp_path, mode):
    """Rank 0 of 2 data-parallel ranks, G = 2, packed, with a memory model whose capacity makes counts differ."""
    path, samples = synth(tmp_path, num=24)
    profile = CostProfile.load("configs/profiles/tiny-cpu.yaml")
    sampler = AdaptiveSampler(samples, profile, PlanConfig("packed", 2, grad_accum=2, lockstep=True, checkpoint=mode), 0)
    sizes = sorted(sum(GEO.tokens(samples[i].frames, samples[i].height, samples[i].width) for i in mb)
                   for step in sampler.plan.steps for mbs in step for mb in mbs)
    memory = {"capacity_bytes": 5 * sizes[len(sizes) // 2], "safety": 1.0, "bytes_per_token": 1,
              "block_bytes_per_token": 2}
    ds = data.LatentDataset(samples, path, GEO, text_len=16, text_dim=8)
    loader = AdaptiveLoader(sampler, ds, data.first, {"num_workers": 0}, 3, None, Settings(0, 5.0, "none"),
                            memory_model=(memory, L))
    return loader, sampler, samples, memory


def _cost(mb, samples):
    return sum(per_gpu_tokens(GEO.tokens(samples[i].frames, samples[i].height, samples[i].width), 1)
               for i in mb), len(mb)


@pytest.mark.parametrize("mode", ["auto", "auto-step"])
def test_the_loaders_steps_carry_the_plans_decisions(tmp_path, mode):
    """Each Step of an epoch holds the planned samples of this rank, their tokens, the loss weight (0 for a pad), and
    the checkpoint counts: under auto each micro-batch's own (they differ here), under auto-step (ZeRO-3) the
    step's largest over both ranks on every micro-batch; state_dict points after the step handed out."""
    loader, sampler, samples, memory = _loader(tmp_path, mode)
    plan, seen = sampler.plan, set()
    for n in range(len(loader)):
        step = next(loader)
        assert step.step == n and loader.state_dict()["next_step"] == n + 1
        assert [mb.indices for mb in step] == plan.steps[n][0]
        assert step.pad == [m for m in range(2) if (n, 0, m) in plan.pad]
        weight = flow.loss_scale(3, 2, step.global_samples)
        for m, mb in enumerate(step):
            assert mb.batch["index"] == mb.indices
            assert mb.tokens == [GEO.tokens(samples[i].frames, samples[i].height, samples[i].width)
                                 for i in mb.indices]
            assert mb.weight == (0.0 if m in step.pad else weight)
            own = checkpoint_plan(*_cost(mb.indices, samples), memory, L)
            if mode == "auto":
                assert mb.checkpoint == own
            else:
                k = max(checkpoint_plan(*_cost(x, samples), memory, L)[0] for mbs in plan.steps[n] for x in mbs)
                assert mb.checkpoint == (k, k, 0) and k >= own[0]
            seen.add(mb.checkpoint)
    assert len(seen) > 1, "the counts differ between micro-batches or steps"


def test_without_a_memory_model_the_model_keeps_its_count(tmp_path):
    """A loop that checkpoints a fixed count (no memory model, or the plan's checkpoint "all") gets no counts."""
    loader, *_ = _loader(tmp_path, "all")
    assert all(mb.checkpoint is None for mb in next(loader))
    loader.memory_model = None
    assert all(mb.checkpoint is None for mb in next(loader))


def test_offload_counts_ride_with_the_checkpoint_counts(tmp_path):
    """activation_offload n under auto: each micro-batch's counts are offload_blocks' (k, k_full, k_ffn, n), n <= k;
    the freed input bytes (dim x 2 per token and block) leave some micro-batch with fewer checkpointed blocks."""
    from ds_adaptiveload.schedule.offload import offload_blocks

    loader, sampler, samples, memory = _loader(tmp_path, "auto")
    # a block input (dim 1, bf16) is 2 of the 8 bytes per token every block checkpointed keeps; 3 of them free what
    # an open block adds (6)
    memory.update(capacity_bytes=2 * memory["capacity_bytes"], bytes_per_token=8, block_bytes_per_token=6)
    loader.offload = (3, 1)
    fewer = False
    for _ in range(len(loader)):
        for mb in next(loader):
            tokens, n = _cost(mb.indices, samples)
            assert mb.checkpoint == offload_blocks(tokens, n, memory, L, 3, 2.0)
            assert mb.checkpoint[3] <= mb.checkpoint[0]
            fewer |= mb.checkpoint[0] < checkpoint_plan(tokens, n, memory, L)[0]
    assert fewer
