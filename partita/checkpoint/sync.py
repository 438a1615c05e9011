"""Rank coordination for checkpoint calls through the process group's key-value store.

Why the store and not a barrier: a checkpoint call made by only some ranks (the classic
``if rank == 0: engine.save_checkpoint(...)``) would block in a collective until the
30-minute collective timeout, and NCCL collectives cannot be given a shorter one per call.
Store waits take a timeout per call, work on every backend, and let the waiting rank see
*which* ranks arrived, so the error can name the missing ones. They are also safe to use
from the background thread of an asynchronous save, where a collective would race with the
training loop's collectives.

Every checkpoint call gets a sequence number (the n-th call of this process), so keys of
different calls never mix; ranks that make the same sequence of calls agree on it. A call whose
handshake fails (made by only some ranks) gives its number back and withdraws its key, so a job
that catches the error and goes on still agrees with the ranks that never made that call.
"""

from __future__ import annotations

import json
import os
import threading
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from partita.checkpoint.errors import CheckpointSyncError

_calls = 0  # checkpoint calls of this process whose number is in use
_calls_lock = threading.Lock()  # an asynchronous save takes its number from its own thread


def _take_sequence_number() -> int:
    global _calls
    with _calls_lock:
        _calls += 1
        return _calls - 1


def _give_back_sequence_number(number: int) -> None:
    global _calls
    with _calls_lock:
        if _calls == number + 1:  # only the newest number: later calls keep theirs
            _calls = number


def _default_store() -> dist.Store:
    # The default group's store (the torchrun agent's, or the in-process one of a world of
    # one). A private accessor, stable since torch 1.x; there is no public one.
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


class Coordinator:
    """The rendezvous of one checkpoint call (``op`` is "save_checkpoint" or "load_checkpoint")."""

    def __init__(self, op: str, *, handshake_timeout_s: float, long_timeout_s: float) -> None:
        if not dist.is_initialized():
            raise CheckpointSyncError(f"{op} needs torch.distributed to be initialized (call partita.initialize first)")
        self.op = op
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.store = _default_store()
        # The restart count keeps a restarted job's keys apart should the store outlive a restart.
        self.sequence = _take_sequence_number()
        self.prefix = f"partita/checkpoint/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{self.sequence}"
        self.handshake_timeout_s = handshake_timeout_s
        self.long_timeout_s = long_timeout_s

    def _keys(self, name: str) -> list[str]:
        return [f"{self.prefix}/{name}/{r}" for r in range(self.world_size)]

    def handshake(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        """Announce this call and wait (briefly) until every rank has made it; return every rank's payload.

        Raises:
            CheckpointSyncError: some ranks did not call within the handshake timeout, or
                ranks made different calls.
        """
        keys = self._keys("join")
        self.store.set(keys[self.rank], json.dumps({"op": self.op, **payload}))
        try:
            self.store.wait(keys, timedelta(seconds=self.handshake_timeout_s))
        except RuntimeError:  # DistStoreError subclasses RuntimeError
            missing = [r for r, key in enumerate(keys) if not self.store.check([key])]
            present = [r for r in range(self.world_size) if r not in missing]
            self._withdraw(keys[self.rank])
            raise CheckpointSyncError(
                f"{self.op} was called on rank(s) {present} but rank(s) {missing} of {self.world_size} did not "
                f"call {self.op} within {self.handshake_timeout_s:g} s. Every rank must call "
                f"engine.{self.op}(...) (not only rank 0: each rank saves and loads its own shard). If some "
                "ranks legitimately arrive later, raise checkpoint.handshake_timeout_seconds"
            ) from None
        payloads = [json.loads(self.store.get(key)) for key in keys]
        ops = {p["op"] for p in payloads}
        if len(ops) > 1:
            calls = ", ".join(f"rank {r}: {p['op']}" for r, p in enumerate(payloads))
            raise CheckpointSyncError(f"the ranks made different checkpoint calls at the same point ({calls}); every rank must make the same call")
        return payloads

    def _withdraw(self, key: str) -> None:
        """This call did not happen: free its sequence number and its join key, so the next
        call made by every rank gets the same number on all of them and finds no stale key."""
        try:
            self.store.delete_key(key)
        except (RuntimeError, NotImplementedError):
            pass  # a store without deletion: the next call overwrites the key when it joins
        _give_back_sequence_number(self.sequence)

    def publish(self, name: str, value: dict[str, Any]) -> None:
        """Post this rank's ``value`` under ``name`` (a phase of the call)."""
        self.store.set(self._keys(name)[self.rank], json.dumps(value))

    def gather(self, name: str, *, what: str) -> list[dict[str, Any]]:
        """Wait (up to the long timeout) for every rank's ``name`` value; ``what`` describes the phase for errors."""
        keys = self._keys(name)
        try:
            self.store.wait(keys, timedelta(seconds=self.long_timeout_s))
        except RuntimeError:
            missing = [r for r, key in enumerate(keys) if not self.store.check([key])]
            raise CheckpointSyncError(
                f"{self.op}: rank(s) {missing} did not finish {what} within {self.long_timeout_s:g} s "
                "(a rank died or is stuck; distributed.timeout_seconds sets this limit)"
            ) from None
        return [json.loads(self.store.get(key)) for key in keys]

    def decide(self, name: str, decide_on_root: Callable[[], dict[str, Any]], *, what: str) -> dict[str, Any]:
        """Rank 0 computes a decision with ``decide_on_root``; every rank returns it.

        Rank 0 returns only after every rank has read the decision. When rank 0 hosts the
        store (torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, or a plain env:// init), a
        rank 0 that saved its last checkpoint and exited at once would otherwise take the store
        with it while the other ranks are still reading ("Connection reset by peer").
        """
        key = f"{self.prefix}/{name}/root"
        if self.rank == 0:
            decision = decide_on_root()
            self.store.set(key, json.dumps(decision))
        else:
            try:
                self.store.wait([key], timedelta(seconds=self.long_timeout_s))
            except RuntimeError:
                raise CheckpointSyncError(
                    f"{self.op}: rank 0 did not finish {what} within {self.long_timeout_s:g} s (it died or is stuck)"
                ) from None
            decision = json.loads(self.store.get(key))
        # Only rank 0 waits for the acknowledgements, and it only waits (no reads of them after
        # the wait), so no rank touches the store after rank 0 may have moved on.
        if self.rank != 0:
            self.publish(f"{name}-read", {})
        elif self.world_size > 1:
            acks = self._keys(f"{name}-read")[1:]
            try:
                self.store.wait(acks, timedelta(seconds=self.long_timeout_s))
            except RuntimeError:
                missing = [r for r, key in enumerate(acks, start=1) if not self.store.check([key])]
                raise CheckpointSyncError(
                    f"{self.op}: rank(s) {missing} did not read rank 0's decision after {what} within "
                    f"{self.long_timeout_s:g} s (a rank died or is stuck)"
                ) from None
        return decision
