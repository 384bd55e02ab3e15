"""Memory-aware activation checkpointing, the planning half: how many of a micro-batch's blocks must be
checkpointed to fit, and what the recompute that remains costs. Pure Python: no torch.

Memory model of one micro-batch of `samples` samples holding `tokens` tokens in all, with the first k of
L blocks checkpointed (the profile's memory section, as `calibrate` fits it with every block checkpointed):

    peak(k) = fixed_bytes + bytes_per_sample * samples + tokens * (bytes_per_token + (L - k) * block_bytes_per_token)
              + samples * (L - k) * block_bytes_per_sample

block_bytes_per_token is what one block left un-checkpointed adds per token (its saved activations, less
the block input a checkpointed block keeps anyway); bench/mfu.py measures it as
(bytes/token with no block checkpointed - with all) / L. block_bytes_per_sample (optional, 0 if absent) is what
an open block adds per sample whatever its tokens: the cross-attention's keys and values of the text context.
On the H200 a 32-image micro-batch with 24 open blocks peaked 6.4 GiB over the model without it (2026-12-01); bench/mfu.py measures it from a probe of several samples. A micro-batch fits when peak(k) <= capacity_bytes
* safety. Without block_bytes_per_token every block is checkpointed (the behaviour before this module).

Time: a profile calibrated with every block checkpointed predicts t; with k of L checkpointed the recompute
of L - k blocks is gone:  t(k) = t * (1 - recompute_frac * (1 - k / L)),  recompute_frac (time_ms section)
being the share of fwd+bwd that is recompute when all L are checkpointed (0 or absent: no change). Under the
attention policy the k - k_full checkpointed blocks that keep their attention outputs also skip attention's
recompute: - attention_recompute_frac * (k - k_full) / L more. `calibrate` measures both (calibrate/blocks.py);
RecomputeCost is what the planner costs micro-batches with under --checkpoint-blocks auto.

FFN outputs (attention policy, optional memory.ffn_bytes_per_token and time_ms.ffn_recompute_frac): a kept block
may also keep its FFN's output (model/wan.save_attention_ffn_policy), ffn_bytes_per_token more per token, and skip
that matmul's recompute, ffn_recompute_frac / L of the fully checkpointed time. On the H200 it bought 3-5x more
time per byte than opening a block (bench/model/ckpt_policy.py, docs/history/benchmarks.md), so memory goes, in this
order, to every block's attention outputs, then every block's FFN output, then open blocks; ffn_blocks says how
many of the k checkpointed blocks got theirs.
"""
import math

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.schedule.geometry import per_gpu_tokens

DEFAULT_SAFETY = 0.9  # calibrate's default share of device memory the budget may use


def profile_number(mem: dict, key: str, default=None) -> float:
    v = mem.get(key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise UserError(f"profile: memory.{key} must be a finite number >= 0, got {v!r}")
    return float(v)


def _free_bytes(tokens: int, samples: int, profile_memory: dict) -> float:
    """capacity * safety - peak(k = L): what is left beyond every block checkpointed (the profile has
    capacity_bytes and bytes_per_token)."""
    safety = profile_number(profile_memory, "safety", DEFAULT_SAFETY)
    if not 0 < safety <= 1:
        raise UserError(f"profile: memory.safety must be in (0, 1], got {safety!r}")
    return (profile_number(profile_memory, "capacity_bytes") * safety
            - profile_number(profile_memory, "fixed_bytes", 0.0)
            - profile_number(profile_memory, "bytes_per_sample", 0.0) * samples
            - profile_number(profile_memory, "bytes_per_token") * tokens)


def _beyond_attention(tokens: int, samples: int, profile_memory: dict, num_layers: int) -> float:
    """What is left once every block is checkpointed and keeps its attention outputs (attention_bytes_per_token):
    the bytes selective_checkpoint and ffn_blocks share out to FFN outputs and open blocks."""
    attn = profile_number(profile_memory, "attention_bytes_per_token", 0.0)
    return _free_bytes(tokens, samples, profile_memory) - num_layers * attn * tokens


def blocks_to_checkpoint(tokens: int, samples: int, profile_memory: dict, num_layers: int) -> int:
    """The fewest blocks k (checkpointing blocks 0..k-1) with which the micro-batch fits, from 0 to
    num_layers. num_layers when the profile has no block_bytes_per_token, no capacity_bytes or no
    bytes_per_token (today's behaviour: checkpoint everything), or when even k = num_layers does not fit
    (the planner's token budget is what keeps such micro-batches out)."""
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
        raise UserError(f"blocks_to_checkpoint: num_layers must be a positive int, got {num_layers!r}")
    for name, v in (("tokens", tokens), ("samples", samples)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise UserError(f"blocks_to_checkpoint: {name} must be an int >= 0, got {v!r}")
    if not isinstance(profile_memory, dict):
        raise UserError(f"blocks_to_checkpoint: profile_memory must be the profile's memory mapping, "
                        f"got {type(profile_memory).__name__}")
    block = profile_number(profile_memory, "block_bytes_per_token")
    capacity = profile_number(profile_memory, "capacity_bytes")
    per_token = profile_number(profile_memory, "bytes_per_token")
    if block is None or capacity is None or per_token is None:
        return num_layers
    per_block = block * tokens + profile_number(profile_memory, "block_bytes_per_sample", 0.0) * samples
    if tokens == 0 or per_block == 0:
        return 0
    free = _free_bytes(tokens, samples, profile_memory)
    # Un-checkpointed blocks the free bytes hold; the rest must be checkpointed.
    full = math.floor(free / per_block) if free > 0 else 0
    return max(0, num_layers - min(full, num_layers))


def selective_checkpoint(tokens: int, samples: int, profile_memory: dict, num_layers: int) -> tuple:
    """(k, k_full) under the "attention" checkpoint policy: blocks 0..k-1 checkpointed, the first k_full of
    them recomputed whole and the rest keeping their attention outputs (memory.attention_bytes_per_token more
    per token each). Keeping attention buys the most recompute per byte (attention is most of a long clip's
    FLOPs, its outputs a few KB per token), so every block gets it before any block goes un-checkpointed.
    Without attention_bytes_per_token: (blocks_to_checkpoint, same k), i.e. every checkpointed block whole."""
    k = blocks_to_checkpoint(tokens, samples, profile_memory, num_layers)
    attn = profile_number(profile_memory, "attention_bytes_per_token")
    if attn is None or tokens == 0 or profile_number(profile_memory, "capacity_bytes") is None:
        return k, k  # without a capacity blocks_to_checkpoint checkpoints every block: all recomputed whole
    block = profile_number(profile_memory, "block_bytes_per_token") or 0.0
    free = _free_bytes(tokens, samples, profile_memory)
    if free <= 0:
        return num_layers, num_layers
    kept = num_layers if attn == 0 else min(num_layers, math.floor(free / (attn * tokens)))
    if kept < num_layers:
        return num_layers, num_layers - kept
    ffn = profile_number(profile_memory, "ffn_bytes_per_token", 0.0)
    rest = _beyond_attention(tokens, samples, profile_memory, num_layers) - num_layers * ffn * tokens
    if rest < 0:  # not every block's FFN output fits: no block opens (ffn_blocks says how many keep theirs)
        return num_layers, 0
    # an open block adds its activations less what a kept block holds already, and its per-sample bytes
    per_block = (block - attn - ffn) * tokens + profile_number(profile_memory, "block_bytes_per_sample", 0.0) * samples
    open_ = num_layers if per_block <= 0 else min(num_layers, math.floor(rest / per_block))
    return num_layers - open_, 0


def ffn_blocks(tokens: int, samples: int, profile_memory: dict, num_layers: int, k: int, k_full: int) -> int:
    """Of selective_checkpoint's k checkpointed blocks (k_full of them whole), how many also keep their FFN output
    (memory.ffn_bytes_per_token each per token): none without the field or when a block recomputes whole, all k
    when a block is open, else as many as the bytes beyond every block's attention outputs hold."""
    ffn = profile_number(profile_memory, "ffn_bytes_per_token")
    if not ffn or k_full > 0 or k == 0 or tokens == 0:
        return 0
    if k < num_layers:
        return k
    rest = _beyond_attention(tokens, samples, profile_memory, num_layers)
    return max(0, min(num_layers, math.floor(rest / (ffn * tokens))))


def predicted_peak_bytes(tokens: int, samples: int, profile_memory: dict, num_layers: int, k: int,
                         k_full: int = None, k_ffn: int = 0) -> float:
    """peak(k) of the module docstring (needs fixed_bytes, bytes_per_token; block_bytes_per_token 0 if absent).
    k_full (the "attention" policy, selective_checkpoint's pair): of the k checkpointed blocks all but the first
    k_full keep their attention outputs, memory.attention_bytes_per_token more per token each; None: k. k_ffn
    (ffn_blocks) of those also keep their FFN output, memory.ffn_bytes_per_token more each."""
    k_full = k if k_full is None else k_full
    if not 0 <= k_full <= k <= num_layers or not 0 <= k_ffn <= k - k_full:
        raise UserError(f"predicted_peak_bytes: need 0 <= k_full <= k <= {num_layers} and 0 <= k_ffn <= k - k_full, "
                        f"got k={k!r}, k_full={k_full!r}, k_ffn={k_ffn!r}")
    per_token = profile_number(profile_memory, "bytes_per_token")
    if per_token is None:
        raise UserError("predicted_peak_bytes: the profile has no memory.bytes_per_token")
    block = profile_number(profile_memory, "block_bytes_per_token", 0.0)
    attn = profile_number(profile_memory, "attention_bytes_per_token", 0.0)
    block_sample = profile_number(profile_memory, "block_bytes_per_sample", 0.0)
    return (profile_number(profile_memory, "fixed_bytes", 0.0)
            + profile_number(profile_memory, "bytes_per_sample", 0.0) * samples
            + tokens * (per_token + (num_layers - k) * block + (k - k_full) * attn
                        + k_ffn * profile_number(profile_memory, "ffn_bytes_per_token", 0.0))
            + samples * (num_layers - k) * block_sample)


def checkpoint_ks(tokens: int, samples: int, profile_memory: dict, num_layers: int, policy: str = "full") -> tuple:
    """(k, k_full) of a micro-batch under --checkpoint-policy `policy`: blocks_to_checkpoint with every checkpointed
    block recomputed whole (full), or selective_checkpoint (attention). What the trainer sets and the planner costs."""
    if policy == "attention":
        return selective_checkpoint(tokens, samples, profile_memory, num_layers)
    k = blocks_to_checkpoint(tokens, samples, profile_memory, num_layers)
    return k, k


def checkpoint_plan(tokens: int, samples: int, profile_memory: dict, num_layers: int, policy: str = "full") -> tuple:
    """(k, k_full, k_ffn) of a micro-batch: checkpoint_ks, and how many of its checkpointed blocks keep their FFN
    output (ffn_blocks; 0 under full). The one answer the trainer sets the model to and the planner costs."""
    k, k_full = checkpoint_ks(tokens, samples, profile_memory, num_layers, policy)
    return k, k_full, ffn_blocks(tokens, samples, profile_memory, num_layers, k, k_full)


def recompute_factor(k: int, num_layers: int, recompute_frac: float = 0.0, k_full: int = None,
                     attention_frac: float = 0.0, k_ffn: int = 0, ffn_frac: float = 0.0) -> float:
    """t(k) / t(all checkpointed) = 1 - recompute_frac * (L - k) / L - attention_frac * (k - k_full) / L
    - ffn_frac * k_ffn / L: the open blocks skip their recompute, under the attention policy the k - k_full blocks
    that keep their attention outputs skip attention's share of it (attention_frac, time_ms.attention_recompute_frac),
    and the k_ffn of them that keep their FFN output that matmul's (ffn_frac, time_ms.ffn_recompute_frac)."""
    if not isinstance(num_layers, int) or num_layers < 1:
        raise UserError(f"recompute_factor: num_layers must be a positive int, got {num_layers!r}")
    k_full = k if k_full is None else k_full
    if not 0 <= k_full <= k <= num_layers or not 0 <= k_ffn <= k - k_full:
        raise UserError(f"recompute_factor: need 0 <= k_full <= k <= {num_layers} and 0 <= k_ffn <= k - k_full, "
                        f"got k={k!r}, k_full={k_full!r}, k_ffn={k_ffn!r}")
    out = 1.0
    for name, frac, blocks in (("recompute_frac", recompute_frac, num_layers - k),
                               ("attention_recompute_frac", attention_frac, k - k_full),
                               ("ffn_recompute_frac", ffn_frac, k_ffn)):
        if frac is None:
            continue
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 <= frac < 1:
            raise UserError(f"profile: time_ms.{name} must be in [0, 1), got {frac!r}")
        out -= frac * blocks / num_layers
    return out


class RecomputeCost:
    """The planner's side of --checkpoint-blocks auto: the time factor of a micro-batch of `tokens` (per GPU) and
    `samples`, at the k (and k_full, attention policy) the trainer will choose for it from the same memory model.
    RecomputeCost.of(profile, policy) is None when the profile cannot say (no recompute_frac, no
    block_bytes_per_token or capacity_bytes, or no meta.model.num_layers): its times are then taken as they are."""

    def __init__(self, memory: dict, num_layers: int, recompute_frac: float, attention_frac: float = 0.0,
                 policy: str = "full", ffn_frac: float = 0.0):
        if policy not in ("full", "attention"):
            raise UserError(f"checkpoint policy must be full or attention, got {policy!r}")
        self.memory, self.L, self.policy = memory, num_layers, policy
        self.recompute_frac, self.attention_frac, self.ffn_frac = recompute_frac, attention_frac, ffn_frac
        self.offload = None  # set_offload: (tokens, samples) -> (k, k_full, k_ffn, offloaded blocks)
        self.exposed = None  # set_offload: (tokens, n, t_ms) -> host-copy ms that n offloaded blocks do not hide
        recompute_factor(num_layers, num_layers, recompute_frac, 0, attention_frac, num_layers, ffn_frac)  # validates
        self._cache = {}

    @classmethod
    def of(cls, profile, policy: str = "full"):
        mem, model = profile.memory, profile.meta.get("model")
        L = model.get("num_layers") if isinstance(model, dict) else None
        if (not profile.recompute_frac or not isinstance(L, int) or isinstance(L, bool) or L < 1
                or any(mem.get(key) is None for key in ("block_bytes_per_token", "capacity_bytes", "bytes_per_token"))):
            return None
        return cls(mem, L, profile.recompute_frac, profile.attention_recompute_frac, policy,
                   profile.ffn_recompute_frac)

    def set_offload(self, planner, exposed=None) -> "RecomputeCost":
        """adaptive_load.activation_offload under --checkpoint-blocks auto (schedule/offload.attach): plan() then gives
        planner(tokens, samples), (k, k_full, k_ffn, n) with n of the checkpointed blocks offloaded, and ms() adds
        exposed(tokens, n, t_ms), the host-copy time they do not hide; None: as before."""
        self.offload, self.exposed = planner, exposed
        self._cache = {}
        return self

    def plan(self, tokens: int, samples: int) -> tuple:
        """(k, k_full, k_ffn) as the trainer sets them (checkpoint_plan); with set_offload, (k, k_full, k_ffn, n)."""
        key = ("plan", tokens, samples)
        if key not in self._cache:
            self._cache[key] = (checkpoint_plan(tokens, samples, self.memory, self.L, self.policy)
                                if self.offload is None else self.offload(tokens, samples))
        return self._cache[key]

    def step_k(self, micro_batches) -> int:
        """Under auto-step (ZeRO-3) the k every micro-batch of a step runs at: the largest plan() k over the step's
        micro-batches on every rank, given as (per-GPU tokens, samples). ZeRO-3 replays the module order it
        recorded, so the count must match on every rank, and the plan alone gives it without communication."""
        return max(self.plan(t, n)[0] for t, n in micro_batches)

    def step_plans(self, mode: str, rank_mbs: list, all_mbs) -> list:
        """(k, k_full, k_ffn) of each of a rank's micro-batches ((per-GPU tokens, samples) each) under
        PlanConfig.checkpoint `mode`: auto, each its own plan(); auto-step, all at step_k(all_mbs), recomputed
        whole (with set_offload, offloading the most blocks any of them does); None under all (the model keeps its
        fixed count)."""
        if mode == "all":
            return None
        if mode == "auto-step":
            return [self.step_plan(all_mbs)] * len(rank_mbs)
        return [self.plan(t, n) for t, n in rank_mbs]

    def step_plan(self, micro_batches) -> tuple:
        """auto-step: the (k, k, 0) every micro-batch of the step runs at (step_k), recomputed whole; with set_offload
        (k, k, 0, n), n the most blocks any of them offloads (more offload only lowers a peak)."""
        all_mbs = list(micro_batches)
        k = self.step_k(all_mbs)
        if self.offload is not None:
            return k, k, 0, min(k, max(self.plan(t, n)[3] for t, n in all_mbs))
        return k, k, 0

    def step_checkpoints(self, mode: str, sp: int, rank_tokens: list, all_tokens=()) -> list:
        """step_plans of a rank's micro-batches given as their samples' full-sequence tokens, split over `sp` GPUs:
        the counts the loader hands the model and `plan --dump` shows. all_tokens: every rank's micro-batches of
        the step, read under auto-step only."""
        def cost(tokens):  # (this GPU's tokens, samples) of a micro-batch
            return sum(per_gpu_tokens(S, sp) for S in tokens), len(tokens)

        every = (cost(t) for t in all_tokens) if mode == "auto-step" else ()
        return self.step_plans(mode, [cost(t) for t in rank_tokens], every)

    def ks(self, tokens: int, samples: int) -> tuple:
        """(k, k_full) of plan()."""
        return self.plan(tokens, samples)[:2]

    def ffn_blocks(self, tokens: int, samples: int) -> int:
        """How many of the micro-batch's own checkpointed blocks keep their FFN output (plan()'s k_ffn)."""
        return self.plan(tokens, samples)[2]

    def factor(self, tokens: int, samples: int, ks: tuple = None) -> float:
        """recompute_factor at ks ((k, k_full) or a plan (k, k_full, k_ffn[, n]); default: this micro-batch's own,
        its FFN-keeping blocks included)."""
        ks = None if ks is None else (*ks, 0)[:3]
        key = ("factor", tokens, samples) if ks is None else ("at", *ks)
        if key not in self._cache:
            k, k_full, k_ffn = self.plan(tokens, samples)[:3] if ks is None else ks
            self._cache[key] = recompute_factor(k, self.L, self.recompute_frac, k_full, self.attention_frac, k_ffn,
                                                self.ffn_frac)
        return self._cache[key]

    def ms(self, t_ms: float, tokens: int, samples: int, ks: tuple = None) -> float:
        """Predicted ms of a micro-batch whose time with every block checkpointed is t_ms, at ks (factor's; default
        its own plan): t_ms * factor, plus with set_offload the host-copy time its offloaded blocks do not hide."""
        out = t_ms * self.factor(tokens, samples, ks)
        if self.exposed is None:
            return out
        plan = self.plan(tokens, samples) if ks is None else ks
        return out + self.exposed(tokens, plan[3] if len(plan) > 3 else 0, t_ms)


def plan_checkpoints(plan, samples, geometry, cfg, recompute):
    """{(step, rank, micro): (k, k_full, k_ffn)}: the checkpoint counts the trainer runs each micro-batch at under
    --checkpoint auto or auto-step, from the same RecomputeCost.step_checkpoints as the loader; None without
    `recompute` (checkpoint all, or a profile without the memory model). The plan stores no counts: they are a
    function of the micro-batch and the profile, derived where they are used."""
    if recompute is None:
        return None

    def tokens(mb):
        return [geometry.tokens(samples[i].frames, samples[i].height, samples[i].width) for i in mb]

    out = {}
    for s, step in enumerate(plan.steps):
        every = [tokens(mb) for mbs in step for mb in mbs]
        for r, mbs in enumerate(step):
            ks = recompute.step_checkpoints(cfg.checkpoint, cfg.sp, [tokens(mb) for mb in mbs], every)
            out.update(((s, r, m), list(k)) for m, k in enumerate(ks))
    return out
