"""Markdown table of one or more --tile-sweep JSON files (bench/kernel/ln_modulate.py): one row per (shape, dtype,
layout, pass, tile), one column per (file, batch path, waves), % of the pass's byte floor in a stream.

    python bench/kernel/sweep_table.py bench/results/ln_modulate-...-tiles.json [more.json] [--names a,b]
        [--tiles 3x2x1,2x3x1]

The "auto" path is labelled by the file's name alone; other paths as NAME:flat8 (batch path, then waves; 0 = the
op's rule)."""
import argparse
import json
from collections import defaultdict


def columns(paths, names):
    """{(B, S, D, dtype, layout, pass, tile): {column: bw%}} and the columns in first-seen order."""
    cells, order = defaultdict(dict), []
    for path, name in zip(paths, names):
        with open(path) as f:
            rows = json.load(f)["tiles"]
        for r in rows:
            path_name = r.get("batch_path", "auto")
            col = name if path_name == "auto" else f"{name}:{path_name}{r.get('waves', 0)}"
            if col not in order:
                order.append(col)
            key = (r["B"], r["S"], r["D"], r["dtype"], r.get("layout", "sample"), r["pass"], tuple(r["tile"]))
            cells[key][col] = r.get("bw%", "-")
    return cells, order


def table(cells, order, tiles=None):
    lines = ["| shape | dtype | layout | pass | tile | " + " | ".join(order) + " |",
             "|---|---|---|---|---|" + "---:|" * len(order)]
    for (B, S, D, dtype, layout, pas, tile), row in cells.items():
        if tiles and tile not in tiles:
            continue
        vals = " | ".join(str(row.get(c, "-")) for c in order)
        lines.append(f"| {B}x{S}x{D} | {dtype} | {layout} | {pas} | [{', '.join(map(str, tile))}] | {vals} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--names", default=None, help="one per file (default: a, b, ...)")
    ap.add_argument("--tiles", default=None, help="only these tiles, e.g. 3x2x1,4x5x2")
    args = ap.parse_args(argv)
    names = args.names.split(",") if args.names else [chr(ord("a") + i) for i in range(len(args.files))]
    if len(names) != len(args.files):
        raise SystemExit(f"--names: {len(names)} names for {len(args.files)} files")
    tiles = {tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")} if args.tiles else None
    print(table(*columns(args.files, names), tiles))


if __name__ == "__main__":
    main()
