"""Open-block probes (pure, no torch): what a block left un-checkpointed costs in memory and saves in time.

`--checkpoint-blocks auto` (schedule/memory.py) checkpoints only as many blocks as a micro-batch's predicted peak
needs, from memory.block_bytes_per_token and block_bytes_per_sample (what an open block adds per token and per
sample over a checkpointed one) and, under the attention policy, attention_bytes_per_token (what a checkpointed
block that keeps its attention outputs adds). time_ms.recompute_frac is the share of a fully checkpointed
micro-batch's fwd+bwd that the recompute takes. calibrate measures them here: a few fitted points that ran with
every block checkpointed run again with none (and one with the attention policy, and once more with every block
keeping its FFN output too: memory.ffn_bytes_per_token, time_ms.ffn_recompute_frac), and the differences give the
fields. Two points, one clip (B = 1) and one of several samples, separate the per-token and per-sample terms.
"""
from dataclasses import replace

from ds_adaptiveload.calibrate.fit import FLOOR_MARGIN

# An open model's peak per token and per sample is taken to be at most this many times the checkpointed one's when
# choosing points that fit with every block open (the 1.3B model on an H200: 10x per token, 8x per sample).
OPEN_GROWTH = 16.0
# Seconds the grid leaves for these runs (at most OPEN_RESERVE_FRAC of the budget): on an H200 with the 1.3B model
# a 480p 81f clip and 16 images open, the clip with the attention policy, each a warm-up and 3 timed steps: ~25 s;
# the clip keeping its FFN outputs too, ~8 s more.
OPEN_RESERVE_S, OPEN_RESERVE_FRAC = 40.0, 0.1
MAX_RECOMPUTE_FRAC = 0.9  # the time model's bound: recompute_factor needs recompute_frac < 1


def open_bound(p, mem) -> float:
    """A bound on point p's peak with every block open: fixed + OPEN_GROWTH x (its tokens' and samples' bytes);
    mem is fit.fit_memory's (fixed, per token, floor, per sample)."""
    fixed, per_token, _, per_sample = mem
    return fixed + OPEN_GROWTH * (per_token * p.tokens + per_sample * p.B)


def choose_points(points, mem, limit) -> list:
    """The fitted points to run with every block open: the B = 1 point with the most tokens, and the point of
    several samples with the most samples (of the shortest shape), each with open_bound(p) <= limit bytes. The
    second is dropped when it cannot separate the per-sample term (its tokens per sample equal the first's)."""
    ok = [p for p in points if p.status == "ok" and p.role == "fit" and p.peak_bytes and open_bound(p, mem) <= limit]
    clips = [p for p in ok if p.B == 1]
    multi = [p for p in ok if p.B > 1]
    chosen = [max(clips, key=lambda p: p.tokens)] if clips else []
    if multi:
        m = max(multi, key=lambda p: (p.B, -p.s))
        if not chosen or m.s != chosen[0].s:
            chosen.append(m)
    return chosen


def open_point(p, role="open"):
    """A copy of fitted point p to measure again (no times or peak yet), with `role` (open | attention |
    attention-ffn)."""
    return replace(p, role=role, status="pending", ms=[], step_ms=[], peak_bytes=None, reserved_bytes=None,
                   fwd_bwd_peak_bytes=None, note="")


def ckpt_peak(c, mem) -> float:
    """The checkpointed point's fwd+bwd peak: as measured before its optimizer step (grid.Point.fwd_bwd_peak_bytes),
    else its step peak, or, where that is the floor (the optimizer step's peak, higher than a small micro-batch's
    fwd+bwd), the fitted line without the floor. Against the floor the open and attention runs' extra bytes came out
    too small: on the H200 (1.3B model, ZeRO-2) the clip's step peaked at the 31.29 GB floor where its fwd+bwd line
    gives 28.76 GB, which put attention_bytes_per_token at 2,716 instead of about 5,300 and end-to-end peaks
    10-12 GiB above the model (docs/history/benchmarks.md, 2026-12-03)."""
    if getattr(c, "fwd_bwd_peak_bytes", None):
        return c.fwd_bwd_peak_bytes
    if mem is None:
        return c.peak_bytes
    fixed, per_token, floor, per_sample = mem
    if c.peak_bytes > floor * FLOOR_MARGIN:
        return c.peak_bytes
    return min(c.peak_bytes, fixed + per_token * c.tokens + per_sample * c.B)


def _fwd_bwd(o) -> float:
    """An open or attention run's fwd+bwd peak where measured, else its step peak (far above the floor there)."""
    return getattr(o, "fwd_bwd_peak_bytes", None) or o.peak_bytes


def derive(pairs, num_layers, attention=None, mem=None, ffn=None) -> dict:
    """The profile fields from (checkpointed point, the same point open) pairs and, optionally, (checkpointed,
    attention-policy) for one point and (checkpointed, attention-policy with every FFN output kept) for the same
    point. Per open block: (open - checkpointed fwd+bwd peak) / L = per_token * tokens + per_sample * B, solved
    non-negatively (fit.nnls; one pair: per_sample 0); mem: fit.fit_memory's (fixed, per token, floor, per sample),
    for ckpt_peak. recompute_frac = 1 - open ms / checkpointed ms of the pair with the most tokens;
    attention_recompute_frac = 1 - attention-policy ms / checkpointed ms (at most recompute_frac); the FFN fields
    from the FFN run against the attention run (_ffn_fields). Returns {"memory": {...}, "time_ms": {...},
    "points": [...]}."""
    from ds_adaptiveload.calibrate.fit import nnls

    L = num_layers
    ran = [(c, o) for c, o in pairs if o.status == "ok" and o.peak_bytes and c.peak_bytes]
    out = {"memory": {}, "time_ms": {}, "points": [_row(c, o) for c, o in pairs]}
    if not ran:
        return out
    rows = [[c.tokens, c.B] if len(ran) > 1 else [c.tokens] for c, _ in ran]
    y = [max(0.0, _fwd_bwd(o) - ckpt_peak(c, mem)) / L for c, o in ran]
    coef = nnls(rows, y, [1.0 / max(v, 1.0) for v in y])  # relative: the clip's and the images' errors alike
    out["memory"]["block_bytes_per_token"] = round(float(coef[0]))
    out["memory"]["block_bytes_per_sample"] = round(float(coef[1])) if len(coef) > 1 else 0
    c, o = max(ran, key=lambda pair: pair[0].tokens)
    if c.median_ms and o.median_ms:
        out["time_ms"]["recompute_frac"] = round(min(MAX_RECOMPUTE_FRAC, max(0.0, 1.0 - o.median_ms / c.median_ms)), 4)
    if attention is not None:
        c, a = attention
        out["points"].append(_row(c, a))
        if a.status == "ok" and a.peak_bytes and c.peak_bytes:
            extra = max(0.0, _fwd_bwd(a) - ckpt_peak(c, mem))
            out["memory"]["attention_bytes_per_token"] = round(extra / (L * c.tokens))
        if a.status == "ok" and c.median_ms and a.median_ms:
            # every block kept its attention: what that saved is attention's share of the recompute (at most all of it)
            saved = max(0.0, 1.0 - a.median_ms / c.median_ms)
            saved = min(saved, out["time_ms"].get("recompute_frac", saved))
            out["time_ms"]["attention_recompute_frac"] = round(saved, 4)
        if ffn is not None:
            out["points"].append(_row(*ffn))
            _ffn_fields(out, a, ffn, L)
    return out


def _ffn_fields(out, a, ffn, L) -> None:
    """memory.ffn_bytes_per_token = (FFN run's - attention run's fwd+bwd peak) / (L * tokens), and
    time_ms.ffn_recompute_frac = (attention ms - FFN ms) / checkpointed ms, at most what the attention policy leaves
    of the recompute; nothing unless both runs ran."""
    c, f = ffn
    if not (a.status == "ok" and f.status == "ok" and a.peak_bytes and f.peak_bytes):
        return
    out["memory"]["ffn_bytes_per_token"] = round(max(0.0, _fwd_bwd(f) - _fwd_bwd(a)) / (L * c.tokens))
    if c.median_ms and a.median_ms and f.median_ms:
        left = out["time_ms"].get("recompute_frac", 1.0) - out["time_ms"].get("attention_recompute_frac", 0.0)
        saved = max(0.0, (a.median_ms - f.median_ms) / c.median_ms)
        out["time_ms"]["ffn_recompute_frac"] = round(min(saved, max(left, 0.0)), 4)


def _row(c, o) -> dict:
    """One report row: the point, both peaks and times, and the status of the second run."""
    return {"role": o.role, "B": c.B, "shape": list(c.shape), "tokens": c.tokens, "status": o.status,
            "ckpt_peak_bytes": c.peak_bytes, "peak_bytes": o.peak_bytes, "ckpt_ms": c.median_ms, "ms": o.median_ms,
            **({"ckpt_fwd_bwd_peak_bytes": c.fwd_bwd_peak_bytes} if getattr(c, "fwd_bwd_peak_bytes", None) else {}),
            **({"fwd_bwd_peak_bytes": o.fwd_bwd_peak_bytes} if getattr(o, "fwd_bwd_peak_bytes", None) else {}),
            **({"note": o.note} if o.note else {})}
