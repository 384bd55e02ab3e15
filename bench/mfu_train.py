"""launch/train_wan.py with the MFU levers applied from outside (bench/mfu_levers.py), for bench/mfu.py's e2e
part until the coordinator wires them into the model and the trainer. Same arguments as launch/train_wan.py;
the levers come from the environment (the deepspeed launcher passes it on):

    MFU_CKPT     auto (schedule/memory.py's k per micro-batch) | all | none | <k>; unset: no levers
    MFU_MEMORY   JSON of the memory dict k is planned with (capacity_bytes null: this GPU's)
    MFU_COMPILE  1: compiled blocks (model/compile.py)
    MFU_POLICY   full (default) | attention: what checkpointed blocks recompute (WanModel checkpoint_policy)
    MFU_STATS    where to write, at exit, the k chosen per micro-batch and the compile counters

WanModel.forward is wrapped at class level, so whichever code builds the model (today's train(), a Trainer)
gets the levers on its first forward; the engine has been built by then.
"""
import atexit
import collections
import json
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))


def install(mode, memory, compiled, stats_path, policy="full"):
    import torch

    from ds_adaptiveload.model import wan
    from mfu_levers import Levers, choose_k

    ks = collections.Counter()
    original = wan.WanModel.forward

    def forward(self, x, *args, **kwargs):
        levers = self.__dict__.get("_mfu_levers")
        if levers is None:
            levers = self.__dict__["_mfu_levers"] = Levers(self)
            if memory.get("capacity_bytes") is None and torch.cuda.is_available():
                memory["capacity_bytes"] = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        k = choose_k(x, memory, levers, mode, policy) if torch.is_grad_enabled() else 0
        k, k_full = k if isinstance(k, tuple) else (k, k)
        ks[k if policy == "full" else f"{k}/{k_full}"] += 1
        levers.set(k, compiled, policy, k_full)
        return original(self, x, *args, **kwargs)

    wan.WanModel.forward = forward

    def dump():
        doc = {"k_counts": {str(k): n for k, n in sorted(ks.items())}, "ckpt_mode": mode, "compiled": compiled,
               "policy": policy,
               "memory": memory}
        if compiled:
            from ds_adaptiveload.model.compile import compile_stats

            doc.update(compile_stats())
        with open(stats_path, "w") as f:
            json.dump(doc, f, indent=1)

    if stats_path:
        atexit.register(dump)


def main():
    mode = os.environ.get("MFU_CKPT")
    if mode:
        memory = {}
        if os.environ.get("MFU_MEMORY"):
            with open(os.environ["MFU_MEMORY"]) as f:
                memory = json.load(f)
        install(mode, memory, os.environ.get("MFU_COMPILE") == "1", os.environ.get("MFU_STATS"),
                os.environ.get("MFU_POLICY", "full"))
    script = os.path.join(ROOT, "launch", "train_wan.py")
    sys.argv = [script, *sys.argv[1:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
