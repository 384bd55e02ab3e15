"""--val-data MANIFEST --val-every N: a held-out flow-matching loss that is comparable across steps, runs and world
sizes. Every sample is evaluated at the same VAL_TIMESTEPS timesteps, spread over [0, 1] (no shift), with one noise
drawn from a generator seeded by the sample's id; so a sample's loss depends only on the weights.

Samples are spread over the data-parallel ranks by cost (tokens, longest first to the least loaded rank), and every
rank runs as many forwards as the busiest one (a zero-cost stand-in where it has none left): under ZeRO-3 each
forward gathers parameters with every rank. Per-sample losses are gathered and summed in id order, so the result
does not depend on which rank computed what.
"""
import hashlib

from ds_adaptiveload.errors import UserError

VAL_TIMESTEPS = 8


def timesteps(n: int = VAL_TIMESTEPS) -> list:
    """n timesteps at the centres of n equal parts of [0, 1]: 1/16, 3/16, ..., 15/16 for n = 8."""
    return [(k + 0.5) / n for k in range(n)]


def id_seed(seed: int, sample_id: str) -> int:
    """A 63-bit seed from the run's seed and a sample id (stable across processes, unlike hash())."""
    h = hashlib.sha256(f"{seed}/{sample_id}".encode()).digest()
    return int.from_bytes(h[:8], "little") & (2**63 - 1)


def assign(costs: list, ranks: int) -> list:
    """Sample indices per rank: longest first to the least loaded rank (ties: the lower rank)."""
    loads, out = [0] * ranks, [[] for _ in range(ranks)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(ranks), key=lambda r: (loads[r], r))
        out[r].append(i)
        loads[r] += costs[i]
    return out


class Validation:
    """The held-out set of one run: its samples, this rank's share, and the loss at the current weights."""

    def __init__(self, manifest: str, model_cfg, geometry, dims, seed: int):
        from ds_adaptiveload.data import latents as data
        from ds_adaptiveload.schedule.manifest import load_manifest

        samples = load_manifest(manifest, geometry)
        if not samples:
            raise UserError(f"--val-data {manifest}: no samples")
        data.check_samples(samples, manifest, geometry, model_cfg.text_dim, "error")
        self.samples, self.dims, self.seed, self.model_cfg = samples, dims, seed, model_cfg
        self.dataset = data.LatentDataset(samples, manifest, geometry, model_cfg.text_len, model_cfg.text_dim)
        shares = assign([geometry.tokens(s.frames, s.height, s.width) for s in samples], dims.dp)
        self.mine, self.slots = shares[dims.dp_rank], max(len(s) for s in shares)

    def sample_losses(self, engine, i: int, *, device, dtype, seq_shard=None) -> list:
        """The loss of sample i at each of the timesteps (one forward each, batch 1, as training's memory allows)."""
        import torch

        from ds_adaptiveload.train import flow

        batch = self.dataset.__getitems__([i])
        x0 = batch["latent"].to(device, dtype)
        text = batch["text"].to(device, dtype)
        g = torch.Generator().manual_seed(id_seed(self.seed, self.samples[i].id))
        eps = torch.randn(x0.shape, generator=g).to(device)
        return [float(flow.flow_matching_loss(engine, x0, text, eps, torch.tensor([t], device=device),
                                              seq_shard=seq_shard)[0]) for t in timesteps()]

    def stand_in(self, engine, *, device, dtype, seq_shard=None) -> None:
        """A forward of a one-token sample, result unused: the collectives of a forward without its cost."""
        import torch

        from ds_adaptiveload.data.latents import LATENT_CHANNELS

        x = torch.zeros(1, LATENT_CHANNELS, 1, 2, 2 * self.dims.sp, device=device, dtype=dtype)
        text = torch.zeros(1, 1, self.model_cfg.text_dim, device=device, dtype=dtype)
        engine(x, torch.zeros(1, device=device), text, seq_shard=seq_shard)

    def run(self, engine, *, device, dtype, seq_shard=None) -> dict:
        """Collective. {"val_loss": mean over samples and timesteps, "val_loss_t": mean per timestep}."""
        import torch
        import torch.distributed as dist

        mine = {}
        was_training = engine.module.training
        engine.module.eval()
        with torch.no_grad():
            for slot in range(self.slots):
                if slot < len(self.mine):
                    i = self.mine[slot]
                    losses = self.sample_losses(engine, i, device=device, dtype=dtype, seq_shard=seq_shard)
                    mine[self.samples[i].id] = losses
                else:
                    for _ in timesteps():
                        self.stand_in(engine, device=device, dtype=dtype, seq_shard=seq_shard)
        engine.module.train(was_training)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        per_sample = {}
        for d in everyone:
            per_sample.update(d)  # SP peers report the same sample with the same values
        rows = [per_sample[k] for k in sorted(per_sample)]
        per_t = [sum(r[k] for r in rows) / len(rows) for k in range(len(timesteps()))]
        return {"val_loss": sum(per_t) / len(per_t), "val_loss_t": per_t}
