"""Packed micro-batches on one GPU (issue #19): forward+backward ms, tokens/s and peak memory of one packed
micro-batch of mixed shapes against the same samples as separate one-shape micro-batches, and of a packed
image-heavy micro-batch against the best one-shape image batch (a sweep over B). Plain bf16 (no ZeRO, no
optimizer), the flow-matching loss of train/flow.py, with and without activation checkpointing.

    python bench/model/packed_model.py --out bench/results                 # one H200, 1.3B config, < 5 min
    PACKED_SMOKE=1 python bench/model/packed_model.py --out /tmp/packed    # CPU: tiny model and shapes

Timing: wall time of loss + backward with a device sync after it (what a training micro-step pays,
Python overhead included), after one warm-up run of the same case; noise is drawn before timing. Memory
(act_gib): the peak allocated during the timed runs minus what was allocated before the case's inputs were
made (bf16 weights and their gradients), so inputs count as they do in calibration; compared with the
profile's memory model bytes_per_token * tokens + bytes_per_sample * samples (the profile is calibrated with
checkpointed blocks, so that comparison applies to the checkpointed runs).
Writes one JSON (date, device, versions, every case, a summary) to --out, rewritten after each case.
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from ds_adaptiveload.train.config import default_alloc_conf  # noqa: E402

default_alloc_conf()  # the allocator the profile was calibrated under, before the first CUDA allocation
import torch  # noqa: E402

from ds_adaptiveload.schedule.geometry import Geometry  # noqa: E402
from ds_adaptiveload.model import WanConfig, WanModel  # noqa: E402
from ds_adaptiveload.ops import layernorm_modulate as lnm  # noqa: E402
from ds_adaptiveload.schedule.profile import CostProfile  # noqa: E402
from ds_adaptiveload.train import flow  # noqa: E402

SMOKE = os.environ.get("PACKED_SMOKE") == "1"
# Micro-batches as (count, frames, height, width) in pixels, per checkpoint_blocks. Without checkpointing
# the 1.3B model saves ~165 kB per token per block (measured on CPU), ~5 MB per token: those stay under 19k tokens.
if SMOKE:
    MIXED = {True: [(1, 9, 64, 96), (2, 5, 32, 64), (6, 1, 32, 64)], False: [(1, 5, 64, 64), (3, 1, 32, 64)]}
    IMAGE_MIX = {True: [(4, 1, 32, 64), (4, 1, 64, 32), (2, 1, 64, 64)], False: [(2, 1, 32, 64), (2, 1, 64, 32)]}
    SWEEP = {True: [1, 4, 8], False: [1, 4]}
    IMAGE = (1, 32, 64)
else:
    MIXED = {True: [(1, 81, 720, 1280), (2, 81, 480, 832), (40, 1, 480, 832)],
             False: [(1, 17, 480, 832), (2, 5, 480, 832), (3, 1, 480, 832)]}
    # Image shapes of 1024-2040 tokens (mean 1485): per-token cost near the 1560-token sweep's, so tokens/s compare.
    IMAGE_MIX = {True: [(32, 1, 480, 832), (32, 1, 832, 480), (24, 1, 512, 512), (16, 1, 640, 640), (8, 1, 544, 960)],
                 False: [(3, 1, 480, 832), (3, 1, 832, 480), (2, 1, 512, 512), (2, 1, 640, 640), (1, 1, 544, 960)]}
    SWEEP = {True: [8, 32, 64, 128], False: [1, 4, 8, 12]}
    IMAGE = (1, 480, 832)
HEAVY_TOKENS = 100_000  # cases above this many tokens are timed --heavy-reps times (after the warm-up), others --reps


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-config", default="configs/wan_tiny.yaml" if SMOKE else "configs/wan_1_3b.yaml")
    p.add_argument("--profile", default="configs/profiles/h200-wan1.3b-zero3.yaml",
                   help="cost profile whose memory model (bytes_per_token, bytes_per_sample) the peaks are checked against")
    p.add_argument("--out", required=True, help="folder for the JSON")
    p.add_argument("--modes", default="ckpt,plain", help="comma list: ckpt (checkpoint_blocks) and/or plain")
    p.add_argument("--reps", type=int, default=2, help="timed runs per case (median), after one warm-up")
    p.add_argument("--heavy-reps", type=int, default=1,
                   help=f"timed runs of cases over {HEAVY_TOKENS:,} tokens (one packed mixed run is ~17 s on an H200; "
                        "2 or 3 tell a 1-2%% difference from run-to-run noise)")
    p.add_argument("--budget-s", type=float, default=240.0, help="cases not started after this many seconds are skipped")
    p.add_argument("--pairs", type=int, default=0,
                   help="after the cases, time packed against its comparison this many times in ABBA order (the mixed "
                        "pack against its separate micro-batches, the image-heavy pack against the best one-shape "
                        "batch), so that a GPU's clock drift falls on both alike; 0: off")
    p.add_argument("--compile", choices=("none", "regions"), default="none",
                   help="regions: the blocks' elementwise steps compiled (model/compile.compile_regions) for every case, "
                        "packed and separate alike; a case's warm-up run compiles what it needs")
    return p.parse_args(argv)


def op_status() -> str:
    """Load the fused op now (a JIT build is setup time, not a case's) and say which backend runs."""
    try:
        return "cuda op" if lnm.load_op() is not None else f"torch ({lnm.op_error()})"
    except Exception as err:  # noqa: BLE001 - the op module is being reworked elsewhere; report, do not stop
        return f"unknown ({type(err).__name__}: {err})"


class Bench:
    """The model, the device and the results of one run."""

    def __init__(self, args):
        self.args, self.t0 = args, time.perf_counter()
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.cuda = self.device.type == "cuda"
        self.cfg = WanConfig.from_yaml(os.path.join(ROOT, args.model_config))
        self.geo = Geometry(patch_size=self.cfg.patch_size)
        self.mem = CostProfile.load(os.path.join(ROOT, args.profile)).memory
        torch.manual_seed(0)
        with self.device:
            self.model = WanModel(self.cfg).to(torch.bfloat16)
        torch.nn.init.normal_(self.model.head.head.weight, std=0.02)  # a zero head would not train the blocks
        for p in self.model.parameters():  # gradients held from the start: memory baselines include them
            p.grad = torch.zeros_like(p)
        if args.compile == "regions":
            from ds_adaptiveload.model.compile import compile_regions

            compile_regions(self.model)
        op = op_status()
        self.capacity = torch.cuda.get_device_properties(0).total_memory if self.cuda else 0
        self.worst_bytes_per_token = 0.0
        stamp = datetime.datetime.now(datetime.timezone.utc)
        dev = torch.cuda.get_device_name() if self.cuda else platform.processor() or "cpu"
        tag = "-regions" if args.compile == "regions" else ""
        self.path = os.path.join(args.out, f"packed-model{tag}-{stamp:%Y-%m-%d-%H%M}-{dev.split()[-1].lower()}.json")
        self.res = {"date": f"{stamp:%Y-%m-%d %H:%M} UTC", "device": dev, "torch": torch.__version__,
                    "cuda": torch.version.cuda, "python": platform.python_version(),
                    "ln_modulate": op, "compile": args.compile,
                    "model_config": args.model_config, "profile": args.profile, "dtype": "bf16",
                    "memory_model": {k: self.mem.get(k) for k in ("bytes_per_token", "bytes_per_sample")},
                    "setup_s": round(time.perf_counter() - self.t0, 1), "cases": []}

    def samples(self, spec):
        """(x0, context, index) per sample of a [(count, frames, height, width)] spec, grouped by shape."""
        out, g = [], torch.Generator(self.device).manual_seed(1)
        for count, f, h, w in spec:
            lat = self.geo.latent_shape(f, h, w)
            for _ in range(count):
                x0 = torch.randn(self.cfg.in_dim, *lat, generator=g, device=self.device).to(torch.bfloat16)
                ctx = torch.randn(self.cfg.text_len, self.cfg.text_dim, generator=g, device=self.device)
                out.append((x0, ctx.to(torch.bfloat16), len(out)))
        return out

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def measure(self, fn, base: int, tokens: int, n: int, one_micro_batch: bool):
        """Warm-up, then timed runs of fn (loss + backward): ms, peak memory above `base` (weights and grads,
        allocated before the case's inputs, which count as in calibration) and, for a single micro-batch, the
        memory model's prediction for it."""
        reps = self.args.heavy_reps if tokens > HEAVY_TOKENS else self.args.reps
        fn()
        self.sync()
        self.model.zero_grad(set_to_none=False)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            self.sync()
            times.append((time.perf_counter() - t) * 1000)
        act = (torch.cuda.max_memory_allocated() - base) if self.cuda else 0
        self.worst_bytes_per_token = max(self.worst_bytes_per_token, act / tokens)
        ms = statistics.median(times)
        rec = {"ms": round(ms, 2), "runs_ms": [round(x, 2) for x in times], "tokens_per_s": round(tokens / ms * 1000),
               "act_gib": round(act / 2**30, 3), "act_bytes_per_token": round(act / tokens),
               "base_gib": round(base / 2**30, 3)}
        if one_micro_batch:
            pred = self.mem["bytes_per_token"] * tokens + self.mem.get("bytes_per_sample", 0.0) * n
            rec.update(pred_act_gib=round(pred / 2**30, 3), mem_err=round(act / pred - 1, 4) if act else None)
        return rec

    def case(self, name, mode, spec, packed: bool):
        """One case: the samples of `spec` as one packed micro-batch or as one micro-batch per shape."""
        rec = {"name": name, "mode": mode, "packed": packed, "spec": spec}
        tokens, n = sum(self.geo.tokens(f, h, w) * c for c, f, h, w in spec), sum(c for c, *_ in spec)
        rec.update(samples=n, tokens=tokens,
                   tflop=round(sum(self.cfg.flops_per_sample(self.geo.tokens(f, h, w)) * c for c, f, h, w in spec) / 1e12, 2))
        if time.perf_counter() - self.t0 > self.args.budget_s:
            rec["status"] = "skipped: time budget"
        elif self.cuda and self.worst_bytes_per_token * tokens > 0.9 * self.capacity:
            rec["status"] = "skipped: would not fit (largest measured bytes per token)"
        else:
            self.model.set_checkpointing(mode == "ckpt", 0)
            base = torch.cuda.memory_allocated() if self.cuda else 0
            fn = self.packed_fn(self.samples(spec)) if packed else self.separate_fn(self.samples(spec))
            try:
                rec.update(self.measure(fn, base, tokens, n, packed or len(spec) == 1), status="ok")
                rec["tflop_per_s"] = round(rec["tflop"] / rec["ms"] * 1000, 1)
            except torch.cuda.OutOfMemoryError:
                rec["status"] = "oom"
            del fn
            if self.cuda:
                torch.cuda.empty_cache()
        print(json.dumps(rec), flush=True)
        self.res["cases"].append(rec)
        self.save()
        return rec

    def paired(self, name, mode, a, b, tokens_a, tokens_b):
        """--pairs: a and b (loss + backward functions, warmed by their cases) timed alternately A B B A ...; the
        median over pairs of tokens/s(a) / tokens/s(b): above 1, a is faster."""
        rec = {"name": name, "mode": mode, "pairs": []}
        for i in range(self.args.pairs):
            if time.perf_counter() - self.t0 > self.args.budget_s:
                rec["status"] = "cut: time budget"
                break
            ms = {}
            for key, fn in ((("a", a), ("b", b)) if i % 2 == 0 else (("b", b), ("a", a))):
                t = time.perf_counter()
                fn()
                self.sync()
                ms[key] = (time.perf_counter() - t) * 1000
            rec["pairs"].append({"a_ms": round(ms["a"], 2), "b_ms": round(ms["b"], 2),
                                 "ratio": round(tokens_a / ms["a"] / (tokens_b / ms["b"]), 5)})
        if rec["pairs"]:
            rec["ratio_median"] = statistics.median(p["ratio"] for p in rec["pairs"])
        print(json.dumps(rec), flush=True)
        self.res.setdefault("paired", []).append(rec)
        self.save()
        return rec

    def packed_fn(self, smp):
        x0s, ctxs, idx = zip(*smp)
        eps, t = flow.draw_noise_packed(x0s, idx, seed=0, epoch=0, shift=5.0)

        def run():
            flow.packed_flow_matching_loss(self.model, list(x0s), list(ctxs), eps, t).sum().backward()
        return run

    def separate_fn(self, smp):
        """One tensor-form micro-batch per shape (samples arrive grouped by shape)."""
        batches = {}
        for x0, ctx, i in smp:
            batches.setdefault(tuple(x0.shape), []).append((x0, ctx, i))
        prepared = []
        for items in batches.values():
            x0 = torch.stack([s[0] for s in items])
            eps, t = flow.draw_noise(x0, [s[2] for s in items], seed=0, epoch=0, shift=5.0)
            prepared.append((x0, torch.stack([s[1] for s in items]), eps, t))

        def run():
            for x0, ctx, eps, t in prepared:
                flow.flow_matching_loss(self.model, x0, ctx, eps, t).sum().backward()
        return run

    def save(self):
        os.makedirs(self.args.out, exist_ok=True)
        self.res["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        with open(self.path, "w") as f:
            json.dump(self.res, f, indent=1)


def check_outputs(b: Bench) -> dict:
    """Sanity check on the device: one packed forward against the same samples as one-shape micro-batches
    (bf16, no grad). A wrong row or sample order shows as an O(1) relative error; bf16 rounding of GEMMs of
    other row counts as ~1e-2."""
    smp = b.samples(MIXED[False])
    with torch.no_grad():
        x0s, ctxs, _ = zip(*smp)
        t = torch.linspace(100, 900, len(smp), device=b.device)
        packed = b.model(list(x0s), t, list(ctxs))
        errs = []
        for i, (x0, ctx) in enumerate(zip(x0s, ctxs)):
            alone = b.model(x0[None], t[i:i + 1], ctx[None])[0]
            errs.append(((packed[i].float() - alone.float()).norm() / alone.float().norm()).item())
    rec = {"samples": len(smp), "max_rel_err_packed_vs_alone": max(errs)}
    print(json.dumps(rec), flush=True)
    return rec


def attention_compare(b: Bench) -> list:
    """Self-attention core alone, fwd+bwd, on the tokens of the checkpointed packs: one dense SDPA call per
    shape group (what the model does) against one torch varlen_attn call over all samples (issue #19: use
    varlen only where it measures faster)."""
    from ds_adaptiveload.model import sdpa_attention
    from ds_adaptiveload.model.packing import plan_packing

    out, heads, d = [], b.cfg.num_heads, b.cfg.head_dim
    for name, spec in (("mixed", MIXED[True]), ("image-heavy", IMAGE_MIX[True])):
        pt, ph, pw = b.cfg.patch_size
        lats = [b.geo.latent_shape(f, h, w) for c, f, h, w in spec for _ in range(c)]
        pk = plan_packing([(f // pt, h // ph, w // pw) for f, h, w in lats])
        q, k, v = (torch.randn(pk.rows, heads, d, device=b.device, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        lens = [g.tokens for g in pk.groups for _ in range(g.n)]
        cu = torch.tensor([0] + lens, device=b.device).cumsum(0).to(torch.int32)

        def dense():
            o = [sdpa_attention(qg, kg, vg) for qg, kg, vg in zip(pk.views(q), pk.views(k), pk.views(v))]
            torch.autograd.backward(o, [torch.ones_like(x) for x in o])

        def varlen():
            from torch.nn.attention.varlen import varlen_attn
            varlen_attn(q, k, v, cu, cu, max(lens), max(lens)).backward(torch.ones_like(q))

        rec = {"pack": name, "tokens": pk.rows, "groups": len(pk.groups)}
        for label, fn in (("dense_per_group", dense), ("varlen", varlen)):
            try:
                times = []
                for i in range(1 + b.args.reps):
                    t = time.perf_counter()
                    fn()
                    b.sync()
                    times.append((time.perf_counter() - t) * 1000)
                rec[f"{label}_ms"] = round(statistics.median(times[1:]), 2)
            except Exception as err:  # noqa: BLE001 - varlen may be missing or refuse a layout; record it
                rec[f"{label}_error"] = f"{type(err).__name__}: {str(err)[:200]}"
        print(json.dumps(rec), flush=True)
        out.append(rec)
    return out


def run_mode(b: Bench, mode: str) -> dict:
    """Mixed packed vs separate, the one-shape image sweep, image-heavy packed vs separate; a summary."""
    ck = mode == "ckpt"
    b.worst_bytes_per_token = 0.0  # the fit guard is per mode: checkpointing changes bytes per token ~20x
    mixed = [b.case("mixed", mode, MIXED[ck], True), b.case("mixed", mode, MIXED[ck], False)]
    sweep = [b.case(f"images-B{n}", mode, [(n, *IMAGE)], False) for n in SWEEP[ck]]
    heavy = [b.case("image-heavy", mode, IMAGE_MIX[ck], True), b.case("image-heavy", mode, IMAGE_MIX[ck], False)]
    ok = [r for r in sweep if r["status"] == "ok"]
    best = max(ok, key=lambda r: r["tokens_per_s"]) if ok else None
    summary = {"mode": mode}
    if b.args.pairs:
        summary.update(paired_ratios(b, mode, mixed, heavy, best))
    if all(r["status"] == "ok" for r in mixed):
        summary.update(mixed_packed_ms=mixed[0]["ms"], mixed_separate_ms=mixed[1]["ms"],
                       mixed_saved_ms=round(mixed[1]["ms"] - mixed[0]["ms"], 1),
                       mixed_packed_mem_err=mixed[0]["mem_err"])
    if heavy[0]["status"] == "ok" and best:
        summary.update(image_heavy_tokens_per_s=heavy[0]["tokens_per_s"], best_one_shape=best["name"],
                       best_one_shape_tokens_per_s=best["tokens_per_s"],
                       image_heavy_vs_best=round(heavy[0]["tokens_per_s"] / best["tokens_per_s"], 3),
                       image_heavy_mem_err=heavy[0]["mem_err"])
    return summary


def paired_ratios(b: Bench, mode: str, mixed, heavy, best) -> dict:
    """--pairs: the two targets measured in ABBA pairs (Bench.paired); each function's inputs are made anew, so
    the memory of one case's inputs is held only while its pair runs."""
    ck, out = mode == "ckpt", {}
    b.model.set_checkpointing(ck, 0)
    if all(r["status"] == "ok" for r in mixed):
        tok = mixed[0]["tokens"]
        rec = b.paired("mixed: packed / separate", mode, b.packed_fn(b.samples(MIXED[ck])),
                       b.separate_fn(b.samples(MIXED[ck])), tok, tok)
        out["mixed_paired_speed"] = rec.get("ratio_median")
    if heavy[0]["status"] == "ok" and best:
        rec = b.paired(f"image-heavy packed / {best['name']}", mode, b.packed_fn(b.samples(IMAGE_MIX[ck])),
                       b.separate_fn(b.samples(best["spec"])), heavy[0]["tokens"], best["tokens"])
        out["image_heavy_paired_vs_best"] = rec.get("ratio_median")
    return out


def main(argv=None):
    args = parse_args(argv)
    b = Bench(args)
    b.res["output_check"] = check_outputs(b)
    b.res["attention"] = attention_compare(b)
    b.save()
    b.res["summary"] = []
    for mode in args.modes.split(","):
        b.res["summary"].append(run_mode(b, mode))
        b.save()
    print(json.dumps(b.res["summary"], indent=1))
    print(f"wrote {b.path}")


if __name__ == "__main__":
    main()
