"""JIT-build (or load from the torch extensions cache) the fused LN-modulate op once, so that later processes of
the same machine load it; with --resource-usage, each bf16 kernel's registers and stack from cuobjdump.

    python bench/kernel/build_op.py [--resource-usage OUT.log]
"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def resource_usage(so):
    """'kernel REG n STACK m' per bf16 kernel of the built library (register pressure of each tile)."""
    if not shutil.which("cuobjdump"):
        return ["cuobjdump: not found"]
    text = subprocess.run(["cuobjdump", "--dump-resource-usage", so], capture_output=True, text=True).stdout
    lines, fn = [], None
    for ln in text.splitlines():
        m = re.search(r"Function ([^ :]*)", ln)
        if m:
            fn = m.group(1)
            continue
        r = re.search(r"REG:(\d+).*STACK:(\d+)", ln)
        if fn and r and "bfloat16fS1_" in fn.lower():
            lines.append(f"{fn} REG {r.group(1)} STACK {r.group(2)}")
        fn = None if r else fn
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--resource-usage", help="write the kernels' register / stack use here")
    args = ap.parse_args()
    from ds_adaptiveload.ops.builder import LNModulateBuilder

    t = time.time()
    m = LNModulateBuilder().load(verbose=False)
    print(f"built/loaded {m.__file__} in {time.time() - t:.0f} s", flush=True)
    if args.resource_usage:
        so = m.__file__ or next(iter(glob.glob(os.path.expanduser("~/.cache/torch_extensions/*/ln_modulate/*.so"))), "")
        with open(args.resource_usage, "w") as f:
            f.write("\n".join(resource_usage(so)) + "\n")


if __name__ == "__main__":
    main()
