"""``partita estimate``: per-rank memory of a training setup, and the fastest setup that fits.

Imports stay inside the functions so that building the ``partita`` parser stays cheap.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["add_estimate_parser", "run_estimate_command"]

_EPILOG = """\
examples:
  partita estimate --model gpt --d-model 2048 --n-layers 24 --n-heads 16 --vocab 50304 --seq-len 2048 \\
      --dtype bf16 --stage 2 --world-size 8 --micro-batch 4
  partita estimate --model gpt-1.3b --world-size 8 --micro-batch 8 --gpu-memory 80GiB
  partita estimate --params 7e9 --stage 3 --world-size 8 --activation-bytes 20GB --json
  partita estimate --model gpt --d-model 5120 --n-layers 40 --n-heads 40 --vocab 50304 --seq-len 2048 \\
      --gpu-memory 141GB --cpu-memory 120GB --nvme-memory 64GB
  partita estimate --model gpt2-124m --config ds_config.json --world-size 2

Flags override --config, which overrides the defaults (bf16, stage 0, one rank, micro-batch 1, AdamW).
Fits compare the predicted reserved memory (allocated tensors + the CUDA caching allocator's rounding and
fragmentation). Exit status: 0; 1 when no setup fits --gpu-memory; 2 for a wrong input.
"""

_PRESETS = ("tiny", "gpt2-124m", "gpt-1.3b")
_OPTIMIZERS = ("Adam", "AdamW", "SGD", "Lion", "AdamW8bit", "Adam8bit", "Lion8bit",
               "PagedAdamW8bit", "PagedAdam8bit", "PagedLion8bit")


def add_estimate_parser(commands: Any) -> None:
    """Add the ``estimate`` subcommand to the ``partita`` parser's subparsers."""
    p = commands.add_parser(
        "estimate", help="per-rank GPU/CPU memory of a training setup; the fastest setup that fits",
        description="Predict per-rank accelerator and CPU memory (parameters, gradients, optimizer states, "
                    "activations, buffers) and, with --gpu-memory, recommend the fastest setup that fits.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = p.add_argument_group("model (one of --model or --params)")
    model.add_argument("--model", choices=("gpt",) + _PRESETS, default=None,
                       help="partita's reference GPT: 'gpt' with the shape flags, or a preset (shape flags override it)")
    model.add_argument("--d-model", type=int, default=None)
    model.add_argument("--n-layers", type=int, default=None)
    model.add_argument("--n-heads", type=int, default=None)
    model.add_argument("--vocab", type=int, default=None)
    model.add_argument("--seq-len", type=int, default=None, help="sequence length (the GPT's block size)")
    model.add_argument("--dropout", type=float, default=None, help="GPT dropout (default 0)")
    model.add_argument("--params", default=None, help="a bare parameter count, e.g. 7e9 (activations unknown)")
    setup = p.add_argument_group("setup (default: from --config, else partita's defaults)")
    setup.add_argument("--config", default=None, help="a partita/DeepSpeed JSON config to read the setup from")
    setup.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None)
    setup.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=None, help="ZeRO stage")
    setup.add_argument("--world-size", type=int, default=None, help="data-parallel ranks (default 1)")
    setup.add_argument("--micro-batch", type=int, default=None, help="samples per rank per forward (default 1)")
    setup.add_argument("--gradient-accumulation-steps", type=int, default=None)
    setup.add_argument("--optimizer", choices=_OPTIMIZERS, default=None, help="default AdamW")
    setup.add_argument("--checkpointing", default=None, help="none, every, selective or every_k:K (default none)")
    setup.add_argument("--cpu-checkpointing", action="store_true", default=None,
                       help="keep checkpointed blocks' inputs in CPU memory")
    setup.add_argument("--offload-optimizer", choices=("none", "cpu", "nvme", "auto"), default=None,
                       help="auto: split over accelerator, host and NVMe (tiered placement; see the tier flags)")
    setup.add_argument("--offload-ratio", type=float, default=None, help="fraction offloaded, (0, 1] (default 1)")
    setup.add_argument("--offload-param", choices=("none", "cpu", "nvme"), default=None, help="stage 3 only")
    setup.add_argument("--one-rank-gradient-fold", choices=("auto", "early", "end", "stream"), default=None,
                       help="zero_optimization.one_rank_gradient_fold at world size 1 (default auto: stream where "
                            "it applies, else early)")
    setup.add_argument("--staging-bytes", default=None,
                       help="bytes per pinned offload staging buffer (default partita's, 64MiB)")
    setup.add_argument("--activation-bytes", default=None,
                       help="activations per rank for a model without a shape, e.g. 12GB")
    setup.add_argument("--logits-held", action="store_true", default=None,
                       help="the training loop keeps each step's logits through the next forward (logits, loss = "
                            "engine(x, y) with no del, as examples/train_gpt.py does): reserved memory gains the "
                            "16-bit logits' hole (what partita tune assumes)")
    from partita.estimate.tiers_cli import add_tier_arguments

    add_tier_arguments(p)
    fit = p.add_argument_group("recommendation")
    fit.add_argument("--gpu-memory", default=None, help="accelerator memory per rank, e.g. 141GB or 80GiB")
    fit.add_argument("--cpu-memory", default=None, help="CPU memory available per rank (for offload), e.g. 200GB")
    fit.add_argument("--nvme-memory", default=None,
                     help="NVMe space per rank for offloaded optimizer states, e.g. 64GB (default: the free space "
                          "at --nvme-path divided by the world size when that path exists, else no NVMe)")
    fit.add_argument("--headroom", type=float, default=None,
                     help="fraction of --gpu-memory kept free for the CUDA context and NCCL (default 0.05)")
    setup.add_argument("--allocator", choices=("expandable", "default", "none"), default=None,
                       help="CUDA caching allocator to predict reserved memory for: expandable segments (default, "
                            "what partita run sets), default (fixed segments), none (reserved = allocated); "
                            "default: from PYTORCH_CUDA_ALLOC_CONF when set")
    setup.add_argument("--max-split-size-mb", type=int, default=None,
                       help="PYTORCH_CUDA_ALLOC_CONF max_split_size_mb (with --allocator default)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _model(args: argparse.Namespace):
    from partita.estimate.inputs import EstimateError, GPTShape

    shape_flags = {"d_model": args.d_model, "n_layers": args.n_layers, "n_heads": args.n_heads,
                   "vocab": args.vocab, "seq_len": args.seq_len, "dropout": args.dropout}
    if (args.model is None) == (args.params is None):
        raise EstimateError("give the model as --model gpt|tiny|gpt2-124m|gpt-1.3b (with shape flags) or "
                            "as --params N, exactly one of them")
    if args.params is not None:
        try:
            count = float(args.params)
        except ValueError:
            raise EstimateError(f"--params {args.params!r} is not a number; write e.g. 7e9 or 1300000000") from None
        if count < 1 or count != int(count):
            raise EstimateError(f"--params {args.params!r} must be a whole number >= 1")
        given = [f"--{k.replace('_', '-')}" for k, v in shape_flags.items() if v is not None and k != "seq_len"]
        if given:
            raise EstimateError(f"{', '.join(given)} describe a GPT; use --model gpt with them, or drop them")
        return int(count)
    if args.model == "gpt":
        missing = [f"--{k.replace('_', '-')}" for k, v in shape_flags.items() if v is None and k != "dropout"]
        if missing:
            raise EstimateError(f"--model gpt needs {', '.join(missing)} (or use a preset: {', '.join(_PRESETS)})")
        return GPTShape(**{k: v for k, v in shape_flags.items() if v is not None})
    base = GPTShape.preset(args.model)
    changes = {k: v for k, v in shape_flags.items() if v is not None}
    from dataclasses import replace

    return replace(base, **changes) if changes else base


def _setup(args: argparse.Namespace, model: Any):
    from partita.estimate.inputs import Setup, parse_bytes

    flags: dict[str, Any] = {
        "dtype": args.dtype, "stage": args.stage, "world_size": args.world_size, "micro_batch": args.micro_batch,
        "gradient_accumulation_steps": args.gradient_accumulation_steps, "optimizer": args.optimizer,
        "checkpointing": args.checkpointing, "cpu_checkpointing": args.cpu_checkpointing,
        "offload_optimizer": args.offload_optimizer, "offload_ratio": args.offload_ratio,
        "offload_param": args.offload_param, "logits_held_to_next_step": args.logits_held,
    }
    if args.staging_bytes is not None:
        flags["staging_bytes"] = parse_bytes(args.staging_bytes, what="--staging-bytes")
    if args.activation_bytes is not None:
        flags["activation_bytes"] = parse_bytes(args.activation_bytes, what="--activation-bytes")
    if isinstance(model, int) and args.seq_len is not None:
        flags["seq_len"] = args.seq_len
    allocator = _allocator(args)
    flags.update(allocator=allocator.kind, max_split_size_mb=allocator.max_split_size_mb)
    fold = args.one_rank_gradient_fold
    if fold not in (None, "auto"):
        flags.update(fold_gradients_at_end=fold != "early", streamed_step=fold == "stream")
    flags = {k: v for k, v in flags.items() if v is not None}
    if args.config is not None:
        return Setup.from_config(args.config, **flags)
    setup = Setup(**flags)
    return setup.replace(fold_gradients_at_end=True, streamed_step=True) if fold in (None, "auto") and \
        setup.streams_by_default() else setup


def _allocator(args: argparse.Namespace):
    """--allocator / --max-split-size-mb, else PYTORCH_CUDA_ALLOC_CONF, else expandable segments."""
    from partita.estimate.allocator import AllocatorConfigError, AllocatorModel, allocator_from_conf
    from partita.estimate.inputs import EstimateError

    try:
        if args.allocator is None and args.max_split_size_mb is None:
            return allocator_from_conf()
        return AllocatorModel(args.allocator or "default", args.max_split_size_mb)
    except AllocatorConfigError as error:
        raise EstimateError(f"PYTORCH_CUDA_ALLOC_CONF / --allocator: {error}") from None


def _nvme_memory(args: argparse.Namespace, world_size: int) -> int | None:
    """--nvme-memory, else the free space at an existing --nvme-path shared by the ranks (shutil.disk_usage)."""
    import os
    import shutil

    from partita.estimate.inputs import EstimateError, parse_bytes

    if args.nvme_memory is not None:
        return parse_bytes(args.nvme_memory, what="--nvme-memory")
    if args.nvme_path is None:
        return None
    if not os.path.isdir(args.nvme_path):
        raise EstimateError(f"--nvme-path {args.nvme_path!r} is not an existing directory: create it, point it at "
                            "the NVMe mount, or give --nvme-memory SIZE")
    return shutil.disk_usage(args.nvme_path).free // max(1, world_size)


def run_estimate_command(args: argparse.Namespace) -> int:
    """Print the estimate (or the recommendation); a wrong input is one error line and status 2."""
    from partita.config import ConfigError
    from partita.estimate import estimate_memory, recommend_config
    from partita.estimate.inputs import EstimateError
    from partita.estimate.model_info import model_info

    try:
        model = _model(args)
        setup = _setup(args, model)
        info = model_info(model)
        if args.gpu_memory is None:
            if args.cpu_memory is not None or args.headroom is not None or args.nvme_memory is not None:
                raise EstimateError("--cpu-memory, --nvme-memory and --headroom only apply with --gpu-memory "
                                    "(a recommendation)")
            if setup.offload_optimizer == "auto":  # tiered placement: the split per tier and the machine's bound
                from partita.estimate.tiers_cli import run_tiered

                return run_tiered(args, info, setup)
            estimate = estimate_memory(info, setup)
            print(json.dumps(estimate.to_dict(), indent=2) if args.json else estimate.table())
            return 0
        if setup.offload_optimizer == "auto":
            raise EstimateError("--gpu-memory recommends among offload none/cpu/nvme; for tiered placement give "
                                "--offload-optimizer auto with --tier-capacity (and no --gpu-memory)")
        headroom = {} if args.headroom is None else {"headroom": args.headroom}
        nvme = _nvme_memory(args, setup.world_size)
        recommendation = recommend_config(info, args.gpu_memory, setup, cpu_memory=args.cpu_memory,
                                          nvme_memory=nvme, **headroom)
    except (EstimateError, ConfigError, OSError) as error:
        print(f"partita estimate: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(recommendation.to_dict(), indent=2))
    else:
        print(recommendation.explanation())
        if recommendation.chosen is not None:
            print()
            print(recommendation.chosen.estimate.table())
    return 0 if recommendation.chosen is not None else 1
