"""The packed policy's second opinions on its steps: an uneven step and the next packed anew together by plain LPT
over the cost model, and a short last step folded into the steps before it; each kept only where it predicts less
wall time. Pure Python, no torch."""
import bisect

from ds_adaptiveload.schedule.policies.common import fill_slots, lpt_micro_batches
from ds_adaptiveload.schedule.policies.packed_slots import even_round, pack_step

# A step is packed anew with the next (redeal) only where its slowest micro-batches leave the ranks idle more than
# this fraction of their mean: most steps are even already, and packing every step twice doubled the planning
# time (1M samples, 1024 ranks).
REDEAL_ABOVE = 0.002
# The steps before the last that the fold repacks with it (fold_tail): room enough to take a short last step at
# 1024 ranks (openvid-720p, one clip per micro-batch, G = 4: 4 steps had too little, 16 took a last step of 3,181
# pad micro-batches), few enough that the steps keep their place in the stream.
FOLD_STEPS = 16
# ... and only a last step with less line cost than this fraction of the mean step's is folded.
FOLD_BELOW = 0.75


def refine(steps, ctx, r, g):
    """The epoch's steps after redeal and fold_tail."""
    return fold_tail(redeal(steps, ctx, r, g), ctx, r, g)


def redeal(steps, ctx, r, g):
    """Each step idle more than REDEAL_ABOVE (by line cost) and the next, packed anew together by LPT into two
    steps (_lpt_steps), where that predicts less wall time in all. A step's samples are drawn in stream order so
    that it mixes kinds; where memory holds a few long clips among many short ones (the bimodal world-model mix,
    or memory for three 720p clips at 8 ranks), the slots holding long clips set a round's pace and the others
    cannot catch up in memory. Two steps' samples give LPT twice the slots to even them out; the two steps
    together keep their samples, so composition moves only between neighbours."""
    steps = list(steps)
    for s in range(len(steps) - 1):
        pair = steps[s:s + 2]
        if any(len(mbs) != g for mbs in pair[1]) or not _uneven(pair[0], ctx, r, g):
            continue  # the short last step is fold_tail's
        alt = _lpt_steps([i for step in pair for mbs in step for mb in mbs for i in mb], ctx, r, g, 2)
        if alt and sum(map(ctx.step_ms, alt)) < sum(map(ctx.step_ms, pair)):
            steps[s:s + 2] = alt
    return steps


def fold_tail(steps, ctx, r, g):
    """The epoch's steps with a short last one folded in: the samples of the last FOLD_STEPS + 1 steps packed by
    LPT into FOLD_STEPS steps, where they fit and predict less wall time in all. A short last step pays the step's
    fixed cost and every micro-batch's floor for little work (image-heavy, 3 clips per micro-batch, 64 ranks,
    G = 4: a last step of 256 images, 2.2% of the epoch)."""
    k = min(FOLD_STEPS, len(steps) - 1)
    if k < 1 or _line(steps[-1], ctx) >= FOLD_BELOW * sum(_line(step, ctx) for step in steps[-k - 1:-1]) / k:
        return steps
    tail = steps[-k - 1:]
    alt = _lpt_steps([i for step in tail for mbs in step for mb in mbs for i in mb], ctx, r, g, k)
    if alt and sum(map(ctx.step_ms, alt)) < sum(_wall(step, ctx, g) for step in tail):
        return steps[:-k - 1] + alt
    return steps


def _lpt_steps(samples, ctx, r, g, n):
    """`samples` packed by LPT into n steps of R*G micro-batches: slots sorted by cost cut into rounds of R, each
    evened out (even_round), the j-th round to step j mod n (each step a spread of costs) and within a round the
    costliest slot to the least-loaded rank. Samples the LPT's few cheapest slots had no room for go to the
    cheapest slot with room; None when one has none or a micro-batch stays empty."""
    slots = n * r * g
    sl, left = pack_step(samples, ctx, slots)
    if left and not _place_left(sl, left, slots):
        return None
    if not all(sl.samples):
        return None
    order = sorted(range(slots), key=sl.load.__getitem__, reverse=True)
    steps = [[[] for _ in range(r)] for _ in range(n)]
    totals = [[0.0] * r for _ in range(n)]
    shape = ctx.shape.__getitem__
    for j in range(0, len(order), r):
        rd = order[j:j + r]
        even_round(rd, sl, ctx)
        step, total = steps[j // r % n], totals[j // r % n]
        ranks = sorted(range(r), key=total.__getitem__)
        for rank, k in zip(ranks, sorted(rd, key=sl.load.__getitem__, reverse=True)):
            step[rank].append(sorted(sl.samples[k], key=shape))
            total[rank] += sl.load[k]
    return steps


def _place_left(sl, left, slots):
    """Each of `left` (costliest first) into the cheapest slot that has room; False when one fits none. Slots
    with less memory free than the smallest of `left` leave the search for good (memory-full steps leave
    thousands of small samples to place among thousands of slots)."""
    small = min(map(sl.mem.__getitem__, left))
    by_load = sorted((sl.load[k], k) for k in range(slots) if sl.limit - sl.used[k] >= small)
    for i in left:
        j = next((j for j, (_, k) in enumerate(by_load) if sl.room(k, i)), None)
        if j is None:
            return False
        k = by_load.pop(j)[1]
        sl.add(k, i)
        if sl.limit - sl.used[k] >= small:
            bisect.insort(by_load, (sl.load[k], k))
    return True


def _line(step, ctx):
    """A step's summed line cost (the cost model without the micro-batch floor): a cheap first look."""
    cost = ctx.cost
    return sum(sum(map(cost.__getitem__, mb)) for mbs in step for mb in mbs)


def _uneven(step, ctx, r, g):
    """Whether the step's slowest micro-batches (lockstep: of each round; else the slowest rank) exceed the ranks'
    mean by more than REDEAL_ABOVE, by line cost."""
    cost = ctx.cost
    if g == 1:  # one micro-batch a rank: its line cost is the rank's (sum([x]) is x), without the inner lists
        line = [sum(map(cost.__getitem__, mbs[0])) for mbs in step]
        return max(line) > (1 + REDEAL_ABOVE) * sum(line) / r
    line = [[sum(map(cost.__getitem__, mb)) for mb in mbs] for mbs in step]
    top = sum(max(c[m] for c in line) for m in range(g)) if ctx.cfg.lockstep else max(map(sum, line))
    return top > (1 + REDEAL_ABOVE) * sum(map(sum, line)) / r


def _wall(step, ctx, g):
    """Predicted wall ms of a step; a short one (the epoch's last) as the planner's tail finishes it: its
    micro-batches dealt by LPT, split where a rank has fewer than G, the rest padded with its cheapest sample."""
    if all(len(mbs) == g for mbs in step):
        return ctx.step_ms(step)
    flat = sorted((list(mb) for mbs in step for mb in mbs if mb), key=ctx.mb_ms, reverse=True)
    if not flat:  # an empty step: all pads
        return ctx.profile.step_fixed_ms + g * ctx.profile.floor_ms
    done = lpt_micro_batches(flat, len(step), g, ctx)
    fill_slots(done, g)
    cheapest = min((i for mb in flat for i in mb), key=ctx.cost.__getitem__)
    return ctx.step_ms([mbs + [[cheapest]] * (g - len(mbs)) for mbs in done])
