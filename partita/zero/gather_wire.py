"""How one ZeRO-3 all-gather travels: the exact 16-bit shards, int8 blocks (ZeRO++ qwZ) or FP8.

The gatherer (partita/zero/param_gatherer.py) decides which parameters go together; this module
decides, per parameter, which wire format its unit gathers use, and issues the collective for a
set of shards laid side by side in one flat ``local`` buffer. Whatever the wire, the result is
(size, columns) rows, one per rank, of the shards' dtype once ``decoder`` (if any) has run:
the layout ``unpack_from_columns`` reads.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from partita.zero.bounded_gather import all_gather_rows
from partita.zero.fp8_gather import is_fp8_gathered, precomputed_fp8_scales, refresh_gatherer_fp8_scales, start_fp8_all_gather
from partita.zero.quantized_comm import start_quantized_all_gather

PURPOSE = "ZeRO-3 parameter all-gather"

# A wire: False (exact), True (int8, qwZ), "fp8" (Float8Linear weights), "hpz" (from hpZ copies, zero/hpz.py).
Wire = bool | str


def wire_of(param: nn.Parameter, *, unit_gather: bool, quantize_weights: str) -> Wire:
    """The wire of one parameter's gather. Only a unit's forward/backward gather is compressed:
    gathers asked for by users (holds, exports, checkpoints) stay exact. ``quantize_weights``:
    "all", "frozen" (nontrainable only, zero_quantized_nontrainable_weights) or "none"."""
    if not unit_gather:
        return False
    if is_fp8_gathered(param):  # fp8.all_gather: a Float8Linear weight (zero/fp8_gather.py)
        return "fp8"
    return quantize_weights == "all" or (quantize_weights == "frozen" and not param.requires_grad)


def start_all_gather(
    local: torch.Tensor, spans: list[tuple[int, int]], *, size: int, group: dist.ProcessGroup | None, wire: Wire,
    params: list[nn.Parameter] | None = None,
) -> tuple[dist.Work | None, torch.Tensor, Any]:
    """Start the all-gather of ``local`` (1-D; the shards at ``spans``, (column, numel) each).

    Returns the Work (None: nothing to wait for), the buffer the collective fills and the decoder
    whose ``dequantize(buffer)`` gives the (size, local.numel()) values (None: the buffer is them).
    ``params``: the gathered parameters in span order; FP8 weights with scales precomputed after the
    step (zero/fp8_gather.py [Note: per-step scales]) skip the per-gather amax all-reduce.
    """
    if size == 1:
        return None, local.view(1, -1), None
    if wire == "fp8":
        scales = precomputed_fp8_scales(params) if params is not None else None
        return start_fp8_all_gather(local, spans, size=size, group=group, purpose=PURPOSE, scales=scales)
    if wire:
        return start_quantized_all_gather(local, size=size, group=group, purpose=PURPOSE)
    gathered = torch.empty((size, local.numel()), dtype=local.dtype, device=local.device)
    # On CPU in pieces of bounded size (zero/bounded_gather.py [Note: bounded gathers on CPU]).
    work = all_gather_rows(gathered, local, group=group, purpose=PURPOSE, async_op=True)
    return work, gathered, None
