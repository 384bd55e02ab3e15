"""ZeRO memory accounting (pure, no torch): a cost profile's memory moved to another run's ZeRO stage and world size.

A profile's memory.fixed_bytes holds one rank's share of the training state for the run it was calibrated for
(meta.zero_stage, meta.train_world_size). With bf16 and Adam that state is 16 bytes per parameter: bf16 weights 2,
bf16 grads 2, fp32 master weights and Adam's m and v 12 (the ZeRO paper's accounting). Stage 1 shards the 12 over
the ranks, stage 2 the grads too, stage 3 the weights too; the rest is whole on every rank. A LoRA run (adaptive_load.lora)
holds its frozen base as bf16 weights only, 2 bytes per parameter (sharded under ZeRO-3 alone), and the 16 bytes for
its adapters' parameters: the 14B model with rank-32 adapters on every projection holds 31.0 GB on one GPU, where
full training would hold 229 GB. A run on another number
of ranks, or under another stage, holds a different share, so its fixed bytes and its token budget differ by

    delta = state_bytes(params, stage, world) - state_bytes(params, meta.zero_stage, meta.train_world_size)

fixed_bytes + delta, and budget_tokens - delta / bytes_per_token (the budget is linear in the fixed bytes). This is
what `calibrate --train-world-size` does when it writes a profile; for_run does it when the run differs. Across
stages it leaves out the stage's own buffers (ZeRO-3's prefetch and gathered parameters, ZeRO-2's buckets): on the
H200 the 1.3B model's fixed bytes on one GPU were 23.0 GB under ZeRO-3 and 23.6 GB under ZeRO-2 against 23.0 GB
accounted for both; and the time terms stay the calibrated stage's.
"""
import dataclasses
import math

from ds_adaptiveload.errors import UserError

STATE_BYTES_PER_PARAM = 16
# Bytes per parameter each rank holds as its 1/world share, by ZeRO stage; the other 16 - n are whole on every rank.
ZERO_SHARDED_BYTES = {0: 0, 1: 12, 2: 14, 3: STATE_BYTES_PER_PARAM}


WEIGHT_BYTES = 2  # a frozen bf16 weight


def state_bytes(params: float, stage: int, world: int, lora=None) -> float:
    """One rank's bytes of weights, grads and Adam state under ZeRO `stage` over `world` ranks (bf16 + Adam); lora:
    the adapters' parameter count of a LoRA run, whose `params` base weights are frozen (weights only)."""
    if lora is not None:
        frozen = WEIGHT_BYTES * params / (world if stage == 3 else 1)
        return frozen + state_bytes(lora, stage, world)
    if stage not in ZERO_SHARDED_BYTES:
        raise UserError(f"ZeRO stage must be one of 0-3, got {stage!r}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise UserError(f"world size must be a positive int, got {world!r}")
    sharded = ZERO_SHARDED_BYTES[stage]
    return (STATE_BYTES_PER_PARAM - sharded) * params + sharded * params / world


def calibrated_for(profile):
    """(params, zero_stage, train_world_size) the profile's memory was written for, or None when its meta or memory
    cannot say (hand-written and tiny profiles): then for_run leaves the profile as it is."""
    meta, mem = profile.meta, profile.memory
    params = (meta.get("model") or {}).get("params") if isinstance(meta.get("model"), dict) else None
    stage, world = meta.get("zero_stage"), meta.get("train_world_size")
    numbers = (params, mem.get("fixed_bytes"), mem.get("bytes_per_token"))
    if (stage not in ZERO_SHARDED_BYTES or isinstance(world, bool) or not isinstance(world, int) or world < 1
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in numbers)):
        return None
    return params, stage, world


def lora_of(profile):
    """The adapters' parameter count a profile was calibrated with (meta.lora.params; calibrate --lora-rank), or
    None for a profile of full training."""
    lora = profile.meta.get("lora")
    params = lora.get("params") if isinstance(lora, dict) else None
    return params if isinstance(params, int) and not isinstance(params, bool) and params > 0 else None


def for_run(profile, zero_stage, world: int, source: str = "profile", lora=None) -> tuple:
    """(profile, notes): the profile with memory.fixed_bytes and budget_tokens moved to a run of `world` ranks under
    ZeRO `zero_stage` (None: the profile's own stage; module docstring), its meta.zero_stage and train_world_size set to the run's and the old
    values under meta.rescaled_from; notes are lines for the user saying what moved, and, across stages, what the
    accounting leaves out. lora: the run's adapter parameter count (None: full training); a profile of full training
    moved to a LoRA run loses the optimizer state and gradients of its base, and the reverse gains them. The profile itself when it already matches or cannot say (calibrated_for)."""
    known = calibrated_for(profile)
    if known is None:
        return profile, []
    params, stage0, world0 = known
    zero_stage = stage0 if zero_stage is None else zero_stage
    lora0 = lora_of(profile)
    if (stage0, world0, lora0) == (zero_stage, world, lora):
        return profile, []
    held = state_bytes(params, zero_stage, world, lora)
    delta = held - state_bytes(params, stage0, world0, lora0)
    mem = profile.memory
    budget = math.floor(profile.budget_tokens - delta / mem["bytes_per_token"])
    if budget < 1:
        raise UserError(f"{source}: under ZeRO-{zero_stage} on {world} rank(s) each rank holds "
                        f"{held / 2**30:.1f} GiB of model and optimizer state, "
                        f"which leaves no memory for tokens (the profile's budget is {profile.budget_tokens:,} tokens "
                        f"for ZeRO-{stage0} on {world0}); use more ranks or a higher ZeRO stage")
    fixed = mem["fixed_bytes"] + delta
    moved = dataclasses.replace(
        profile, budget_tokens=budget, memory={**mem, "fixed_bytes": round(fixed), "budget_tokens": budget},
        meta={**profile.meta, "zero_stage": zero_stage, "train_world_size": world, "lora": {"params": lora},
              "rescaled_from": {"zero_stage": stage0, "train_world_size": world0, "lora": {"params": lora0},
                                "fixed_bytes": mem["fixed_bytes"], "budget_tokens": profile.budget_tokens}})
    if lora is None:
        moved.meta.pop("lora")
    kind = (lambda n: f"LoRA ({n:,} adapter parameters)" if n else "full training")
    what = f", {kind(lora0)} to {kind(lora)}" if lora != lora0 else ""
    notes = [f"{source}: memory moved from ZeRO-{stage0} on {world0} rank(s) to this run's ZeRO-{zero_stage} on "
             f"{world}{what}: fixed bytes {mem['fixed_bytes'] / 2**30:.2f} -> {fixed / 2**30:.2f} GiB, budget "
             f"{profile.budget_tokens:,} -> {budget:,} tokens per micro-batch (docs/calibration.md, \"Other runs\")"]
    if zero_stage != stage0:
        notes.append(f"{source}: its time terms were measured under ZeRO-{stage0} and the memory move leaves out each "
                     f"stage's own buffers: calibrate with this config for exact predictions")
    return moved, notes
