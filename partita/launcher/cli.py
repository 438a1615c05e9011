"""The ``partita`` command.

``partita run`` is a thin front end to torchrun (``torch.distributed.run``): it works out
the node layout from flags, a DeepSpeed hostfile or the SLURM allocation, then hands
process management, restarts and failure reporting to torch.distributed.elastic, which
already does them well. ``partita env`` prints the environment report; ``partita plot``
charts logged runs (:mod:`partita.monitor.plot`); ``partita estimate`` predicts per-rank
memory (:mod:`partita.estimate`); ``partita k8s`` writes Kubernetes manifests
(:mod:`partita.launcher.k8s`); ``partita tune`` searches micro-batch, ZeRO stage, activation
checkpointing and offload with short trials (:mod:`partita.autotune`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from partita.launcher.plan import RunOptions

__all__ = ["build_parser", "main", "run_options_from_args"]

_RUN_EPILOG = """\
layouts (strongest first):
  flags        --nnodes 2 --node-rank 0 --master-addr node01 [--master-port 29500]
  hostfile     --hostfile hosts.txt   (lines 'HOST slots=N'; start partita run on every host)
  elastic      --nnodes 2:4 --rdzv-backend c10d --rdzv-endpoint node01:29400   (same on every node)
  Kubernetes   a PyTorchJob or JobSet pod (PET_* / JobSet variables; see partita k8s)
  SLURM        srun --ntasks-per-node=1 partita run train.py   (nodes read from the allocation)
  local        one node, all GPUs, or 2 CPU processes without a GPU
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="partita", description="partita distributed training tools")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{run,env,plot,checkpoint,estimate,k8s,tune}")

    run = commands.add_parser(
        "run", help="launch a training script on every local GPU (or CPU) through torchrun",
        description="Launch a training script through torchrun.", epilog=_RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("--nproc", "--nproc-per-node", dest="nproc", type=int, default=None,
                     help="processes per node (default: all local GPUs, or 2 without a GPU)")
    run.add_argument("--nnodes", type=_node_count, default=None,
                     help="number of nodes, or MIN:MAX for an elastic job (with --rdzv-backend c10d)")
    run.add_argument("--node-rank", type=int, default=None, help="this node's index, 0..nnodes-1")
    run.add_argument("--master-addr", default=None, help="host of node rank 0")
    run.add_argument("--master-port", type=int, default=None, help="rendezvous port (default 29500)")
    run.add_argument("--hostfile", default=None, help="DeepSpeed-style hostfile ('HOST slots=N' lines)")
    run.add_argument("--rdzv-backend", default=None, choices=("static", "c10d"),
                     help="c10d: torchrun's elastic rendezvous (nodes may leave and rejoin); needs --rdzv-endpoint")
    run.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the c10d rendezvous, the same on every node")
    run.add_argument("--rdzv-id", default=None, help="job id shared by the nodes of one c10d rendezvous")
    run.add_argument("--rdzv-conf", default=None, help="torchrun's rendezvous options, e.g. last_call_timeout=5")
    run.add_argument("--max-restarts", type=int, default=0,
                     help="restart all workers up to K times after a failure (default 0)")
    run.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module, like python -m")
    run.add_argument("--dry-run", action="store_true",
                     help="print the torchrun command instead of running it")
    run.add_argument("script", help="training script (or module name with --module)")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")

    commands.add_parser("env", help="print versions, devices, backends and optional extras")

    plot = commands.add_parser("plot", help="PNG charts of loss, throughput, memory and grad norm of runs",
                               description="Plot runs logged by csv_monitor or tensorboard, overlaid.")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run's output_path/job_name directory")
    plot.add_argument("-o", "--out-dir", default="plots", help="where the PNG files go (default ./plots)")
    plot.add_argument("--x", dest="x_axis", choices=("steps", "samples"), default="steps",
                      help="x axis: optimizer steps (default) or samples trained")

    from partita.checkpoint.cli import add_checkpoint_parser  # import-light: no torch

    add_checkpoint_parser(commands)
    from partita.estimate.cli import add_estimate_parser  # import-light: no torch

    add_estimate_parser(commands)
    from partita.launcher.k8s import add_k8s_parser  # import-light: no torch

    add_k8s_parser(commands)
    from partita.autotune.cli import add_tune_parser  # import-light: no torch

    add_tune_parser(commands)
    return parser


def _node_count(text: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` (torchrun's elastic form) as (min, max)."""
    parts = text.split(":")
    try:
        counts = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a node count N or a range MIN:MAX") from None
    if len(counts) not in (1, 2):
        raise argparse.ArgumentTypeError(f"{text!r} is not a node count N or a range MIN:MAX")
    return counts[0], counts[-1]


def run_options_from_args(args: argparse.Namespace) -> RunOptions:
    """The parsed ``run`` flags as plain data (torch is imported lazily to keep --help fast)."""
    from partita.launcher.plan import RunOptions

    return RunOptions(
        script=args.script, script_args=tuple(args.script_args), nproc=args.nproc,
        nnodes=args.nnodes[1] if args.nnodes else None, node_rank=args.node_rank, master_addr=args.master_addr,
        master_port=args.master_port, hostfile=args.hostfile, max_restarts=args.max_restarts,
        module=args.module, min_nnodes=args.nnodes[0] if args.nnodes and args.nnodes[0] != args.nnodes[1] else None,
        rdzv_backend=args.rdzv_backend, rdzv_endpoint=args.rdzv_endpoint, rdzv_id=args.rdzv_id,
        rdzv_conf=args.rdzv_conf,
    )


def _torchrun_argv(args: argparse.Namespace) -> list[str]:
    import torch

    from partita.launcher.hostfile import hostfile_layout, read_hostfile
    from partita.launcher.kubernetes_env import kubernetes_layout
    from partita.launcher.plan import build_torchrun_argv, resolve_plan
    from partita.launcher.slurm import slurm_allocation

    opts = run_options_from_args(args)
    layout = None
    if opts.hostfile is not None:
        layout = hostfile_layout(read_hostfile(opts.hostfile), node_rank=opts.node_rank)
    gpus = torch.cuda.device_count()
    plan = resolve_plan(opts, cuda_device_count=gpus, slurm=slurm_allocation(), hostfile=layout,
                        kubernetes=kubernetes_layout(cuda_device_count=gpus))
    return build_torchrun_argv(plan)


def _run(args: argparse.Namespace) -> int:
    try:
        argv = _torchrun_argv(args)
    except ValueError as error:
        # Same status as argparse's usage errors: the command line was wrong, nothing ran.
        print(f"partita run: error: {error}", file=sys.stderr)
        return 2
    if args.dry_run:
        print("torchrun " + " ".join(argv))
        return 0

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    from partita.launcher.allocator import prepare_allocator
    from partita.launcher.signals import prepare_signal_forwarding, signal_exit_code

    prepare_signal_forwarding(os.environ)  # SIGUSR1 reaches the ranks, and they get time to save
    prepare_allocator(os.environ)  # expandable segments: ZeRO's large flat tensors do not fragment

    # No TORCH_DISABLE_SHARE_RDZV_TCP_STORE for restarts (d5293f6 set it): the ranks share the
    # agent's store, and partita's init keeps each restart attempt's keys under a prefix of its
    # own (partita.distributed.init._agent_store), so a restarted group never reads dead peers'.

    try:
        torchrun_main(argv)
    except ChildFailedError as error:
        # torchrun has already logged each failed rank with its traceback; repeat the
        # summary and exit non-zero without a second, launcher-internal traceback.
        print(error.format_msg(), file=sys.stderr)
        _, root_cause = error.get_first_failure()
        # A worker killed by a signal has a negative exitcode; the shell convention is 128+N.
        code = root_cause.exitcode
        return code if 0 < code < 256 else (128 - code if -64 < code < 0 else 1)
    except SignalException as error:
        # The scheduler signalled the launcher; torchrun forwarded it and waited for the ranks.
        print(f"partita run: stopped by {signal.Signals(error.sigval).name}", file=sys.stderr)
        return signal_exit_code(error.sigval)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``partita`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "env":
        from partita.launcher.env_report import env_report

        print(env_report())
        return 0
    if args.command == "plot":
        from partita.monitor.plot_cli import plot_command

        return plot_command(args.run_dirs, args.out_dir, x_axis=args.x_axis)
    if args.command == "checkpoint":
        from partita.checkpoint.cli import run_checkpoint_command

        return run_checkpoint_command(args)
    if args.command == "estimate":
        from partita.estimate.cli import run_estimate_command

        return run_estimate_command(args)
    if args.command == "k8s":
        from partita.launcher.k8s import run_k8s_command

        return run_k8s_command(args)
    if args.command == "tune":
        from partita.autotune.cli import run_tune_command

        return run_tune_command(args)
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
