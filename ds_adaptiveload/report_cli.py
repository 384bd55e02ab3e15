"""`python -m ds_adaptiveload report op | data`: the fused op's build state and versions (like ds_report), or the
dataset report (plots + Markdown). The older forms still work: `report` alone is `report op`, and
`report --manifest ...` is `report data --manifest ...`."""
from ds_adaptiveload.data import report as dataset_report
from ds_adaptiveload.errors import UserError
from ds_adaptiveload.ops import report as op_report


def add_arguments(p):
    p.add_argument("what", nargs="?", choices=("op", "data"),
                   help="op: the fused op's build state and versions; data: the dataset report (needs --manifest); "
                        "default: data when --manifest is given, else op")
    dataset_report.add_arguments(p)
    op_report.add_arguments(p)


def run(args):
    what = args.what or ("data" if args.manifest else "op")
    if what == "op" and args.manifest:
        raise UserError("report op takes no --manifest (the dataset report is `report data --manifest ...`)")
    if what == "data":
        if not args.manifest:
            raise UserError("report data needs --manifest")
        return dataset_report.run(args)
    return op_report.run(args)
