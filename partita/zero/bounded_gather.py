"""All-gathers of CPU tensors issued in pieces of bounded size (issue 32, item 9).

[Note: bounded gathers on CPU]
gloo runs each collective on one of its worker threads, and its all-gather assembles the result
in a flat temporary of the whole output's size, allocated on that thread and so from that
thread's glibc arena. Freed, it stays resident as the top of that arena: glibc gives an arena's
top back only once it exceeds the trim threshold (32 MiB once the dynamic mmap threshold has
grown), and ``malloc_trim`` (partita/utils/host_memory.py) never touches the top of a thread's
arena. So every rank kept, per gloo thread, the largest gather it had ever issued:

- ``zero.Init`` gathering a 16 MiB embedding whole pinned 16 MiB on each of gloo's two threads,
  32 MiB per rank of a 4-rank build whose shard was 28 MiB (init_context.gather_init_param);
- ZeRO-3's unit gathers on CPU (partita/zero/gather_wire.py) did the same with each unit's
  whole weights: ~50 MiB per rank after training that no trim could return.

Gathering in pieces of at most ``PIECE_BYTES`` of output bounds what gloo's threads keep to about
that much each. The pieces land in staging buffers allocated on the calling thread (the main
heap, which ``malloc_trim`` does return), then are laid into the caller's rows, the copy gloo
itself makes from its temporary into the output. Accelerator tensors (NCCL: no such temporary)
take one collective, as do outputs of at most one piece.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from partita.distributed import collectives

__all__ = ["PIECE_BYTES", "PiecewiseGather", "all_gather_rows", "piece_numel"]

PIECE_BYTES = 1 << 20  # 1 MiB of output per collective: 2 MiB kept by gloo's two threads at most


def piece_numel(world: int, element_size: int) -> int:
    """Elements of each rank's row one CPU piece carries (at least one)."""
    return max(1, PIECE_BYTES // (world * element_size))


class PiecewiseGather:
    """The Work of an all-gather issued in pieces: ``wait()`` waits for every piece and lays it
    into its columns of the output rows (then frees the staging)."""

    def __init__(self, works: list, staged: list[tuple[int, int, torch.Tensor]], rows: torch.Tensor,
                 purpose: str) -> None:
        self._works, self._staged, self._rows, self._purpose = works, staged, rows, purpose

    def wait(self, timeout=None) -> bool:  # noqa: ANN001 - dist.Work's signature
        for work in self._works:
            collectives.wait(work, purpose=self._purpose)
        world = self._rows.shape[0]
        for lo, hi, staging in self._staged:
            self._rows[:, lo:hi].copy_(staging.view(world, hi - lo))
        self._works, self._staged = [], []
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def all_gather_rows(
    rows: torch.Tensor, local: torch.Tensor, *, group: dist.ProcessGroup | None, purpose: str, async_op: bool = False
) -> dist.Work | PiecewiseGather | None:
    """Gather every rank's 1-D ``local`` into row r of ``rows`` ((world, local.numel()), contiguous),
    as ``all_gather_into_tensor(rows.view(-1), local)``; on CPU in bounded pieces (see the note)."""
    world, numel = rows.shape
    if local.dim() != 1 or local.numel() != numel or not rows.is_contiguous():
        raise ValueError(f"all_gather_rows: rows {tuple(rows.shape)} (contiguous: {rows.is_contiguous()}) "
                         f"and local {tuple(local.shape)} must be (world, n) and (n,)")
    step = piece_numel(world, local.element_size())
    if rows.device.type != "cpu" or numel <= step:
        return collectives.all_gather_into_tensor(rows.view(-1), local, group=group, purpose=purpose,
                                                  async_op=async_op)
    works, staged = [], []
    for lo in range(0, numel, step):
        hi = min(numel, lo + step)
        staging = torch.empty(world * (hi - lo), dtype=local.dtype, device=local.device)
        works.append(collectives.all_gather_into_tensor(staging, local[lo:hi], group=group, purpose=purpose,
                                                        async_op=True))
        staged.append((lo, hi, staging))
    gather = PiecewiseGather(works, staged, rows, purpose)
    if async_op:
        return gather
    gather.wait()
    return None
