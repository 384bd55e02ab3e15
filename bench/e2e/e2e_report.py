"""The end-to-end benchmark's report (bench/e2e/train_e2e.py): the markdown table of its runs and simulations, and
the per-rank compute and idle plots (matplotlib, when installed)."""
import os
import statistics


def table(res):
    base = next((r for r in res["runs"] if r["name"] == "equal-tokens" and "samples_per_s" in r), None)
    lines = ["| run | policy | fused op | dp x sp | steps | samples/s | tokens/s | vs equal-tokens | MFU | "
             "idle (measured) | idle (predicted) | wall err (sim) | VRAM mean / p95 | OOM |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["runs"]:
        if "samples_per_s" not in r:
            lines.append(f"| {r['name']} | {r['policy']} | {'on' if r['fused'] else 'off'} | {r['dp']} x {r['sp']} "
                         f"| {r['steps_run']} | failed (rc {r['rc']}) | | | | | | | | {r['oom_count']} |")
            continue
        rel = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else ""
        mem = (f"{r['mem_frac_mean']:.0%} / {r['mem_frac_p95']:.0%}" if "mem_frac_mean" in r else "n/a")
        fused = ("on (fell back!)" if r.get("fused_fallback") else "on") if r["fused"] else "off"
        lines.append(
            f"| {r['name']} | {r['policy']} | {fused} | {r['dp']} x {r['sp']} | "
            f"{r['measured_steps']} | {r['samples_per_s']:.2f} | {r['tokens_per_s']:,.0f} | {rel} | "
            f"{r['mfu']:.1%} | {r['idle_fraction']:.1%} | {r['pred_idle_fraction']:.1%} | "
            f"{r['pred_wall_err']:+.1%} | {mem} | {r['oom_count']} |")
    ok = {r["name"]: r for r in res["runs"] if "tokens_per_s" in r}
    ratios = []
    for a, b, what in (("balanced", "equal-tokens", "balanced / equal-tokens"),
                       ("dual", "equal-tokens", "dual / equal-tokens"),
                       ("balanced", "balanced-unfused", "fused / unfused op, balanced"),
                       ("equal-tokens", "equal-tokens-unfused", "fused / unfused op, equal-tokens"),
                       ("dual", "dual-unfused", "fused / unfused op, dual"),
                       ("balanced-sp2", "balanced", "sp=2 / dp=2, balanced")):
        if a in ok and b in ok:
            ratios.append(f"{what}: {ok[a]['tokens_per_s'] / ok[b]['tokens_per_s']:.3f}x tokens/s, "
                          f"{ok[a]['samples_per_s'] / ok[b]['samples_per_s']:.3f}x samples/s")
        if a in ok and b in ok and res.get("measured_steps") == "epoch" and "epoch0_samples" in ok[a] and \
                ok[a].get("epoch0_samples") == ok[b].get("epoch0_samples"):
            ratios.append(f"{what}, same {ok[a]['epoch0_samples']} samples (epoch 0 incl. warm-up): "
                          f"{ok[a]['epoch0_wall_s']:.1f} s vs {ok[b]['epoch0_wall_s']:.1f} s = "
                          f"speed {ok[b]['epoch0_wall_s'] / ok[a]['epoch0_wall_s']:.3f}x (predicted "
                          f"{ok[b]['epoch0_pred_wall_s'] / ok[a]['epoch0_pred_wall_s']:.3f}x)")
    if ratios:
        lines += [""] + [f"- {r}" for r in ratios]
    if res.get("variants_same_plan"):
        lines += [f"- {a}: not run, its plan equals {b}'s" for a, b in res["variants_same_plan"].items()]
    if res.get("variants_dropped"):
        lines.append(f"- not run for time: {', '.join(res['variants_dropped'])}")
    sim = res.get("simulation") or []
    if sim:
        lines += ["", "| ranks | policy | predicted idle | predicted samples/s | steps | mix_tv |",
                  "|---:|---|---:|---:|---:|---:|"]
        for s in sim:
            lines.append(f"| {s['ranks']} | {s['policy']} | {s['pred_idle_fraction']:.1%} | "
                         f"{s['samples_per_s_pred']:.1f} | {s['steps']} | {s['mix_tv']:.3f} |")
    return "\n".join(lines)


def render(res, out_dir, tag):
    os.makedirs(out_dir, exist_ok=True)
    md = table(res)
    with open(os.path.join(out_dir, f"{tag}.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[e2e] matplotlib missing: no plots")
        return
    runs = [r for r in res["runs"] if "compute_ms" in r]
    if not runs:
        return
    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 1.9 * len(runs) + 0.6), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], runs):
        comp = r["compute_ms"]
        for k in range(len(comp[0])):
            ax.plot(range(1, len(comp) + 1), [c[k] / 1000 for c in comp], marker="o", ms=3, label=f"rank {k}")
        pred_step = r.get("pred_step_ms") or [max(p) for p in r["pred_ms"]]
        ax.plot(range(1, len(comp) + 1), [w / 1000 for w in pred_step], "k--", lw=1, label="step wall (pred)")
        ax.plot(range(1, len(comp) + 1), [w / 1000 for w in r["step_ms"]], "k:", lw=1, label="step wall (measured)")
        ax.set_ylabel("s")
        ax.set_title(f"{r['name']}: idle {r['idle_fraction']:.1%} measured, {r['pred_idle_fraction']:.1%} predicted",
                     fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
        ax.xaxis.get_major_locator().set_params(integer=True)
    axes[-1, 0].set_xlabel("measured step")
    fig.suptitle("Per-step per-rank compute time (forward+backward)", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{tag}-compute.png"), dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    dp_runs = [r for r in runs if r["dp"] > 1]
    bins = [i / 20 for i in range(0, 21)]
    for r in dp_runs:
        mean = statistics.fmean(r["step_idle"])
        ax.hist(r["step_idle"], bins=bins, alpha=0.5, label=f"{r['name']} measured (mean {mean:.1%})")
        if r.get("pred_step_idle"):  # under ZeRO-3 the ranks' timers include the waits: see the prediction too
            mean = statistics.fmean(r["pred_step_idle"])
            ax.hist(r["pred_step_idle"], bins=bins, histtype="step", lw=1.5,
                    label=f"{r['name']} predicted (mean {mean:.1%})")
    ax.set_xlabel("per-step idle fraction (1 - mean rank compute / step wall)")
    ax.set_ylabel("steps")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{tag}-idle.png"), dpi=110)
    plt.close(fig)
