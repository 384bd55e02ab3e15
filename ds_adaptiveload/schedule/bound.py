"""A lower bound on any plan's predicted wall time for an epoch, and a checker of a plan against the profile.

The bound is the largest of three, each holding for every plan of the data at this world size and G:
- fixed: the fewest steps memory allows (all samples' memory over R*G micro-batches of budget_tokens), each
  paying step_fixed_ms, and every micro-batch at least the cheapest lone sample (the profile's floor);
- work: the same steps' fixed cost plus all micro-batches' time over the R ranks (no rank ever idle) and, under
  lockstep, the idle that samples too big to share a micro-batch force on the rounds they do not fill
  (_forced_idle);
- heaviest: the steps' fixed cost plus, per round (lockstep) or per step, its costliest micro-batch: a round
  holds at most R * floor(budget / memory) samples of a given memory or more, so the n costliest samples need
  at least n / that many rounds as costly as the cheapest of them.
Pure Python, no torch. Valid for checkpoint "all" (every micro-batch costed as profiled); None otherwise.
"""
import math
from collections import Counter

from ds_adaptiveload.schedule.geometry import per_gpu_tokens
from ds_adaptiveload.schedule.profile import smooth_max


def lower_bound(gpu_tokens, profile, cfg) -> dict:
    """{"wall_s", "binds", "fixed_s", "work_s", "heaviest_s", "forced_s", "steps_min"} for the samples' per-GPU
    tokens (`gpu_tokens`, one entry per planned sample), or None when the bound does not apply. forced_s: the part
    of work_s that is forced idle (_forced_idle), 0 without lockstep."""
    counts = Counter(gpu_tokens)
    if not counts or cfg.checkpoint != "all":
        return None
    r, g, budget = cfg.dp_size, cfg.grad_accum, profile.budget_tokens
    # a sample over the budget runs alone: it takes one micro-batch, not more
    mem = sum(n * min(profile.mem_tokens(s), budget) for s, n in counts.items())
    steps = math.ceil(mem / (budget * r * g) * (1 - 1e-12))
    fixed_steps = steps * profile.step_fixed_ms
    lone = {s: profile.packed_ms([s]) for s in counts}
    c_min = min(lone.values())
    n_mb = steps * r * g
    line = sum(n * profile.sample_ms(s) for s, n in counts.items()) + n_mb * profile.fixed_ms
    forced = _forced_idle(counts, lone, profile, r) if cfg.lockstep else 0.0
    work = fixed_steps + (max(n_mb * c_min, line) + forced) / r
    # lockstep: a step is G rounds of R micro-batches; else one group of R*G micro-batches, the slowest rank
    # running its costliest micro-batch and G - 1 others
    group_mbs, groups = (r, steps * g) if cfg.lockstep else (r * g, steps)
    fixed = fixed_steps + steps * g * c_min  # G micro-batches a step on every rank, each at least c_min
    heaviest = fixed_steps + (0.0 if cfg.lockstep else steps * (g - 1) * c_min) + _round_max_sum(
        counts, lone, profile, budget, group_mbs, groups)
    parts = {"fixed_s": fixed / 1000, "work_s": work / 1000, "heaviest_s": heaviest / 1000}
    binds = max(parts, key=parts.get)
    return {"wall_s": parts[binds], "binds": binds[:-2], **parts, "forced_s": forced / r / 1000, "steps_min": steps}


def _round_max_sum(counts, lone, profile, budget, group_mbs, groups_min) -> float:
    """Least sum over groups (rounds or steps) of their costliest micro-batch: the integral over cost c of the
    groups whose costliest is at least c. Samples by per-GPU tokens, costliest first (cost and memory both grow
    with tokens); above the cheapest cost every group counts, and there are at least groups_min of them."""
    order = sorted(counts, reverse=True)
    total, seen = 0.0, 0
    for j, s in enumerate(order):
        seen += counts[s]
        nxt = lone[order[j + 1]] if j + 1 < len(order) else 0.0
        per_group = group_mbs * max(1, int(budget // profile.mem_tokens(s)))
        need = max(math.ceil(seen / per_group), groups_min if nxt == 0.0 else 0)
        total += (lone[s] - nxt) * need
    return total


def _forced_idle(counts, lone, profile, r) -> float:
    """Rank-ms that every lockstep plan idles beyond its work. Take the n_H samples of size t or more, where size t
    needs over half the budget: no two share a micro-batch, so at least ceil(n_H / R) rounds hold one, and those
    rounds have D = ceil(n_H / R) * R - n_H slots whose micro-batch holds none (or holds a pad of one, which adds
    at least as much work). Such a micro-batch costs at most c2 (_cost_without), and its round at least c_H, the
    least lone cost of the n_H: each of the D slots idles c_H - c2 or more. The best t counts; t must not be the
    smallest size, so that c2 is at least the cheapest micro-batch the work part already counts."""
    budget = profile.budget_tokens
    sizes = sorted(counts)
    big = [s for s in sizes[1:] if profile.mem_tokens(s) > budget / 2]
    if not big or r < 2:
        return 0.0
    c2 = _cost_without(counts, sizes, big, lone, profile)
    best, n_h, c_h = 0.0, 0, math.inf
    for t in reversed(big):
        n_h += counts[t]
        c_h = min(c_h, lone[t])
        best = max(best, -n_h % r * (c_h - c2[t]))
    return best


def _cost_without(counts, sizes, big, lone, profile, grid_cells=16, most_cells=4096) -> dict:
    """{t: an upper bound on the cost of any micro-batch of samples smaller than t} for each t in `big`: a bounded
    knapsack of the samples' costs within the budget, on a grid of memory with every sample's memory rounded down
    (so it holds at least what really fits). A sample over the budget runs alone and counts at its lone cost. The
    grid is 1/16 of the smallest sample, but at most `most_cells` cells (a coarser grid only loosens the bound), so
    that tiny samples beside a large budget keep the planner fast."""
    budget = profile.budget_tokens
    smallest = profile.mem_tokens(sizes[0])  # sizes ascend, and memory with them
    unit = max(smallest / grid_cells, budget / most_cells) if smallest <= budget else budget
    best = [0.0] * (int(budget // unit) + 1)  # best[c]: the most sample time that c cells of memory hold
    out, alone, thresholds = {}, 0.0, set(big)
    for s in sizes[:sizes.index(big[-1]) + 1]:
        if s in thresholds:  # before s joins: the samples smaller than s
            out[s] = max(alone, smooth_max(profile.floor_ms, profile.fixed_ms + best[-1], profile.floor_q))
        if profile.mem_batch(s) == 0:
            alone = max(alone, lone[s])
            continue
        w, v = int(profile.mem_tokens(s) // unit), profile.sample_ms(s)
        copies, k = min(counts[s], profile.mem_batch(s)), 1
        while copies:  # binary split of the copies: each chunk is taken whole or not at all
            take = min(k, copies)
            copies, k = copies - take, 2 * k
            if take * w < len(best):
                best[take * w:] = [max(a, b + take * v) for a, b in zip(best[take * w:], best)]
    return out


def check_plan(plan, profile) -> None:
    """Raise ValueError unless `plan` covers every planned sample exactly once, gives every rank G micro-batches
    in every step, keeps every micro-batch within budget_tokens, and (checkpoint all) its predicted times are
    the profile's: the one check every policy and baseline passes through."""
    cfg = plan.config
    gpu = [per_gpu_tokens(t, cfg.sp) for t in plan.tokens]
    seen = []
    for s, step in enumerate(plan.steps):
        if len(step) != cfg.dp_size or any(len(mbs) != cfg.grad_accum for mbs in step):
            raise ValueError(f"step {s}: not {cfg.dp_size} ranks of {cfg.grad_accum} micro-batches")
        costs = []
        for k, mbs in enumerate(step):
            row = []
            for m, mb in enumerate(mbs):
                if not mb or sum(profile.mem_tokens(gpu[i]) for i in mb) > profile.budget_tokens * (1 + 1e-12) \
                        and len(mb) > 1:
                    raise ValueError(f"step {s} rank {k} micro-batch {m}: empty or over budget_tokens")
                if (s, k, m) not in plan.pad:
                    seen += mb
                row.append(profile.packed_ms([gpu[i] for i in mb]))
            costs.append(row)
        if cfg.checkpoint == "all":
            want = profile.step_fixed_ms + (sum(max(c[m] for c in costs) for m in range(cfg.grad_accum))
                                            if cfg.lockstep else max(sum(c) for c in costs))
            if not math.isclose(plan.pred_wall_ms[s], want, rel_tol=1e-9):
                raise ValueError(f"step {s}: predicted wall {plan.pred_wall_ms[s]} ms, the profile says {want}")
    skipped = set(plan.skipped)
    if sorted(seen) != [i for i in range(len(plan.tokens)) if i not in skipped]:
        raise ValueError("samples not covered exactly once")
