"""Calibration's engine glue (torch + DeepSpeed): the engine built with training's own pieces (train/engine.py:
init_distributed, pick_device, build_engine, compute_dtype), one training step on random inputs through
training's micro_step, its OOM recovery, device facts, and a clock that agrees over ranks."""
import os
import sys
import time


def init_engine(cfg, ds, args):
    """deepspeed.initialize exactly as launch/train_wan.py does; a single process needs no launcher."""
    from ds_adaptiveload.train import config as tconfig, engine as eng, failures, sp as tsp

    eng.single_process_env()
    accel, rank, world = eng.init_distributed()
    failures.register_rank()  # a peer that finds this rank gone names it (failures.report)
    # Ranks share the host's cores (as training does), unless the user set OMP_NUM_THREADS.
    device = eng.pick_device(accel, int(os.environ.get("LOCAL_RANK", 0)), threads="OMP_NUM_THREADS" not in os.environ)
    # Calibrate on the JSON's sequence_parallel_size only when launched on enough ranks for it.
    k = int(ds.get("sequence_parallel_size", 1))
    if world % k:
        k = 1
    dims = tsp.ParallelDims(world=world, sp=k, rank=rank)
    mpu = tsp.init_sequence_parallel(dims)
    # Every micro-batch is one optimizer step here, so fwd+bwd and the step are timed apart; no monitors.
    ds = tconfig.derive_ds_config(ds, grad_accum=1, sp=k, dp=dims.dp, tensorboard=None, csv_monitor=None,
                                  wandb=None, comet=None, steps_per_print=10**9)
    ds.pop("adaptive_load", None)
    model, seq_shard = build_model(cfg, args, mpu)
    engine = eng.build_engine(model, ds, mpu)
    return engine, dims, seq_shard, device, eng.compute_dtype(engine)


def build_model(cfg, args, mpu=None):
    """(model, seq_shard): the model init_engine trains, before deepspeed.initialize: seeded, its head drawn,
    Ulysses over mpu's sequence-parallel group (none without mpu), blocks compiled as args.compile_blocks."""
    import torch

    from ds_adaptiveload.model import WanModel
    from ds_adaptiveload.model.attention import resolve_attention
    from ds_adaptiveload.train import sp as tsp

    torch.manual_seed(args.seed)
    model = WanModel(cfg, checkpoint_blocks=args.checkpoint_blocks)
    with torch.no_grad():  # the zero-initialised head would make every other gradient zero
        model.head.head.weight.normal_(std=0.02)
    if getattr(args, "lora", None):  # calibrate --lora-rank: the step a LoRA run trains (as the trainer adds them)
        from ds_adaptiveload.model.lora import apply_lora

        apply_lora(model, args.lora)
    _, core = resolve_attention(getattr(args, "attention", "sdpa"))  # as the trainer does
    seq_shard = tsp.apply_ulysses(model, mpu, cfg.num_heads, core)
    if getattr(args, "compile_blocks", None):  # as the trainer does, before deepspeed.initialize
        from ds_adaptiveload.model.compile import apply_compile, compile_kind

        apply_compile(model, compile_kind(args.compile_blocks))
    return model, seq_shard


class StepFn:
    """One training step on random inputs of a point's shape: flow-matching loss (train/flow.py),
    engine.backward, engine.step. Returns (fwd+bwd ms, step ms, peak bytes).

    Several ranks (`dims.world` > 1): every rank draws the same inputs (SP peers must hold the same
    samples), and the returned times and peak are the maximum over ranks, so that every rank schedules and
    fits on the same numbers. An out-of-memory error there is not recoverable (the peers wait inside a
    collective the failed rank will not join): the rank says so and exits, and the launcher stops the
    others, instead of the job hanging until its timeout."""

    def __init__(self, engine, cfg, geometry, seq_shard, device, dtype, seed, dims=None):
        from deepspeed.accelerator import get_accelerator

        self.engine, self.cfg, self.geo, self.seq_shard = engine, cfg, geometry, seq_shard
        self.device, self.dtype, self.seed = device, dtype, seed
        self.world = dims.world if dims is not None else 1
        self.rank = dims.rank if dims is not None else 0
        self.accel = get_accelerator()
        self.calls = 0
        self.reserved = None  # max_memory_reserved of the last step (max over ranks), read by grid.measure_point
        self.fwd_bwd_peak = None  # max_memory_allocated before the optimizer step (max over ranks), likewise
        self.before_exit = None  # several ranks: called with the point before an out-of-memory exit

    def __call__(self, p):
        import torch

        from ds_adaptiveload.train import engine as eng

        cuda = self.device.type == "cuda"
        try:
            batch, epoch = self._inputs(p), self.calls
            self.calls += 1
            if cuda:
                if p.role in ("anchor", "probe"):  # the budget checks start from an empty cache, not the grid's
                    torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(self.device)
            self.accel.synchronize()
            t0 = time.perf_counter()
            # training's micro-step (train/engine.py): the mean loss is the sum with weight 1 / B
            eng.micro_step(self.engine, batch, 1.0 / p.B, device=self.device, dtype=self.dtype, seed=self.seed,
                           epoch=epoch, shift=5.0, seq_shard=self.seq_shard)
            self.accel.synchronize()
            t1 = time.perf_counter()
            fwd_bwd = torch.cuda.max_memory_allocated(self.device) if cuda else None
            self.engine.step()
            self.accel.synchronize()
            t2 = time.perf_counter()
            peak = self._peak(p)
            self.reserved = torch.cuda.max_memory_reserved(self.device) if cuda else None
        except torch.cuda.OutOfMemoryError as e:
            if self.world > 1:
                self._stop(p, e)
            self._recover()
            raise
        ms = ((t1 - t0) * 1000, (t2 - t1) * 1000, peak)
        if self.world > 1:
            import torch.distributed as dist

            v = torch.tensor([ms[0], ms[1], float(peak or 0), float(self.reserved or 0), float(fwd_bwd or 0)],
                             dtype=torch.float64, device=self.device)
            dist.all_reduce(v, op=dist.ReduceOp.MAX)
            ms = (float(v[0]), float(v[1]), int(v[2]) if peak is not None else None)
            self.reserved = int(v[3]) if self.reserved is not None else None
            fwd_bwd = int(v[4]) if fwd_bwd is not None else None
        self.fwd_bwd_peak = fwd_bwd
        return ms

    def _stop(self, p, err):
        """Several ranks, out of memory: say so and exit EXIT_PEER_LOST now. The peers wait in a collective this rank
        cannot join (a stand-in's Ulysses all-to-all would not match theirs, and on a GPU the OOM can land after some
        of the step's collectives); its exit fails theirs, and each ends with the same code (failures.report: rank R
        stopped answering), so the launcher returns 3 whichever rank it polls first."""
        from ds_adaptiveload.train import failures

        print(f"error: calibrate: rank {self.rank} ran out of memory at B={p.B} x s={p.s} ({p.tokens} tokens per GPU, "
              f"role {p.role}): not recoverable with {self.world} ranks, stopping. Lower --probe-tokens/--batches, or "
              f"--no-probe-budget. ({str(err).splitlines()[0][:200]})", file=sys.stderr, flush=True)
        if self.before_exit:
            self.before_exit(p)
        sys.stdout.flush()
        os._exit(failures.EXIT_PEER_LOST)

    def set_checkpointing(self, blocks, policy="full"):
        """The model's per-block checkpointing for the next steps (calibrate/blocks.py's open-block runs): the first
        `blocks` blocks checkpointed (True: every block), recomputed whole (full), keeping their attention outputs
        (attention) or those and their FFN outputs (attention-ffn), as the trainer sets them per micro-batch under
        --checkpoint-blocks auto."""
        m = self.engine.module
        # attention-ffn: k_ffn is every block, as WanModel.forward keeps the FFN output of at most the checkpointed ones
        m.set_checkpointing(blocks, 0, len(m.blocks) if policy == "attention-ffn" else 0,
                            policy="attention" if policy == "attention-ffn" else policy)

    def _inputs(self, p):
        """Random latents and text contexts of p's shape: [B, C, ...] tensors for a grid Point, lists of
        [C, F_i, H_i, W_i] latents and [L, text_dim] contexts for a packed micro-batch (calibrate.packs.Pack,
        run as one packed forward by micro_step as training runs it)."""
        import torch

        g = torch.Generator(device=self.device).manual_seed(self.seed + self.calls)
        dev, dt, cfg = self.device, self.dtype, self.cfg
        shapes = getattr(p, "shapes", None)
        if shapes is None:
            x0 = torch.randn(p.B, 16, *self.geo.latent_shape(*p.shape), generator=g, device=dev).to(dt)
            text = torch.randn(p.B, cfg.text_len, cfg.text_dim, generator=g, device=dev).to(dt)
        else:
            x0 = [torch.randn(16, *self.geo.latent_shape(*sh), generator=g, device=dev).to(dt) for sh in shapes]
            text = [torch.randn(cfg.text_len, cfg.text_dim, generator=g, device=dev).to(dt) for _ in shapes]
        return {"latent": x0, "text": text, "index": list(range(p.B))}

    def _peak(self, p):
        """This rank's peak allocated bytes over the step just run (None on CPU)."""
        import torch

        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None

    def _recover(self):
        """After an OOM mid-step: drop gradients and cached blocks so the next point starts clean."""
        import gc

        import torch

        try:
            self.engine.zero_grad()
        except Exception:  # noqa: BLE001 - best effort; the point is already recorded as oom
            pass
        try:  # ZeRO-3: forget the half-finished step's parameter-fetch trace
            coord = self.engine.optimizer.parameter_offload.get_param_coordinator()
            coord.reset_step()
        except Exception:  # noqa: BLE001
            pass
        gc.collect()
        torch.cuda.empty_cache()


def capacity(device):
    """Device memory in bytes; None on CPU (no peak memory statistics there)."""
    import torch

    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def op_state(device):
    """Which LN-modulate the measured steps ran: the fused CUDA op, or PyTorch and why."""
    if device.type != "cuda":
        return "torch (CPU)"
    if os.environ.get("DS_ADAPTIVELOAD_LN_MODULATE") == "torch":
        return "torch (DS_ADAPTIVELOAD_LN_MODULATE=torch)"
    from ds_adaptiveload.ops import layernorm_modulate as lm

    return "cuda" if lm.load_op() is not None else f"torch (op unavailable: {lm.op_error()})"


class Clock:
    """Seconds since start. With several ranks, the maximum over ranks: every rank then takes the same
    measure/skip decisions in the same order (a rank that skipped a point alone would hang the others
    in the next collective)."""

    def __init__(self, t_start, device=None):
        self.t_start, self.device = t_start, device

    def __call__(self):
        t = time.monotonic() - self.t_start
        if self.device is None:
            return t
        import torch
        import torch.distributed as dist

        v = torch.tensor([t], dtype=torch.float64, device=self.device)
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        return float(v)

