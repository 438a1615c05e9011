"""The CUDA caching allocator's setting ``partita run`` gives its ranks.

ZeRO keeps each parameter group's fp32 master, gradient partition and optimizer moments as
single flat tensors: for a 9 B-parameter GPT on one GPU that is four allocations of ~34 GiB.
With the allocator's default fixed-size segments such requests fail from fragmentation long
before memory is full. Measured on one H200 (benchmarks/largest_per_setting.py, GPT 4096 wide,
ZeRO-3, nothing offloaded): without expandable segments partita's largest GPT was 7.87 B (8.27 B
asked for 30.8 GiB with 16 GiB of the card never reserved), FSDP2's (small per-parameter
tensors) 9.08 B; with ``expandable_segments:True`` partita's is 9.08 B too. So ``partita run``
sets it unless the user configured the allocator themselves.
"""

from __future__ import annotations

from collections.abc import MutableMapping

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
DEFAULT = "expandable_segments:True"


def prepare_allocator(environ: MutableMapping[str, str]) -> None:
    """Set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` for the ranks, unless the
    variable is already set (the user's allocator settings win, whatever they are)."""
    environ.setdefault(ALLOC_CONF, DEFAULT)
