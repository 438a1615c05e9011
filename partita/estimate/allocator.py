"""What torch's CUDA caching allocator reserves for the tensors the estimator counts.

The estimator's peak counts tensor bytes, as ``torch.cuda.max_memory_allocated`` does. A run
fails when the allocator cannot *reserve* what a request needs, and reserved memory is larger:

1. Rounding per tensor (``CUDACachingAllocator``, torch 2.x, exact): every request is rounded up
   to a multiple of 512 bytes (at least 512: :func:`round_size`); this is what the allocated
   statistic counts. Requests of at most 1 MiB come from the small pool, whose segments are
   2 MiB; larger ones from the large pool, whose segments are 20 MiB for requests under 10 MiB
   and the request rounded up to 2 MiB otherwise (:func:`segment_size`). Blocks are cached per
   stream and split for later requests. With ``expandable_segments:True`` each pool of each
   stream is one segment growing in pages of those sizes (2 MiB small, 20 MiB large), so at most
   one page per pool is unused at the segment's end.
2. Fragmentation (calibrated, not derived): free blocks cached between live ones that a later,
   larger request cannot use. Modelled as ``a x S + r x K + g x T``, a term per way blocks are
   freed while others stay live:

   - ``S``, the model states: few flat tensors allocated once (the optimizer states at the first
     step, into whatever holes the first step's activations left): a few percent of them.
   - ``K``, the bytes of one block recomputed in backward (activation checkpointing): each
     block's activations are rebuilt and freed while its parameter gradients are allocated in
     between, so the holes are a few blocks' worth; ``r`` is per byte of *one* block and applies
     whether or not the peak falls inside backward (the holes stay cached).
   - ``T``, the rest of the peak (saved activations, the loss, buffers): freed in backward in
     changing sizes: a small fraction.
   - Not counted: blocks re-requested at one size each time, which reuse their own freed blocks:
     ZeRO-3's gathered parameters (frozen ones included) and sequence tiling's MLP tile. The H200
     runs show none (ZeRO-3 without checkpointing: 0.4% over the allocated bytes).

   The coefficients come from GPU memory snapshots on one H200
   (:mod:`partita.estimate.allocator_calibration` refits them; ``tests/test_estimate_allocator.py``
   checks the constants equal the fit). Fixed segments keep ``a`` and ``r`` and a larger ``g``
   from their one measured run (torch cannot merge blocks of different ``cudaMalloc`` segments).

3. The previous step's logits, when the training loop holds them through the next forward
   (``Setup.logits_held_to_next_step``: ``logits, loss = engine(x, y)`` with no ``del``, the habit of
   examples/train_gpt.py and nanoGPT): they are freed only once that forward has returned, in the
   middle of the segment, between tensors still alive. The backward's first requests, the fp32
   gradients of the loss (``b x s x V x 4`` bytes each), are twice as large as 16-bit logits, so that
   hole is cached but unusable at the start of backward: reserved is at least the allocated bytes
   there plus the logits (:func:`reserved_estimate`'s ``held_logits``). Derived, not fitted: the one
   recorded ``partita tune`` out-of-memory trial, which ran that loop, had 15.7 GiB cached and
   unusable at that moment with 12.3 GiB of logits (``allocator_calibration.TUNE_RUN``).

``max_split_size_mb`` stops blocks above it from being split (less fragmentation of large
blocks, more of small ones); no run records it, so it takes the default allocator's
coefficients and the estimate says so. ``roundup_power2_divisions`` is not modelled.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from partita.estimate.result import MemoryEstimate

__all__ = [
    "ALLOCATORS", "AllocatorConfigError", "FRAGMENTATION", "KIB", "MIB", "AllocatorModel", "ReservedEstimate", "allocator_from_conf",
    "fragmentation_terms", "page_size", "reserved_estimate", "round_size", "segment_size",
]

class AllocatorConfigError(ValueError):
    """An allocator setting the model does not accept (``Setup`` re-raises it as ``EstimateError``;
    kept separate so this module imports nothing of the estimator)."""


KIB, MIB = 2**10, 2**20
MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 * MIB  # kSmallSize: the largest request served by the small pool
SMALL_BUFFER = 2 * MIB  # kSmallBuffer: small-pool segment
MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc: below it a large request gets a 20 MiB segment
LARGE_BUFFER = 20 * MIB  # kLargeBuffer
ROUND_LARGE = 2 * MIB  # kRoundLarge

ALLOCATORS = ("expandable", "default", "none")
"""``expandable``: ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (what ``partita run`` sets,
partita/launcher/allocator.py); ``default``: torch's fixed segments; ``none``: no caching allocator
(CPU runs), reserved = allocated."""

# (a, r, g): fragmentation per byte of model states, of one recomputed block and of the rest of the
# peak. Fitted by partita.estimate.allocator_calibration.fit() from the runs it lists; the test refits.
FRAGMENTATION: dict[str, tuple[float, float, float]] = {
    "expandable": (0.023, 3.7, 0.052),
    "default": (0.108, 3.7, 0.181),
}


def round_size(nbytes: int) -> int:
    """Bytes the allocator hands out for a request of ``nbytes`` (``round_size``: 512-byte multiples,
    at least 512). The allocated statistic counts these."""
    if nbytes < 0:
        raise AllocatorConfigError(f"a tensor cannot have {nbytes} bytes")
    return MIN_BLOCK if nbytes < MIN_BLOCK else MIN_BLOCK * math.ceil(nbytes / MIN_BLOCK)


def segment_size(nbytes: int) -> int:
    """Bytes ``cudaMalloc``-ed when no cached block fits a request (``get_allocation_size``): a 2 MiB
    small-pool segment up to 1 MiB, a 20 MiB segment below 10 MiB, else rounded up to 2 MiB."""
    size = round_size(nbytes)
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * math.ceil(size / ROUND_LARGE)


def page_size(nbytes: int) -> int:
    """The mapping granularity of an expandable segment for a request: 2 MiB in the small pool,
    20 MiB in the large pool."""
    return SMALL_BUFFER if round_size(nbytes) <= SMALL_SIZE else LARGE_BUFFER


@dataclass(frozen=True)
class AllocatorModel:
    """Which allocator behaviour to predict; build one with :func:`allocator_from_conf`."""

    kind: str = "expandable"
    max_split_size_mb: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ALLOCATORS:
            raise AllocatorConfigError(f"allocator {self.kind!r} is not one of {', '.join(ALLOCATORS)}")
        if self.max_split_size_mb is not None and (isinstance(self.max_split_size_mb, bool)
                                                   or not isinstance(self.max_split_size_mb, int)
                                                   or self.max_split_size_mb < 20):
            raise AllocatorConfigError(f"max_split_size_mb must be an integer >= 20 (torch's minimum), "
                                f"got {self.max_split_size_mb!r}")

    @property
    def coefficients(self) -> tuple[float, float, float]:
        return (0.0, 0.0, 0.0) if self.kind == "none" else FRAGMENTATION[self.kind]

    def describe(self) -> str:
        if self.kind == "none":
            return "no caching allocator (reserved = allocated)"
        text = "expandable segments" if self.kind == "expandable" else "fixed segments"
        return text + (f", max_split_size_mb {self.max_split_size_mb}" if self.max_split_size_mb else "")


_KEY = re.compile(r"^\s*([a-z_0-9]+)\s*:\s*([^,]+?)\s*$")


def allocator_from_conf(conf: str | None = None, *, environ: Mapping[str, str] | None = None) -> AllocatorModel:
    """The model for a ``PYTORCH_CUDA_ALLOC_CONF`` value (default: the environment's; unset means what
    ``partita run`` sets, expandable segments). Unknown keys are ignored, as torch ignores none: a
    malformed item is an :class:`AllocatorConfigError`."""
    if conf is None:
        conf = (os.environ if environ is None else environ).get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    kind, split = "default", None
    for item in filter(None, (part.strip() for part in conf.split(","))):
        match = _KEY.match(item)
        if match is None:
            raise AllocatorConfigError(f"PYTORCH_CUDA_ALLOC_CONF item {item!r} is not key:value "
                                "(e.g. expandable_segments:True,max_split_size_mb:512)")
        key, value = match.groups()
        if key == "expandable_segments":
            kind = "expandable" if value.lower() == "true" else "default"
        elif key == "max_split_size_mb":
            if not value.isdigit():
                raise AllocatorConfigError(f"max_split_size_mb {value!r} is not a whole number of MiB")
            split = int(value)
    return AllocatorModel(kind, split if kind == "default" else None)


@dataclass(frozen=True)
class ReservedEstimate:
    """Predicted ``torch.cuda.max_memory_reserved`` of one estimate, in its parts."""

    allocated: int  # the estimator's peak (tensor bytes)
    rounding: int  # 512-byte rounding of the tensors it can enumerate
    pages: int  # unused end of the segments (expandable: one page per pool)
    fragmentation: int  # a x model states + r x one recomputed block + g x the rest
    model: AllocatorModel
    held_logits: int = 0  # reserved beyond the rest at the start of backward: the held logits' hole

    @property
    def reserved(self) -> int:
        return self.allocated + self.rounding + self.pages + self.fragmentation + self.held_logits

    def to_dict(self) -> dict:
        return {"allocated_bytes": self.allocated, "rounding_bytes": self.rounding, "page_bytes": self.pages,
                "fragmentation_bytes": self.fragmentation, "held_logits_bytes": self.held_logits,
                "reserved_bytes": self.reserved, "allocator": self.model.describe()}


def rounding_overhead(sizes: list[int]) -> int:
    """What 512-byte rounding adds to tensors of ``sizes`` bytes."""
    return sum(round_size(n) - n for n in sizes if n > 0)


def fragmentation_terms(estimate: MemoryEstimate) -> tuple[int, int, int]:
    """``(S, K, T)`` of :data:`FRAGMENTATION`'s model for ``estimate``: accelerator model states, the
    bytes of one block recomputed in backward, and the rest of the peak less the blocks re-requested
    at one size (ZeRO-3 gathers, the MLP tile), which reuse their own freed blocks."""
    peak = estimate.peak_accelerator
    states = min(peak, estimate.model_states("accelerator"))
    on_device = [line for line in estimate.lines if line.device == "accelerator"]
    recompute = sum(line.nbytes for line in on_device if line.kind == "recompute")
    recycled = sum(line.nbytes for line in on_device if line.kind in ("gathered", "mlp_tile"))
    return states, recompute, max(0, peak - states - recompute - recycled)


def reserved_estimate(estimate: MemoryEstimate, model: AllocatorModel, tensor_sizes: list[int], *,
                      held_logits: tuple[int, int] = (0, 0)) -> ReservedEstimate:
    """Reserved accelerator bytes at ``estimate``'s peak under ``model``; ``tensor_sizes``: the bytes of
    the tensors alive at the peak that the estimator can enumerate (model states, saved activations);
    ``held_logits``: (the held logits' hole, the allocated bytes beside it), item 3 of the module
    docstring; the hole raises the prediction where it exceeds the rest's margin over the peak."""
    allocated = estimate.peak_accelerator
    if model.kind == "none" or allocated == 0:
        return ReservedEstimate(allocated, 0, 0, 0, model)
    a, r, g = model.coefficients
    states, recompute, rest = fragmentation_terms(estimate)
    fragmentation = int(a * states + r * recompute + g * rest)
    pages = LARGE_BUFFER + SMALL_BUFFER if model.kind == "expandable" else SMALL_BUFFER
    rounding = rounding_overhead(tensor_sizes)
    hole, beside = held_logits
    # The hole and the loop's own overheads (rounding, pages, a x S + g x T) add up at the start of
    # backward; where the peak comes later, by more than the hole, the hole is refilled before it.
    held = max(0, beside + hole - allocated)
    return ReservedEstimate(allocated, rounding, pages, fragmentation, model, held)
