"""Two runs of bench/kernel/ln_modulate.py side by side: per (shape, dtype, layout) row, the stream times of a run
and of its reference (e.g. `run.py --ref`'s verify16 and verify16-ref on one machine), their change, and the fwd+bwd
% of the byte floor of each, as a markdown table. No torch: it reads the JSONs only.

    python3 bench/kernel/compare.py NEW.json REF.json [--names branch,main]
"""
import argparse
import json
import sys

TIMES = (("fwd", "ours_stream_fwd_ms"), ("bwd", "ours_stream_bwd_ms"))  # in a stream: the timing that decides
PCT = "ours_stream_fwdbwd_bw%"


def rows_by_key(doc, path):
    """{(B, S, D, dtype, layout): row} of one run's JSON; a run without rows is an error naming the file."""
    rows = doc.get("rows") or []
    if not rows:
        raise SystemExit(f"error: {path}: no 'rows' (a --tile-sweep run has 'tiles' only)")
    return {(r["B"], r["S"], r["D"], r["dtype"], r["layout"]): r for r in rows}


def table(new, ref, names=("new", "ref")) -> list[str]:
    """Markdown lines: the rows both runs have, in the new run's order; a row only one run has is listed below."""
    a, b = names
    head = ["shape", "dtype", "layout"]
    for what, _ in TIMES:
        head += [f"{what} {a}, us", f"{what} {b}, us", "change"]
    head += [f"fwd+bwd % {a} / {b}"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * 3 + "---:|" * (3 * len(TIMES)) + "---|"]
    for key, r in new.items():
        if key not in ref:
            continue
        q = ref[key]
        cells = [f"{key[0]}x{key[1]}x{key[2]}", {"bfloat16": "bf16", "float16": "fp16"}.get(key[3], key[3]), key[4]]
        for _, t in TIMES:
            x, y = r.get(t), q.get(t)
            cells += [f"{x * 1e3:.1f}" if x else "-", f"{y * 1e3:.1f}" if y else "-",
                      f"{100 * (x / y - 1):+.1f}%" if x and y else "-"]
        cells.append(f"{r.get(PCT, '-')} / {q.get(PCT, '-')}")
        out.append("| " + " | ".join(cells) + " |")
    only = [k for k in new if k not in ref] + [k for k in ref if k not in new]
    if only:
        out.append("")
        out.append("In one run only: " + ", ".join(f"{k[0]}x{k[1]}x{k[2]} {k[3]} {k[4]}" for k in only))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("new")
    ap.add_argument("ref")
    ap.add_argument("--names", default="new,ref", help="two column names, comma-separated")
    args = ap.parse_args(argv)
    names = args.names.split(",")
    if len(names) != 2:
        ap.error(f"--names: expected two names, got {args.names!r}")
    docs = []
    for path in (args.new, args.ref):
        with open(path) as f:
            docs.append(rows_by_key(json.load(f), path))
    print("\n".join(table(*docs, names=names)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
