"""`python -m ds_adaptiveload report`: one command, two reports. Without --manifest it prints the fused op's
build state and versions (like ds_report); with --manifest it writes the dataset report (plots + Markdown)."""
from ds_adaptiveload.data import report as dataset_report
from ds_adaptiveload.ops import report as op_report


def add_arguments(p):
    dataset_report.add_arguments(p)
    op_report.add_arguments(p)


def run(args):
    if args.manifest:
        return dataset_report.run(args)
    return op_report.run(args)
