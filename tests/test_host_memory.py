"""partita.utils.host_memory: freed heap memory goes back to the OS (issue 32, item 9).

The pattern zero.Init leaves behind: whole tensors freed between long-lived small ones (the
shards). glibc keeps such memory resident; release_free_host_memory returns it.
"""

from __future__ import annotations

import gc
import multiprocessing
import platform

import pytest
import torch

from partita.utils.host_memory import release_free_host_memory


def _rss() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def _freed_between_shards() -> tuple[int, int, bool, bool]:
    # 96 x 1 MiB "whole parameters", each followed by a small "shard" that stays alive; at 1 MiB
    # they come from the heap once glibc's mmap threshold has grown past them (a freed 2 MiB
    # mmapped block raises it), as after the first large free in a real build.
    warm = torch.empty(2 * 2**20 // 4)
    del warm
    wholes, shards = [], []
    for _ in range(96):
        wholes.append(torch.ones(2**20 // 4))
        shards.append(wholes[-1][:1024].clone())
    del wholes
    gc.collect()
    before = _rss()
    released = release_free_host_memory()
    after = _rss()
    return before, after, released, all(float(s.sum()) == 1024.0 for s in shards)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim")
def test_whole_tensors_freed_between_shards_are_returned() -> None:
    # In a fresh process: what earlier tests left in this process's heap (free chunks, a grown mmap
    # threshold) decides where the 1 MiB tensors come from, and so what a trim can return.
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        before, after, released, shards_intact = pool.apply(_freed_between_shards)
    assert released is True
    assert before - after > 48 * 2**20, (before, after)
    assert shards_intact  # the shards are untouched
