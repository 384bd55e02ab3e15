"""A training step's error messages (each names the step, the rank and the samples with their manifest line),
and the gradient poisoning that skips a step on every rank. failures.py agrees on them across ranks."""


def where(sample, manifest) -> str:
    shard = sample.extra.get("shard")
    return f"{shard + ', ' if shard else ''}{manifest}:{sample.line}"


def bad_sample_message(step, rank, bad, hint=True) -> str:
    """bad: [(sample id, reason)] of this rank's step, the reasons naming shard, sample and manifest line."""
    more = f" (and {len(bad) - 1} more: {', '.join(i for i, _ in bad[1:4])})" if len(bad) > 1 else ""
    tip = '; set adaptive_load.on_bad_sample "skip" to skip such steps' if hint else ""
    return f"step {step}, rank {rank}: {bad[0][1]}{more}{tip}"


def oom_message(step, rank, g, batch, samples, manifest, profile, sp, err) -> str:
    """The micro-batch that ran out of memory, with what the profile predicted for it."""
    s = samples[batch["index"][0]]
    B, S = len(batch["index"]), profile.geometry.tokens(s.frames, s.height, s.width)
    S_gpu = -(-S // sp)
    mem = profile.memory
    pred_mem = ""
    if "bytes_per_token" in mem:
        gib = (mem.get("fixed_bytes", 0) + mem["bytes_per_token"] * B * S_gpu) / 2**30
        pred_mem = f", predicted {gib:.1f} GiB"
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return (f"step {step}, rank {rank}: out of memory in micro-batch {g} (B={B}, frames={s.frames}, "
            f"{s.height}x{s.width}, {S} tokens/sample, {B * S_gpu} tokens/GPU; profile predicts "
            f"{profile.micro_ms(B, S_gpu):.0f} ms{pred_mem}, budget_tokens {profile.budget_tokens}; "
            f"samples {', '.join(batch['ids'][:4])}{' ...' if B > 4 else ''} ({where(s, manifest)})): "
            f"{first[:200]}")


OOM_HINT = ('; set adaptive_load.on_oom "skip" to skip such steps, or lower memory.budget_tokens / use '
            '--checkpoint-blocks')


def _nonfinite(seen):
    for ids, index, per_sample, _ in seen:
        for sid, i, v in zip(ids, index, per_sample.tolist()):
            if v != v or v in (float("inf"), float("-inf")):
                yield sid, i


def nonfinite_samples(seen, samples, manifest) -> list:
    """'id: non-finite loss (shard, manifest:line)' for this rank's samples whose loss is NaN/Inf."""
    return [f"{sid}: non-finite loss ({where(samples[i], manifest)})" for sid, i in _nonfinite(seen)]


def nonfinite_message(step, rank, seen, samples, manifest):
    """This rank's part of the agreed error, or None when its losses are finite."""
    mine = [f"{sid} ({where(samples[i], manifest)})" for sid, i in _nonfinite(seen)]
    if not mine:
        return None
    return (f"step {step}: non-finite loss on rank {rank} for sample(s) {', '.join(mine)}; stopped before "
            f"the optimizer update")


def poison_gradients(engine) -> None:
    """Make this step's gradient norm NaN, so ZeRO-3's step() takes its overflow path on every rank (the
    norm is all-reduced): gradients discarded, optimizer state and LR schedule untouched, global_steps and
    skipped_steps counted. A plain zero_grad would still let AdamW decay its moments and step its count."""
    import torch
    from deepspeed.utils import safe_get_local_grad, safe_set_local_grad

    for p in engine.module.parameters():
        g = safe_get_local_grad(p)
        if g is not None and g.numel():
            safe_set_local_grad(p, torch.full_like(g, float("nan")))
            return
