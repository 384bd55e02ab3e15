"""Flow matching as Wan 2.1 trains, and the loss normalization that makes a step's gradient independent
of how its samples are split over ranks and micro-batches.

  x_t = (1 - t) x0 + t eps,   target v = eps - x0,   loss = MSE(model(x_t, 1000 t, ctx), v)
  t = s u / (1 + (s - 1) u),  u ~ U(0, 1),  shift s = 5 by default

The shift moves t towards 1 (more noise): the median t is s/(s+1) = 0.83 for s = 5 instead of 0.5.
High-resolution video has redundant pixels, so at a given t more signal survives than in a small image;
shifting keeps training on the noisy end where the structure is decided (Wan, SD3).

Noise and t of a sample come from a generator seeded by (seed, epoch, sample index), so they do not
depend on the rank, the micro-batch or whether the run was resumed, and SP peers draw the same values.
"""
import math

import torch

from ds_adaptiveload.errors import UserError


def shift_t(u: torch.Tensor, shift: float) -> torch.Tensor:
    """Wan's timestep shift of uniform u in [0, 1)."""
    return shift * u / (1 + (shift - 1) * u)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed per (seed, epoch, sample); splitmix64 mixing so nearby indices are unrelated."""
    x = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) & (2**63 - 1)


def _draw_one(shape, seed: int, device):
    """(u, eps) of one sample: u first, then eps, from one generator seeded per sample."""
    g = torch.Generator(device=device).manual_seed(seed)
    u = torch.rand((), generator=g, device=device)
    return u, torch.randn(shape, generator=g, device=device)


def draw_noise(x0: torch.Tensor, indices, seed: int, epoch: int, shift: float):
    """eps like x0 and t [B] (fp32), one generator per sample."""
    eps = torch.empty(x0.shape, dtype=torch.float32, device=x0.device)
    u = torch.empty(x0.shape[0], dtype=torch.float32, device=x0.device)
    for b, i in enumerate(indices):
        u[b], eps[b] = _draw_one(x0.shape[1:], sample_seed(seed, epoch, i), x0.device)
    return eps, shift_t(u, shift)


def draw_noise_packed(x0s, indices, seed: int, epoch: int, shift: float):
    """Packed form of draw_noise: a list of eps (fp32, each like its x0 [C, F, H, W]) and t [n]. A sample
    gets the same noise and t as draw_noise gives it in a one-shape batch."""
    if len(x0s) != len(indices):
        raise UserError(f"draw_noise_packed: {len(x0s)} latents but {len(indices)} sample indices")
    draws = [_draw_one(x.shape, sample_seed(seed, epoch, i), x.device) for x, i in zip(x0s, indices)]
    u = torch.stack([d[0] for d in draws]) if draws else torch.empty(0)
    return [d[1] for d in draws], shift_t(u, shift)


def flow_matching_loss(model, x0, context, eps, t, **model_kwargs) -> torch.Tensor:
    """Per-sample MSE [B] (fp32) of the velocity prediction. x0, eps: [B, C, F, H, W]; t in [0, 1]."""
    x0f = x0.float()
    tb = t.view(-1, *([1] * (x0.ndim - 1)))
    xt = (1 - tb) * x0f + tb * eps
    pred = model(xt.to(x0.dtype), t * 1000, context, **model_kwargs)
    return (pred.float() - (eps - x0f)).pow(2).flatten(1).mean(1)


def packed_flow_matching_loss(model, x0s, contexts, eps, t, **model_kwargs) -> torch.Tensor:
    """Per-sample MSE [n] (fp32) of one packed forward. x0s, eps: lists of [C, F_i, H_i, W_i]; contexts:
    list of [L_i, text_dim]; t [n] in [0, 1]. Sample i's loss equals flow_matching_loss on it alone."""
    n = len(x0s)
    if not (len(eps) == len(contexts) == n and t.shape == (n,)):
        raise UserError(f"packed_flow_matching_loss: {n} latents, {len(eps)} noises, {len(contexts)} contexts, "
                        f"t of shape {tuple(t.shape)}: all must hold one entry per sample")
    xts, targets = [], []
    for x0, e, ti in zip(x0s, eps, t):
        x0f = x0.float()
        xts.append(((1 - ti) * x0f + ti * e).to(x0.dtype))
        targets.append(e - x0f)
    # One output tensor whatever n (WanModel.forward's flat): ZeRO-3 hooks each output tensor in backward.
    flat = model(xts, t * 1000, contexts, flat=True, **model_kwargs)
    preds = flat.split([v.numel() for v in targets])
    return torch.stack([(p.float() - v.flatten()).pow(2).mean() for p, v in zip(preds, targets)])


def loss_scale(grad_divisor: int, grad_accum: int, global_samples: int) -> float:
    """Factor for a micro-batch's *sum* of per-sample losses so that the step's gradient is the gradient
    of the mean loss over the global step's N samples.

    DeepSpeed divides each micro-batch loss by G (gradient_accumulation_steps), sums gradients over the
    ranks and divides by `grad_divisor` (the dp size; see sp.grad_divisor for sequence parallelism), so
    the applied gradient is sum over ranks and micro-batches of grad(loss) / (divisor * G). With
    loss = scale * sum_i l_i and scale = divisor * G / N this is sum over the N samples of grad(l_i) / N.
    N comes from the plan (every rank knows every rank's micro-batches): no communication is needed.
    """
    return grad_divisor * grad_accum / global_samples


# Timestep loss weighting. "bell" follows the weighting of DiffSynth-Studio's Wan training: a Gaussian
# exp(-2 (t - 1/2)^2) in t = timestep / 1000, shifted so that its minimum over the training timesteps is 0
# (at t = 1, pure noise; t = 0 has the same value) and scaled to mean 1 over them. DiffSynth-Studio trains on a grid of 1000
# shifted timesteps and looks the weight up at the nearest one; here t is continuous, so the same curve is
# evaluated at t, normalised over the same grid (uniform u = 1, 0.999, ..., 0.001, shifted), which is the
# distribution draw_noise samples from. With Wan's shift 5 most draws have t > 0.7, so the mean-1 scaling
# puts ~2.1x on t = 0.5 and 1.46x on t = 0.75; the weight falls to 0 towards pure noise.
BELL_GRID = 1000


def bell_normaliser(shift: float) -> float:
    """Mean of exp(-2 (t - 1/2)^2) - exp(-1/2) over the shifted training grid."""
    u = torch.arange(BELL_GRID, 0, -1, dtype=torch.float64) / BELL_GRID
    return float((torch.exp(-2 * (shift_t(u, shift) - 0.5) ** 2) - math.exp(-0.5)).mean())


def timestep_weight(t: torch.Tensor, kind: str, shift: float) -> torch.Tensor:
    """Per-sample loss weights [B] (fp32) for timesteps t in [0, 1]: kind "none" (ones) or "bell"."""
    if kind == "none":
        return torch.ones_like(t, dtype=torch.float32)
    if kind != "bell":
        from ds_adaptiveload.errors import UserError

        raise UserError(f"adaptive_load.loss_weighting must be none or bell, got {kind!r}")
    y = torch.exp(-2 * (t.double() - 0.5) ** 2) - math.exp(-0.5)
    return (y / bell_normaliser(shift)).float()


def weighted_sum(per_sample: torch.Tensor, t, kind: str, shift: float) -> torch.Tensor:
    """sum_i w(t_i) l_i (fp32): the micro-batch's loss sum under adaptive_load.loss_weighting, before the
    loss_scale factor. t may be None only for kind "none"."""
    if kind == "none":
        return per_sample.float().sum()
    if t is None:
        from ds_adaptiveload.errors import UserError

        raise UserError(f"adaptive_load.loss_weighting is {kind!r}: the timesteps are needed, mb.loss(losses, t)")
    return (per_sample.float() * timestep_weight(t, kind, shift).to(per_sample.device)).sum()
