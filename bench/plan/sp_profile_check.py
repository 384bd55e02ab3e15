"""Derive a k-way Ulysses profile from a one-GPU calibration (calibrate.sp_profile: attention k x, all-to-all
added at --link-gbs) and check it against the step walls of a measured sp run (its steps.rank0.jsonl).

    python bench/plan/sp_profile_check.py --profile configs/profiles/h200-wan1.3b-zero3.yaml --sp 2 \\
        --steps LOGS/e2e/balanced-sp2/steps.rank0.jsonl --mix video-heavy --num 120 --seed 0 \\
        --out-profile /tmp/h200-wan1.3b-sp2-derived.yaml --out bench/results/sp-profile-check.json
"""
import argparse
import json

from ds_adaptiveload.calibrate import sp_profile
from ds_adaptiveload.schedule.geometry import per_gpu_tokens
from ds_adaptiveload.schedule.mixes import make_mix
from ds_adaptiveload.model import WanConfig
from ds_adaptiveload.schedule.profile import CostProfile


def step_ms(profile, rec, shapes, sp):
    """Predicted wall of one logged step of a dp = 1 run (one rank: the sum of its micro-batches)."""
    return profile.step_fixed_ms + sum(
        profile.micro_ms(len(mb), per_gpu_tokens(profile.geometry.tokens(*shapes[mb[0]]), sp)) for mb in rec["ids"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--profile", required=True, help="one-GPU calibrated profile (meta.sp 1)")
    ap.add_argument("--model-config", default="configs/wan_1_3b.yaml")
    ap.add_argument("--sp", type=int, default=2)
    ap.add_argument("--link-gbs", type=float, default=200.0)
    ap.add_argument("--steps", help="steps.rank0.jsonl of a measured dp = 1, sp = k run")
    ap.add_argument("--mix", default="video-heavy")
    ap.add_argument("--num", type=int, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-profile")
    ap.add_argument("--out")
    args = ap.parse_args()
    base = CostProfile.load(args.profile)
    if base.meta.get("sp", 1) != 1:
        raise SystemExit(f"error: {args.profile} is already an sp = {base.meta['sp']} profile")
    derived = sp_profile(base, WanConfig.from_yaml(args.model_config), args.sp, args.link_gbs, source=args.profile)
    res = {"profile": args.profile, "sp": args.sp, "per_token": derived.per_token_ms,
           "per_token_sq": derived.per_token_sq_ms,
           "all_to_all_ms_per_token": derived.fit["sp_from_one_gpu"]["all_to_all_ms_per_token"]}
    if args.steps:
        shapes = {s.id: (s.frames, s.height, s.width) for s in make_mix(args.mix, args.num, args.seed)}
        with open(args.steps) as f:
            recs = [json.loads(line) for line in f if line.strip()]
        ep0 = [r for r in recs if r.get("epoch", 0) == 0]
        meas = sum(r["step_ms"] for r in ep0) / 1000
        for name, prof in (("one_gpu_profile", base), ("derived_profile", derived)):
            pred = sum(step_ms(prof, r, shapes, args.sp) for r in ep0) / 1000
            res[name] = {"pred_wall_s": pred, "err": pred / meas - 1}
        res.update(measured_wall_s=meas, steps=len(ep0), steps_log=args.steps)
    print(json.dumps(res, indent=1))
    if args.out_profile:
        derived.to_yaml(args.out_profile)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
