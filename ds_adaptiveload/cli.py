"""`python -m ds_adaptiveload <command>`: each command lives in its own module, imported lazily so that
`plan` never imports torch."""
import importlib
import os
import signal
import sys

from ds_adaptiveload import log
from ds_adaptiveload.errors import UserError
from ds_adaptiveload.flags import Parser
from ds_adaptiveload.train import failures  # torch-free: imports torch only when a command has

# command -> (module, help). Each module defines add_arguments(parser) and run(args) -> int, and keeps
# heavy imports (torch, deepspeed) inside run().
COMMANDS = {
    "train": ("ds_adaptiveload.train_cli", "train a Wan DiT with DeepSpeed and the AdaptiveLoad scheduler "
                                            "(launch/train_wan.py runs the same)"),
    "plan": ("ds_adaptiveload.plan_cli", "plan an epoch of micro-batches from a manifest and a cost profile"),
    "report": ("ds_adaptiveload.report_cli",
               "report op: the fused op's build state and versions; report data --manifest ...: a dataset report"),
    "manifest": ("ds_adaptiveload.data.scan", "write a manifest from a folder of videos and images"),
    "encode": ("ds_adaptiveload.data.encode",
               "encode a manifest's videos and captions into the latent dataset (Wan VAE + umT5)"),
    "synthesize": ("ds_adaptiveload.data.latents", "write a synthetic latent dataset of realistic shapes"),
    "calibrate": ("ds_adaptiveload.calibrate.cli", "measure the training step and write a cost profile"),
    "export": ("ds_adaptiveload.export_cli",
               "export a training checkpoint to a diffusers transformer folder or the original Wan 2.1 layout"),
    "sample": ("ds_adaptiveload.sample_cli", "render a clip from a checkpoint or export with diffusers' WanPipeline"),
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # `deepspeed --module ds_adaptiveload encode ...` puts --local_rank=N before the command; the launcher
    # also sets LOCAL_RANK, which is what the commands read.
    argv = [a for a in argv if not a.startswith("--local_rank=")]
    parser = Parser(prog="python -m ds_adaptiveload")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_module=module)
        if name != "train":  # the trainer's own parser adds it (train_cli.add_arguments)
            log.add_argument(p)
        # Only the chosen command's module is imported: one broken or heavy command cannot break others.
        if argv and argv[0] == name:
            importlib.import_module(module).add_arguments(p)
    try:
        args = parser.parse_args(argv)  # a bad flag is a UserError too (flags.Parser)
    except UserError as e:
        error = e
    else:
        log.configure(args.log_level)
        signal.signal(signal.SIGTERM, failures.on_sigterm)  # one error line and exit 143, not a silent death
        try:
            return importlib.import_module(args._module).run(args) or 0
        except (Exception, failures.Terminated) as e:
            return _report(e)
    return flag_error(argv, error)


def flag_error(argv, error) -> int:
    """A bad flag: one `error:` line, exit 2. Under a launcher with several ranks (train, calibrate, encode) the
    ranks agree on it first and rank 0 prints it (train_cli.agreed_exit), outside the `except` block of the error;
    each rank printed its own copy before."""
    if argv and argv[0] in COMMANDS and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from ds_adaptiveload.train_cli import agreed_exit

        return agreed_exit(error)
    print(f"error: {error}", file=sys.stderr)
    return 2


def _report(e) -> int:
    """The exit code of a failed command, after one `error:` line; a bug is re-raised (its traceback is wanted).
    A command running on several ranks (calibrate, encode under a launcher) ends as the trainer does
    (failures.report): an agreed error printed once, a lost peer named, the same exit code on every rank."""
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return failures.report(e)
    if isinstance(e, UserError):
        print(f"error: {e}", file=sys.stderr)
        return getattr(e, "code", failures.EXIT_USER_ERROR)  # an agreed bug on one process: 1
    if isinstance(e, failures.Terminated):
        print("error: stopped by SIGTERM", file=sys.stderr, flush=True)
        return failures.EXIT_TERMINATED
    raise e
