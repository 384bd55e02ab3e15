"""The scheduler in your own DeepSpeed loop: `get_dataloader_and_lr_scheduler` (docs/training.md).

DeepSpeed's dynamic batching hands out variable-size micro-batches through
`get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(dataset, engine, ...)`. This is the
same shape of call for the compute-balanced plan: every step yields this rank's G micro-batches, each with
the loss weight that makes the step's gradient the mean over the step's samples (what launch/train_wan.py
does: ZeRO stage and Ulysses SP taken into account through sp.grad_divisor), and the engine's LR schedule
is wrapped to scale with the step's sample count (lr_scaling.BatchSizeLR).

    for batches in loader:                   # one optimizer step
        for mb in batches:                   # G micro-batches
            eps, t = mb.noise(x0)            # optional: noise and t seeded per sample, as train_wan
            per_sample = ...                 # [B] losses of mb.batch
            engine.backward(mb.loss(per_sample, t))
            engine.step()
"""
import logging

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.loader import AdaptiveLoader, MicroBatch, Settings, Step  # noqa: F401 (the loader API)

logger = logging.getLogger(__name__)


def _engine_config(engine, config):
    """The DeepSpeed dict: `config` (a dict or a JSON path), else the one the engine was initialised with."""
    from ds_adaptiveload.fileio import read_json_object

    if config is None:
        return dict(engine._config._param_dict), None
    if isinstance(config, dict):
        return config, None
    return read_json_object(config, "DeepSpeed config"), str(config)


def _parallel_dims(engine, ds):
    import torch.distributed as dist

    from ds_adaptiveload.train import sp

    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    k = ds.get("sequence_parallel_size", 1)
    if not isinstance(k, int) or k < 1 or world % k:
        raise UserError(f"sequence_parallel_size must be a positive integer dividing the world size {world}, got {k!r}")
    return sp.ParallelDims(world=world, sp=k, rank=rank)


def get_dataloader_and_lr_scheduler(engine, dataset, samples, profile=None, collate_fn=None, config=None,
                                    timestep_shift=5.0, num_workers=None, pin_memory=None, prefetch_factor=2):
    """-> (AdaptiveLoader, BatchSizeLR) for a DeepSpeed engine (_build's docstring says what each argument is).
    Called on every rank: an error on any rank (a profile one node cannot read, bad config) raises the same
    AgreedError on every rank (failures.agreed), so no rank goes on into training while a peer has left."""
    from ds_adaptiveload.train import failures

    return failures.agreed(_build, engine, dataset, samples, profile, collate_fn, config, timestep_shift, num_workers,
                           pin_memory, prefetch_factor)


def _build(engine, dataset, samples, profile, collate_fn, config, timestep_shift, num_workers, pin_memory,
           prefetch_factor):
    """-> (AdaptiveLoader, BatchSizeLR) for a DeepSpeed engine; the LR scheduler is installed as
    `engine.lr_scheduler` (so engine.step() steps it and checkpoints carry it).

    dataset: any map-style Dataset whose index i is samples[i]; samples: manifest Samples (id, frames,
    height, width; schedule.manifest.load_manifest). profile: a CostProfile or YAML path (default
    adaptive_load.profile). collate_fn: default data.latents.first for a LatentDataset (it stacks itself),
    else torch's default_collate. config: the DeepSpeed dict or JSON path holding `adaptive_load` (top level
    or data_efficiency.data_sampling.adaptive_load); default the engine's. num_workers / pin_memory: default
    data_efficiency.data_sampling.num_workers / pin_memory, as DeepSpeed's loader, else 0 / False."""
    from ds_adaptiveload.data import latents
    from ds_adaptiveload.model.config import WanConfig
    from ds_adaptiveload.schedule.profile import CostProfile
    from ds_adaptiveload.schedule.sampler import AdaptiveSampler
    from ds_adaptiveload.train import config as train_config, lr_scaling, sp
    from ds_adaptiveload.train.setup import gpu_of, profile_for_run

    ds, source = _engine_config(engine, config)
    al = train_config.adaptive_load_section(ds, source or "DeepSpeed config")
    for key in ("on_bad_sample", "on_oom"):
        if getattr(al, key) != "error":
            raise UserError(f"adaptive_load.{key} \"skip\" is handled by launch/train_wan.py's loop, not by "
                            f"get_dataloader_and_lr_scheduler; set it to \"error\"")
    if len(samples) != len(dataset):
        raise UserError(f"samples ({len(samples)}) and dataset ({len(dataset)}) differ in length; index i of the "
                        f"dataset must be samples[i]")
    dims = _parallel_dims(engine, ds)
    gpu, lines = gpu_of(getattr(engine, "device", None)), []
    if profile is None:
        model_cfg = getattr(getattr(engine, "module", None), "cfg", None)  # a WanModel's
        profile, lines = al.profile_path(source, model_cfg if isinstance(model_cfg, WanConfig) else None,
                                         engine.zero_optimization_stage(), dims.sp, gpu)
    if not isinstance(profile, CostProfile):
        profile = CostProfile.load(profile)
    # the profile's memory moved to this run's ZeRO stage, world size and GPU (schedule/zero.py, profile.for_device)
    profile, moved = profile_for_run(profile, engine.zero_optimization_stage(), dims, gpu=gpu)
    lines += moved
    for line in lines if dims.rank == 0 else ():
        logger.info(f"[ds_adaptiveload] {line}")
    G = engine.gradient_accumulation_steps()
    train_config.check_grad_accum(G, dims.dp, len(samples), f"{source or 'DeepSpeed config'}: "
                                  f"gradient_accumulation_steps", "`samples`")
    plan_cfg = al.plan_config(dims.world, dims.sp, G, engine.zero_optimization_stage())
    sampler = AdaptiveSampler(samples, profile, plan_cfg, dims.dp_rank)
    lr = lr_scaling.install(engine, al.lr_scaling_method, al.lr_reference_batch_size)
    if collate_fn is None:
        import torch.utils.data

        if al.policy == "packed" and not isinstance(dataset, latents.LatentDataset):
            # a packed micro-batch mixes shapes, which default_collate cannot stack (and a one-shape model cannot run)
            raise UserError("adaptive_load.policy \"packed\" (the default) builds micro-batches of several shapes: "
                            "pass a collate_fn that takes them (and a model that runs them, as WanModel does), or "
                            "set adaptive_load.policy to \"balanced\" for one shape per micro-batch")
        collate_fn = latents.first if isinstance(dataset, latents.LatentDataset) else torch.utils.data.default_collate
    sampling = (ds.get("data_efficiency") or {}).get("data_sampling") or {}
    workers = sampling.get("num_workers", 0) if num_workers is None else num_workers
    loader_kwargs = {"num_workers": workers, "prefetch_factor": prefetch_factor if workers else None,
                     "pin_memory": bool(sampling.get("pin_memory", False) if pin_memory is None else pin_memory)}
    settings = Settings(al.seed, timestep_shift, al.loss_weighting)
    loader = AdaptiveLoader(sampler, dataset, collate_fn, loader_kwargs, sp.grad_divisor(engine, dims), lr, settings,
                            getattr(engine, "device", None), dims.rank)
    return loader, lr
