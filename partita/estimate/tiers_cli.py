"""``partita estimate --offload-optimizer auto``: the split per tier and the machine's bound.

The tiers' capacities are this machine's (``partita.offload.capacity``: CUDA free memory, host
``MemAvailable``, free disk at ``--nvme-path``), or those of ``--tier-capacity``, so the same
command answers "what would auto do here" and "what would it do on an H200 with 128 GiB of host
memory and 64 GiB of disk" (``--tier-capacity accelerator=141GB,cpu=128GiB,nvme=64GiB``).
Exit status: 0 when a split fits, 1 when none does (the message has the numbers per tier).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["add_tier_arguments", "run_tiered"]

_TIER_NAMES = ("accelerator", "cpu", "nvme")


def add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    tiers = parser.add_argument_group("tiered placement (--offload-optimizer auto)")
    tiers.add_argument("--tier-fractions", default=None,
                       help="an explicit split accelerator,cpu,nvme summing to 1, e.g. 0.4,0.4,0.2 "
                            "(default: decided from the capacities)")
    tiers.add_argument("--tier-capacity", default=None,
                       help="capacities replacing the measured ones, e.g. accelerator=141GB,cpu=128GiB,nvme=64GiB")
    tiers.add_argument("--tier-headroom", type=float, default=None,
                       help="fraction of every tier kept free (default: the config's tiers.headroom, 0.1)")
    tiers.add_argument("--nvme-path", default=None,
                       help="where the swap files would go, for its free space (default: the config's nvme_path)")


def _parse_fractions(text: str) -> tuple[float, float, float]:
    from partita.estimate.inputs import EstimateError

    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3:
        raise EstimateError(f"--tier-fractions {text!r}: write three shares accelerator,cpu,nvme, e.g. 0.4,0.4,0.2")
    return values  # type: ignore[return-value]


def _parse_capacities(text: str | None) -> dict[str, float]:
    from partita.estimate.inputs import EstimateError, parse_bytes

    out: dict[str, float] = {}
    for item in filter(None, (text or "").split(",")):
        name, sep, size = item.partition("=")
        if not sep or name.strip() not in _TIER_NAMES:
            raise EstimateError(f"--tier-capacity item {item!r}: write tier=size with tier one of "
                                f"{', '.join(_TIER_NAMES)}, e.g. cpu=128GiB")
        out[name.strip()] = parse_bytes(size, what=f"--tier-capacity {name.strip()}") / 2**30
    return out


def _config_tiers(args: argparse.Namespace) -> tuple[Any, str | None]:
    """The config's ``offload_optimizer.tiers`` section and nvme_path (defaults without --config)."""
    from partita.offload.config import OffloadOptimizerConfig

    if args.config is None:
        return OffloadOptimizerConfig().tiers, None
    from partita.config import load_config

    offload = load_config(args.config).zero_optimization.offload_optimizer
    return offload.tiers, offload.nvme_path


def run_tiered(args: argparse.Namespace, info: Any, setup: Any) -> int:
    """Decide (or describe) the split and print it with the estimate; 1 when no split fits."""
    import torch

    from partita.estimate.tiers import TierFitError, describe_split, plan_tiers
    from partita.offload.capacity import measure_capacities

    tiers, config_path = _config_tiers(args)
    given = _parse_capacities(args.tier_capacity)
    configured = tiers.capacity_gib
    overrides = tuple(given.get(t, getattr(configured, t)) for t in _TIER_NAMES)
    headroom = tiers.headroom if args.tier_headroom is None else args.tier_headroom
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    capacities = measure_capacities(device, nvme_path=args.nvme_path or config_path, overrides_gib=overrides,
                                    headroom=headroom)
    if args.tier_fractions is not None:
        setup = setup.replace(offload_tiers=_parse_fractions(args.tier_fractions))
    try:
        plan = describe_split(info, setup, capacities) if setup.offload_tiers else plan_tiers(info, setup, capacities)
    except TierFitError as error:
        print(f"partita estimate: {error}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"estimate": plan.estimate.to_dict(), "tiers": plan.to_dict()}, indent=2))
    else:
        print(plan.estimate.table())
        print()
        print("tiered placement (offload_optimizer.device auto):")
        print(plan.table())
    return 0
