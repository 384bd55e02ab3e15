"""Synthetic dataset mixes of realistic shapes, shared by the benchmarks, tests and `synthesize`.

video-heavy (by sample count; by tokens it is dominated by clips):
  30% images        480x832, 832x480, 720x1280, 1024x1024            1,560 - 4,096 tokens
  30% 480p clips    480x832 or 832x480, 17/33/49/65/81 frames         7,800 - 32,760 tokens
  20% 720p clips    720x1280, 17/33/49/81 frames                     18,000 - 75,600 tokens
  20% long low-res  240x416 or 320x576, 121/161/241 frames           12,090 - 43,920 tokens

image-heavy (the shapes of video-heavy, most samples images: an image-video pretraining mix):
  70% images, 15% 480p clips, 10% 720p clips, 5% long low-res clips
"""
import random
from types import MappingProxyType

from ds_adaptiveload.schedule.manifest import Sample

_NO_EXTRA = MappingProxyType({})  # shared and read-only: 10M synthetic samples need no dict each

MIXES = {
    "video-heavy": [
        (0.30, [(1, 480, 832), (1, 832, 480), (1, 720, 1280), (1, 1024, 1024)]),
        (0.30, [(f, h, w) for f in (17, 33, 49, 65, 81) for h, w in ((480, 832), (832, 480))]),
        (0.20, [(f, 720, 1280) for f in (17, 33, 49, 81)]),
        (0.20, [(f, h, w) for f in (121, 161, 241) for h, w in ((240, 416), (320, 576))]),
    ],
    "image-heavy": [
        (0.70, [(1, 480, 832), (1, 832, 480), (1, 720, 1280), (1, 1024, 1024)]),
        (0.15, [(f, h, w) for f in (17, 33, 49, 65, 81) for h, w in ((480, 832), (832, 480))]),
        (0.10, [(f, 720, 1280) for f in (17, 33, 49, 81)]),
        (0.05, [(f, h, w) for f in (121, 161, 241) for h, w in ((240, 416), (320, 576))]),
    ],
    # Small shapes for CPU smoke runs with the tiny model.
    "tiny": [
        (0.5, [(1, 64, 64), (1, 64, 96)]),
        (0.5, [(5, 64, 64), (9, 64, 64), (5, 96, 64)]),
    ],
}


def make_mix(name: str, n: int, seed: int = 0) -> list:
    """n samples drawn from the named mix: class by its weight, then a shape uniformly within it."""
    if name not in MIXES:
        raise ValueError(f"unknown mix {name!r}; choose from {', '.join(MIXES)}")
    rng = random.Random(f"mix/{name}/{seed}")
    weights, shapes = zip(*MIXES[name])
    out = []
    for i in range(n):
        f, h, w = rng.choice(rng.choices(shapes, weights)[0])
        out.append(Sample(f"{name}-{i:07d}", f, h, w, _NO_EXTRA))
    return out
