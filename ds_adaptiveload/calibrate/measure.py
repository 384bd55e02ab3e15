"""Measured calibration (torch + DeepSpeed): the grid timed on the real training step, the fits, the budget
probes, the profile they give and its check on held-out packed micro-batches. `Calibration` holds what every
stage reads (engine, points, fits, budget); each stage is a method."""
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, replace

from ds_adaptiveload.calibrate import engine as eng
from ds_adaptiveload.calibrate.blocks import OPEN_RESERVE_FRAC, OPEN_RESERVE_S, choose_points, derive, open_point
from ds_adaptiveload.calibrate.estimate import sp_terms
from ds_adaptiveload.calibrate.fit import (ZERO_BYTES_PER_PARAM, ZERO_SHARDED_BYTES, budget_tokens, fit_memory,
                                           fit_time, train_fixed_bytes)
from ds_adaptiveload.calibrate.grid import grid_points, measure_point, parse_batches, time_schedule
from ds_adaptiveload.calibrate.host_link import host_link_fields
from ds_adaptiveload.calibrate.packs import (PACK_GRID_FRAC, PACK_HEADROOM, PACK_RESERVE_FRAC, PACK_RESERVE_S,
                                             build_packs, measure_packs, pack_rows, pack_seconds, packed_summary)
from ds_adaptiveload.calibrate.probe import (PROBE_ANCHOR_S, PROBE_RESERVE_S, PROBE_RETRY_S, budget_after_oom,
                                             budget_probes)
from ds_adaptiveload.calibrate.report import err_summary, print_packs, print_report, report
from ds_adaptiveload.calibrate.result import build_profile, run_meta
from ds_adaptiveload.errors import UserError
from ds_adaptiveload.train.config import zero_stage
from ds_adaptiveload.schedule.geometry import Geometry
from ds_adaptiveload.schedule.planner import pack_cost

logger = logging.getLogger(__name__)


def measure_profile(cfg, ds, args, shapes, heldout):
    """The measured profile (a CostProfile) on rank 0; None on the other ranks."""
    return Calibration(cfg, ds, args, shapes, heldout).run()


class Calibration:
    """One measured calibration. Several ranks: every step's times and peak are the maximum over ranks (the
    collectives make the slowest rank the step's time), so that every rank holds the same points, fits and
    decisions; only rank 0 writes."""

    def __init__(self, cfg, ds, args, shapes, heldout):
        self.t_start = time.monotonic()
        import torch

        self.cfg, self.ds, self.args = cfg, ds, args
        self.engine, self.dims, seq_shard, self.device, dtype = eng.init_engine(cfg, ds, args)
        self.init_s = time.monotonic() - self.t_start
        self.multi, self.is_main = self.dims.world > 1, self.dims.rank == 0
        self.clock = eng.Clock(self.t_start, self.device if self.multi else None)
        self.deadline = args.time_budget  # on clock(): seconds since start, the same on every rank
        self.geometry = Geometry(patch_size=cfg.patch_size)
        ds_sp = int(ds.get("sequence_parallel_size", 1))
        # One GPU for a config with k > 1: measure full sequences, convert to per-GPU terms (fit_grid).
        self.emulate_sp = ds_sp if self.dims.sp == 1 and ds_sp > 1 else 1
        self.sp_eff = self.dims.sp * self.emulate_sp
        self.train_world = args.train_world_size or max(self.dims.world, self.sp_eff)
        try:
            for sh in list(shapes) + list(heldout):
                self.geometry.check(*sh)
        except ValueError as e:
            raise UserError(f"--shapes/--heldout: {e}") from None
        self.points = grid_points(shapes, heldout, self.geometry, sp=self.dims.sp,
                                  batches=parse_batches(args.batches), probe_tokens=args.probe_tokens)
        self.oom_types = (torch.cuda.OutOfMemoryError,) if self.device.type == "cuda" else ()
        self.step_fn = eng.StepFn(self.engine, cfg, self.geometry, seq_shard, self.device, dtype, args.seed,
                                  self.dims)
        self.capacity = eng.capacity(self.device)
        self.mem = self.mem_doc = self.mem_note = None  # the memory fit, set by fit_grid / memory_budget
        # Seconds kept at the end for the packed validation (packs.PACK_RESERVE_S; none with --packs 0).
        self.pack_reserve = min(PACK_RESERVE_S, PACK_RESERVE_FRAC * self.deadline) if args.packs else 0.0
        self.packs = []
        self.blocks = None  # measure_open_blocks' fields for the profile
        self.host_link = None  # host_link_fields' for the profile

    def run(self):
        """Grid, fits, budget probes, packed validation: the profile on rank 0 (printed, --json written), None
        elsewhere."""
        self.measure_grid()
        budget = self.fit_grid()
        if self.mem and self.capacity and self.args.probe_budget:
            budget = self.probe_budget(budget)
        self.blocks = self.measure_open_blocks()
        self.host_link = host_link_fields(self.device)  # no collective: each rank its own link, rank 0's written
        rows, prof = self.profile(budget)
        prof.fit["packed"] = self.validate_packs(prof)  # every rank: the packs' steps are collective
        prof.fit["elapsed_s"] = round(time.monotonic() - self.t_start, 1)
        if not self.is_main:
            return None
        print_report(rows, prof.fit, prof)
        print_packs(prof.fit["packed"])
        self.write_json(prof.fit)
        return prof

    def measure_grid(self):
        """Time the grid's points in priority order within the time budget, a tqdm bar on rank 0."""
        from tqdm import tqdm

        args, multi = self.args, self.multi
        bar = tqdm(total=len(self.points), desc="calibrate", disable=not self.is_main, dynamic_ncols=True)

        def on_point(p):
            bar.update(1)
            bar.set_postfix_str(f"B={p.B} S={p.S}: {p.status}" + (f" {p.median_ms:.0f} ms" if p.status == "ok" else ""))

        # An OOM on one of several ranks leaves its peers inside a collective (StepFn stops the job then): with
        # several ranks, points the memory fit puts over the budget's memory are skipped instead of tried.
        # The budget probe is one step of a micro-batch filling the memory budget (~20-25 s for the 1.3B model
        # on H200s): the grid leaves it that much time, or the probe would never run within the default budget.
        reserve = (min(PROBE_RESERVE_S + PROBE_ANCHOR_S + (0 if multi else PROBE_RETRY_S), 0.25 * self.deadline)
                   if args.probe_budget and self.capacity else 0.0)
        if args.open_blocks and args.checkpoint_blocks and self.capacity:  # and for the open-block runs
            reserve += min(OPEN_RESERVE_S, OPEN_RESERVE_FRAC * self.deadline)
        time_schedule(self.points, self.step_fn, None, clock=self.clock, oom_types=self.oom_types,
                      repeats=args.repeats, on_point=on_point, deadline=self.deadline - reserve - self.pack_reserve,
                      mem_limit=self.capacity * args.safety if multi and self.capacity else None)
        bar.close()

    def fit_grid(self):
        """Time and memory fits of the grid, the per-GPU terms of the training run, meta; returns the budget."""
        points, args = self.points, self.args
        self.coef = fixed, a, b, floor = fit_time(points)
        if a <= 0 and b <= 0:
            raise UserError("calibrate: the measured times do not grow with tokens (timing noise dominates the "
                            "work): give larger --shapes or --batches")
        self.step_fixed = statistics.median([v for p in points if p.status == "ok" for v in p.step_ms])
        self.mem = fit_memory(points)
        self.oom_tokens = min((p.tokens for p in points if p.status == "oom"), default=None)
        # Per-GPU terms for the training run (a one-GPU measurement of a k-way SP config is converted).
        self.terms = sp_terms(a, b, self.cfg, self.emulate_sp, args.checkpoint_blocks, args.link_gbs)
        if self.mem and self.capacity:
            budget = self.memory_budget()
        else:
            # CPU (no peak memory): the largest micro-batch that ran is the only evidence.
            budget = max(p.tokens for p in points if p.status == "ok")
            self.mem_note = {"note": "no device memory statistics (CPU): budget = largest micro-batch measured"}
        import torch

        device = self.device
        self.meta = {**run_meta(self.cfg, self.ds, args, self.sp_eff, self.dims.world), "estimated": False,
                     "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "train_world_size": self.train_world, "time_budget_s": args.time_budget,
                     "ln_modulate_op": eng.op_state(device)}
        # the training run's per-GPU s of the fitted sizes: the dual's range
        self.sizes = [-(-p.S // self.sp_eff) for p in points if p.status == "ok" and p.role == "fit"]
        return budget

    def memory_budget(self):
        """The training run's budget from the memory fit of the points as they stand (the probes' peaks join
        it), the fixed bytes rescaled to its ZeRO shards (ZERO_SHARDED_BYTES of the config's stage)."""
        self.mem = mem = fit_memory(self.points)
        sharded = ZERO_SHARDED_BYTES.get(zero_stage(self.ds), ZERO_BYTES_PER_PARAM)
        fixed_bytes = train_fixed_bytes(mem[0], self.cfg.num_params(), self.dims.world, self.train_world, sharded)
        lora = getattr(self.args, "lora", None)
        if lora:  # the frozen base holds weights only: the shards move as schedule/zero.state_bytes counts them
            from ds_adaptiveload.schedule.zero import state_bytes

            params, n, stage = self.cfg.num_params(), self.cfg.lora_params(lora.rank, lora.modules()), zero_stage(self.ds)
            fixed_bytes = max(mem[0] - state_bytes(params, stage, self.dims.world, n)
                              + state_bytes(params, stage, self.train_world, n), 0.0)
        self.mem_doc = (fixed_bytes, mem[1], mem[3])
        self.mem_note = {"fixed_bytes_measured": int(mem[0]), "floor_bytes_measured": int(mem[2]),
                         "model": "peak = max(floor, fixed + bytes_per_token * tokens + bytes_per_sample * B)",
                         "measured_world_size": self.dims.world,
                         "train_world_size": self.train_world, "zero_bytes_per_param": sharded,
                         "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")}
        return budget_tokens(self.capacity, self.args.safety, fixed_bytes, mem[1], self.oom_tokens)

    def budget_below(self, p, safety=None):
        """The training budget once micro-batch p ran out of memory (or, with safety 1, up to what p held)."""
        return budget_after_oom(self.capacity, self.args.safety if safety is None else safety, self.mem,
                                self.mem_doc[0], p)

    def probe_budget(self, budget):
        """Check the extrapolated budget where it matters, with micro-batches of the smallest shape filling
        it (probe.budget_probes); returns the budget they leave."""
        args, points = self.args, self.points
        fixed, a, b, _ = self.coef
        small = min((p for p in points if p.status == "ok"), key=lambda p: p.s)
        self._budget = budget  # what _before_probe and _lower_budget start from
        probes = budget_probes(small, points, self.capacity, args.safety, self.step_fn, self.clock,
                               self.deadline - self.pack_reserve,
                               lambda p: (fixed + a * p.tokens + b * p.tokens * p.s + self.step_fixed) / 1000,
                               self.oom_types, retry=not self.multi,
                               before=self._before_probe if self.multi and self.is_main else None)
        self.step_fn.before_exit = None
        budget = self.memory_budget()  # refitted with the probes' peaks
        for p in probes:
            if p.status == "oom":
                budget = min(budget, self.budget_below(p))
        ran = [p for p in probes if p.role == "probe" and p.status == "ok"]
        if ran:  # no larger than what a probe ran: the rest of the budget would be extrapolated
            budget = min(budget, self.budget_below(ran[-1], safety=1.0))
        return budget

    def measure_open_blocks(self):
        """blocks.py: fitted points again with every block open, and the largest clip with the attention policy, then
        with every FFN output kept too, where the trainer allows it (not ZeRO-3), within the time budget;
        blocks.derive's fields, or None."""
        args, L = self.args, self.cfg.num_layers
        if not (args.open_blocks and args.checkpoint_blocks and self.mem and self.capacity):
            return None
        chosen = choose_points(self.points, self.mem, self.capacity * args.safety)
        runs = [(c, open_point(c), 0, "full") for c in chosen]
        if chosen and zero_stage(self.ds) != 3:
            runs += [(chosen[0], open_point(chosen[0], role), L, role) for role in ("attention", "attention-ffn")]
        for c, o, blocks, policy in runs:
            seconds = (1 + args.repeats) * (c.median_ms + statistics.median(c.step_ms)) / 1000
            if self.clock() + 1.2 * seconds > self.deadline - self.pack_reserve:
                o.status, o.note = "skipped", f"time budget (needs ~{seconds:.0f} s)"
                continue
            self.step_fn.set_checkpointing(blocks, policy)
            try:
                measure_point(o, self.step_fn, self.clock, self.oom_types, args.repeats, big_s=5.0)  # as the grid
            finally:
                self.step_fn.set_checkpointing(args.checkpoint_blocks)
        kept = {policy: (c, o) for c, o, _, policy in runs if policy != "full"}
        return derive([(c, o) for c, o, _, policy in runs if policy == "full"], L, kept.get("attention"), self.mem,
                      kept.get("attention-ffn"))

    def _before_probe(self, probe):
        """Several ranks: an OOM in the probe stops the run (StepFn), so the profile is written first."""
        _, prof = self.profile(self._budget)
        prof.fit["budget_probe"] = (f"not run yet: {probe.role} B={probe.B} x s={probe.s} ({probe.tokens} "
                                    "tokens) is next; an out-of-memory there stops a multi-rank run")
        prof.to_yaml(self.args.out)
        logger.info(f"wrote {self.args.out} before the budget probe")
        self.step_fn.before_exit = self._lower_budget

    def _lower_budget(self, p):
        """Rank 0 ran out of memory in the probe: the bound goes into the profile before the exit."""
        p.status, p.note = "oom", "out of memory on rank 0; the run stopped here"
        _, prof = self.profile(min(self._budget, self.budget_below(p)))
        prof.to_yaml(self.args.out)
        self.write_json(prof.fit)
        logger.info(f"wrote {self.args.out} with the budget below the probe's {p.tokens} tokens")

    def profile(self, budget):
        """(report rows, CostProfile) of the fits as they stand, at `budget` tokens."""
        points, args = self.points, self.args
        fixed, a, b, floor = self.coef
        per_token, per_token_sq, a2a = self.terms
        rows = report(points, self.coef, self.mem, self.capacity)
        fit = {
            "method": "NNLS, relative weighting; medians of timed steps after one warm-up"
                      + ("; times and peaks are the maximum over ranks" if self.multi else ""),
            "time_coef_measured": {"fixed": fixed, "per_token": a, "per_token_sq": b, "floor": floor},
            "time_fit": err_summary(rows, "fit"),
            "time_heldout": err_summary(rows, "heldout"),
            "memory_fit": err_summary(rows, "fit", "mem_err"),
            "memory_heldout": err_summary(rows, "heldout", "mem_err"),
            "memory": self.mem_note,
            "oom_bound_tokens": min((p.tokens for p in points if p.status == "oom"), default=None),
            "budget_probe": "; ".join(f"{p.role} B={p.B} x s={p.s} ({p.tokens} tokens): {p.status}"
                                      for p in points if p.role in ("anchor", "probe")) or "not run",
            "points": rows,
            "init_s": round(self.init_s, 1),
            "elapsed_s": round(time.monotonic() - self.t_start, 1),
        }
        if self.emulate_sp > 1:
            fit["sp_from_one_gpu"] = {"k": self.emulate_sp, "all_to_all_ms_per_token": a2a,
                                      "link_gbs": args.link_gbs,
                                      "note": "per_token_sq x k, all-to-all added analytically (not measured)"}
        prof = build_profile(self.geometry, (fixed, per_token, per_token_sq, floor), self.step_fixed, self.mem_doc,
                             self.capacity, args.safety, budget, self.meta, fit,
                             dual_range=(min(self.sizes), max(self.sizes)), dual_sizes=self.sizes,
                             pin_dual=args.pin_dual, blocks=self.blocks, host_link=self.host_link)
        return rows, prof

    def validate_packs(self, prof):
        """Held-out packed micro-batches (packs.build_packs) of the fitted shapes that ran, each within
        PACK_HEADROOM of the memory budget the fit predicts for this run and PACK_GRID_FRAC of the grid's
        largest micro-batch, timed and peaked as the grid was, predicted by the profile as the planner costs a packed
        micro-batch (schedule.planner.pack_cost) and, for memory, at this run's fixed bytes (the profile's
        are the training run's ZeRO-3 shards). fit.packed: the rows and the verdicts against 10% / 5%."""
        args = self.args
        if not args.packs:
            return {"note": "not run (--packs 0)"}
        _, a, b, _ = self.coef
        # A one-GPU measurement of a k-way SP config writes per-GPU terms for k GPUs: this run's steps are
        # predicted by the measured terms in the profile's form.
        run_prof = prof if self.emulate_sp == 1 else replace(prof, per_token_ms=a, per_token_sq_ms=b)
        budget, memory, floor_bytes = prof.budget_tokens, None, 0.0
        if self.mem and self.capacity:
            budget = min(budget, budget_tokens(self.capacity, args.safety, self.mem[0], self.mem[1], self.oom_tokens))
            memory, floor_bytes = {**prof.memory, "fixed_bytes": self.mem[0]}, self.mem[2]
        ok = [p for p in self.points if p.status == "ok" and p.role == "fit"]
        target = min(PACK_HEADROOM * budget, PACK_GRID_FRAC * max(p.B * run_prof.mem_tokens(p.s) for p in ok))
        sp, layers = self.dims.sp, self.cfg.num_layers
        self.packs = build_packs(sorted({p.shape for p in ok}), self.geometry, args.packs, target, sp=sp,
                                 sample_tokens=run_prof.sample_tokens, seed=args.seed)

        def seconds(pk):
            return pack_seconds(pack_cost(run_prof, pk.shapes, sp)[0], self.step_fixed, args.repeats)

        def mem_ok(pk):  # several ranks: an OOM cannot be recovered, so a pack predicted over the limit is not run
            return pack_rows([pk], run_prof, sp, memory, floor_bytes, layers)[0]["pred_bytes"] <= limit

        limit = self.capacity * args.safety if self.multi and memory else None
        measure_packs(self.packs, self.step_fn, self.clock, self.deadline, seconds, self.oom_types, args.repeats,
                      mem_ok if limit else None)
        return packed_summary(
            pack_rows(self.packs, run_prof, sp, memory, floor_bytes, layers), seed=args.seed,
            target_mem_tokens=round(target, 1), budget_tokens_here=int(budget),
            predicted_by="time: schedule.planner.pack_cost (the planner's PackedCtx.mb_ms) of "
                         + ("the profile written" if run_prof is prof else "the measured terms (sp emulated)")
                         + "; memory: schedule.memory.predicted_peak_bytes at this run's fixed bytes, "
                           "max with the fitted floor")

    def write_json(self, fit):
        """--json: meta, the raw points and packs, and the fit report."""
        path = self.args.json
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                json.dump({"meta": self.meta, "points": [asdict(p) for p in self.points],
                           "packs": [asdict(p) for p in self.packs], "fit": fit}, f, indent=1)
