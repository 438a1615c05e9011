"""The states of a ZeRO-3 parameter and the record of an all-gather in flight (param_gatherer.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from partita.zero.quantized_comm import QuantizedGather


class ParamState(enum.Enum):
    """SHARDED -> GATHERING (prefetch in flight) -> GATHERED -> SHARDED."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


@dataclass(slots=True)
class InFlight:
    """An asynchronous all-gather started by prefetch, not yet unpacked."""

    work: Any
    gathered: torch.Tensor  # what the collective fills: values, or with ``quantized`` the int8 wire rows
    params: list[nn.Parameter]
    columns: list[int]
    ready: Any  # the storage's side-stream event (None without one), see partita/offload/param_offload.py
    quantized: QuantizedGather | None = None  # ZeRO++ qwZ: turns the wire rows into values (quantized_comm.py)
