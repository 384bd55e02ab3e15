"""Token geometry: how many transformer tokens a sample of F frames at H x W pixels becomes.

Rules (Wan 2.1): the causal video VAE keeps the first frame and compresses each following group of
`vae_stride[0]` frames into one latent frame, so it only accepts F = 4n+1 frames; height and width are
divided by the spatial stride and then by the patch size. We do not round silently: a sample that the
VAE/patch grid does not divide is an error naming it, because rounding here would make the planner's
token count disagree with the latents the trainer later loads. `python -m ds_adaptiveload manifest` is
where real videos are cut to 4n+1 frames and resized to the grid.
"""
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Geometry:
    vae_stride: tuple = (4, 8, 8)
    """VAE compression in (frames, height, width)."""
    patch_size: tuple = (1, 2, 2)
    """DiT patch size in latent (frames, height, width)."""

    def check(self, frames: int, height: int, width: int) -> None:
        st, sh, sw = self.vae_stride
        _, ph, pw = self.patch_size
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (frames, height, width)):
            raise ValueError(f"frames/height/width must be integers, got {frames!r}, {height!r}, {width!r}")
        if frames < 1 or height < 1 or width < 1:
            raise ValueError(f"frames/height/width must be positive, got {frames}x{height}x{width}")
        if (frames - 1) % st:
            raise ValueError(f"frames={frames} is not of the form {st}n+1 (the VAE needs it; "
                             f"the nearest valid counts are {frames - (frames - 1) % st} and "
                             f"{frames - (frames - 1) % st + st})")
        for name, v, grid in (("height", height, sh * ph), ("width", width, sw * pw)):
            if v % grid:
                raise ValueError(f"{name}={v} is not a multiple of {grid} (VAE stride x patch size)")

    def latent_shape(self, frames: int, height: int, width: int) -> tuple:
        self.check(frames, height, width)
        st, sh, sw = self.vae_stride
        return ((frames - 1) // st + 1, height // sh, width // sw)

    def tokens(self, frames: int, height: int, width: int) -> int:
        f, h, w = self.latent_shape(frames, height, width)
        pt, ph, pw = self.patch_size
        return math.ceil(f / pt) * (h // ph) * (w // pw)


def per_gpu_tokens(tokens: int, sp: int) -> int:
    """Ulysses sequence parallelism splits a sample over `sp` GPUs; the sequence is padded to a
    multiple of sp, so each GPU holds ceil(S / sp) tokens."""
    return -(-tokens // sp)
