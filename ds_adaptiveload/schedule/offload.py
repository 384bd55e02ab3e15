"""Activation offload, the planning half: how many of a micro-batch's checkpointed blocks keep their input in pinned
host memory instead of device memory (model/offload.py), and what that costs against recompute. Pure Python: no torch.

Memory: a checkpointed block keeps its input from forward to backward, tokens x dim x 2 bytes in bf16
(input_bytes_per_token). The profile's bytes_per_token, calibrated with every block checkpointed, holds L of them;
with n of the k checkpointed blocks offloaded, n x input_bytes_per_token x tokens leave the peak, so
peak(k, n) = peak(k) - n * input_bytes_per_token * tokens (n <= k). The bytes freed can open blocks (less recompute)
or let a micro-batch that does not fit with every block checkpointed fit.

Time: an offloaded block's input goes to the host during the next block's forward and comes back during the backward
of the block after it, each copy bytes / host_link_bytes_per_s. A copy hides behind that compute and costs only what
exceeds it: exposed(n) = n * (max(0, copy - fwd) + max(0, copy - 2 * fwd)), fwd = one block's forward, which is what
recomputing a fully checkpointed block costs (time_ms.recompute_frac * t / L, t the micro-batch's time with every
block checkpointed). Recompute costs t * recompute_factor(k, ...) (schedule/memory.py). "auto" takes the n with the
least predicted time among those that fit, the fewest on a tie (offload is off where it buys nothing).

Pinned host memory: each offloaded input gets its own pinned buffer, which CUDA's caching host allocator (torch's
CachingHostAllocator) rounds up to a power of two and keeps when freed, for a later buffer of that size; a micro-batch's
buffers are freed when the next forward begins (model/offload.py), so nothing is double-buffered. A micro-batch holds
n * pinned_buffer_bytes; over an epoch a rank holds, per buffer size, the most buffers of that size one of its
micro-batches takes (pinned_host_bytes). Where the profile gives memory.host_bytes_per_rank, "auto" offloads no more
than one micro-batch's buffers fit in it and an integer that does not fit is an error.

host_link_bytes_per_s (profile memory.host_link_bytes_per_s, which calibrate measures on CUDA: calibrate/host_link.py;
else DEFAULT_HOST_LINK_BYTES_PER_S): an H100 SXM's
PCIe Gen5 x16 link moves 64 GB/s per direction on paper; pinned device-to-host copies reach about half of it beside
training traffic, so the default is 25e9, a chosen value, not measured here.
"""
import math

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.schedule.geometry import per_gpu_tokens
from ds_adaptiveload.schedule.memory import (DEFAULT_SAFETY, checkpoint_plan, predicted_peak_bytes, profile_number,
                                             recompute_factor)

DEFAULT_HOST_LINK_BYTES_PER_S = 25e9
BWD_PER_FWD = 2.0  # a block's backward against its forward: the window the copy back hides in


def input_bytes_per_token(dim: int, dtype_bytes: int = 2) -> int:
    """What a checkpointed block keeps per token: its input, dim values of dtype_bytes (bf16: 2)."""
    return int(dim) * int(dtype_bytes)


def parse_setting(value, source: str):
    """adaptive_load.activation_offload as the planner takes it: "off", "auto" or an int >= 0 (0 is "off")."""
    if value in ("off", "auto"):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return "off" if value == 0 else value
    raise UserError(f'{source}: must be "off", "auto" or an integer >= 0, got {value!r}')


def pinned_buffer_bytes(tokens: int, in_bpt: float) -> int:
    """One offloaded block input's pinned host buffer: tokens x in_bpt bytes, rounded up to a power of two."""
    size = max(1, math.ceil(tokens * in_bpt))
    return 1 << (size - 1).bit_length()


def host_fits(memory: dict, tokens: int, n: int, in_bpt: float) -> bool:
    """Whether n offloaded inputs of a micro-batch of `tokens` fit memory.host_bytes_per_rank (True without one)."""
    host = memory.get("host_bytes_per_rank")
    return host is None or n * pinned_buffer_bytes(tokens, in_bpt) <= host


def check_host(memory: dict, tokens: int, n: int, in_bpt: float, setting) -> None:
    """An integer activation_offload whose n buffers do not fit memory.host_bytes_per_rank: a UserError naming both."""
    if host_fits(memory, tokens, n, in_bpt):
        return
    buf, host = pinned_buffer_bytes(tokens, in_bpt), memory["host_bytes_per_rank"]
    raise UserError(f"adaptive_load.activation_offload (--activation-offload) {setting}: a micro-batch of {tokens} "
                    f"tokens per GPU offloads {n} block inputs, {n * buf / 2**30:.2f} GiB of pinned host memory, over "
                    f"the profile's memory.host_bytes_per_rank ({host / 2**30:.2f} GiB); give at most "
                    f"{int(host // buf)}, or auto (with the block checkpointing on auto)")


def pinned_host_bytes(micro_batches, in_bpt: float) -> int:
    """The pinned host memory a rank's offload holds over its micro-batches ((tokens per GPU, blocks offloaded)
    each): per buffer size, the most buffers of that size one micro-batch takes (module docstring)."""
    most = {}
    for tokens, n in micro_batches:
        if n:
            size = pinned_buffer_bytes(tokens, in_bpt)
            most[size] = max(most.get(size, 0), n)
    return sum(size * n for size, n in most.items())


def plan_pinned_bytes(plan, offloaded, in_bpt: float) -> int:
    """pinned_host_bytes of the rank that holds the most over `plan`'s epoch; offloaded(step, rank, micro): the
    blocks that micro-batch offloads."""
    sp = plan.config.sp
    return max((pinned_host_bytes(((sum(per_gpu_tokens(plan.tokens[i], sp) for i in mb), offloaded(s, r, m))
                                   for s, step in enumerate(plan.steps) for m, mb in enumerate(step[r])), in_bpt)
                for r in range(plan.config.dp_size)), default=0)


def _freed(memory: dict, n: int, in_bpt: float) -> dict:
    """The memory section with n block inputs per token off the device."""
    return {**memory, "bytes_per_token": profile_number(memory, "bytes_per_token") - n * in_bpt}


def _consistent(tokens, samples, memory, num_layers, policy, n, in_bpt) -> tuple:
    """(k, k_full, k_ffn, m): the checkpoint plan with m blocks offloaded, m the largest up to n that the plan
    checkpoints (only a checkpointed block's input can go to the host; fewer offloaded blocks checkpoint more)."""
    for m in range(min(n, num_layers), -1, -1):
        plan = checkpoint_plan(tokens, samples, _freed(memory, m, in_bpt), num_layers, policy)
        if plan[0] >= m:
            return (*plan, m)
    raise AssertionError("unreachable: m = 0 is always consistent")


def fits(tokens: int, samples: int, memory: dict, num_layers: int, plan: tuple, in_bpt: float) -> bool:
    """Whether (k, k_full, k_ffn, n) keeps the micro-batch under capacity_bytes * safety (True without a capacity)."""
    if memory.get("capacity_bytes") is None:
        return True
    k, k_full, k_ffn, n = plan
    peak = predicted_peak_bytes(tokens, samples, memory, num_layers, k, k_full, k_ffn) - n * in_bpt * tokens
    return peak <= profile_number(memory, "capacity_bytes") * profile_number(memory, "safety", DEFAULT_SAFETY)


def host_link(memory: dict) -> float:
    """memory.host_link_bytes_per_s, else DEFAULT_HOST_LINK_BYTES_PER_S (module docstring)."""
    host_bps = profile_number(memory, "host_link_bytes_per_s", DEFAULT_HOST_LINK_BYTES_PER_S)
    if not host_bps:
        raise UserError("profile: memory.host_link_bytes_per_s must be > 0")
    return host_bps


def model_dim(profile, source: str = "profile") -> int:
    """The profile's meta.model.dim: the width whose bf16 values a block input holds per token."""
    model = profile.meta.get("model")
    dim = model.get("dim") if isinstance(model, dict) else None
    if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
        raise UserError(f"{source}: activation_offload (--activation-offload) needs the profile's meta.model.dim "
                        f"(the model's width)")
    return dim


def exposed_time(memory: dict, num_layers: int, recompute_frac: float, in_bpt: float):
    """(tokens, n, t_ms) -> offload_ms of n offloaded blocks of a micro-batch of `tokens` (per GPU) whose time with
    every block checkpointed is t_ms: one block's forward is recompute_frac * t_ms / num_layers (0 where the profile
    has no recompute_frac: every copy counted whole, an upper bound)."""
    host_bps = host_link(memory)

    def exposed(tokens, n, t_ms):
        return offload_ms(tokens, n, (recompute_frac or 0.0) * t_ms / num_layers, in_bpt, host_bps) if n else 0.0

    return exposed


def offload_ms(tokens: int, n: int, block_fwd_ms: float, in_bpt: float, host_bps: float) -> float:
    """The exposed host-link time of n offloaded blocks (module docstring)."""
    copy_ms = tokens * in_bpt / host_bps * 1e3
    return n * (max(0.0, copy_ms - block_fwd_ms) + max(0.0, copy_ms - BWD_PER_FWD * block_fwd_ms))


def offload_blocks(tokens: int, samples: int, memory: dict, num_layers: int, setting, in_bpt: float,
                   policy: str = "full", t_ms: float = None, fracs: tuple = (0.0, 0.0, 0.0)) -> tuple:
    """(k, k_full, k_ffn, n) of a micro-batch of `tokens` (per GPU) and `samples`: its checkpoint plan with n of its
    checkpointed blocks offloaded. setting "off": checkpoint_plan and n = 0; an int: at most that many (fewer where
    fewer are checkpointed); "auto": the n with the least predicted time that fits (module docstring). t_ms: the
    micro-batch's time with every block checkpointed; fracs: time_ms (recompute_frac, attention_recompute_frac,
    ffn_recompute_frac). Without t_ms or recompute_frac, auto offloads the fewest blocks that make it fit."""
    if setting == "off":
        return (*checkpoint_plan(tokens, samples, memory, num_layers, policy), 0)
    if setting != "auto":
        plan = _consistent(tokens, samples, memory, num_layers, policy, setting, in_bpt)
        check_host(memory, tokens, plan[3], in_bpt, setting)
        return plan
    host_bps = host_link(memory)
    rf, af, ff = fracs
    plans, seen = [], set()
    for n in range(num_layers + 1):
        plan = _consistent(tokens, samples, memory, num_layers, policy, n, in_bpt)
        if plan not in seen:
            seen.add(plan)
            plans.append(plan)
    plans = [p for p in plans if host_fits(memory, tokens, p[3], in_bpt)]  # n = 0 always does
    fitting = [p for p in plans if fits(tokens, samples, memory, num_layers, p, in_bpt)]
    if not fitting:  # nothing fits: the most offload the host holds leaves the least on the device
        return max(plans, key=lambda p: p[3])
    if not t_ms or not rf:
        return min(fitting, key=lambda p: p[3])

    def cost(p):
        k, k_full, k_ffn, n = p
        return (t_ms * recompute_factor(k, num_layers, rf, k_full, af, k_ffn, ff)
                + offload_ms(tokens, n, rf * t_ms / num_layers, in_bpt, host_bps), n)

    return min(fitting, key=cost)


def attach(cost, setting, dim: int, profile=None):
    """RecomputeCost `cost` planning activation_offload `setting` ("off": unchanged) for a model of width `dim` (bf16
    block inputs), its "auto" timed by `profile` (a CostProfile: a micro-batch's time with every block checkpointed;
    None: no time model, the fewest blocks that fit)."""
    if setting == "off":
        return cost.set_offload(None)
    in_bpt, fracs = input_bytes_per_token(dim), (cost.recompute_frac, cost.attention_frac, cost.ffn_frac)

    def planner(tokens, samples):
        t_ms = profile.micro_ms(samples, tokens / samples) if profile and samples and setting == "auto" else None
        return offload_blocks(tokens, samples, cost.memory, cost.L, setting, in_bpt, cost.policy, t_ms, fracs)

    return cost.set_offload(planner, exposed_time(cost.memory, cost.L, cost.recompute_frac, in_bpt))


def for_plan(cost, profile, setting):
    """(cost, fixed): how the planner costs activation_offload `setting` (not "off"). With a RecomputeCost `cost`
    (--checkpoint-blocks auto): cost planning the offload (attach), fixed None. Without (a fixed checkpoint count,
    timed as every block checkpointed): fixed(tokens, t_ms), the exposed copy time of min(N, L) blocks for an
    integer N (None for "auto", which needs auto checkpointing, or without meta.model.num_layers)."""
    dim = model_dim(profile)
    if cost is not None:
        return attach(cost, setting, dim, profile), None
    model = profile.meta.get("model")
    L = model.get("num_layers") if isinstance(model, dict) else None
    if setting == "auto" or not isinstance(L, int) or isinstance(L, bool) or L < 1:
        return None, None
    in_bpt, n = input_bytes_per_token(dim), min(setting, L)
    exposed = exposed_time(profile.memory, L, profile.recompute_frac, in_bpt)

    def fixed(tokens, t_ms):
        check_host(profile.memory, tokens, n, in_bpt, setting)
        return exposed(tokens, n, t_ms)

    return None, fixed
