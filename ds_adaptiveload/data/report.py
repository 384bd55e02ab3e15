"""`python -m ds_adaptiveload report --manifest M.jsonl --profile P.yaml --world-size N --out DIR`: what the
scheduler will do with a dataset, before any GPU time is spent.

Writes DIR/report.md with three PNGs: the token-length histogram, the predicted per-rank load of the first
steps under each policy, and the idle fraction by policy and world size. Every number is a prediction of
the cost profile through the planner (ds_adaptiveload.schedule.planner), not a measurement.
"""
import os
import statistics

from ds_adaptiveload.errors import UserError
from ds_adaptiveload.schedule import policies
from ds_adaptiveload.train.config import AdaptiveLoadConfig, add_flag, flag_name

# Every policy of the registry, equal-tokens (the baseline the tables compare with) first.
POLICIES = ("equal-tokens", *(p for p in policies.POLICIES if p != "equal-tokens"))
WORLD_SIZES = (8, 64, 1024)  # reported next to --world-size: one node, a small and a large cluster
HEATMAP_STEPS = 50
TABLE_ROWS = 60  # bucket table rows shown; the rest are summed in one line


def add_arguments(parser):
    # Optional at parser level: `report` without --manifest is the fused op's report (report_cli.py).
    parser.add_argument("--manifest", help="dataset report: manifest (JSONL) to analyse")
    parser.add_argument("--profile", help="dataset report: cost profile (YAML), e.g. configs/profiles/*.yaml")
    parser.add_argument("--world-size", type=int, help="dataset report: GPUs in the job")
    parser.add_argument("--out", help="dataset report: folder for report.md and the PNG plots")
    parser.add_argument("--sp", type=int, default=1, help="dataset report: sequence-parallel degree (default 1)")
    parser.add_argument("--grad-accum", type=int, default=1,
                        help="dataset report: micro-batches per rank per step, G (default 1)")
    add_flag(parser, "seed", help="dataset report: planner seed (default 0)")


def run(args) -> int:
    for name in ("manifest", "profile", "world_size", "out"):
        if getattr(args, name, None) is None:
            raise UserError(f"report --manifest needs --{name.replace('_', '-')}")
    import matplotlib
    matplotlib.use("Agg")

    from ds_adaptiveload.schedule.geometry import per_gpu_tokens
    from ds_adaptiveload.schedule.manifest import load_manifest
    from ds_adaptiveload.schedule.planner import make_plan
    from ds_adaptiveload.plan_cli import run_profile
    from ds_adaptiveload.schedule.profile import CostProfile

    from ds_adaptiveload import shipped

    base = CostProfile.load(shipped.resolve(args.profile, "--profile"))  # a path, or a shipped profile's name
    samples = load_manifest(args.manifest, base.geometry)
    sp, n = args.sp, args.world_size

    def plan_config(policy, world):
        keys = {"profile": args.profile, "policy": policy, "seed": args.seed, "on_oversize": "skip"}
        return AdaptiveLoadConfig.checked(keys, flag_name).plan_config(world, sp, args.grad_accum)
    plan_config("balanced", n)  # validates --seed/--world-size/--sp/--grad-accum with the planner's messages
    profile = run_profile(base, None, n, args.profile)  # this run's budget (schedule/zero.py)
    os.makedirs(args.out, exist_ok=True)

    tokens = [profile.geometry.tokens(s.frames, s.height, s.width) for s in samples]
    plans = {}  # (world_size, policy) -> Plan
    for w in sorted(set(WORLD_SIZES) | {n}):
        if w % sp == 0:
            prof_w = profile if w == n else profile_at(base, w)
            for policy in POLICIES if prof_w else ():
                plans[w, policy] = make_plan(samples, prof_w, plan_config(policy, w))

    figs = dict(hist="tokens_hist.png", load="load_per_rank.png", idle="idle_fraction.png")
    plot_token_hist(os.path.join(args.out, figs["hist"]), samples, tokens, profile.budget_tokens * sp)
    plot_load(os.path.join(args.out, figs["load"]), {p: plans[n, p] for p in POLICIES}, n)
    plot_idle(os.path.join(args.out, figs["idle"]), plans)

    shapes = bucket_table(samples, tokens, profile, sp, plans[n, "balanced"], per_gpu_tokens)
    md = render_markdown(args, profile, samples, tokens, shapes, plans, figs)
    path = os.path.join(args.out, "report.md")
    with open(path, "w") as f:
        f.write(md)
    print(f"wrote {path} and {len(figs)} plots")
    return 0


def bucket_table(samples, tokens, profile, sp, balanced, per_gpu_tokens) -> list:
    """One row per shape: count, tokens, and micro-batch size under each policy. equal-tokens and dual
    come from the profile's caps (the planner's own rule); balanced lists the sizes its plan used."""
    rows = {}
    for s, t in zip(samples, tokens):
        key = (s.frames, s.height, s.width)
        row = rows.setdefault(key, dict(shape=key, count=0, tokens=t, gpu_tokens=per_gpu_tokens(t, sp)))
        row["count"] += 1
    for s_idx, step in enumerate(balanced.steps):
        for r, mbs in enumerate(step):
            for m, mb in enumerate(mbs):
                if (s_idx, r, m) not in balanced.pad:
                    s = samples[mb[0]]
                    rows[s.frames, s.height, s.width].setdefault("used", []).append(len(mb))
    for row in rows.values():
        g = row["gpu_tokens"]
        row["b_mem"] = profile.mem_batch(g)  # floor(M_mem / S); 0 = oversize, skipped
        row["b_dual"] = min(row["b_mem"], profile.comp_batch(g, balanced.dual)) if row["b_mem"] else 0
    return sorted(rows.values(), key=lambda r: (r["tokens"], r["shape"]))


def _fmt_used(sizes) -> str:
    if not sizes:
        return "-"
    lo, hi = min(sizes), max(sizes)
    return f"{lo}" if lo == hi else f"{lo}-{hi} (mean {statistics.fmean(sizes):.1f})"


def render_markdown(args, profile, samples, tokens, shapes, plans, figs) -> str:
    n, sp = args.world_size, args.sp
    images = sum(s.frames == 1 for s in samples)
    oversize = sum(r["count"] for r in shapes if r["b_mem"] == 0)
    meta = ", ".join(f"{k}: {v}" for k, v in profile.meta.items()) or "no meta section"
    dual = plans[n, "balanced"].dual
    out = [
        "# Dataset report", "",
        f"Manifest `{args.manifest}`, profile `{args.profile}` ({meta}); world size {n}, sp {sp}, "
        f"G {args.grad_accum} micro-batches per step, seed {args.seed}. Every time below is predicted by "
        "the profile's cost model through the planner, not measured.", "",
        "## Samples", "",
        "| samples | images | videos | shapes | tokens min | median | p90 | max | total tokens | oversize (skipped) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {len(samples)} | {images} | {len(samples) - images} | {len(shapes)} | {min(tokens)} | "
        f"{statistics.median(tokens):.0f} | {percentile(tokens, 90):.0f} | {max(tokens)} | {sum(tokens)} | "
        f"{oversize} |", "",
        f"Oversize: more than M_mem = {profile.budget_tokens} tokens per GPU at sp={sp}; the plans skip them.",
        "",
        "## Token lengths", "", f"![token-length histogram]({figs['hist']})", "",
        "## Buckets", "",
        f"One row per shape (frames x height x width). S: tokens per GPU (sp={sp}). equal-tokens: "
        f"B = floor(M_mem / S), M_mem = {profile.budget_tokens}. dual: B = min(floor(M_mem / S), "
        f"floor(M_comp / S^p)), p = {dual[0]:.3f}, M_comp = {dual[1]:.4g} "
        f"({'from the profile' if profile.dual_p is not None else 'derived for this data'}). balanced: "
        f"the micro-batch sizes its plan at world size {n} used (min-max; it sizes micro-batches to even "
        "out the ranks, so they vary). 0 = oversize.", "",
        "| shape | samples | tokens S | equal-tokens B | dual B | balanced B used |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in shapes[:TABLE_ROWS]:
        f_, h, w = r["shape"]
        out.append(f"| {f_}x{h}x{w} | {r['count']} | {r['gpu_tokens']} | {r['b_mem']} | {r['b_dual']} | "
                   f"{_fmt_used(r.get('used'))} |")
    if len(shapes) > TABLE_ROWS:
        rest = shapes[TABLE_ROWS:]
        out.append(f"| ... {len(rest)} more shapes | {sum(r['count'] for r in rest)} | | | | |")
    out += [
        "", "## Predicted per-rank load", "",
        f"Predicted compute of each data-parallel rank in each of the first {HEATMAP_STEPS} optimizer steps "
        f"at world size {n}, one panel per policy, one colour scale. A step lasts as long as its slowest "
        "rank; the rest of the column is idle time.", "",
        f"![predicted per-rank load]({figs['load']})", "",
        "## Idle fraction by policy and world size", "",
        "Idle fraction: 1 - sum over steps of the mean rank time / sum over steps of the slowest rank time "
        "(Plan.summary). mix_tv: mean total-variation distance between a step's mix of short, mid and long "
        "samples and the epoch's (0 = every step looks like the data). Wall: sum of the slowest rank "
        "per step. An epoch of only a few steps is dominated by its last, partly filled step. Each world size "
        "plans with the profile's memory budget moved to it (schedule/zero.py: more ranks hold less of the ZeRO "
        "state).", "",
        "| world size | policy | steps | idle fraction | predicted wall (s) | vs equal-tokens | mix_tv | skipped |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for w in sorted({w for w, _ in plans}):
        base = plans[w, "equal-tokens"].summary()["predicted_wall_s"]
        for p in POLICIES:
            s = plans[w, p].summary()
            rel = f"{s['predicted_wall_s'] / base:.3f}x" if base else "-"
            mark = " (--world-size)" if w == n else ""
            out.append(f"| {w}{mark} | {p} | {s['steps']} | {100 * s['idle_fraction']:.1f}% | "
                       f"{s['predicted_wall_s']:.1f} | {rel} | {s['mix_tv']:.3f} | {s['samples_skipped']} |")
    skipped_ws = [w for w in sorted(set(WORLD_SIZES) | {n}) if w % sp]
    if skipped_ws:
        out.append(f"\nNot planned (not divisible by sp={sp}): world size {', '.join(map(str, skipped_ws))}.")
    out += ["", f"![idle fraction by policy and world size]({figs['idle']})", ""]
    return "\n".join(out)


def percentile(values, q: int) -> float:
    """The q-th percentile, interpolated between the data points (numpy's default), so within [min, max]. statistics'
    default ("exclusive") extrapolates past the ends of a small sample: a report printed p90 32,448 over a max of
    31,200."""
    if len(values) == 1:
        return float(values[0])
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def profile_at(profile, world):
    """The profile's memory at `world` ranks under its own ZeRO stage (schedule/zero.for_run), or None where the ZeRO
    state leaves no memory for tokens there (that world size is left out of the idle plot)."""
    from ds_adaptiveload.schedule.zero import for_run

    try:
        return for_run(profile, None, world)[0]
    except UserError:
        return None


def plot_token_hist(path, samples, tokens, max_tokens):
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    lo, hi = max(1, min(tokens)), max(max(tokens), max_tokens)
    bins = [lo * (hi * 1.05 / lo) ** (i / 40) for i in range(41)] if hi > lo else [lo * 0.9, lo * 1.1]
    img = [t for s, t in zip(samples, tokens) if s.frames == 1]
    vid = [t for s, t in zip(samples, tokens) if s.frames > 1]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.hist([img, vid], bins=bins, stacked=True, label=[f"images ({len(img)})", f"videos ({len(vid)})"],
            color=["tab:orange", "tab:blue"])
    ax.axvline(max_tokens, color="tab:red", ls="--", label=f"M_mem x sp = {max_tokens} (largest that fits)")
    ax.set_xscale("log")
    # Plain numbers at 1-2-5 steps; the default minor labels (3x10^3 ...) overlap.
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("tokens per sample (log scale)")
    ax.set_ylabel("samples")
    ax.set_title(f"Token lengths of {len(samples)} samples")
    ax.legend(loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_load(path, plans, world_size):
    """Heat map per policy: data-parallel rank x step, colour = predicted compute ms."""
    import matplotlib.pyplot as plt
    grids = {p: [row for row in plan.pred_ms[:HEATMAP_STEPS]] for p, plan in plans.items()}
    vmax = max((max(max(r) for r in g) for g in grids.values() if g), default=1.0)
    longest_grid = max((len(g) for g in grids.values()), default=1)
    fig, axes = plt.subplots(len(plans), 1, figsize=(10, 2.2 + 2.2 * len(plans)), squeeze=False,
                             layout="constrained")
    im = None
    for ax, (policy, grid) in zip(axes[:, 0], grids.items()):
        if not grid:
            ax.set_title(f"{policy}: no steps")
            ax.axis("off")
            continue
        cols = list(zip(*grid))  # ranks x steps
        im = ax.imshow(cols, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0, vmax=vmax,
                       origin="lower")
        busy = sum(sum(r) / len(r) for r in grid)
        longest = sum(max(r) for r in grid)
        ax.set_title(f"{policy}: first {len(grid)} steps, idle {100 * (1 - busy / longest):.1f}% of rank time")
        ax.set_ylabel("data-parallel rank")
        ax.set_xlim(-0.5, longest_grid - 0.5)  # one step scale for every panel
    axes[-1, 0].set_xlabel("optimizer step")
    if im is not None:
        fig.colorbar(im, ax=axes[:, 0].tolist(), label="predicted compute per rank (ms)")
    fig.suptitle(f"Predicted per-rank load at world size {world_size}")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_idle(path, plans):
    import matplotlib.pyplot as plt
    sizes = sorted({w for w, _ in plans})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(POLICIES)
    for j, policy in enumerate(POLICIES):
        vals = [100 * plans[w, policy].summary()["idle_fraction"] for w in sizes]
        xs = [i + (j - (len(POLICIES) - 1) / 2) * width for i in range(len(sizes))]
        bars = ax.bar(xs, vals, width, label=policy)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(range(len(sizes)), [str(w) for w in sizes])
    ax.set_xlabel("world size (GPUs)")
    ax.set_ylabel("idle fraction of GPU time (%)")
    ax.set_title("Predicted idle fraction (waiting for the slowest rank) by policy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
