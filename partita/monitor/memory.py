"""This process's memory: tensors allocated on a GPU, or the resident set size on a CPU.

On a GPU the caching allocator's counters are what a user compares against the device's
capacity (``torch.cuda.memory_allocated`` / ``max_memory_allocated``). A CPU run has no
allocator counter worth reading, so the process's RSS (current, and the peak the kernel
tracks) stands in for it.
"""

from __future__ import annotations

import os
import sys

import torch


def memory_bytes(device: torch.device) -> tuple[float, float]:
    """(current, peak) bytes for ``device`` in this process."""
    if device.type == "cuda":
        return float(torch.cuda.memory_allocated(device)), float(torch.cuda.max_memory_allocated(device))
    return _rss_bytes()


def _rss_bytes() -> tuple[float, float]:
    import resource  # Unix only

    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = float(maxrss) if sys.platform == "darwin" else maxrss * 1024.0  # bytes on macOS, KiB elsewhere
    try:
        with open("/proc/self/statm") as f:
            current = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):  # not Linux: the peak is the best we have
        current = peak
    return float(current), max(peak, float(current))
