"""Predictions beside measurements (pure, no torch): per-point rows of measured and predicted time and
peak with their relative errors, the fit and held-out error summaries, the dual's error against the time
model, and the printed tables (grid points, packed validation)."""
import statistics

from ds_adaptiveload.calibrate.fit import predict_ms, predict_peak, rel_err


def report(points, coef, mem, capacity=None):
    """Per-point rows: measured, predicted and relative error of time (and memory when measured)."""
    rows = []
    for p in points:
        r = {"role": p.role, "status": p.status, "B": p.B, "shape": "x".join(map(str, p.shape)), "S": p.S,
             "s": p.s}
        if p.status == "ok":
            pred = predict_ms(coef, p.B, p.s)
            r.update(ms=round(p.median_ms, 3), pred_ms=round(pred, 3), err=round(rel_err(pred, p.median_ms), 4),
                     step_ms=round(statistics.median(p.step_ms), 3), n=len(p.ms))
            if p.peak_bytes:
                r["peak_gib"] = round(p.peak_bytes / 2**30, 3)
                if p.reserved_bytes:
                    r["reserved_gib"] = round(p.reserved_bytes / 2**30, 3)
                if capacity:
                    r["peak_frac"] = round(p.peak_bytes / capacity, 4)
                if mem:
                    pm = predict_peak(mem, p.tokens, p.B)
                    r.update(pred_gib=round(pm / 2**30, 3), mem_err=round(rel_err(pm, p.peak_bytes), 4))
        if p.note:
            r["note"] = p.note
        rows.append(r)
    return rows


def err_summary(rows, role, key="err"):
    """n, median and worst |relative error| of `key` over the rows of `role`; None when it has none."""
    errs = [abs(r[key]) for r in rows if r["role"] == role and key in r]
    if not errs:
        return None
    return {"n": len(errs), "median_abs_rel_err": round(statistics.median(errs), 4),
            "worst_abs_rel_err": round(max(errs), 4)}


def dual_report(profile, dual, sizes):
    """How well the paper's B * s^p <= M_comp tracks the time model's equal-compute batch
    B_time(s) = T / sample_ms(s), T as in profile.derive_dual, at the measured sizes."""
    p, m_comp = dual
    s_hi = max(sizes)
    target = max(profile.sample_ms(s_hi), profile.per_token_ms * profile.budget_tokens)
    out = []
    for s in sorted(set(sizes)):
        b_time = target / profile.sample_ms(s)
        b_dual = m_comp / s ** p
        out.append({"s": s, "B_time": round(b_time, 3), "B_dual": round(b_dual, 3),
                    "err": round(rel_err(b_dual, b_time), 4)})
    return out


def print_report(rows, fit, prof):
    """The per-point table, the error summaries, the OOM bound and the budget, on stdout."""
    cols = ("role", "status", "B", "shape", "S", "s", "ms", "pred_ms", "err", "step_ms", "peak_gib", "pred_gib",
            "mem_err")
    have = [c for c in cols if any(c in r for r in rows)]
    table = [[str(r.get(c, "")) for c in have] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(have)]
    print("  ".join(c.rjust(w) for c, w in zip(have, widths)))
    for t in table:
        print("  ".join(v.rjust(w) for v, w in zip(t, widths)))
    for key in ("time_fit", "time_heldout", "memory_fit", "memory_heldout"):
        v = fit.get(key)
        if v:
            print(f"{key}: median |err| {v['median_abs_rel_err']:.1%}, worst {v['worst_abs_rel_err']:.1%} "
                  f"over {v['n']} point(s)")
    if fit.get("oom_bound_tokens"):
        print(f"out of memory at {fit['oom_bound_tokens']} tokens per micro-batch (bound)")
    print(f"budget_tokens {prof.budget_tokens}; start-up {fit['init_s']} s, elapsed {fit['elapsed_s']} s")



def print_packs(sec):
    """The packed validation (fit.packed, packs.packed_summary) on stdout: a row per pack, then the median
    errors against their thresholds, PASS / FAIL."""
    if not sec or "packs" not in sec:
        print(f"packed validation: {(sec or {}).get('note', 'not run')}")
        return
    gib = 2**30
    print(f"packed validation: {sec['n_measured']} of {sec['n_built']} pack(s) measured (seed {sec['seed']}, "
          f"<= {sec['target_mem_tokens']:.0f} memory tokens each)")
    for r in sec["packs"]:
        mem = (f", peak {r['peak_bytes'] / gib:.2f} GiB pred {r['pred_bytes'] / gib:.2f} ({r['mem_err']:+.1%})"
               if "mem_err" in r else "")
        got = (f"{r['ms']:.1f} ms pred {r['pred_ms']:.1f} ({r['err']:+.1%}){mem}" if r["status"] == "ok"
               else f"{r['status']} (pred {r['pred_ms']:.1f} ms){': ' + r['note'] if r.get('note') else ''}")
        print(f"  {r['recipe']:<18} n={r['n']:<3} {r['tokens']:>7} tokens  {got}  [{r['shapes']}]")
    for what in ("time", "memory"):
        v = sec[what]
        if v["n"]:
            print(f"packed {what}: median |err| {v['median_abs_rel_err']:.1%} (worst {v['worst_abs_rel_err']:.1%}) "
                  f"over {v['n']} pack(s): {'PASS' if v['pass'] else 'FAIL'} (<= {v['threshold']:.0%})")
        else:
            print(f"packed {what}: not measured")
