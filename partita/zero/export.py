"""Export whole weights from a running engine, one parameter at a time.

``save_16bit_model`` writes the model's weights in its compute dtype as one safetensors
file (rank 0 writes; every rank takes part in the gathers). ``fp32_state_dict`` rebuilds
full fp32 weights from the optimizer's master shards. Both gather parameter by parameter, so
no rank holds more than one extra whole parameter on the device at a time.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from partita.zero.api import ZeroState
from partita.zero.gathered import iter_fp32_master, iter_full_parameters


def _is_writer() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def fp32_state_dict(module: nn.Module, zero: ZeroState, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """Full fp32 weights keyed like ``module.state_dict()`` (tied weights under every name),
    as CPU tensors; empty on ranks other than 0 when ``rank0_only``."""
    keep = _is_writer() or not rank0_only
    master: dict[nn.Parameter, torch.Tensor] = {}
    for param, full in iter_fp32_master(zero):
        if keep:
            master[param] = full.detach().to("cpu", copy=True)
    if not keep:
        return {}
    out: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        out[name] = master[param] if param in master else param.detach().float().cpu()
    for name, buffer in module.named_buffers():
        out[name] = buffer.detach().cpu()
    return out


def save_16bit_model(module: nn.Module, zero: ZeroState, save_dir: str | os.PathLike, save_filename: str) -> Path:
    """Write the weights in the model's dtype to ``save_dir/save_filename`` (safetensors)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    writer = _is_writer()
    # remove_duplicate=True: safetensors refuses two names for one storage; tied weights are
    # stored once under their first name, the way torch's own state_dict loading resolves them.
    for name, full in iter_full_parameters(zero, module.named_parameters()):
        if writer:
            tensors[name] = full.to("cpu", copy=True).contiguous()
    saved_keys = set(module.state_dict(keep_vars=True))  # persistent buffers only
    for name, buffer in module.named_buffers():
        if writer and name in saved_keys:
            tensors[name] = buffer.detach().to("cpu", copy=True).contiguous()
    path = Path(save_dir) / save_filename
    if writer:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": "pt", "producer": "partita"})
        os.replace(tmp, path)  # a crash mid-write never leaves a truncated file under the real name
    if dist.is_initialized():
        dist.barrier()
    return path
