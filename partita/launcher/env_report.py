"""``partita env``: what a bug report needs to know about this machine.

Optional extras are looked up by package metadata, not imported: importing wandb or
deepspeed takes seconds and can fail on import-time side effects, and the report must
work on a broken install.
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata

import torch
import torch.distributed as dist

__all__ = ["CORE_PACKAGES", "EXTRA_PACKAGES", "env_report"]

CORE_PACKAGES = ("pydantic", "numpy", "tqdm", "safetensors")
# Optional packages and what needs them: pyproject's extras, and DeepSpeed for the benchmarks.
_EXTRA_USES = {
    "tensorboard": "extra 'monitor'",
    "wandb": "extra 'monitor'",
    "matplotlib": "extra 'plot'",
    "bitsandbytes": "extra 'eight_bit'",
    "deepspeed": "benchmarks only",
}
EXTRA_PACKAGES = tuple(_EXTRA_USES)


def _row(label: str, value: object) -> str:
    return f"  {label + ' ':.<22} {value}"


def _version(dist_name: str) -> str | None:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def _partita_version() -> str:
    found = _version("partita")
    if found is not None:
        return found
    try:  # running from a source tree without an install
        import partita

        return str(getattr(partita, "__version__", "unknown (not installed)"))
    except ImportError:
        return "unknown (not installed)"


def _cuda_lines() -> list[str]:
    # CPU training is first-class (gloo), so the cores and torch's intra-op threads matter too.
    lines = [_row("cpu", f"{os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}")]
    lines.append(_row("torch CUDA build", torch.version.cuda or "none (CPU-only build)"))
    available = torch.cuda.is_available()
    lines.append(_row("CUDA available", available))
    if not available:
        return lines
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        lines.append(_row(f"cuda:{index}", f"{props.name}, {props.total_memory / 2**30:.1f} GiB, "
                                            f"compute capability {props.major}.{props.minor}"))
    lines.append(_row("bf16 supported", torch.cuda.is_bf16_supported()))
    return lines


def _nccl_version() -> str:
    if not dist.is_available() or not dist.is_nccl_available():
        return "not available"
    try:
        version = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):
        return "available (version unknown)"
    return ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)


def env_report() -> str:
    """The full report as text (the command prints it)."""
    lines = [
        "partita environment",
        _row("partita", _partita_version()),
        _row("python", f"{sys.version.split()[0]} ({sys.executable})"),
        _row("platform", platform.platform()),
        "packages",
        _row("torch", torch.__version__),
    ]
    for name in CORE_PACKAGES:
        lines.append(_row(name, _version(name) or "not installed"))
    lines.append("devices")
    lines.extend(_cuda_lines())
    lines.append("distributed backends")
    if dist.is_available():
        lines.append(_row("gloo", dist.is_gloo_available()))
        lines.append(_row("nccl", _nccl_version()))
        lines.append(_row("mpi", dist.is_mpi_available()))
    else:
        lines.append("  torch.distributed is not available in this torch build")
    lines.append("optional extras")
    for name, use in _EXTRA_USES.items():
        lines.append(_row(name, f"{_version(name) or 'not installed'} ({use})"))
    return "\n".join(lines)
