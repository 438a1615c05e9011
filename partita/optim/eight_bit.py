"""8-bit optimizers (AdamW8bit, Adam8bit, Lion8bit and their paged forms) through bitsandbytes.

Why bitsandbytes and not torchao's low-bit optimizers (both run on CPU with torch 2.13 at
about the same speed, ~22 M params/s on one core):
- it is the reference implementation of the paper (Dettmers et al. 2021, block-wise
  dynamic quantisation), with CUDA kernels on GPUs and a torch fallback elsewhere;
- its states are plain tensors (``uint8`` codes, ``float32`` block scales), which
  checkpoints store as they are and re-cut per parameter for another world size; torchao
  0.18 keeps them in tensor subclasses that safetensors cannot write and whose slices
  cannot even be cloned (the sharded optimizer keeps per-parameter copies that way);
- it has Lion8bit and paged variants; torchao has neither (its extra is 4-bit AdamW).

On each rank the optimizer steps the flat fp32 master partition. bitsandbytes quantises
its states in blocks of :data:`BLOCK_SIZE` consecutive elements of that flat tensor, each
with its own scale. For a block never to mix two parameters and for a parameter's blocks
to start at the same element offsets whatever the world size, every shard must hold a
multiple of ``BLOCK_SIZE`` elements: the ZeRO layout's ``alignment`` (see
:func:`partita.optim.factory.required_alignment`). Then the update is the same on any
number of ranks.

State of the master partition ``m`` (``P = m.numel()``, ``B = ceil(P / 256)`` blocks), as
``optimizer.state[m]`` holds it (``state_dict()`` nests all but ``step`` under the key
``"__bnb_optimizer_quant_state__"``, which bitsandbytes adds to keep FSDP from gathering them):
- ``state1``: uint8 ``[P]``: first moment (Lion: its momentum), signed dynamic code;
- ``state2``: uint8 ``[P]``: second moment, unsigned dynamic code (Adam variants only);
- ``absmax1`` / ``absmax2``: float32 ``[B]``: the scale of each block;
- ``qmap1`` / ``qmap2``: float32 ``[256]``: the code tables (constants, shared);
- ``step``: int.
So 2 bytes per parameter for Adam (1 for Lion) plus 8 bytes per 256, against 8 for fp32
Adam. :func:`range_views` gives the slices of all of them that cover one parameter.
"""

from __future__ import annotations

import importlib
import logging
import math
from types import ModuleType
from typing import Any

import torch

__all__ = [
    "BLOCK_SIZE",
    "CONSTANT_KEYS",
    "EIGHT_BIT_CLASSES",
    "PER_BLOCK_KEYS",
    "PER_ELEMENT_KEYS",
    "block_span",
    "build_eight_bit_optimizer",
    "is_block_wise",
    "load_bitsandbytes",
    "range_views",
    "step_eight_bit",
]

BLOCK_SIZE = 256
"""Elements per quantisation block (fixed in bitsandbytes' block-wise 8-bit kernels)."""

# partita type -> bitsandbytes class name (the same names).
EIGHT_BIT_CLASSES: dict[str, str] = {
    "AdamW8bit": "AdamW8bit",
    "Adam8bit": "Adam8bit",
    "Lion8bit": "Lion8bit",
    "PagedAdamW8bit": "PagedAdamW8bit",
    "PagedAdam8bit": "PagedAdam8bit",
    "PagedLion8bit": "PagedLion8bit",
}

PER_ELEMENT_KEYS = ("state1", "state2")
"""State keys with one uint8 code per partition element."""
PER_BLOCK_KEYS = ("absmax1", "absmax2")
"""State keys with one float32 scale per block of :data:`BLOCK_SIZE` partition elements."""
CONSTANT_KEYS = ("qmap1", "qmap2")
"""State keys of the code tables: the same 256 values on every rank and every step."""


def is_block_wise(state: dict[str, Any]) -> bool:
    """Whether ``state`` (one tensor's optimizer state) is bitsandbytes' block-wise 8-bit state."""
    return any(key in state for key in PER_BLOCK_KEYS)


def block_span(start: int, end: int) -> tuple[int, int]:
    """Blocks ``[first, last)`` holding elements ``[start, end)`` (``start`` block-aligned)."""
    return start // BLOCK_SIZE, math.ceil(end / BLOCK_SIZE)


def load_bitsandbytes(kind: str) -> ModuleType:
    """Import bitsandbytes, or explain how to install it."""
    # Its CPU backend logs a warning at import about an optional 4-bit *matmul* kernel
    # package; optimizers never use it, so the line would only mislead users.
    cpu_ops_logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = cpu_ops_logger.level
    cpu_ops_logger.setLevel(logging.ERROR)
    try:
        return importlib.import_module("bitsandbytes")
    except ImportError as error:
        raise ImportError(
            f"optimizer type {kind!r} needs bitsandbytes, which is not installed: "
            "pip install 'partita[eight_bit]' (or pip install bitsandbytes)"
        ) from error
    finally:
        cpu_ops_logger.setLevel(level)


def build_eight_bit_optimizer(kind: str, params: Any, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    """The bitsandbytes optimizer for ``kind`` over ``groups`` with the config ``params`` as defaults.

    ``min_8bit_size=1``: every tensor gets 8-bit states. bitsandbytes' default keeps
    tensors under 4,096 elements in fp32, which for a flat partition would make the state
    format (and the result) depend on the world size, since partitions shrink as ranks grow.
    """
    bnb = load_bitsandbytes(kind)
    cls = getattr(bnb.optim, EIGHT_BIT_CLASSES[kind])
    options: dict[str, Any] = {"lr": params.lr, "betas": params.betas, "weight_decay": params.weight_decay}
    if hasattr(params, "eps"):
        options["eps"] = params.eps
    return cls(groups, min_8bit_size=1, **options)


MAX_CUDA_NUMEL = 2**31 - 1
"""Largest tensor one call of bitsandbytes' CUDA 8-bit kernels steps: they count elements in
32-bit ints (one H200, a 12.2 B-element partition in one call: ``Error invalid argument at
line 177 in file /src/csrc/ops.cu``). Larger partitions are stepped in chunks
(:func:`step_eight_bit`)."""


CUDA_CHUNK_NUMEL = 2**30
"""Elements per chunk on CUDA: half the limit, so no count the kernels derive from it (bytes of
a 2-byte tensor, say) can pass 2^31 either; 4 GiB of fp32 master per call is plenty to keep a
GPU busy."""


def chunk_limit(tensor: torch.Tensor) -> int | None:
    """Elements of ``tensor`` one bitsandbytes call may step (whole blocks), or None: no limit
    (the CPU path indexes with 64-bit integers)."""
    return CUDA_CHUNK_NUMEL if tensor.is_cuda else None


@torch.no_grad()
def step_eight_bit(inner: torch.optim.Optimizer) -> None:
    """``inner.step()`` for a bitsandbytes optimizer over flat partitions, with each partition
    larger than :func:`chunk_limit` stepped chunk by chunk.

    Why chunks are exact: block-wise 8-bit Adam/Lion update each block of 256 elements from that
    block's codes and scale alone, so stepping whole blocks apart is stepping them together.
    Each chunk is a view of the partition (and of its states) handed to the optimizer's own
    ``update_step``, with the step count it would have had; no state is copied.
    """
    big = []
    for gindex, group in enumerate(inner.param_groups):
        for pindex, param in enumerate(group["params"]):
            limit = chunk_limit(param)
            if param.grad is not None and limit is not None and param.numel() > limit:
                big.append((gindex, pindex, group, param, limit, param.grad))
                param.grad = None  # the whole-tensor call below skips it
    try:
        inner.step()
    finally:
        for *_, param, _, grad in big:
            param.grad = grad
    for gindex, pindex, group, param, limit, grad in big:
        state = inner.state[param]
        if len(state) == 0:
            inner.init_state(group, param, gindex, pindex)
        for lo in range(0, param.numel(), limit):
            hi = min(lo + limit, param.numel())
            chunk = param[lo:hi]
            chunk.grad = grad[lo:hi]
            first, last = block_span(lo, hi)
            inner.state[chunk] = {
                key: (value[lo:hi] if key in PER_ELEMENT_KEYS else value[first:last] if key in PER_BLOCK_KEYS else value)
                for key, value in state.items()
            }
            try:
                inner.update_step(group, chunk, gindex, pindex)
            finally:
                del inner.state[chunk]
        state["step"] += 1


def range_views(state: dict[str, Any], start: int, end: int) -> list[torch.Tensor]:
    """Views of every state tensor that covers partition elements ``[start, end)``.

    ``start`` and ``end`` must be multiples of :data:`BLOCK_SIZE` (``end`` may also be
    the end of the partition): a parameter's slice of a block-aligned layout. Used to
    keep or restore one parameter's state (checkpoints cut it the same way, see
    :mod:`partita.checkpoint.state_layout`).
    """
    numel = next((state[k].numel() for k in PER_ELEMENT_KEYS if k in state), None)
    if numel is None:
        return []
    if start % BLOCK_SIZE or (end % BLOCK_SIZE and end != numel) or not 0 <= start <= end <= numel:
        raise ValueError(
            f"range [{start}, {end}) of a {numel}-element partition is not block-aligned (blocks of "
            f"{BLOCK_SIZE}); build the ZeRO layout with alignment={BLOCK_SIZE} for 8-bit optimizers"
        )
    views = [state[k][start:end] for k in PER_ELEMENT_KEYS if k in state]
    first, last = block_span(start, end)
    views += [state[k][first:last] for k in PER_BLOCK_KEYS if k in state]
    return views
