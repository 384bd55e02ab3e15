"""Synthetic dataset mixes of realistic shapes, shared by the benchmarks, tests and `synthesize`.

video-heavy (by sample count; by tokens it is dominated by clips):
  30% images        480x832, 832x480, 720x1280, 1024x1024            1,560 - 4,096 tokens
  30% 480p clips    480x832 or 832x480, 17/33/49/65/81 frames         7,800 - 32,760 tokens
  20% 720p clips    720x1280, 17/33/49/81 frames                     18,000 - 75,600 tokens
  20% long low-res  240x416 or 320x576, 121/161/241 frames           12,090 - 43,920 tokens

image-heavy (the shapes of video-heavy, most samples images: an image-video pretraining mix):
  70% images, 15% 480p clips, 10% 720p clips, 5% long low-res clips

Held-out mixes, shaped after published dataset statistics (the shares within them are our assumptions):
openvid-720p: OpenVid-1M (Nan et al., ICLR 2025, arXiv:2407.02371: 1M+ clips of many aspect ratios, 433K of them
  1080p in OpenVidHD-0.4M) bucketed as Open-Sora does, to 12 aspect ratios of about 720x1280's area. 60% clips of
  41-81 frames (72 shapes of 38,016-75,600 tokens: each fills a micro-batch of 75,693 tokens alone), 25% clips
  of 17-33 frames, 15% images, all in those buckets.
worldmodel: bimodal, as world-model training: 20% long 480p windows (81/121/161 frames of 832x480), 80% short
  low-resolution action clips shaped like Language-Table's episodes (LeRobot conversions: 442,226 episodes of
  7,045,476 frames at 10 fps, 256x256, 15.9 frames each; the simulated set 181,020 episodes of 4,484,403 frames,
  360x640, 24.8 each): 17-25 frames at 256x256 and 352x640.
panda-web: Panda-70M (Chen et al., CVPR 2024, arXiv:2402.19479: 70.7M clips, 167 khrs, a mean of 8.5 s, cut from
  720p HD-VILA-100M videos), at 16 fps most clips fill an 81-frame window: 45% 81-frame clips at 720p and 480p in
  three aspect ratios, 30% shorter ones (17-65 frames), 25% web images of six sizes (512-1024 px a side).
"""
import random
from types import MappingProxyType

from ds_adaptiveload.schedule.manifest import Sample

_NO_EXTRA = MappingProxyType({})  # shared and read-only: 10M synthetic samples need no dict each

# (height, width) of 12 aspect-ratio buckets (9:21 to 21:9) of 3,456-3,600 latent patches a frame, multiples of 16
_AR_720P = [(720, 1280), (1280, 720), (944, 944), (816, 1088), (1088, 816), (768, 1152), (1152, 768),
            (624, 1456), (1456, 624), (672, 1344), (1344, 672), (848, 1056)]

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
    "openvid-720p": [
        (0.60, [(f, h, w) for f in (41, 49, 57, 65, 73, 81) for h, w in _AR_720P]),
        (0.25, [(f, h, w) for f in (17, 25, 33) for h, w in _AR_720P]),
        (0.15, [(1, h, w) for h, w in _AR_720P]),
    ],
    "worldmodel": [
        (0.20, [(f, 480, 832) for f in (81, 121, 161)]),
        (0.80, [(f, h, w) for f in (17, 21, 25) for h, w in ((256, 256), (352, 640))]),
    ],
    "panda-web": [
        (0.45, [(81, h, w) for h, w in ((720, 1280), (480, 832), (832, 480))]),
        (0.30, [(f, h, w) for f in (17, 33, 49, 65) for h, w in ((720, 1280), (480, 832), (832, 480))]),
        (0.25, [(1, h, w) for h, w in ((512, 512), (768, 768), (1024, 1024), (576, 1024), (1024, 576), (768, 1024))]),
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
