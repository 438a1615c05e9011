"""``engine.save_checkpoint``: every rank writes its share into ``<tag>.partial``; rank 0
commits (manifest, rename, ``latest``) once every rank has reported its files fsynced.

Sequence (all ranks):
1. wait for a previous asynchronous save; check the arguments (tag, client_state);
2. handshake through the store (short timeout): all ranks are here, with the same tag;
   rank 0 has emptied ``<tag>.partial`` before joining, so writing can start right away;
3. snapshot the state (references, or CPU copies for an asynchronous save);
4. write this rank's files, each hashed while written, and post sizes and sha256;
5. rank 0 waits for every rank's report, writes manifest.json, renames the directory to
   ``<tag>``, replaces ``latest``, and posts the outcome, which every rank waits for.
Steps 4-5 run on a background thread for an asynchronous save; the next save or load, or
the end of the process, waits for them. Nothing here is a collective, so the thread never
races the training loop's collectives.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch.distributed as dist

import partita.checkpoint.format as fmt
from partita.checkpoint.config import CheckpointConfig
from partita.checkpoint.errors import CheckpointError, CheckpointSyncError
from partita.checkpoint.jsoncodec import encode
from partita.checkpoint.manifest import commit_tag, write_latest
from partita.checkpoint.safetensors_io import WrittenFile, write_json, write_safetensors
from partita.checkpoint.snapshot import Snapshot, capture, check_accumulation_boundary
from partita.checkpoint.sync import Coordinator

if TYPE_CHECKING:
    from partita.engine import Engine

logger = logging.getLogger("partita")


def checkpoint_config(engine: Engine) -> CheckpointConfig:
    section = getattr(engine.config, "checkpoint", None) if engine.config is not None else None
    return section if section is not None else CheckpointConfig()


def long_timeout_s(engine: Engine) -> float:
    return engine.config.distributed.timeout_seconds if engine.config is not None else 1800.0


# ---------------------------------------------------------------------------- async state


class _PendingSave:
    """The background write of one asynchronous save."""

    def __init__(self, description: str, job) -> None:
        self.description = description
        self.error: BaseException | None = None
        self._job = job
        # Not a daemon: the interpreter waits for it at exit, so a save never ends half-written
        # because the training script returned.
        self.thread = threading.Thread(target=self._run, name="partita-checkpoint-writer", daemon=False)

    def _run(self) -> None:
        try:
            self._job()
        except BaseException as error:  # noqa: BLE001 - re-raised on the training thread
            self.error = error
            logger.error("asynchronous save of %s failed: %s", self.description, error)


_pending: _PendingSave | None = None
_pending_lock = threading.Lock()


def wait_for_pending_save() -> None:
    """Block until this process's asynchronous save (if any) is written; re-raise its error."""
    global _pending
    with _pending_lock:
        pending, _pending = _pending, None
    if pending is None:
        return
    pending.thread.join()
    if pending.error is not None:
        raise CheckpointError(f"the asynchronous save of {pending.description} failed: {pending.error}") from pending.error


# ---------------------------------------------------------------------------- save


def save_checkpoint(
    engine: Engine,
    save_dir: str | os.PathLike[str] | None,
    *,
    tag: str | None = None,
    client_state: dict[str, Any] | None = None,
    save_latest: bool = True,
    async_save: bool | None = None,
    capture_fn: Callable[..., Snapshot] = capture,
) -> bool:
    """Save the complete training state under ``save_dir/<tag>``; see :meth:`partita.engine.Engine.save_checkpoint`.

    ``capture_fn(engine, tag=, client_state=, copy=)``: what this rank writes (a pipeline engine's
    gathers its stages' sections, partita/pipe/checkpoint.py); called on every rank after the
    handshake, on the training thread, so it may use collectives."""
    global _pending
    wait_for_pending_save()
    cfg = checkpoint_config(engine)
    if async_save is None:
        async_save = cfg.async_save
    if save_dir is None:
        save_dir = cfg.save_dir
    tag = f"global_step{engine.global_steps}" if tag is None else tag
    coordinator = Coordinator("save_checkpoint", handshake_timeout_s=cfg.handshake_timeout_seconds, long_timeout_s=long_timeout_s(engine))

    problem = _check_arguments(save_dir, tag, client_state)
    partial = Path(save_dir) / (tag + fmt.PARTIAL_SUFFIX) if problem is None else None
    if problem is None and coordinator.rank == 0:
        problem = _prepare_partial_dir(partial)
    samples = getattr(engine, "_samples", None)  # the engine's SampleCounter (partita/sample_count.py)
    payloads = coordinator.handshake({"tag": tag, "error": problem,
                                      "samples": samples.unchecked if samples is not None else None})
    failures = [(r, p["error"]) for r, p in enumerate(payloads) if p["error"]]
    if failures:
        if coordinator.rank == 0 and partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
        detail = "; ".join(f"rank {r}: {message}" for r, message in failures)
        raise CheckpointError(f"save_checkpoint did not start: {detail}")
    if samples is not None:
        try:  # the saved global_samples must be right: every rank trained on as many samples
            samples.check_counts([p["samples"] for p in payloads], last_step=engine.global_steps)
        except ValueError:
            if coordinator.rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
            raise
    tag = _agree_on_tag(tag, [p["tag"] for p in payloads], cfg.tag_validation, coordinator.rank)
    save_dir = Path(save_dir)
    partial = save_dir / (tag + fmt.PARTIAL_SUFFIX)

    check_accumulation_boundary(engine)
    started = time.perf_counter()
    snapshot = capture_fn(engine, tag=tag, client_state=client_state or {}, copy=async_save)
    summary = _summary(engine)

    def job() -> None:
        _write_and_commit(coordinator, snapshot, save_dir=save_dir, partial=partial, tag=tag,
                          save_latest=save_latest, summary=summary, started=started)

    if not async_save:
        job()
        return True
    pending = _PendingSave(str(save_dir / tag), job)
    with _pending_lock:
        _pending = pending
    pending.thread.start()
    return True


def _check_arguments(save_dir: Any, tag: str, client_state: Any) -> str | None:
    """This rank's argument problems, as a message (reported on every rank by the handshake)."""
    if save_dir is None:
        return "no directory: pass save_checkpoint(save_dir, ...) or set checkpoint.save_dir in the config"
    reason = fmt.check_tag(tag)
    if reason is not None:
        return reason
    if client_state is not None and not isinstance(client_state, dict):
        return f"client_state must be a dict, got {type(client_state).__name__}"
    try:
        encode(client_state or {}, path="client_state", sink={})
    except CheckpointError as error:
        return str(error)
    return None


def _prepare_partial_dir(partial: Path) -> str | None:
    """Rank 0 removes every ``*.partial`` directory in the save directory before anyone writes.

    A failed save removes its own ``.partial`` directory; one left behind means a process was
    killed mid-save. None belongs to a save still running: every rank finished its previous
    (asynchronous) save before this handshake, since rank 0's commit waits for all of them.
    """
    try:
        for leftover in partial.parent.glob("*" + fmt.PARTIAL_SUFFIX) if partial.parent.is_dir() else ():
            if leftover.is_dir():
                shutil.rmtree(leftover)
                if leftover != partial:
                    logger.info("removed %s, left by a save that did not finish", leftover)
        partial.mkdir(parents=True)
    except OSError as error:
        return f"cannot create {partial}: {error}"
    return None


def _agree_on_tag(tag: str, tags: list[str], validation: str, rank: int) -> str:
    if len(set(tags)) == 1:
        return tag
    listing = ", ".join(f"rank {r}: {t!r}" for r, t in enumerate(tags))
    if validation == "Fail":
        raise CheckpointSyncError(
            f"save_checkpoint got different tags on different ranks ({listing}) and checkpoint.tag_validation "
            "is \"Fail\"; pass the same tag on every rank (e.g. derived from engine.global_steps)"
        )
    if validation == "Warn" and rank == 0:
        logger.warning("save_checkpoint got different tags (%s); using rank 0's %r", listing, tags[0])
    return tags[0]


def _summary(engine: Engine) -> dict[str, Any]:
    return {
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "world_size": dist.get_world_size(),
        "pipeline_parallel_size": engine.topology.pipe_size,
        "zero_stage": engine.zero.policy.stage,
        "precision": str(engine.compute_dtype).replace("torch.", ""),
    }


def _write_files(snapshot: Snapshot, partial: Path) -> dict[str, WrittenFile]:
    partial.mkdir(parents=True, exist_ok=True)  # rank 0 made it; a slow shared file system may lag
    written = {}
    for plan in snapshot.files:
        written[plan.name] = write_safetensors(partial / plan.name, plan.entries, metadata=plan.metadata)
        plan.entries.clear()  # drop the (copied) tensors as soon as they are on disk
    if snapshot.meta is not None:
        written[fmt.META_FILE] = write_json(partial / fmt.META_FILE, snapshot.meta)
    return written


def _write_and_commit(
    coordinator: Coordinator,
    snapshot: Snapshot,
    *,
    save_dir: Path,
    partial: Path,
    tag: str,
    save_latest: bool,
    summary: dict[str, Any],
    started: float,
) -> None:
    error = None
    written: dict[str, WrittenFile] = {}
    try:
        written = _write_files(snapshot, partial)
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, then raised below on every rank
        error = f"{type(exc).__name__}: {exc}"
    # Always report, even a failure, so no rank waits for this one in vain.
    coordinator.publish("written", {"files": {n: [f.size, f.sha256] for n, f in written.items()}, "error": error})
    decision = coordinator.decide(
        "commit",
        lambda: _commit(coordinator, save_dir=save_dir, tag=tag, save_latest=save_latest, summary=summary),
        what="committing the checkpoint",
    )
    if decision.get("error"):
        if coordinator.rank == 0:
            # Every rank has read the decision (decide() waited for that) and none writes any more.
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(
            f"saving checkpoint {save_dir / tag} failed: {decision['error']} ({partial} was removed; "
            "the previous checkpoints and 'latest' are untouched)"
        )
    if coordinator.rank == 0:
        logger.info(
            "saved checkpoint %s (%.1f MB in %.1f s)", save_dir / tag, decision["total_bytes"] / 1e6, time.perf_counter() - started
        )


def _commit(coordinator: Coordinator, *, save_dir: Path, tag: str, save_latest: bool, summary: dict[str, Any]) -> dict[str, Any]:
    reports = coordinator.gather("written", what="writing their checkpoint files")
    errors = [f"rank {r}: {rep['error']}" for r, rep in enumerate(reports) if rep["error"]]
    if errors:
        return {"error": "; ".join(errors)}
    files = {name: WrittenFile(size, sha) for rep in reports for name, (size, sha) in rep["files"].items()}
    try:
        commit_tag(save_dir, tag, files, summary)
        if save_latest:
            write_latest(save_dir, tag)
    except OSError as error:
        return {"error": f"committing failed: {error}"}
    return {"total_bytes": sum(f.size for f in files.values())}
