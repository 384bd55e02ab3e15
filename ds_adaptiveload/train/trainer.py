"""The training loop as a class (torchtitan's Trainer): `__init__` builds engine, data and resume state top
to bottom, `train()` orders the steps, `train_step(step)` runs one step through small methods, and
`forward_backward(mb)` is the overridable micro-step (mb: the loader's MicroBatch).

Failures follow docs/reliability.md: what one rank detects is agreed with every rank (failures.py) before
any rank leaves the step; setup.py holds the collective-free setup pieces that are agreed on.
"""
import logging
import os
import time
from types import SimpleNamespace

from ds_adaptiveload.train import failures, gpu_busy, step_errors
from ds_adaptiveload.train.setup import (agree_attention_later, attention_mismatch, end_loop, offload_fields,
                                         offload_line, offload_stats, prepare_data, read_config, write_summary,
                                         write_synthetic)

logger = logging.getLogger(__name__)


class Trainer:
    _saved_graphs = 0  # block graphs in the last --compile-cache write
    _pred_peak_gib = 0.0  # the memory model's largest micro-batch peak in the current step
    _step_ks = ()  # [k, k_full(, k_ffn)] of the current step's micro-batches so far (--checkpoint-blocks auto)
    _offloaded = ()  # (blocks, bytes) each of the current step's micro-batches moved to host memory so far
    plan_step = None  # the last Step read (loader.Step): its plan decisions, what the step log records
    log_error = None  # this rank's failed step-log write, until agreed

    def __init__(self, args):
        import torch

        from ds_adaptiveload.train import engine as eng, sp

        self.args = args
        self.step = None
        """The step in progress (1-based), named by the error of a lost peer."""
        # -- distributed init, device ---------------------------------------------------------------------
        self.accel, self.rank, self.world = eng.init_distributed()
        failures.register_rank()
        self.device = eng.pick_device(self.accel, int(os.environ.get("LOCAL_RANK", max(args.local_rank, 0))))
        self.profiler = gpu_busy.StepProfile(args, self.device, args.output, self.rank)  # --profile-steps
        # -- config (checks before the first collective are agreed: one error, every rank exits 2) ----------
        c = failures.agreed(read_config, args, self.world, self.rank, self.device)
        self.ds_cfg, self.al, self.dims, self.G = c.ds_cfg, c.al, c.dims, c.G
        self.model_cfg, self.profile, self.fault = c.model_cfg, c.profile, c.fault
        mpu = sp.init_sequence_parallel(self.dims)
        # -- seed: same model init on every rank; noise/t are seeded per sample (flow.py) -------------------
        torch.manual_seed(self.al.seed)
        # -- data / sampler / resume checks (before DeepSpeed loads anything) -------------------------------
        resume_tag = self.setup_data(c)
        # -- model, deepspeed.initialize -------------------------------------------------------------------
        self.setup_engine(self.setup_model(c, mpu), mpu)
        # -- checkpoint resume (files loaded without unpickling code: train/ckpt_safe.py) --------------------
        self.setup_resume(resume_tag)

    def setup_data(self, c):
        """The manifest (written first with --synthetic), plan, sampler and DataLoader; the checkpoint to resume
        from (None: a start from step 0), chosen before the model exists."""
        from ds_adaptiveload.train import checkpoint

        args = self.args
        self.manifest = args.data
        if args.synthetic:
            self.manifest = os.path.join(args.output, "synthetic", "manifest.jsonl")
            # the agreement is also the barrier before the other ranks read it
            failures.agreed(write_synthetic, args, self.manifest, c, self.device, self.rank)
        d = failures.agreed(prepare_data, args, self.manifest, c, self.world, self.rank)
        self.samples, self.bad_upfront, self.sampler = d.samples, d.bad_upfront, d.sampler
        self.layout = d.layout
        self.empty_prompt = None
        if self.al.caption_dropout > 0:
            from ds_adaptiveload.train.captions import load_empty_prompt

            self.empty_prompt = failures.agreed(load_empty_prompt, self.manifest, self.model_cfg.text_dim)
        # the newest intact checkpoint (collective: the ranks verify its checksums in parallel); before the model
        resume_tag = checkpoint.choose(args.resume, d.resume_tags, d.resume_notes, self.layout,
                                       getattr(args, "trust_checkpoint", False)) if args.resume else None
        if getattr(args, "overwrite", False):
            failures.agreed(checkpoint.clear, os.path.join(args.output, "checkpoints"), self.rank)
        self.dataset = d.dataset
        return resume_tag

    def setup_model(self, c, mpu):
        """The model (partitioned as built under ZeRO-3), its pretrained weights, LoRA adapters, attention kernels,
        Ulysses sharding and block compile: everything deepspeed.initialize then wraps."""
        from ds_adaptiveload.train import sp
        from ds_adaptiveload.train.build import build_model

        args = self.args
        # "auto": every block until checkpoint_for sets the count of the first micro-batch
        # Under ZeRO-3 built inside zero.Init (train/build.py): partitioned as it is constructed, never one full
        # copy per rank; the same weights as an unpartitioned build (tests/test_build.py). WanBlock stays a
        # non-leaf module here: the leaf form is measured in bench/mfu.py's z3 part only.
        model = build_model(self.model_cfg, self.ds_cfg, leaf_blocks=False,
                            checkpoint_blocks=True if args.checkpoint_blocks == "auto" else args.checkpoint_blocks,
                            checkpoint_policy=getattr(args, "checkpoint_policy", "full"),
                            init_weights=not getattr(args, "init_from", None))
        if isinstance(self.al.activation_offload, int) and args.checkpoint_blocks != "auto":
            model.offload_blocks = self.al.activation_offload  # a fixed count; under auto the loader's, per micro-batch
        if getattr(args, "init_from", None):
            self.load_init_from(model)
        if self.rank == 0 and hasattr(next(model.parameters()), "ds_tensor"):
            held = sum(p.ds_tensor.numel() for p in model.parameters())
            logger.info(f"[train_wan] ZeRO-3: model built partitioned (zero.Init), {held:,} of "
                        f"{sum(p.ds_numel for p in model.parameters()):,} parameter elements on rank 0")
        if self.al.lora:  # the base frozen, adapters trained; deepspeed.initialize gets the adapters only
            from ds_adaptiveload.model.lora import apply_lora

            apply_lora(model, self.al.lora)
            if self.rank == 0:
                trainable = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                                for p in model.parameters() if p.requires_grad)
                logger.info(f"[train_wan] LoRA rank {self.al.lora.rank} on {', '.join(self.al.lora.modules())}: "
                            f"{trainable:,} trainable parameters")
        self.convert_fp8(model)
        self.attention, core, how, flag = c.attention, c.attention_core, "", getattr(args, "attention", "sdpa")
        later = agree_attention_later(args, self.device)
        if later:  # every rank: the choice is agreed by an all-reduce
            from ds_adaptiveload.model.attention import agreed

            self.attention, core, how = agreed(c.attention_times, self.world,
                                               lambda v: failures.sum_over_ranks(v, self.device))
        if self.rank == 0:
            logger.info(f"[train_wan] attention: {self.attention} (--attention {flag}{how})")
            for line in attention_mismatch(c.profile, self.attention, c.profile_file) if later else ():
                logger.warning(f"[train_wan] {line}")  # read_config left this check until the ranks agreed
        self.seq_shard = sp.apply_ulysses(model, mpu, self.model_cfg.num_heads, core)
        if getattr(args, "compile_blocks", False):
            self.apply_block_compile(model)
        return model

    def setup_engine(self, model, mpu) -> None:
        """deepspeed.initialize and what the loop reads of the engine: LR scaling, gradient divisor, dtype."""
        from ds_adaptiveload.train import engine as eng, sp

        args = self.args
        self.engine = eng.build_engine(model, self.ds_cfg, mpu, compile=args.compile)
        self.lr_scale = self.install_lr_scaling()
        self.divisor = sp.grad_divisor(self.engine, self.dims)  # what DeepSpeed divides summed gradients by
        self.loader = self.make_loader(self.dataset)
        line = failures.agreed(offload_line, self.al, args.checkpoint_blocks, self.model_cfg, self.profile,
                               self.sampler, self.loader.recompute())  # an offload over the host's key: exit 2
        if line and self.rank == 0:
            logger.log(*line)
        self.dtype = eng.compute_dtype(self.engine)
        self.zero3 = self.engine.zero_optimization_stage() == 3

    def setup_resume(self, resume_tag) -> None:
        """The resumed checkpoint's weights and sampler state (start step), the EMA, the step log, validation."""
        import torch.distributed as dist

        from ds_adaptiveload.train import ckpt_safe, faults, metrics

        args = self.args
        self.ckpt_dir = os.path.join(args.output, "checkpoints")
        ckpt_safe.install(self.engine, getattr(args, "trust_checkpoint", False), self.fault)
        self.start = self.resume(resume_tag) if resume_tag else 0
        self.ema = self.make_ema(resume_tag)
        self.oom_error = faults.out_of_memory_error()
        self.log = metrics.StepLog(args.output, self.rank)
        self.skipped = []  # this launch's skipped steps, for the summary
        self._dist = dist
        self.val = None
        if getattr(args, "val_data", None):
            from ds_adaptiveload.train.validation import Validation

            self.val = failures.agreed(Validation, args.val_data, self.model_cfg, self.profile.geometry, self.dims,
                                       self.al.seed)

    def load_init_from(self, model) -> None:
        """--init-from: the folder's config and every key checked (one agreed error), then each rank reads its
        weights (its partitions under ZeRO-3) one tensor at a time (model/init_from.py)."""
        from ds_adaptiveload.model import init_from

        args = self.args
        src = failures.agreed(init_from.prepare, args.init_from, model, self.model_cfg,
                              f"--model-config {args.model_config}")
        t0 = time.perf_counter()
        stats = init_from.load(src, model)
        if self.rank == 0:
            logger.info(f"[train_wan] --init-from {args.init_from}: {len(src.tensors)} tensors from {len(src.files)} "
                        f"file(s) in {time.perf_counter() - t0:.1f} s, {stats['bytes_read'] / 2**20:.1f} MiB read on "
                        f"rank 0")

    def relaunch_advice(self) -> str:
        """What a lost peer's line advises: --resume where a checkpoint exists to continue from, else a relaunch from
        step 0 (a line advising --resume before any save sent users looking for a checkpoint that never existed)."""
        for folder in (getattr(self, "ckpt_dir", None), self.args.resume if getattr(self, "start", 0) else None):
            if folder and os.path.isfile(os.path.join(folder, "latest")):
                return f"Relaunch with --resume {folder} (docs/reliability.md)"
        return "Relaunch; no checkpoint was saved yet, so it starts from step 0 (docs/reliability.md)"

    def convert_fp8(self, model) -> None:
        """--fp8 linear: torchao float8 layers, before compile and deepspeed.initialize (model/fp8.py says why)."""
        if self.al.fp8 != "off":
            from ds_adaptiveload.model.fp8 import convert_fp8

            n = len(convert_fp8(model, self.al.fp8))
            if self.rank == 0:
                logger.info(f"[train_wan] fp8 {self.al.fp8}: {n} linears as torchao float8 (rowwise); MFU counts "
                            f"bf16-equivalent FLOPs over --peak-tflops")

    def apply_block_compile(self, model):
        """--compile-blocks: the blocks (or their regions) compiled before deepspeed.initialize, and the compile
        cache loaded where --compile-cache names one."""
        from ds_adaptiveload.model.compile import apply_compile, compile_kind, load_compile_cache

        args = self.args
        self.compile_kind = compile_kind(args.compile_blocks)  # block or regions
        apply_compile(model, self.compile_kind, getattr(args, "compile_backend", "inductor"))
        if self.rank == 0:
            logger.info(f"[train_wan] --compile-blocks: {self.compile_kind} (model/compile.py)")
            if self.compile_kind == "block" and self.al.policy == "packed":  # docs/model.md, compiled regions
                logger.warning("[train_wan] warning: --compile-blocks block compiles a graph per number of shape "
                               "groups, and nearly every packed micro-batch is a new one; regions keep a few")
        if load_compile_cache(getattr(args, "compile_cache", None)) and self.rank == 0:
            logger.info(f"[train_wan] compile cache loaded from {args.compile_cache}")

    def install_lr_scaling(self):
        """adaptive_load.lr_scaling_method linear / sqrt: the LR follows each step's sample count relative to
        the reference batch size (train/lr_scaling.py, DeepSpeed's dynamic-batching rule); none: untouched."""
        if self.al.lr_scaling_method == "none":
            return None
        from ds_adaptiveload.train import lr_scaling

        return lr_scaling.install(self.engine, self.al.lr_scaling_method, self.al.lr_reference_batch_size)

    def make_loader(self, dataset):
        """The AdaptiveLoader (loader.py) over the sampler: LatentDataset micro-batches read by --num-workers workers
        that die with this rank, and under --checkpoint-blocks auto the memory model the counts come from (the
        device's capacity where the profile leaves it out)."""
        import functools

        from ds_adaptiveload.data.latents import first
        from ds_adaptiveload.loader import AdaptiveLoader, Settings

        args, workers = self.args, max(0, self.args.num_workers)
        kwargs = {"num_workers": workers, "pin_memory": self.device.type == "cuda",
                  "prefetch_factor": args.prefetch_factor if workers else None,
                  "worker_init_fn": functools.partial(failures.die_with_parent, os.getpid())}
        memory_model = None
        if args.checkpoint_blocks == "auto":
            mem = self.profile.memory
            if "capacity_bytes" not in mem and self.device.type == "cuda":
                import torch

                mem = {**mem, "capacity_bytes": torch.cuda.get_device_properties(self.device).total_memory}
            memory_model = (mem, self.model_cfg.num_layers)
        settings = Settings(self.al.seed, args.timestep_shift, self.al.loss_weighting)
        offload = (self.al.activation_offload, self.model_cfg.dim) if memory_model else None
        return AdaptiveLoader(self.sampler, dataset, first, kwargs, self.divisor, self.lr_scale, settings, self.device,
                              self.rank, memory_model, offload)

    def make_ema(self, tag):
        """adaptive_load.ema_decay: the EMA (train/ema.py) from the current weights, or the resumed checkpoint's."""
        if self.al.ema_decay is None:
            return None
        from ds_adaptiveload.train.ema import EMA

        ema = EMA(self.engine, self.al.ema_decay, self.rank)
        if tag and not failures.agreed(ema.load, os.path.join(self.args.resume, tag)) and self.rank == 0:
            logger.warning(f"[train_wan] --resume: checkpoint {tag} holds no EMA; it starts from the resumed weights")
        return ema

    def resume(self, tag) -> int:
        from ds_adaptiveload.train import checkpoint

        st = failures.agreed(checkpoint.load, self.engine, self.args.resume, tag, self.layout,
                             getattr(self.args, "trust_checkpoint", False))  # raises after loading
        failures.agreed(self.sampler.load_state_dict, st["sampler"][self.rank])
        if self.rank == 0:
            logger.info(f"[train_wan] resumed from {os.path.join(self.args.resume, tag)}: step {st['step']} done, "
                        f"continuing with step {st['step'] + 1}")
        return st["step"]

    # -- the loop --------------------------------------------------------------------------------------------

    def train(self) -> None:
        from tqdm import tqdm

        args = self.args
        self.bar = tqdm(total=args.max_steps, initial=self.start, disable=self.rank != 0, desc="train",
                        dynamic_ncols=True)
        self.batches = None
        try:
            self.batches = self.loader.start()
            if self.val is not None and self.start == 0:
                self.validate(0)  # the starting weights' loss (pretrained ones, with --init-from)
            for step in range(self.start, args.max_steps):
                self.step = step + 1
                self.train_step(step)
                if getattr(args, "preview_every", 0) and (step + 1) % args.preview_every == 0:
                    self.preview(step + 1)
                if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.max_steps:
                    self.save(step + 1)
            self.bar.close()
            failures.agree(self.log_error)  # the last step's line (earlier ones: read_and_agree)
            if self.start < args.max_steps and not args.no_final_save:
                self.save(args.max_steps)
            if self.rank == 0:
                write_summary(args.output, self.start, args.max_steps, self.bad_upfront, self.skipped)
        finally:  # every exit path: the bar's line ended (the error line starts a line), workers stopped
            end_loop(self.batches, self.bar.close, self.close_log)
        self._dist.barrier()

    def val_due(self, step: int) -> bool:
        """--val-every N: after every N-th step and the last one."""
        every = getattr(self.args, "val_every", 0)
        return self.val is not None and ((every and step % every == 0) or step == self.args.max_steps)

    def validate(self, step: int) -> dict:
        """The held-out loss at the current weights (train/validation.py): to OUTPUT/val.jsonl (rank 0), the
        monitor, and returned for the step's record."""
        import json

        t0 = time.perf_counter()
        rec = self.val.run(self.engine, device=self.device, dtype=self.dtype, seq_shard=self.seq_shard)
        rec["val_ms"] = (time.perf_counter() - t0) * 1000
        if self.rank == 0:
            with open(os.path.join(self.args.output, "val.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, **rec}) + "\n")
        if self.engine.monitor.enabled:
            self.engine.monitor.write_events([("val/loss", float(rec["val_loss"]), step)])
        return rec

    def preview(self, step: int) -> None:
        """--preview-every: the weights gathered (every rank), a clip rendered on rank 0 (train/preview.py)."""
        from ds_adaptiveload.train import preview

        weights = preview.full_weights(self.engine.module, self.rank)
        if self.rank == 0:
            t0 = time.perf_counter()
            path = preview.render(self.args, self.model_cfg, weights, step, self.device)
            logger.info(f"[train_wan] preview {path} in {time.perf_counter() - t0:.1f} s")
        del weights
        self._dist.barrier()

    def save_compile_cache(self, graphs) -> None:
        """--compile-cache: rank 0 writes the compiled artifacts after a step that compiled new graphs (not at the
        end only: a run cut short keeps what it compiled)."""
        path = getattr(self.args, "compile_cache", None)
        if path and self.rank == 0 and graphs is not None and graphs > self._saved_graphs:
            from ds_adaptiveload.model.compile import save_compile_cache

            try:
                n = save_compile_cache(path)
                logger.info(f"[train_wan] compile cache: {graphs} block graphs, {n / 2**20:.1f} MiB in {path}")
            except OSError as err:  # an optimisation: a full disk must not stop rank 0 alone (the others would hang)
                logger.warning(f"[train_wan] warning: --compile-cache {path} not written: {err}")
            self._saved_graphs = graphs

    def save(self, step: int) -> None:
        from ds_adaptiveload.train import checkpoint

        checkpoint.save(self.engine, self.ckpt_dir, step, self.loader.state_dict(), self.layout, self.fault,
                        getattr(self.args, "keep_last", 0) or 0, write_files=self.write_checkpoint_files)

    def write_checkpoint_files(self, folder: str) -> None:
        """Beside DeepSpeed's files: the model config (rank 0), which `export` reads, and the EMA (train/ema.py)."""
        import json

        from ds_adaptiveload.model.export import MODEL_CONFIG_FILE

        if self.ema is not None:
            self.ema.save(folder)
        if self.rank == 0:
            with open(os.path.join(folder, MODEL_CONFIG_FILE), "w") as f:
                json.dump(self.model_cfg.to_dict(), f, indent=1)

    def train_step(self, step: int) -> None:
        """Read the step, agree on bad samples, run the micro-batches, decide whether to skip, apply or skip
        the update, log."""
        self.profiler.start(step)
        t_step = self.sync_clock()
        mbs, data_ms, n_bad, bad = self.read_and_agree(step)
        plan_step = self.plan_step
        base = {"step": step + 1, "epoch": plan_step.epoch, "plan_step": plan_step.step,
                "ids": [mb.batch["ids"] for mb in mbs], "pad": plan_step.pad}
        step_ids = [(mb.batch["ids"], mb.pad) for mb in mbs]
        if n_bad:  # on_bad_sample "skip": before any compute, on every rank
            entry = self.skip_step(step, "bad_sample", [f"{sid}: {why}" for sid, why in bad], step_ids)
            base.update(self.profiler.stop(step, time.perf_counter() - t_step))
            self.write_log(step, {**base, "skipped": entry})
            self.bar.update(1)
            return
        run = self.run_micro_batches(step, mbs)
        run.counters["data_ms"] = data_ms
        ranks = self.gather(run)
        reason, detail = self.decide_skip(step, ranks, run)
        lr = self.engine.get_lr()[0]  # the rate this update uses (the scheduler advances inside step())
        entry = self.apply_or_skip(step, reason, detail, step_ids)
        step_s = time.perf_counter() - t_step
        base.update(self.profiler.stop(step, step_s))  # before validation, which is not the step's
        if self.val_due(step + 1):  # in the step's record; not in its time, so throughput stays training's
            base.update(self.validate(step + 1))
        self.log_step(step, base, ranks, run, lr, entry, step_s)

    def write_log(self, step: int, rec: dict) -> None:
        """One step-log line; a failed write (a full disk) is kept as this rank's error and agreed with the
        next step's read (or at the end of the loop), so every rank ends with the same line."""
        try:
            self.fault.before_log(step + 1, self.log.path)
            self.log.write(rec)
        except OSError as e:
            self.log_error = self.log_error or (f"step {step + 1}, rank {self.rank}: cannot write the step log "
                                                f"{self.log.path} ({e.strerror or e}); free space, then relaunch "
                                                f"with --resume")

    def close_log(self) -> None:
        try:
            self.log.close()
        except OSError:  # the lines a full disk refused are already this run's error
            pass

    def sync_clock(self) -> float:
        self.accel.synchronize()
        return time.perf_counter()

    def read_and_agree(self, step: int):
        """The step's G micro-batches (the loader's Step), read before any compute, so a bad sample is agreed on (an
        error on every rank, or the step skipped on every rank) before any collective of the step."""
        t0 = time.perf_counter()
        plan_step, read_err = self.loader.read(lambda: self.fault.before_read(step + 1, self.batches),
                                               self.relaunch_advice())
        data_ms = (time.perf_counter() - t0) * 1000
        if read_err:
            read_err = (f"step {step + 1}, rank {self.rank}: {read_err[0]}", read_err[1])
        mbs = plan_step.micro_batches if plan_step else []
        bad = [(sid, why) for mb in mbs for sid, why in mb.batch.get("bad", ())]
        skip = self.al.on_bad_sample == "skip"
        bad_err = step_errors.bad_sample_message(step + 1, self.rank, bad) if bad and not skip else None
        fatal = read_err or next(((e, failures.EXIT_USER_ERROR) for e in (self.log_error, bad_err) if e), None)
        n_bad, n_fatal = failures.sum_over_ranks([len(bad), fatal is not None], self.device)
        if n_fatal:
            failures.agree(*(fatal or (None,)))  # raises on every rank
        self.plan_step = plan_step
        return mbs, data_ms, n_bad, bad

    def forward_backward(self, mb):
        """One micro-batch's forward and backward (a loader.MicroBatch: its batch, loss weight and checkpoint
        counts); returns per-sample losses."""
        from ds_adaptiveload.train import engine as eng

        batch = mb.batch
        self.checkpoint_for(mb)
        if self.empty_prompt is not None:
            from ds_adaptiveload.train.captions import apply

            apply(batch, self.empty_prompt, self.al.seed, mb.epoch, self.al.caption_dropout)
        return eng.micro_step(self.engine, batch, mb.weight, device=self.device, dtype=self.dtype, seed=self.al.seed,
                              epoch=mb.epoch, shift=self.args.timestep_shift, seq_shard=self.seq_shard,
                              loss_weighting=self.al.loss_weighting)

    def checkpoint_for(self, mb) -> None:
        """--checkpoint-blocks auto: the model runs the micro-batch at the counts the loader gives it from the plan
        (MicroBatch.checkpoint, schedule/memory.RecomputeCost.step_plans: only as many blocks as its predicted peak needs;
        under ZeRO-3 the step's largest count over every rank, the same on every rank)."""
        if mb.checkpoint is None:
            return
        self.engine.module.set_checkpointing(*mb.checkpoint)
        self.note_predicted_peak(mb)

    def note_predicted_peak(self, mb) -> None:
        """The memory model's peak for the micro-batch at its (k, k_full, k_ffn), kept as the step's largest
        (pred_mem_gib in the step log, beside the measured mem_peak_gib); nothing if the profile cannot say."""
        from ds_adaptiveload.schedule.geometry import per_gpu_tokens
        from ds_adaptiveload.schedule.memory import predicted_peak_bytes

        k, k_full, k_ffn, *off = mb.checkpoint
        # ckpt_k in the step log: what each micro-batch recomputed ([k, k_full], and k_ffn when blocks kept FFN outputs;
        # with activation_offload, [k, k_full, k_ffn, offloaded blocks])
        self._step_ks = [*self._step_ks, list(mb.checkpoint) if off or k_ffn else [k, k_full]]
        mem = self.profile.memory
        if mem.get("bytes_per_token") is None:
            return
        tokens = sum(per_gpu_tokens(S, self.dims.sp) for S in mb.tokens)
        peak = predicted_peak_bytes(tokens, len(mb.tokens), mem, self.model_cfg.num_layers, k, k_full, k_ffn)
        if off:  # the offloaded block inputs (bf16) leave the device
            from ds_adaptiveload.schedule.offload import input_bytes_per_token

            peak -= off[0] * input_bytes_per_token(self.model_cfg.dim) * tokens
        peak /= 2**30
        self._pred_peak_gib = max(self._pred_peak_gib, peak)

    def run_micro_batches(self, step: int, mbs: list) -> SimpleNamespace:
        """Every micro-batch of the step. An OOM is caught and agreed later: this rank runs zero-weight
        stand-ins for the rest of the step, so its collectives still match its peers'."""
        import torch

        from ds_adaptiveload.train import engine as eng

        run = SimpleNamespace(seen=[], oom=[], nonfinite=torch.zeros((), device=self.device),
                              counters={"loss_sum": 0.0, "samples": 0, "tokens": 0, "flops": 0.0, "compute_ms": 0.0})
        for g, mb in enumerate(mbs):
            batch, pad = mb.batch, mb.pad
            t0 = time.perf_counter()
            if not run.oom:
                try:
                    self.fault.before_forward(step + 1, g)
                    per_sample = self.forward_backward(mb)
                    self._offloaded = [*self._offloaded, *offload_stats(self.engine.module, self.al)]
                except self.oom_error as e:  # agreed after the step's micro-batches (error or skip)
                    run.oom.append(step_errors.oom_message(step + 1, self.rank, g, batch, self.samples,
                                                           self.manifest, self.profile, self.dims.sp, e))
                if run.oom:  # outside the except block, so the failed forward's frames and tensors are gone
                    eng.recover_after_oom(self.engine, self.accel, self.world)
            if run.oom:  # this rank's step is lost; keep issuing the collectives its peers issue
                eng.stand_in(self.engine, self.model_cfg, self.dims.sp, device=self.device, dtype=self.dtype,
                             seq_shard=self.seq_shard)
            else:
                run.nonfinite += (~torch.isfinite(per_sample)).sum()
                run.seen.append((batch["ids"], batch["index"], per_sample, pad))
            self.after_micro_batch(step, g)
            run.counters["compute_ms"] += (time.perf_counter() - t0) * 1000
            if not pad and not run.oom:
                self.count(run.counters, mb.tokens)
        return run

    def after_micro_batch(self, step: int, g: int) -> None:
        from ds_adaptiveload.train import engine as eng

        if g == 0:
            self.fault.after_backward(step + 1)
        if self.args.dump_grads and g == self.G - 1 and step == self.args.max_steps - 1:
            eng.dump_grads(self.engine, self.args.dump_grads, self.rank, step + 1)
        if g < self.G - 1:
            self.engine.step()  # inside the accumulation window: no optimizer update
        self.accel.synchronize()

    def count(self, counters: dict, tokens: list) -> None:
        counters["samples"] += len(tokens)
        counters["tokens"] += sum(tokens)
        counters["flops"] += sum(self.flops_per_sample(S) for S in tokens)

    def flops_per_sample(self, tokens: int) -> float:
        """Model FLOPs of one sample for MFU: a full step's, or a LoRA step's (WanConfig.lora_flops_per_sample)."""
        lora = self.al.lora
        if lora:
            return self.model_cfg.lora_flops_per_sample(tokens, lora.rank, lora.modules())
        return self.model_cfg.flops_per_sample(tokens)

    def gather(self, run) -> list:
        """One all-gather per step, before the optimizer update, so a non-finite loss or an OOM on any rank
        is known to every rank before it reaches the weights."""
        from ds_adaptiveload.train import metrics

        run.counters.update(loss_sum=float(sum(ps.sum() for _, _, ps, is_pad in run.seen if not is_pad)),
                            nonfinite=float(run.nonfinite), oom=float(bool(run.oom)))
        return metrics.gather_counters(run.counters, self.device)

    def decide_skip(self, step: int, ranks: list, run):
        """(reason, detail) of a step to skip, or (None, None); an error policy raises on every rank."""
        if any(r["oom"] for r in ranks):
            if self.al.on_oom != "skip":
                failures.agree(run.oom[0] + step_errors.OOM_HINT if run.oom else None)  # raises on every rank
            return "oom", run.oom
        if any(r["nonfinite"] for r in ranks):
            if self.al.on_bad_sample != "skip" or not self.zero3:
                failures.agree(step_errors.nonfinite_message(step + 1, self.rank, run.seen, self.samples,
                                                             self.manifest))
            return "nonfinite_loss", step_errors.nonfinite_samples(run.seen, self.samples, self.manifest)
        return None, None

    def apply_or_skip(self, step: int, reason, detail, step_ids):
        """The optimizer update, or (reason) its skip on every rank; returns the skip entry or None."""
        if not reason:
            self.engine.step()
            if self.ema is not None and self.engine.was_step_applied():
                self.ema.update()
            self.accel.synchronize()
            return None
        entry = self.skip_step(step, reason, detail, step_ids)
        step_errors.poison_gradients(self.engine)
        self.engine.step()  # ZeRO-3 sees a NaN gradient norm: discards the gradients, no update, LR unchanged
        if self.engine.was_step_applied():
            raise RuntimeError(f"step {step + 1}: DeepSpeed applied an update that had to be skipped")
        if self.device.type == "cuda":
            self.accel.empty_cache()
        self.accel.synchronize()
        return entry

    def skip_step(self, step: int, reason: str, detail: list, step_ids) -> dict:
        """Every rank calls this with the same decision: log the skip with every rank's sample ids."""
        everyone = [None] * self.world
        self._dist.all_gather_object(everyone, {"ids": [i for ids, is_pad in step_ids if not is_pad for i in ids],
                                                "detail": detail})
        ids = sorted({i for e in everyone[::self.dims.sp] for i in e["ids"]})
        details = [d for e in everyone for d in e["detail"]]
        entry = {"step": step + 1, "reason": reason, "ids": ids, "detail": details}
        self.skipped.append(entry)
        if self.rank == 0:
            logger.warning(f"[train_wan] step {step + 1} skipped on every rank ({reason}): "
                           f"{'; '.join(details) if details else ''} samples {ids}")
        return entry

    def log_step(self, step: int, base: dict, ranks: list, run, lr: float, entry, step_s: float) -> None:
        import torch

        from ds_adaptiveload.train import metrics

        ps = self.plan_step
        m = metrics.step_metrics(ranks, self.dims.sp, step_s, self.args.peak_tflops, self.device)
        m["pred_ms"] = list(ps.pred_ms)
        m["pred_wall_ms"] = ps.pred_wall_ms
        m["pred_idle_fraction"] = metrics.idle_fraction(ps.pred_ms, ps.pred_wall_ms)
        rec = {**base, "lr": lr, **m, "rank_loss": run.counters["loss_sum"] / max(run.counters["samples"], 1),
               "end_time": round(time.time(), 3)}  # unix time: joins the step with outside logs (nvidia-smi)
        fp8 = self.al.fp8 != "off"
        if fp8:  # the same model FLOPs over the same bf16 peak as a bf16 run: comparable, and labelled so
            rec["mfu_basis"] = metrics.MFU_BF16_EQUIVALENT
        if self._pred_peak_gib:  # --checkpoint-blocks auto: the memory model's peak for the step
            rec["pred_mem_gib"], self._pred_peak_gib = self._pred_peak_gib, 0.0
        if self._step_ks:  # [k, k_full] per micro-batch (k_full: blocks of those k recomputed whole)
            rec["ckpt_k"], self._step_ks = self._step_ks, ()
        rec.update(offload_fields(self._offloaded))  # the block inputs moved to host memory
        self._offloaded = ()
        if getattr(self.args, "compile_blocks", False):  # graphs so far: a step that compiled shows a rise
            from ds_adaptiveload.model.compile import compile_stats

            rec["block_graphs"] = compile_stats()["block_graphs"]
            self.save_compile_cache(rec["block_graphs"])
        if entry:
            rec["skipped"] = entry
        self.write_log(step, rec)
        if self.engine.monitor.enabled and not entry:
            self.engine.monitor.write_events(metrics.monitor_events(m, step + 1, lr, fp8))
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{m['loss']:.4f}", sps=f"{m['samples_per_s']:.1f}",
                             idle=f"{m['idle_fraction']:.2f}")
