"""The calibration's result as a CostProfile: the fitted terms rounded for reading, the dual over the
calibrated range, provenance (meta) and the comment header; CostProfile.to_yaml writes it."""
import datetime
import math
import os
import sys
from dataclasses import replace

from ds_adaptiveload.calibrate.fit import TIME_FLOOR_Q
from ds_adaptiveload.calibrate.report import dual_report
from ds_adaptiveload.schedule.geometry import Geometry
from ds_adaptiveload.schedule.profile import CostProfile, derive_dual
from ds_adaptiveload.train.config import zero_stage


def build_profile(geometry, coef, step_fixed, mem, capacity, safety, budget, meta, fit, dual_range=None,
                  dual_sizes=None, pin_dual=False, blocks=None, host_link=None) -> CostProfile:
    """The profile of fitted terms: coef = (fixed, per_token, per_token_sq[, floor]) in ms, mem = (fixed_bytes,
    bytes_per_token[, bytes_per_sample]) of the training run or None, budget in tokens, meta and fit as
    written. With dual_range (s_lo, s_hi) the dual fitted there is reported under fit.dual (its error at
    dual_sizes), and written into `dual:` with pin_dual. blocks: calibrate/blocks.derive's open-block fields
    (memory and time_ms.recompute_frac), their runs reported under fit.open_blocks. host_link:
    calibrate/host_link.host_link_fields' memory.host_link_bytes_per_s, its medians under fit.host_link."""
    floor = _r(coef[3]) if len(coef) > 3 and coef[3] else 0.0
    memory = {"budget_tokens": int(budget), "safety": safety}  # the memory section, in the order written
    if mem:
        memory.update(fixed_bytes=int(mem[0]), bytes_per_token=_r(mem[1]))
        if len(mem) > 2 and mem[2]:
            memory.update(bytes_per_sample=_r(mem[2]), sample_tokens=_r(mem[2] / mem[1]))
    if capacity:
        memory["capacity_bytes"] = int(capacity)
    if blocks:
        memory.update(blocks["memory"])
        fit = {**fit, "open_blocks": blocks["points"]}
    if host_link:
        memory.update(host_link["memory"])
        fit = {**fit, "host_link": host_link["fit"]}
    prof = CostProfile(fixed_ms=_r(coef[0]), per_token_ms=_r(coef[1]), per_token_sq_ms=_r(coef[2]),
                       step_fixed_ms=_r(step_fixed), floor_ms=floor, floor_q=TIME_FLOOR_Q if floor else math.inf,
                       budget_tokens=int(budget), sample_tokens=memory.get("sample_tokens", 0.0),
                       geometry=Geometry(tuple(geometry.vae_stride), tuple(geometry.patch_size)),
                       memory=memory, meta=meta, header=header(meta),
                       **{k: v for k, v in (blocks or {}).get("time_ms", {}).items()
                          if k in ("recompute_frac", "attention_recompute_frac", "ffn_recompute_frac")})
    if dual_range:
        # The paper's B * s^p <= M_comp over the calibrated range (profile.derive_dual's convention). Pinned
        # in `dual:` only on request: without it the planner derives it for each dataset's own range.
        p, m_comp = derive_dual(prof, *dual_range)
        fit = {**fit, "dual": {"p": _r(p), "m_comp": _r(m_comp), "s_range": list(dual_range),
                               "vs_time_model": dual_report(prof, (p, m_comp), dual_sizes or dual_range)}}
        if pin_dual:
            prof = replace(prof, dual_p=_r(p), dual_m_comp=_r(m_comp))
    prof.fit = fit
    return prof


def _r(v, digits=5):
    """Round to `digits` significant digits (keeps the YAML readable)."""
    return float(f"{v:.{digits}g}") if v else 0.0


def header(meta):
    """The profile's comment header: how it was made and how to read it."""
    how = ("ESTIMATED from model FLOPs and memory arithmetic (no measurement)" if meta.get("estimated")
           else f"measured on {meta.get('device', '?')}")
    return (f"Cost profile written by `python -m ds_adaptiveload calibrate` ({meta.get('date', '')}), {how}.\n"
            f"Model {meta.get('model_config', '?')}, DeepSpeed config {meta.get('deepspeed_config', '?')}.\n"
            "time_ms: forward+backward of one micro-batch of B samples of s per-GPU tokens\n"
            "  = (floor^q + line^q)^(1/q), line = fixed + per_token * B*s + per_token_sq * B*s^2,\n"
            "  q = floor_q (none: the hard max);\n"
            "  step_fixed once per optimizer step.\n"
            "memory.budget_tokens = (capacity_bytes * safety - fixed_bytes) / bytes_per_token; a micro-batch holds\n"
            "  B * (s + sample_tokens) <= budget_tokens (sample_tokens = bytes_per_sample / bytes_per_token).\n"
            "dual: B * s^p <= m_comp, derived from the time model (profile.derive_dual). fit: per-point errors.")


def lora_meta(cfg, lora) -> dict:
    """meta.lora of a LoRA profile: the settings and the adapters' parameter count (schedule/zero.lora_of)."""
    return {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets),
            "params": cfg.lora_params(lora.rank, lora.modules())}


def run_meta(cfg, ds, args, sp, world):
    """Provenance both modes record: model and DeepSpeed config, parallelism, versions, date."""
    import importlib.metadata as md

    def ver(name):
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    zero = zero_stage(ds)  # meta.zero_stage: what the trainer compares its run's stage with (train/setup.py)
    dtype = "bf16" if ds.get("bf16", {}).get("enabled") else "fp16" if ds.get("fp16", {}).get("enabled") else "fp32"
    return {"model_config": args.model_config, "model": {"dim": cfg.dim, "ffn_dim": cfg.ffn_dim,
            "num_heads": cfg.num_heads, "num_layers": cfg.num_layers, "params": cfg.num_params()},
            "deepspeed_config": args.deepspeed_config, "zero_stage": zero, "dtype": dtype, "sp": sp,
            "world_size": world, "checkpoint_blocks": bool(args.checkpoint_blocks),
            "compile_blocks": getattr(args, "compile_blocks", None) or "none",
            "attention": getattr(args, "attention", "sdpa"),
            **({"lora": lora_meta(cfg, args.lora)} if getattr(args, "lora", None) else {}),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": ver("torch"), "deepspeed": ver("deepspeed"), "python": sys.version.split()[0],
            "ln_modulate": os.environ.get("DS_ADAPTIVELOAD_LN_MODULATE", "auto")}
