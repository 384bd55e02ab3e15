"""The DeepSpeed engine and one micro-step, shared by training (trainer.py) and calibration: device init,
deepspeed.initialize with the sequence-parallel mpu, the compute dtype, the flow-matching micro-step, the
zero-weight stand-in micro-batch and the recovery after an out-of-memory error.

Plain functions with explicit arguments, so calibration can use them without a Trainer."""
import os


def init_distributed():
    """-> (accelerator, rank, world): gloo on the CPU accelerator, nccl on CUDA; once per process."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    if not dist.is_initialized():
        for attempt in range(3):
            try:
                deepspeed.init_distributed(dist_backend=accel.communication_backend_name())
                break
            except dist.DistNetworkError as e:
                # A port single_process_env picked can be taken before the store binds it (the kernel hands the same
                # ephemeral port to another socket): pick again. A launcher's port is the user's: no retry.
                if os.environ.get("MASTER_PORT") != _picked_port.get("port") or attempt == 2 \
                        or "EADDRINUSE" not in str(e):
                    raise
                os.environ["MASTER_PORT"] = _picked_port["port"] = str(free_port())
        if accel.device_name() == "cpu":
            unlink_shm_buffer(dist)
    return accel, dist.get_rank(), dist.get_world_size()


_picked_port = {"port": None}  # the MASTER_PORT single_process_env chose, which init_distributed may choose again


def single_process_env() -> None:
    """The launcher's variables for a run without one (one process, rank 0 of 1), where they are not set, on a port
    the kernel has just handed out as free. A fixed or pid-derived port (29600 + pid % 300 before) could be a port
    that another run or test on the same machine binds: a process group left alive keeps its store listening on it.
    In the test suite, 8 of those 300 ports were fixed ports of later tests, whose launch then failed at start-up
    (EADDRINUSE)."""
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = _picked_port["port"] = str(free_port())


def free_port() -> int:
    """A port the kernel has just handed out as free: the ephemeral range, which the launchers' fixed ports (and the
    test suite's) stay out of."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shm_buffer_path(rank: int, env=os.environ) -> str:
    """The shared-memory file DeepSpeed's CPU all-reduce creates for this rank when every rank is local
    (deepspeed/ops/csrc/cpu/comm/shm.cpp: deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>)."""
    return (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{env.get('MASTER_ADDR', '')}_"
            f"{env.get('MASTER_PORT', '')}_{rank}")


def unlink_shm_buffer(dist) -> bool:
    """Unlink this rank's all-reduce buffer (66 MB of RAM per rank) once every rank has mapped it. DeepSpeed never
    unlinks it, so each CPU run left one file per rank in /dev/shm until reboot: 82 files, 5.4 GB, per run of this
    test suite. Each rank maps every rank's buffer inside init, so after a barrier the names are no longer needed;
    the mappings stay valid. True if this rank's file was there."""
    dist.barrier()
    try:
        os.unlink(shm_buffer_path(dist.get_rank()))
    except FileNotFoundError:  # no shm all-reduce (ranks on several hosts, or the op not built)
        return False
    return True


def pick_device(accel, local_rank: int, threads: bool = True):
    """This rank's device. CPU: ranks share the host's cores, so each gets cores / local ranks threads
    (without it each would start one thread per core); threads=False keeps torch's default."""
    import torch

    if accel.device_name() == "cpu":
        if threads:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_SIZE", 1))))
        return torch.device("cpu")
    accel.set_device(local_rank)
    return torch.device(accel.device_name(local_rank))


def build_engine(model, ds_cfg: dict, mpu, compile: bool = False):
    """deepspeed.initialize with the trainable parameters (all of them, or a LoRA run's adapters: the frozen base
    gets no optimizer state and no gradient buffers) and the sequence-parallel mpu (sp.init_sequence_parallel)."""
    import deepspeed

    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=ds_cfg, mpu=mpu)
    if compile:
        from ds_adaptiveload.model.compile import engine_compile_kwargs

        engine.compile(compile_kwargs=engine_compile_kwargs())  # inductor without mix-order reduction
    return engine


def compute_dtype(engine):
    """The dtype inputs are cast to: bf16 / fp16 when the engine trains in it, else fp32."""
    import torch

    return torch.bfloat16 if engine.bfloat16_enabled() else torch.float16 if engine.fp16_enabled() else torch.float32


def micro_step(engine, batch: dict, weight: float, *, device, dtype, seed: int, epoch: int, shift: float,
               seq_shard=None, loss_weighting: str = "none"):
    """Forward + backward of one micro-batch ({'latent', 'text', 'index'}): flow-matching loss with noise
    and timesteps seeded per sample and epoch (flow.draw_noise), backward of the (timestep-weighted,
    adaptive_load.loss_weighting) loss sum * weight. A packed micro-batch of several shapes holds lists of
    latents and text contexts (data/latents.py) and runs as one packed forward. Returns the detached,
    unweighted per-sample losses."""
    from ds_adaptiveload.train import flow

    if isinstance(batch["latent"], list):
        x0s = [x.to(device, dtype, non_blocking=True) for x in batch["latent"]]
        texts = [c.to(device, dtype, non_blocking=True) for c in batch["text"]]
        eps, t = flow.draw_noise_packed(x0s, batch["index"], seed, epoch, shift)
        per_sample = flow.packed_flow_matching_loss(engine, x0s, texts, eps, t.to(device), seq_shard=seq_shard)
    else:
        x0 = batch["latent"].to(device, dtype, non_blocking=True)
        text = batch["text"].to(device, dtype, non_blocking=True)
        eps, t = flow.draw_noise(x0, batch["index"], seed, epoch, shift)
        per_sample = flow.flow_matching_loss(engine, x0, text, eps, t, seq_shard=seq_shard)
    engine.backward(flow.weighted_sum(per_sample, t, loss_weighting, shift) * weight)
    return per_sample.detach()


def stand_in(engine, model_cfg, sp: int, *, device, dtype, seq_shard=None) -> None:
    """After an OOM: a 1-sample, k-token micro-batch with zero weight, so this rank still issues the
    forward/backward collectives (ZeRO-3 gathers, gradient reduce-scatters) its peers issue."""
    import torch

    from ds_adaptiveload.data.latents import LATENT_CHANNELS
    from ds_adaptiveload.train import flow

    x0 = torch.zeros(1, LATENT_CHANNELS, 1, 2, 2 * sp, device=device, dtype=dtype)
    text = torch.zeros(1, model_cfg.text_len, model_cfg.text_dim, device=device, dtype=dtype)
    loss = flow.flow_matching_loss(engine, x0, text, torch.zeros_like(x0, dtype=torch.float32),
                                   torch.zeros(1, device=device), seq_shard=seq_shard)
    engine.backward(loss.sum() * 0.0)


def recover_after_oom(engine, accel, world: int) -> None:
    """Free what the failed micro-batch held. With one rank under ZeRO-3, an exception inside forward
    leaves gathered parameters and a half-recorded module trace: release them and end the trace step.
    With several ranks that release would make this rank gather parameters its peers keep (persistent
    ones), so its collectives would no longer match theirs; it is left out (docs/reliability.md: an OOM
    after the micro-batch's first collective cannot be recovered with several ranks)."""
    import gc

    gc.collect()
    if world == 1 and engine.zero_optimization_stage() == 3:
        coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
        coordinator.release_and_reset_all(engine.module)
        coordinator.reset_step()
    accel.empty_cache()


def dump_grads(engine, path, rank: int, step: int) -> None:
    """Tests: full fp32 parameters and the accumulated gradients of `step` (before clipping and the
    update), so a single process can recompute that step's gradient. Collective under ZeRO-3."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    params, grads = {}, {}
    for n, p in engine.module.named_parameters():
        full = safe_get_full_fp32_param(p)
        if full is None and hasattr(p, "ds_id"):  # a frozen ZeRO-3 parameter: no fp32 copy, gather the partitions
            from deepspeed.runtime.zero.partition_parameters import GatheredParameters

            with GatheredParameters([p]):
                full = p.detach().clone()
        params[n] = (p if full is None else full).detach().float().cpu().clone()
        if p.requires_grad:  # a frozen (LoRA base) parameter has no gradient
            grads[n] = safe_get_full_grad(p).detach().float().cpu().clone()
    if rank == 0:
        torch.save({"step": step, "params": params, "grads": grads}, path)
