"""`python -m ds_adaptiveload calibrate`: measure the real training step and write a cost profile.

    python -m ds_adaptiveload calibrate --model-config configs/wan_1_3b.yaml \
        --deepspeed_config configs/ds_zero3_bf16.json --out profile.yaml            # on a GPU
    python -m ds_adaptiveload calibrate --model-config configs/wan_1_3b.yaml \
        --deepspeed_config configs/ds_zero3_bf16.json --out profile.yaml --estimate  # no GPU: analytic
    deepspeed --num_gpus 2 --no_local_rank --module ds_adaptiveload calibrate --model-config \
        configs/wan_1_3b.yaml --deepspeed_config configs/ds_zero3_bf16_sp2.json --out profile.yaml  # Ulysses sp=2
    (--no_local_rank: the launcher would put --local_rank=N before the subcommand, which the CLI rejects.)

Measured mode runs the step exactly as the trainer does (deepspeed.initialize with the JSON: ZeRO stage,
bf16, optimizer; per-block activation checkpointing; the fused LN-modulate op through the model; Ulysses
when launched on k ranks with sequence_parallel_size k; the flow-matching loss of train/flow.py) on a grid
of (B, S) shapes, times forward+backward and the optimizer step separately (medians after a warm-up),
records the peak memory of every point, and fits

    time_ms(B, s) = smax(floor, fixed + per_token * B*s + per_token_sq * B*s^2)   (s = per-GPU tokens)
    peak_bytes(B, s) = max(floor, fixed_bytes + bytes_per_token * B*s + bytes_per_sample * B)
    budget_tokens = (capacity * safety - fixed_bytes) / bytes_per_token
    sample_tokens = bytes_per_sample / bytes_per_token    (a micro-batch holds B * (s + sample_tokens) <= budget)

An out-of-memory point is caught, excluded from the fit and recorded as a bound. Held-out shapes (not
fitted) are measured too and their prediction error is reported; so are held-out packed micro-batches of
mixed shapes (--packs), predicted as the planner costs them (fit.packed). docs/calibration.md explains the
choices.

Modules: cli (the command), grid (points and their measuring order), fit (time and memory fits, budget),
probe (budget probes), packs (the packed validation), report (predictions beside measurements), estimate
(--estimate, the sp conversion), result (the CostProfile written), host_link (pinned host <-> device copy
bandwidth, CUDA only), measure (`Calibration`: the measured run),
engine (DeepSpeed glue: engine, micro-step, OOM recovery). All but measure and engine are pure (no torch),
so they are tested on synthetic timings (tests/test_calibrate.py, tests/test_calibrate_packed.py). The names below are re-exported for tests and bench scripts.
"""
from ds_adaptiveload.calibrate.estimate import estimate_profile, sp_profile, sp_terms
from ds_adaptiveload.calibrate.fit import (TIME_FLOOR_Q, ZERO_BYTES_PER_PARAM, ZERO_SHARDED_BYTES, budget_tokens,
                                           fit_memory, fit_time, nnls, predict_ms, predict_peak, rel_err, sample_tokens,
                                           train_fixed_bytes)
from ds_adaptiveload.calibrate.grid import (BATCHES, GRID_SHAPES, HELDOUT_SHAPES, Point, grid_points, measure_point,
                                            time_schedule)
from ds_adaptiveload.calibrate.packs import (PACKS, Pack, build_packs, measure_packs, pack_rows, packed_summary,
                                             verdict)
from ds_adaptiveload.calibrate.probe import budget_after_oom, budget_probes, probe_point
from ds_adaptiveload.calibrate.report import err_summary, report
from ds_adaptiveload.calibrate.result import build_profile

__all__ = ["BATCHES", "GRID_SHAPES", "HELDOUT_SHAPES", "PACKS", "Pack", "Point", "TIME_FLOOR_Q",
           "ZERO_BYTES_PER_PARAM", "ZERO_SHARDED_BYTES",
           "budget_after_oom", "budget_probes", "budget_tokens", "build_packs",
           "build_profile", "err_summary", "estimate_profile", "fit_memory", "fit_time", "grid_points",
           "measure_packs", "measure_point", "nnls", "pack_rows", "packed_summary", "predict_ms", "predict_peak",
           "probe_point", "rel_err", "report", "sample_tokens", "sp_profile", "sp_terms", "time_schedule",
           "train_fixed_bytes", "verdict"]
