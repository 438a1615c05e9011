"""``partita tune``: short trials of a training script, the fastest config that fits.

Imports stay inside the functions so that building the ``partita`` parser stays cheap.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_tune_parser", "format_table", "run_tune_command"]

_EPILOG = """\
examples:
  partita tune train.py --config ds.json                       # every GPU, the default space
  partita tune train.py --config ds.json --nproc 8 --steps 8 --micro-batches 4,8,16 --stages 1,2,3 \\
      --checkpointing none,every --offload none --gpt-preset gpt-1.3b --out best.json --csv trials.csv
  partita tune train.py --config ds.json --model-params 6.7e9 --gpu-memory 80GiB -- --data /data/tokens
  partita tune --config ds.json --nproc 8 train.py --data /data/tokens    # options first, as partita run

After SCRIPT, tune's options come first and the script's arguments after "--"; with --config before
SCRIPT, everything after SCRIPT is the script's.

The script must pass the same config to partita.initialize() (each trial replaces it with its own file)
and take its batch size from the engine (engine.train_micro_batch_size_per_gpu() or initialize's data loader).
The config's "autotuning" section (DeepSpeed's keys) supplies the defaults; flags win.
Exit status: 0 with a best config; 1 when no trial finished; 2 for a wrong input.
"""


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values:
        raise argparse.ArgumentTypeError("the list is empty")
    return values


def _words(text: str) -> tuple[str, ...]:
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    if not values:
        raise argparse.ArgumentTypeError("the list is empty")
    return values


def _add_options(p: argparse.ArgumentParser, *, config_required: bool) -> None:
    p.add_argument("--config", required=config_required, help="the DeepSpeed-style JSON config the script uses")
    p.add_argument("--nproc", type=int, default=None, help="processes per trial (default: all GPUs, or 2 on CPU)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per trial (default end_profile_step, 5)")
    p.add_argument("--out", default=None, help="best config JSON (default <results_dir>/best_config.json)")
    p.add_argument("--csv", default=None, help="every trial (default <results_dir>/trials.csv)")
    p.add_argument("--exps-dir", default=None, help="one folder per trial (default the section's exps_dir)")
    p.add_argument("--micro-batches", type=_ints, default=None,
                   help="micro-batch sizes, e.g. 1,2,4 (default powers of two within the section's bounds)")
    p.add_argument("--stages", type=_ints, default=(0, 1, 2, 3), help="ZeRO stages (default 0,1,2,3)")
    p.add_argument("--checkpointing", type=_words, default=("none", "every"),
                   help="activation checkpointing: none, every, selective (default none,every)")
    p.add_argument("--offload", type=_words, default=("none", "cpu"),
                   help="offload: none, cpu (optimizer), cpu+param (stage 3) (default none,cpu)")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model-params", default=None,
                       help="parameter count for the memory estimate, e.g. 1.3e9 (default: model_info, else measured)")
    model.add_argument("--gpt-preset", choices=("tiny", "gpt2-124m", "gpt-1.3b"), default=None,
                       help="the model is partita's reference GPT of this shape (activations estimated too)")
    p.add_argument("--gpu-memory", default=None, help="accelerator memory per rank (default: the GPU's; none on CPU)")
    p.add_argument("--headroom", type=float, default=0.05, help="fraction of it kept free (default 0.05)")
    p.add_argument("--trial-timeout", type=float, default=600.0, help="seconds before a trial is killed (default 600)")
    p.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module")


def add_tune_parser(commands: Any) -> None:
    """Add the ``tune`` subcommand to the ``partita`` parser's subparsers."""
    p = commands.add_parser(
        "tune", help="try micro-batch x ZeRO stage x checkpointing x offload in short runs; keep the fastest that fits",
        description="Autotune a training script: each trial is a separate short launch of the script with its own "
                    "config; trials the memory estimate says cannot fit are pruned; crashes and out-of-memory are "
                    "recorded and skipped.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_options(p, config_required=False)
    p.add_argument("script", help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER,
                   help="the script's arguments; with no --config before SCRIPT: tune options, then -- and these")


def _split_late_options(args: argparse.Namespace) -> argparse.Namespace:
    """``partita tune script.py --config ds.json ... -- script args``: options after the script.

    With ``--config`` before the script everything after it is the script's (as for
    ``partita run``); without, what follows the script up to ``--`` is tune's options.
    """
    script_args = list(args.script_args)
    if args.config is not None:
        return argparse.Namespace(**{**vars(args), "script_args": script_args[1:] if script_args[:1] == ["--"] else script_args})
    head, tail = (script_args[: script_args.index("--")], script_args[script_args.index("--") + 1:]) \
        if "--" in script_args else (script_args, [])
    late = argparse.ArgumentParser(prog="partita tune SCRIPT", add_help=False)
    _add_options(late, config_required=True)
    try:
        parsed = late.parse_args(head)
    except SystemExit:
        raise ValueError(
            "give --config: partita tune [options] --config ds.json script.py [script args], or "
            "partita tune script.py --config ds.json [options] -- [script args]"
        ) from None
    return argparse.Namespace(**{**vars(parsed), "script": args.script, "script_args": tail,
                                 "module": args.module or parsed.module})


def _model(args: argparse.Namespace, section: Any) -> Any:
    from partita.estimate.inputs import GPTShape

    if args.gpt_preset:
        return GPTShape.preset(args.gpt_preset)
    if args.model_params is not None:
        try:
            count = float(args.model_params)
        except ValueError:
            raise ValueError(f"--model-params {args.model_params!r} is not a number; write e.g. 1.3e9") from None
        if count < 1 or count != int(count):
            raise ValueError(f"--model-params {args.model_params!r} must be a whole number >= 1")
        return int(count)
    if section.model_info is not None and section.model_info.num_params is not None:
        return section.model_info.num_params
    if section.model_info_path:
        path = Path(section.model_info_path)
        try:
            info = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"autotuning.model_info_path {str(path)!r} cannot be read as JSON: {error}") from None
        count = info.get("num_params") if isinstance(info, dict) else None
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"autotuning.model_info_path {str(path)!r} holds no positive integer \"num_params\"")
        return count
    return None


def _budget(args: argparse.Namespace) -> float | None:
    from partita.estimate.inputs import parse_bytes

    if not 0 <= args.headroom < 1:
        raise ValueError(f"--headroom {args.headroom} must be in [0, 1)")
    if args.gpu_memory is not None:
        total = float(parse_bytes(args.gpu_memory, what="--gpu-memory"))
    else:
        import torch

        if not torch.cuda.is_available():
            return None
        total = float(torch.cuda.get_device_properties(0).total_memory)
    return total * (1.0 - args.headroom)


def _options(args: argparse.Namespace):
    from partita.autotune.tuner import TuneOptions
    from partita.config import load_config, resolve_batch_sizes
    from partita.config.loader import read_json_config
    from partita.launcher.plan import default_nproc

    raw = read_json_config(Path(args.config))
    cfg = load_config(raw)
    section = cfg.autotuning
    if args.steps is not None:
        if args.steps < section.start_profile_step:
            raise ValueError(
                f"--steps {args.steps} ends before start_profile_step {section.start_profile_step}; a trial measures "
                "the steps from start_profile_step to --steps"
            )
        section = section.model_copy(update={"end_profile_step": args.steps})
    if args.nproc is not None and args.nproc < 1:
        raise ValueError(f"--nproc {args.nproc} must be >= 1")
    if args.trial_timeout <= 0:
        raise ValueError(f"--trial-timeout {args.trial_timeout} must be > 0 seconds")
    if not args.module and not Path(args.script).is_file():
        raise ValueError(f"training script {args.script!r} does not exist (pass --module to run a module by name)")
    import torch

    nproc = args.nproc or default_nproc(torch.cuda.device_count())
    gas = 1
    if cfg.train_batch_size is not None or cfg.train_micro_batch_size_per_gpu is not None:
        gas = resolve_batch_sizes(cfg, dp_world_size=nproc).gradient_accumulation_steps
    return TuneOptions(
        script=args.script, script_args=tuple(args.script_args), base_config=raw, autotuning=section, nproc=nproc,
        stages=args.stages, micro_batches=args.micro_batches, checkpointing=args.checkpointing, offload=args.offload,
        gradient_accumulation_steps=gas, module=args.module, model=_model(args, section),
        memory_budget_bytes=_budget(args), trial_timeout_s=args.trial_timeout, seed=cfg.seed or 0,
        allocator=_trial_allocator(),
    )


def _trial_allocator() -> str:
    """The caching allocator the trials run under: on a GPU what ``partita run`` gives them
    (PYTORCH_CUDA_ALLOC_CONF, else expandable segments), so pruning compares predicted *reserved*
    memory; on CPU none (no caching allocator: the estimate's tensor bytes)."""
    import torch

    if not torch.cuda.is_available():
        return "none"
    from partita.estimate.allocator import allocator_from_conf

    return allocator_from_conf().kind


def format_table(records: list[Any]) -> str:
    """One line per trial: setup, outcome, tokens/s, samples/s, measured and estimated peak memory."""
    header = ("trial", "status", "tokens/s", "samples/s", "peak GiB", "est. GiB", "note")
    rows = [header]
    for record in records:
        row = record.row()
        rows.append((row["trial"], row["status"], row["tokens_per_sec"], row["samples_per_sec"],
                     row["peak_memory_gib"], row["estimated_peak_gib"], row["note"][:70]))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)


def run_tune_command(args: argparse.Namespace) -> int:
    """Run the search, print the table, write the best config and the CSV."""
    from partita.autotune.tuner import best_record, tune
    from partita.config import ConfigError
    from partita.estimate.inputs import EstimateError
    from partita.progress import Progress

    try:
        args = _split_late_options(args)  # --out, --csv, --exps-dir may follow the script too
        opts = _options(args)
    except (ValueError, ConfigError, EstimateError, OSError) as error:
        print(f"partita tune: error: {error}", file=sys.stderr)
        return 2
    section = opts.autotuning
    results = Path(section.results_dir)
    out = Path(args.out) if args.out else results / "best_config.json"
    csv_path = Path(args.csv) if args.csv else results / "trials.csv"
    exps = Path(args.exps_dir or section.exps_dir)
    progress: list[Progress] = []
    if opts.memory_budget_bytes is None:
        print("partita tune: no accelerator memory limit (CPU run without --gpu-memory): nothing is pruned",
              file=sys.stderr)

    def start(total: int) -> None:
        progress.append(Progress(total=total, desc="partita tune"))

    def advance(record: Any, done: int, total: int) -> None:
        row = record.row()
        progress[0].update(1, last=f"{row['trial']} {row['status']}")

    try:
        records = tune(opts, exps_dir=exps, csv_path=csv_path, on_start=start, on_record=advance)
    except (ValueError, EstimateError) as error:
        print(f"partita tune: error: {error}", file=sys.stderr)
        return 2
    finally:
        if progress:
            progress[0].close()
    print(format_table(records))
    best = best_record(records, section.metric)
    print(f"trials: {csv_path}")
    if best is None:
        print(f"partita tune: no trial finished (see {exps}/<trial>/log.txt); no config written", file=sys.stderr)
        return 1
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(best.point.tuned_config(opts.base_config), indent=2) + "\n")
    print(f"best ({section.metric}): {best.point.name} -> {out}")
    return 0
