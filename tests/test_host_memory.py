"""partita.utils.host_memory: freed heap memory goes back to the OS (issue 32, item 9).

The pattern zero.Init leaves behind: whole tensors freed between long-lived small ones (the
shards). glibc keeps such memory resident; release_free_host_memory returns it.
"""

from __future__ import annotations

import gc
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


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc_trim")
def test_whole_tensors_freed_between_shards_are_returned() -> None:
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
    assert release_free_host_memory() is True
    after = _rss()
    assert before - after > 48 * 2**20, (before, after)
    assert all(float(s.sum()) == 1024.0 for s in shards)  # the shards are untouched
