"""AdaptiveLoader: the one path from the plan to micro-batches, for the trainer and for your own loop (loop.py).

It yields one `Step` per optimizer step, holding this rank's G `MicroBatch`es, each with what the plan decided:
the samples and their tokens, the loss weight, and (with --checkpoint-blocks auto) the checkpoint counts the model
runs it at. A torch DataLoader reads the micro-batches (workers, prefetch).
"""
from dataclasses import dataclass, field


@dataclass
class Settings:
    seed: int
    shift: float
    loss_weighting: str


@dataclass
class MicroBatch:
    """One micro-batch of this rank, as the plan decided it."""

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
    _settings: Settings = field(repr=False)
    tokens: list = field(default_factory=list)
    """Full-sequence tokens of each sample (a packed micro-batch mixes shapes)."""
    checkpoint: tuple = None
    """(k, k_full, k_ffn) the model runs this micro-batch at (schedule/memory.RecomputeCost.step_checkpoints: the counts
    the planner costs it with), and with adaptive_load.activation_offload a 4th, the checkpointed blocks whose input
    goes to host memory; None where the run checkpoints a fixed count."""

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

    @property
    def pad(self) -> list:
        """Positions of this rank's pad micro-batches."""
        return [g for g, mb in enumerate(self.micro_batches) if mb.pad]

    def __iter__(self):
        return iter(self.micro_batches)

    def __len__(self):
        return len(self.micro_batches)


class AdaptiveLoader:
    """Endless iterator of Steps, epoch after epoch (stop at your step count, as train_wan's --max-steps). The
    plan position of the last step handed out is `state_dict()`, a plain dict to store in the checkpoint.

    divisor: what DeepSpeed divides summed gradients by (sp.grad_divisor); lr: a BatchSizeLR told each step's
    sample count, or None; memory_model: (profile memory, num_layers) for --checkpoint-blocks auto, else None;
    offload: (adaptive_load.activation_offload, model dim) with memory_model: each micro-batch's checkpoint counts
    then carry how many of its checkpointed blocks offload their input (schedule/offload.py)."""

    def __init__(self, sampler, dataset, collate_fn, loader_kwargs, divisor, lr, settings, device=None, rank=0,
                 memory_model=None, offload=None):
        self.sampler, self.dataset, self.collate_fn = sampler, dataset, collate_fn
        self.loader_kwargs, self.divisor, self.lr, self.settings = loader_kwargs, divisor, lr, settings
        self.device, self.rank, self.memory_model, self.offload = device, rank, memory_model, offload
        """The per-step agreement's counter lives on `device` (the engine's: NCCL reduces CUDA tensors only)."""
        self._it = self._stream = self._state = None
        self._recompute = None  # RecomputeCost of memory_model, built at the first step

    def __len__(self):
        """Steps in the current epoch's plan."""
        return len(self.sampler)

    def __iter__(self):
        return self

    def start(self):
        """The DataLoader's iterator, started once (its workers are what a failing loop stops: setup.end_loop)."""
        if self._it is None:
            import torch

            from ds_adaptiveload.data.latents import MicroBatchStream

            self._stream = MicroBatchStream(self.sampler)
            self._it = iter(torch.utils.data.DataLoader(self.dataset, batch_sampler=self._stream,
                                                        collate_fn=self.collate_fn, **self.loader_kwargs))
        return self._it

    def __next__(self) -> Step:
        """The next Step, read before any compute and agreed over ranks (as the trainer's steps,
        docs/reliability.md): a bad sample or a killed DataLoader worker on one rank raises the same AgreedError on
        every rank (its exit code: e.code), before any rank enters the step's collectives. Raised on that rank alone,
        its peers would wait in their forward's collectives and die there with gloo's or NCCL's error instead."""
        from ds_adaptiveload.train import failures

        step, err = self.read()
        if failures.sum_over_ranks([err is not None], self.device)[0]:
            failures.agree(*((f"rank {self.rank}: {err[0]}", err[1]) if err else (None,)))
        return step

    def read(self, before=None, advice=None):
        """-> (the next Step, None), or (None, (error line, exit code)) when reading failed on this rank, not yet
        agreed (setup.read_micro_batches; before and advice as there): a loop that agrees on more per step (the
        trainer's bad samples) agrees on it once."""
        from ds_adaptiveload.train.setup import read_micro_batches

        batches, err = read_micro_batches(self.start(), self.sampler.cfg.grad_accum, before, advice)
        if err:
            return None, err
        ps = self._stream.pending.popleft()  # the DataLoader draws ahead; this is the step just read
        self._state = ps.state
        if self.lr is not None:
            self.lr.set_batch_size(ps.global_samples)
        return self._step(ps, batches), None

    def _step(self, ps, batches) -> Step:
        from ds_adaptiveload.train import flow

        weight = flow.loss_scale(self.divisor, self.sampler.cfg.grad_accum, ps.global_samples)
        tokens = [self._tokens(mb) for mb in ps.micro_batches]
        ks = self._checkpoints(ps, tokens)
        mbs = []
        for g, b in enumerate(batches):
            indices = list(ps.micro_batches[g])
            if isinstance(b, dict) and "index" in b and list(b["index"]) != indices:
                raise RuntimeError(f"micro-batch {g} of step {ps.step} holds samples {b['index']}, the plan {indices}")
            mbs.append(MicroBatch(b, indices, 0.0 if g in ps.pad else weight, g in ps.pad, ps.epoch, self.settings,
                                  tokens[g], ks[g] if ks else None))
        return Step(mbs, ps.epoch, ps.step, ps.global_samples, ps.pred_ms, ps.pred_wall_ms)

    def _tokens(self, indices) -> list:
        geo, samples = self.sampler.profile.geometry, self.sampler.samples
        return [geo.tokens(s.frames, s.height, s.width) for s in (samples[i] for i in indices)]

    def _checkpoints(self, ps, tokens=None):
        """(k, k_full, k_ffn) of each micro-batch of the step (its samples' `tokens`, read from the samples when not
        given) under the plan's checkpoint mode, or None. The counts come from the planner's RecomputeCost, cached
        per (tokens, samples)."""
        if self.memory_model is None:
            return None
        if tokens is None:
            tokens = [self._tokens(mb) for mb in ps.micro_batches]
        cfg = self.sampler.cfg
        every = (self._tokens(mb) for mbs in ps.all_micro_batches for mb in mbs)  # read under auto-step only
        return self.recompute().step_checkpoints(cfg.checkpoint, cfg.sp, tokens, every)

    def recompute(self):
        """The RecomputeCost the counts come from (None without memory_model), built once."""
        if self.memory_model is None:
            return None
        from ds_adaptiveload.schedule.memory import RecomputeCost

        cfg = self.sampler.cfg
        if self._recompute is None:
            memory, num_layers = self.memory_model
            # recompute fractions 0: only plan()'s counts are used here, not the time factors
            self._recompute = RecomputeCost(memory, num_layers, 0.0, policy=cfg.checkpoint_policy)
            if self.offload is not None and self.offload[0] != "off":
                from ds_adaptiveload.schedule.offload import attach

                prof = self.sampler.profile  # "auto" weighs recompute time: the profile's fractions
                self._recompute = attach(RecomputeCost(memory, num_layers, prof.recompute_frac,
                                                       prof.attention_recompute_frac, cfg.checkpoint_policy,
                                                       prof.ffn_recompute_frac), *self.offload, prof)
        return self._recompute

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
