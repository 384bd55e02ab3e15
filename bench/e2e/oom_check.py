"""Real-GPU check of adaptive_load.on_oom (docs/reliability.md), 1 GPU, < 2 minutes: the 1.3B architecture
without --checkpoint-blocks and the H200 blocks profile, whose budget_tokens (75,600: one 720p 81-frame clip)
only fits with per-block checkpointing, so a full micro-batch runs out of memory.
  1. on_oom "skip": 2 clips + 2 images; each clip step OOMs, is skipped and reported, the image step trains;
     exit 0, OUT/skip/skipped.json lists the OOM steps.
  2. on_oom "error": clips only; the first step exits 2 with the micro-batch's shape and budget.
Writes OUT/oom_check.json with the checks; exit 1 when one fails.

    python bench/e2e/oom_check.py --out OUT      (device runner stage oom)
"""
import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_e2e import read_steps, write_ds_json  # noqa: E402
from train_steps import launch, write_data  # noqa: E402

CLIP, IMAGE = (81, 720, 1280), (1, 480, 832)
PROFILE = "tests/data/h200-wan1.3b-blocks.yaml"


def checks(out, rc_skip, rc_err):
    path = f"{out}/skip/steps.rank0.jsonl"
    recs = read_steps(path) if os.path.exists(path) else []
    ooms = [r["step"] for r in recs if (r.get("skipped") or {}).get("reason") == "oom"]
    trained = [r["step"] for r in recs if "skipped" not in r]
    with open(f"{out}/error/train.log", errors="replace") as f:
        err = f.read()
    result = {"skip run exits 0": rc_skip == 0, "skip run skipped >= 1 OOM step": len(ooms) >= 1,
              "skip run trained >= 1 step after/besides them": len(trained) >= 1,
              "error run exits 2": rc_err == 2, "error names the micro-batch": "out of memory in micro-batch" in err}
    return {"oom_steps": ooms, "trained_steps": trained, "checks": result}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/oom_out"))
    ap.add_argument("--work", default="/tmp/oom_work")
    a = ap.parse_args(argv)
    from ds_adaptiveload.schedule.manifest import Sample

    shutil.rmtree(a.work, ignore_errors=True)
    rcs = {}
    for policy, name, shapes, steps in (("skip", "mixed", [CLIP, CLIP, IMAGE, IMAGE], 3), ("error", "clips", [CLIP, CLIP], 1)):
        manifest = write_data(f"{a.work}/{name}", [Sample(f"{name}-{i}", *s) for i, s in enumerate(shapes)])
        os.makedirs(f"{a.out}/{policy}", exist_ok=True)
        ds = f"{a.work}/ds_{policy}.json"
        write_ds_json(ds, "configs/ds_zero3_bf16.json", on_oom=policy, profile=PROFILE)
        run = f"{a.work}/run_{policy}"
        rcs[policy] = launch(ds, manifest, steps, run, f"{a.out}/{policy}/train.log", extra=["--num-workers", "1"],
                             timeout=110)
        print(f"on_oom={policy}: exit {rcs[policy]}", flush=True)
        with open(f"{a.out}/{policy}/train.log", errors="replace") as f:  # the trainer's own report
            for ln in f:
                if "skipped on every rank" in ln or "summary:" in ln or ln.startswith("error:"):
                    print(ln.rstrip()[:400])
        for f in ("steps.rank0.jsonl", "skipped.json"):
            if os.path.exists(f"{run}/{f}"):
                shutil.copy(f"{run}/{f}", f"{a.out}/{policy}/")
    doc = checks(a.out, rcs["skip"], rcs["error"])
    for k, v in doc["checks"].items():
        print(("PASS " if v else "FAIL ") + k)
    with open(f"{a.out}/oom_check.json", "w") as f:
        json.dump(doc, f, indent=1)
    return 0 if all(doc["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
