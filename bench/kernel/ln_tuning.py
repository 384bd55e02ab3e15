"""Benchmark-only kernel choices of the fused LayerNorm-Modulate op, for A-B comparison in tests and bench/kernel.

Not part of the installed package: the op's defaults are what users run, and its setters exist only in the bench
build (ds_adaptiveload/ops/builder.TUNING_ENV=1), which importing this module selects for the process; the op must
not have been loaded before. The choices are process-wide state of the
compiled module, so set them through `tuned(...)`, which restores the previous choices on exit. Per direction
(forward, backward): variant 0 = default (compile-time tiles where they apply, else the general kernels),
1 = the general kernels only, 2 = the 2026-11-29 baseline kernels; tile = an index into fast_tiles() (-1: the
default for D); stages = rows staged ahead by cp.async (-1 / 0: off). batch_path: "auto" (the tiles over the
flat row space: the forward at every B, the backward for B >= 2), "grid" (the per-sample grid (C, B) of 2026-11-30
at every B), "flat" (the backward also at B = 1).
waves: the flat row space's forward grid in waves of resident CTAs (0, the default: the op's rule, several waves).
"""
from __future__ import annotations

from contextlib import contextmanager

import os

from ds_adaptiveload.ops.builder import TUNING_ENV
from ds_adaptiveload.ops.layernorm_modulate import load_op, op_error

os.environ[TUNING_ENV] = "1"

BATCH_PATHS = {"auto": 0, "grid": 1, "flat": 2}
DEFAULTS = {"variant": (0, 0), "tile": (-1, -1), "stages": (-1, -1), "batch_path": "auto", "waves": 0}


def _op():
    op = load_op()
    if op is None:
        raise RuntimeError(f"ln_modulate tuning: the CUDA op did not load ({op_error()})")
    if not hasattr(op, "_set_tuning"):
        raise RuntimeError(f"ln_modulate tuning: the op in this process was built without its setters; import "
                           f"ln_tuning (or set {TUNING_ENV}=1) before the op first loads")
    return op


def get() -> dict:
    """The current choices, in the keys of DEFAULTS."""
    variant, tile, stages, batch, waves = _op()._get_tuning()
    names = {v: k for k, v in BATCH_PATHS.items()}
    return {"variant": tuple(variant), "tile": tuple(tile), "stages": tuple(stages), "batch_path": names[batch],
            "waves": waves}


def set_choices(**kw) -> None:
    """Change some choices (keys of DEFAULTS; pairs are (forward, backward)), keeping the others."""
    unknown = set(kw) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"ln_modulate tuning: unknown choices {sorted(unknown)}; expected {sorted(DEFAULTS)}")
    cur = {**get(), **kw}
    if cur["batch_path"] not in BATCH_PATHS:
        raise ValueError(f"ln_modulate tuning: batch_path {cur['batch_path']!r} not in {sorted(BATCH_PATHS)}")
    _op()._set_tuning(list(cur["variant"]), list(cur["tile"]), list(cur["stages"]), BATCH_PATHS[cur["batch_path"]],
                      int(cur["waves"]))


@contextmanager
def tuned(**kw):
    """with tuned(variant=(2, 2)): ... runs the block with those choices, then restores the previous ones."""
    before = get()
    set_choices(**kw)
    try:
        yield
    finally:
        set_choices(**before)


def fast_tiles(backward: bool) -> list[tuple[int, int, int, int]]:
    """The compile-time tiles (D, vpt, wpr, rows ahead), the default per D first."""
    return [tuple(t) for t in _op()._fast_tiles(backward)]
