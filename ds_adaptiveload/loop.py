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
from dataclasses import dataclass, field

from ds_adaptiveload.errors import UserError

logger = logging.getLogger(__name__)


@dataclass
class _Settings:
    seed: int
    shift: float
    loss_weighting: str


@dataclass
class MicroBatch:
    """One micro-batch of this rank: samples of one shape."""

    batch: object
    """What the Dataset (and collate_fn) returned for `indices`."""
    indices: list
    """Sample indices into `samples` / the Dataset."""
    weight: float
    """Factor for the micro-batch's *sum* of per-sample losses (flow.loss_scale); 0.0 for a pad."""
    pad: bool
    """A repeated sample that keeps ranks in lockstep at an epoch's end: trained with weight 0."""
    epoch: int
    """Epoch of the plan this micro-batch comes from."""
    _settings: _Settings = field(repr=False)

    def noise(self, x0):
        """(eps like x0, t [B]) seeded by (seed, epoch, sample index): independent of rank, micro-batch and
        resumption, equal on SP peers (flow.draw_noise, with Wan's timestep shift)."""
        from ds_adaptiveload.train import flow

        return flow.draw_noise(x0, self.indices, self._settings.seed, self.epoch, self._settings.shift)

    def loss(self, per_sample, t=None):
        """The scalar to pass to engine.backward: sum_i w(t_i) l_i * weight, w from
        adaptive_load.loss_weighting (needs the timesteps t unless it is none)."""
        from ds_adaptiveload.train import flow

        return flow.weighted_sum(per_sample, t, self._settings.loss_weighting, self._settings.shift) * self.weight


@dataclass
class Step:
    """One optimizer step of this rank; iterating gives its G MicroBatches."""

    micro_batches: list
    epoch: int
    step: int
    """Index of the step within the epoch's plan."""
    global_samples: int
    """Real samples of the step over all data-parallel ranks (the loss normaliser, the LR's batch size)."""
    pred_ms: list
    """Predicted compute ms of every data-parallel rank."""
    pred_wall_ms: float

    def __iter__(self):
        return iter(self.micro_batches)

    def __len__(self):
        return len(self.micro_batches)


class AdaptiveLoader:
    """Endless iterator of Steps, epoch after epoch (stop at your step count, as train_wan's --max-steps).
    A torch DataLoader reads the micro-batches (workers, prefetch); the plan position of the last step
    handed out is `state_dict()`, a plain dict to store in the checkpoint's client_state."""

    def __init__(self, sampler, dataset, collate_fn, loader_kwargs, divisor, lr, settings, device=None, rank=0):
        self.sampler, self.dataset, self.collate_fn = sampler, dataset, collate_fn
        self.loader_kwargs, self.divisor, self.lr, self.settings = loader_kwargs, divisor, lr, settings
        self.device, self.rank = device, rank
        """The per-step agreement's counter lives on `device` (the engine's: NCCL reduces CUDA tensors only)."""
        self._it = self._stream = self._state = None

    def __len__(self):
        """Steps in the current epoch's plan."""
        return len(self.sampler)

    def __iter__(self):
        return self

    def _start(self):
        import torch

        from ds_adaptiveload.data.latents import MicroBatchStream

        self._stream = MicroBatchStream(self.sampler)
        self._it = iter(torch.utils.data.DataLoader(self.dataset, batch_sampler=self._stream,
                                                    collate_fn=self.collate_fn, **self.loader_kwargs))

    def __next__(self) -> Step:
        from ds_adaptiveload.train import flow

        if self._it is None:
            self._start()
        G = self.sampler.cfg.grad_accum
        batches = self._read(G)
        ps = self._stream.pending.popleft()  # the DataLoader draws ahead; this is the step just read
        self._state = ps.state
        weight = flow.loss_scale(self.divisor, G, ps.global_samples)
        mbs = [MicroBatch(b, list(ps.micro_batches[g]), 0.0 if g in ps.pad else weight, g in ps.pad, ps.epoch,
                          self.settings) for g, b in enumerate(batches)]
        self.lr.set_batch_size(ps.global_samples)
        return Step(mbs, ps.epoch, ps.step, ps.global_samples, ps.pred_ms, ps.pred_wall_ms)

    def _read(self, G) -> list:
        """The step's G micro-batches, read before any compute and agreed over ranks (as the trainer's steps,
        docs/reliability.md): a bad sample or a killed DataLoader worker on one rank raises the same AgreedError on
        every rank (its exit code: e.code), before any rank enters the step's collectives. Raised on that rank alone,
        its peers would wait in their forward's collectives and die there with gloo's or NCCL's error instead."""
        from ds_adaptiveload.train import failures
        from ds_adaptiveload.train.setup import read_micro_batches

        batches, err = read_micro_batches(self._it, G)
        if failures.sum_over_ranks([err is not None], self.device)[0]:
            failures.agree(*((f"rank {self.rank}: {err[0]}", err[1]) if err else (None,)))
        return batches

    def state_dict(self) -> dict:
        """Points at the step after the last one handed out (not at what the DataLoader prefetched)."""
        return dict(self._state) if self._state is not None else self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position; refuses a state from another manifest, seed or layout."""
        self.close()
        self.sampler.load_state_dict(state)
        self._state = dict(state)

    def close(self) -> None:
        """Stop the DataLoader's workers (also done by load_state_dict)."""
        self._it = self._stream = None


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
    settings = _Settings(al.seed, timestep_shift, al.loss_weighting)
    loader = AdaptiveLoader(sampler, dataset, collate_fn, loader_kwargs, sp.grad_divisor(engine, dims), lr, settings,
                            getattr(engine, "device", None), dims.rank)
    return loader, lr
