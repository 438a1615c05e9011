"""ZeRO++ on the wire: block-wise int8/int4 weight all-gathers (qwZ) and gradient reduce-scatters (qgZ).

The wire format and the one-hop gradient all-to-all live here; the two-hop (node, then
cross-node) gradient reduce-scatter that builds on them is partita/zero/hierarchical_reduce.py.

[Note: the wire format]
A tensor is cut into blocks of ``BLOCK`` elements; each block is sent as one fp32 scale
(its largest magnitude / qmax) and its elements rounded to the nearest multiple of the scale:
int8 (qmax 127) or int4 (qmax 7, two per byte). Symmetric, no zero point: weights and
gradients are centred on zero, and round-to-nearest keeps every element within scale/2 of
its value. Scales are fp32, not the model's 16-bit dtype: a bf16 scale carries 8 bits of
mantissa, so rounding it would move every element of the block by up to 127 * 2^-9 of the
scale, four times the rounding itself, and an fp16 scale underflows for gradients below ~1e-5
(the whole block would arrive as zeros). At 4 bytes per 256 elements the scales cost 1.6% of
an int8 payload. 256 is a middle ground between DeepSpeed's ~4k-8k groups (less overhead,
a larger error for blocks with an outlier) and bitsandbytes' 64.

One row per rank travels as one uint8 buffer: the scales first, then the payload, the row
padded to 4 bytes so the next row's scales stay aligned. The last block's padding is
quantized but not sent: a row of n elements costs ceil(n * bits / 8) + 4 * ceil(n / BLOCK)
bytes (+ up to 3), which is what the comms logger counts, because that buffer is what the
collective moves.

A block holding inf or nan gets a non-finite scale and arrives entirely non-finite, so fp16's
overflow check after the reduction still sees it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from partita.distributed import collectives

BLOCK = 256
_QMAX = {8: 127, 4: 7}
# Elements quantized or dequantized at a time (a multiple of BLOCK, even): the fp32 temporaries of a
# 5e8-element gradient bucket (DeepSpeed's default reduce_bucket_size) would be several GiB at once.
_CHUNK = 1 << 24


@dataclass(frozen=True, slots=True)
class RowFormat:
    """Byte layout of one quantized row of ``numel`` elements."""

    numel: int
    bits: int

    def __post_init__(self) -> None:
        if self.bits not in _QMAX:
            raise ValueError(f"quantized communication supports 8 or 4 bits, got {self.bits}")

    @property
    def blocks(self) -> int:
        return max(1, math.ceil(self.numel / BLOCK))

    @property
    def payload_bytes(self) -> int:
        return math.ceil(self.numel * self.bits / 8)

    @property
    def row_bytes(self) -> int:
        raw = 4 * self.blocks + self.payload_bytes
        return raw + (-raw) % 4


def quantize_blocks(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise symmetric quantization of each row of ``x`` (rows, n).

    Returns ``(q, scales)``: ``q`` int8 of shape (rows, blocks * BLOCK) with values in
    [-qmax, qmax] (zeros past ``n``), ``scales`` fp32 (rows, blocks); ``q * scale`` is within
    scale / 2 of each element.
    """
    rows, numel = x.shape
    fmt = RowFormat(numel, bits)
    qmax = _QMAX[bits]
    padded = torch.zeros((rows, fmt.blocks * BLOCK), dtype=torch.float32, device=x.device)
    padded[:, :numel].copy_(x)
    blocks = padded.view(rows, fmt.blocks, BLOCK)
    scales = blocks.abs().amax(dim=2) / qmax  # nan or inf stays in the scale (see the module note)
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block: q = 0
    q = torch.round(blocks / divisor.unsqueeze(2)).clamp_(-qmax, qmax).nan_to_num_(0.0)
    return q.to(torch.int8).view(rows, -1), scales


def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_blocks`: (rows, numel) of ``dtype``."""
    rows = q.shape[0]
    values = q.view(rows, -1, BLOCK).to(torch.float32) * scales.unsqueeze(2)
    return values.view(rows, -1)[:, :numel].to(dtype)


def encode_rows(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Quantize each row of ``x`` (rows, n) into its wire row: (rows, row_bytes) uint8."""
    rows, numel = x.shape
    fmt = RowFormat(numel, bits)
    wire = torch.zeros((rows, fmt.row_bytes), dtype=torch.uint8, device=x.device)
    for lo in range(0, numel, _CHUNK):  # see _CHUNK: fp32 temporaries of one chunk, not of the bucket
        hi = min(lo + _CHUNK, numel)
        q, scales = quantize_blocks(x[:, lo:hi], bits)
        b = lo // BLOCK
        wire[:, 4 * b : 4 * (b + scales.shape[1])].copy_(scales.view(torch.uint8))
        payload = q[:, : hi - lo]
        if bits == 4:
            # Two per byte: (q + 8) is 1..15; the even element in the low nibble.
            if (hi - lo) % 2:
                payload = torch.nn.functional.pad(payload, (0, 1))
            nibbles = (payload + 8).to(torch.uint8).view(rows, -1, 2)
            payload = nibbles[:, :, 0] | (nibbles[:, :, 1] << 4)
        else:
            payload = payload.view(torch.uint8)
        first = 4 * fmt.blocks + lo * bits // 8
        wire[:, first : first + payload.shape[1]].copy_(payload)
    return wire


def decode_rows(wire: torch.Tensor, numel: int, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`encode_rows`: (rows, numel) of ``dtype``."""
    rows = wire.shape[0]
    fmt = RowFormat(numel, bits)
    out = torch.empty((rows, numel), dtype=dtype, device=wire.device)
    for lo in range(0, numel, _CHUNK):
        hi = min(lo + _CHUNK, numel)
        b0, b1 = lo // BLOCK, math.ceil(hi / BLOCK)
        scales = wire[:, 4 * b0 : 4 * b1].contiguous().view(torch.float32)
        first = 4 * fmt.blocks + lo * bits // 8
        payload = wire[:, first : first + math.ceil((hi - lo) * bits / 8)]
        if bits == 4:
            low = (payload & 0x0F).to(torch.int8) - 8
            high = (payload >> 4).to(torch.int8) - 8
            values = torch.stack((low, high), dim=2).view(rows, -1)[:, : hi - lo]
        else:
            values = payload.contiguous().view(torch.int8)
        q = torch.zeros((rows, (b1 - b0) * BLOCK), dtype=torch.int8, device=wire.device)
        q[:, : hi - lo].copy_(values)
        out[:, lo:hi].copy_(dequantize_blocks(q, scales, hi - lo, torch.float32))
    return out


@dataclass(slots=True)
class QuantizedGather:
    """An int8 all-gather of one flat shard per rank, in flight (qwZ)."""

    numel: int
    dtype: torch.dtype

    def dequantize(self, wire: torch.Tensor) -> torch.Tensor:
        """The gathered wire rows as (world, numel) values of the shards' dtype."""
        return decode_rows(wire, self.numel, 8, self.dtype)


def start_quantized_all_gather(
    local: torch.Tensor, *, size: int, group: dist.ProcessGroup | None, purpose: str
) -> tuple[dist.Work | None, torch.Tensor, QuantizedGather]:
    """All-gather ``local`` (1-D) as int8 blocks + fp32 scales; returns the Work, the wire
    buffer it fills (size, row_bytes) and what turns that buffer into values once it is done."""
    mine = encode_rows(local.view(1, -1), 8)
    wire = torch.empty((size, mine.shape[1]), dtype=torch.uint8, device=local.device)
    work = collectives.all_gather_into_tensor(wire.view(-1), mine.view(-1), group=group,
                                              purpose=f"int8 {purpose}", async_op=True)
    return work, wire, QuantizedGather(local.numel(), local.dtype)


@dataclass(slots=True)
class QuantizedReduceScatter:
    """A quantized all-to-all standing in for a reduce-scatter, in flight (qgZ)."""

    received: torch.Tensor  # (size, row_bytes): row j is rank j's quantized copy of this rank's chunk
    numel: int
    bits: int

    def advance(self) -> None:
        """Nothing to do between launch and reduce: one hop (the two-hop kind launches its second hop here)."""

    def reduce(self) -> torch.Tensor:
        """This rank's chunk summed over every rank, in fp32 (each contribution dequantized first,
        one rank's at a time, in rank order: the same sum on every run)."""
        total = decode_rows(self.received[:1], self.numel, self.bits, torch.float32)[0]
        for j in range(1, self.received.shape[0]):
            total += decode_rows(self.received[j : j + 1], self.numel, self.bits, torch.float32)[0]
        return total


def start_quantized_reduce_scatter(
    packed: torch.Tensor, *, bits: int, group: dist.ProcessGroup | None, purpose: str, async_op: bool = True
) -> tuple[dist.Work | None, QuantizedReduceScatter]:
    """Reduce-scatter ``packed`` (size, n) (row r goes to rank r) through one all-to-all of
    quantized rows; the sum happens in fp32 at the receiver, after dequantization, so no
    partial sum is ever re-quantized. Across nodes the reducer uses the two-hop form instead
    (partita/zero/hierarchical_reduce.py), which re-quantizes each node's partial sum once."""
    send = encode_rows(packed, bits)
    received = torch.empty_like(send)
    work = collectives.all_to_all_single(received.view(-1), send.view(-1), group=group,
                                         purpose=f"int{bits} {purpose}", async_op=async_op)
    return work, QuantizedReduceScatter(received, packed.shape[1], bits)
