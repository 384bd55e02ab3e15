"""bench/model/fa4_shapes.py on the CPU: the calls it makes cover every per-sample shape of the mixes, at one sample
and at a micro-batch's worth."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench", "model"))
import fa4_shapes  # noqa: E402
from ds_adaptiveload.schedule.geometry import Geometry  # noqa: E402
from ds_adaptiveload.schedule.mixes import make_mix  # noqa: E402


def test_every_shape_of_the_mixes_at_one_and_a_micro_batchs_worth():
    shapes = fa4_shapes.shapes_of(["video-heavy", "image-heavy"], 70000)
    drawn = {Geometry().tokens(s.frames, s.height, s.width) for mix in ("video-heavy", "image-heavy")
             for s in make_mix(mix, 3000)}
    assert drawn == set(shapes)  # 3,000 draws reach each of the 18 shapes
    assert shapes[1560][1] == [1, 44] and shapes[75600][1] == [1]  # 44 images fill 70,000 tokens; a 720p clip alone
    assert all(ns[0] == 1 and ns[-1] * s <= 70000 for s, (_, ns) in shapes.items() if s <= 70000)
