"""The exact ZeRO-Offload step, run on beside the next forward
(``offload_optimizer.overlap_step_with_forward``).

Without it, ``engine.step()`` returns once the host has stepped the whole fp32 partition and
every bucket of new weights has gone up, and only then can the next forward start: on one H200
with GPT-1.3B that is the host's Adam (~370 ms) plus the forward (~80 ms) in series. Here
``step()`` returns as soon as the gradient norm is known and the host step is under way: a
worker thread steps the partition bucket by bucket, in the order the parameters were laid out,
and writes each bucket back on a side stream. The next forward waits, in a forward pre-hook of
each module that owns parameters, only for the buckets holding that module's parameters, so
the first blocks compute while the host steps the last ones.

It is the same update as without it, bit for bit: the same optimizer kernels over the same
ranges, with the learning rates and the unscale/clip divisor taken before ``step()`` returns
(so the LR scheduler may step at once). What changes is *when* the weights are in the model:
only once their module's forward begins, or at :meth:`OverlappedStep.finish` — which the
engine calls at the start of every backward, before checkpoints and exports, in ``eval()``
and in ``finish_pending_step()``. So reading parameters directly between ``step()`` and the
next forward sees some of them one update old; call ``engine.finish_pending_step()`` first.
A model that reads another module's parameters before that module's own forward runs must
leave this off.

Why our own code: torch has no optimizer step that hands finished ranges to the forward.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from partita.zero.sharded_optimizer import ShardedOptimizer

BucketKey = tuple[int, int]  # (group index, bucket index in the group's write-back order)
# Elements per write-back bucket under the overlap: 128 MB of fp32 per upload, ~3 ms of PCIe
# and ~8 ms of host Adam on one H200 host.
OVERLAP_BUCKET_NUMEL = 32 * 2**20


class OverlappedStep:
    """Runs a ZeRO-Offload step on a worker thread and makes each module's forward wait for
    the buckets of its own parameters."""

    def __init__(self, optimizer: ShardedOptimizer, module: nn.Module, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="partita-overlap")
        self._future: Future | None = None
        self._ready: dict[BucketKey, threading.Event] = {}
        self._landed: dict[BucketKey, torch.cuda.Event] = {}
        for g, group in enumerate(optimizer.groups):
            if group.offloaded:
                # Unsharded (the only case built): a write-back bucket is only a copy, so small
                # ones let the forward start after a small part of the host step rather than a
                # whole allgather_bucket_size of it. Only here: for the plain pipelined step
                # on one H200, 32 M-element buckets measured 1.48x DeepSpeed against 1.61x
                # with the 500 M default (per-bucket host overhead, ~1.3 ms each).
                optimizer.refine_write_back_buckets(g, OVERLAP_BUCKET_NUMEL)
        bucket_of = _bucket_of_param(optimizer)
        self._keys: list[BucketKey] = sorted({key for keys in bucket_of.values() for key in keys})
        # Each bucket's place in the forward: the earliest registration index of its parameters
        # (the worker steps the lowest first, across groups: partita/offload/overlapped_update.py).
        order = {id(p): i for i, p in enumerate(module.parameters())}
        self.bucket_rank: dict[BucketKey, int] = {}
        for g, group in enumerate(optimizer.groups):
            if group.offloaded:
                for b, bucket in enumerate(optimizer.bucket_layout(g)):
                    ranks = [order.get(id(group.params[s.index]), len(order)) for s in group.layout.specs[bucket.first : bucket.last]]
                    self.bucket_rank[(g, b)] = min(ranks, default=len(order))
        self._hooks = []
        for waiter, params in _waiting_modules(module):
            keys = sorted({key for p in params for key in bucket_of.get(id(p), ())})
            if keys:
                self._hooks.append(waiter.register_forward_pre_hook(self._waiter(keys)))

    @property
    def in_flight(self) -> bool:
        return self._future is not None

    def start(self, job: Callable[[Callable[[int, int], None]], None]) -> None:
        """Run ``job(on_bucket)`` on the worker; ``job`` calls ``on_bucket(g, b)`` once bucket
        ``b`` of group ``g`` has been written back (queued on the side stream)."""
        self.finish()
        if self._cuda:
            self._stream.wait_stream(torch.cuda.current_stream())  # after everything queued so far
        self._ready = {key: threading.Event() for key in self._keys}
        self._landed = {}
        self._future = self._worker.submit(self._run, job)

    def _run(self, job) -> None:
        try:
            with torch.cuda.stream(self._stream) if self._cuda else nullcontext():
                job(self._bucket_done)
        finally:
            for event in self._ready.values():  # a failed step releases the waiters; finish() raises
                event.set()

    def _bucket_done(self, g: int, b: int) -> None:
        if self._cuda:
            landed = torch.cuda.Event()
            landed.record(self._stream)
            self._landed[(g, b)] = landed
        self._ready[(g, b)].set()

    def wait_landed(self, g: int, b: int) -> None:
        """Block (the calling thread) until bucket ``b`` of group ``g`` of the job in flight has
        been copied to the device; at once when no job wrote it."""
        ready = self._ready.get((g, b))
        if ready is None:
            return
        ready.wait()
        landed = self._landed.get((g, b))
        if landed is not None:
            landed.synchronize()

    def _waiter(self, keys: list[BucketKey]):
        def wait(module: nn.Module, args) -> None:
            if self._future is None:
                return
            for key in keys:
                self._ready[key].wait()
                landed = self._landed.get(key)
                if landed is not None:
                    torch.cuda.current_stream().wait_event(landed)
            if self._future.done() and self._future.exception() is not None:
                self.finish()  # raise the step's failure here rather than compute on half a step

        return wait

    def finish(self) -> None:
        """Wait for the step in flight (re-raising what failed in it) and order the current
        stream after its uploads. A no-op when none is in flight."""
        if self._future is None:
            return
        future, self._future = self._future, None
        future.result()
        if self._cuda:
            torch.cuda.current_stream().wait_stream(self._stream)

    def close(self) -> None:
        try:
            self.finish()
        finally:
            for hook in self._hooks:
                hook.remove()
            self._worker.shutdown(wait=True)


def _waiting_modules(module: nn.Module) -> list[tuple[nn.Module, list[nn.Parameter]]]:
    """Which module's forward waits for which parameters: a repeated block (ZeRO-3's units,
    the regions compile and checkpointing use) for all of its own, so no hook runs inside a
    compiled block; any other module for the parameters it owns directly."""
    from partita.zero.units import find_units

    blocks = find_units(module)[1:]  # the root is first: it is not a block
    in_block = {id(p) for block in blocks for p in block.parameters()}
    out = [(block, list(block.parameters())) for block in blocks]
    for sub in module.modules():
        own = [p for p in sub.parameters(recurse=False) if id(p) not in in_block]
        if own:
            out.append((sub, own))
    return out


def _bucket_of_param(optimizer: ShardedOptimizer) -> dict[int, set[BucketKey]]:
    """id(parameter) -> the write-back buckets holding it, for the offloaded groups (the others
    are written back before ``step()`` returns)."""
    found: dict[int, set[BucketKey]] = {}
    for g, group in enumerate(optimizer.groups):
        if not group.offloaded:
            continue
        for b, bucket in enumerate(optimizer.bucket_layout(g)):
            for spec in group.layout.specs[bucket.first : bucket.last]:
                found.setdefault(id(group.params[spec.index]), set()).add((g, b))
    return found
