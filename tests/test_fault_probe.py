"""Regression tests for the defects a fault probe found (issue 19, item 6).

- a ``latest`` file holding binary bytes: rank 0 crashed with UnicodeDecodeError and rank 1
  reported a handshake timeout; now a warning and the newest complete tag;
- ``fp16.initial_scale_power`` was unbounded (4000 overflowed, 1e30 accepted when disabled);
- micro-batches of different sizes on different ranks trained silently, and ``global_samples``
  counted the configured batch, not the samples;
- an fp16 step skipped for overflow logged nothing;
- a failed save left ``<tag>.partial`` behind.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from tests.harness import run_distributed
from tests.tiny_models import SEQ, VOCAB, build_model

BASE = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    "steps_per_print": 1000,
    # A regression that makes one rank skip the handshake must fail in seconds, not hang.
    "checkpoint": {"handshake_timeout_seconds": 20},
}


def _batch(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (size, SEQ), generator=g), torch.randint(0, VOCAB, (size, SEQ), generator=g)


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _capture_partita_log() -> _Records:
    records = _Records()
    partita_logger = logging.getLogger("partita")
    partita_logger.addHandler(records)  # before initialize(), which then leaves the logger's set-up alone
    partita_logger.setLevel(logging.INFO)
    return records


def _train_step(engine, size: int, seed: int):
    import torch.distributed as dist

    x, y = _batch(size, seed * 10 + dist.get_rank())
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return loss


# ---------------------------------------------------------------------------- checkpoints


def _checkpoint_faults(save_dir: str) -> dict:
    import torch.distributed as dist

    import partita
    import partita.checkpoint.save as save_module
    from partita.checkpoint import CheckpointError

    records = _capture_partita_log()
    engine, *_ = partita.initialize(model=build_model(), config=BASE)
    rank = dist.get_rank()
    out: dict = {}
    root = Path(save_dir)
    for step in (1, 2):
        _train_step(engine, 4, step)
        engine.save_checkpoint(save_dir)

    # 1. `latest` holding binary bytes (not UTF-8): warn and load the newest complete tag.
    if rank == 0:
        (root / "latest").write_bytes(b"\xff\xfe\x00\x9cglobal_step1\x80")
    dist.barrier()
    path, _ = engine.load_checkpoint(save_dir)
    out["binary_latest_loaded"] = Path(path).name
    # ... and one naming something that cannot be a tag.
    if rank == 0:
        (root / "latest").write_text("../../etc\n")
    dist.barrier()
    path, _ = engine.load_checkpoint(save_dir)
    out["bad_name_loaded"] = Path(path).name

    # 2. A save that fails on rank 1 leaves no `<tag>.partial`; latest and older tags are untouched.
    if rank == 0:
        (root / "latest").write_text("global_step2\n")
    dist.barrier()
    real_write = save_module.write_safetensors

    def failing_write(path, *args, **kwargs):
        if rank == 1:
            raise OSError(28, "No space left on device")
        return real_write(path, *args, **kwargs)

    save_module.write_safetensors = failing_write
    try:
        engine.save_checkpoint(save_dir, tag="failed")
    except CheckpointError as error:
        out["failed_save_error"] = str(error)
    finally:
        save_module.write_safetensors = real_write
    dist.barrier()
    out["after_failure"] = sorted(p.name for p in root.iterdir())
    out["latest_after_failure"] = (root / "latest").read_text().strip()
    dist.barrier()  # every rank has looked before rank 0 plants the next leftover

    # 3. A `.partial` left by a process killed mid-save is removed by the next save.
    if rank == 0:
        (root / "global_step9.partial").mkdir()
        (root / "global_step9.partial" / "rank00000.safetensors").write_bytes(b"half")
    dist.barrier()
    engine.save_checkpoint(save_dir, tag="after_crash")
    dist.barrier()
    out["after_next_save"] = sorted(p.name for p in root.iterdir())
    out["log"] = records.messages
    return out


def test_damaged_latest_and_failed_save_on_two_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_dir = tmp_path / "ckpt"
    results = run_distributed(_checkpoint_faults, 2, str(save_dir), timeout=240)
    for rank, out in enumerate(results):
        assert out["binary_latest_loaded"] == "global_step2"  # the newest complete tag, on both ranks
        assert out["bad_name_loaded"] == "global_step2"
        assert out["failed_save_error"].startswith("saving checkpoint ")
        assert "rank 1: OSError: [Errno 28] No space left on device" in out["failed_save_error"]
        assert f"{save_dir / 'failed.partial'} was removed; the previous checkpoints and 'latest' are untouched" in (
            out["failed_save_error"])
        assert out["after_failure"] == ["global_step1", "global_step2", "latest"]
        assert out["latest_after_failure"] == "global_step2"
        assert out["after_next_save"] == ["after_crash", "global_step1", "global_step2", "latest"]
    log0 = results[0]["log"]
    assert f"{save_dir / 'latest'} is damaged (it is not UTF-8 text); falling back to the newest complete checkpoint" in log0
    assert (f"{save_dir / 'latest'} is damaged (the tag '../../etc' must be a plain directory name (no '/', '\\' or NUL, "
            "not '.' or '..')); falling back to the newest complete checkpoint") in log0
    assert f"removed {save_dir / 'global_step9.partial'}, left by a save that did not finish" in log0


    # The CLI reads a damaged `latest` as the loader does, instead of dying on a decode error.
    from partita.checkpoint.cli import _inspect, _resolve_tag

    (save_dir / "latest").write_bytes(b"\x80\x81\xff")
    assert _inspect(save_dir) == 0
    assert _resolve_tag(save_dir, None) == save_dir / "after_crash"  # the newest complete tag
    shown = capsys.readouterr().out
    assert f"{save_dir / 'latest'} is damaged (it is not UTF-8 text); loading would use the newest complete tag" in shown
    assert f"{save_dir / 'latest'} is damaged (it is not UTF-8 text); using the newest complete tag" in shown


# ---------------------------------------------------------------------------- fp16 loss scale bounds


def test_initial_scale_power_is_bounded_also_in_a_disabled_section() -> None:
    from partita.config import ConfigError, load_config

    for fp16, shown in (({"enabled": True, "initial_scale_power": 4000}, "4000"),
                        ({"enabled": False, "initial_scale_power": 1e30}, "1000000000000000019884624838656")):
        with pytest.raises(ConfigError) as caught:
            load_config({"train_batch_size": 4, "fp16": fp16})
        assert str(caught.value).endswith(
            f"fp16.initial_scale_power = {shown}: out of range; allowed: an integer >= 0 and <= 40 (default 16)"
        )
    with pytest.raises(ConfigError, match=r"fp16.loss_scale = 1e\+30: out of range; allowed: a number >= 0 and <= 1099511627776.0"):
        load_config({"train_batch_size": 4, "fp16": {"enabled": True, "loss_scale": 1e30}})
    assert load_config({"train_batch_size": 4, "fp16": {"enabled": True, "initial_scale_power": 40}}).fp16.initial_scale_power == 40


# ---------------------------------------------------------------------------- micro-batch sizes and fp16 overflow


def _batch_sizes_and_overflow(save_dir: str) -> dict:
    import torch.distributed as dist

    import partita

    records = _capture_partita_log()
    out: dict = {}

    # Different sizes at the first step: refused before the update, on every rank.
    model = build_model()
    engine, *_ = partita.initialize(model=model, config=BASE)
    rank = dist.get_rank()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x, y = _batch(4 if rank == 0 else 3, rank)
    engine.backward(engine(x, y))
    try:
        engine.step()
    except ValueError as error:
        out["first_step"] = str(error)
    out["unchanged"] = all(torch.equal(before[n], p) for n, p in model.named_parameters())

    # Equal sizes, the last one smaller than configured (a DistributedSampler's last batch): exact count.
    engine, *_ = partita.initialize(model=build_model(), config=BASE)
    for step, size in enumerate((4, 4, 2), start=1):
        _train_step(engine, size, step)
    out["global_samples"] = engine.global_samples

    # A mismatch after the first step is caught at the next check: here the checkpoint save, whose
    # store handshake compares the counts (no collective, so a save by only some ranks still fails fast).
    engine, *_ = partita.initialize(model=build_model(), config=BASE)
    _train_step(engine, 4, 1)
    _train_step(engine, 4 if rank == 0 else 3, 2)
    try:
        engine.save_checkpoint(save_dir, tag="x")
    except ValueError as error:
        out["later_step"] = str(error)
    dist.barrier()
    out["nothing_saved"] = sorted(p.name for p in Path(save_dir).iterdir())

    # fp16: a step skipped for overflow is logged with the loss scale.
    cfg = {**BASE, "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}}
    engine, *_ = partita.initialize(model=build_model(), config=cfg)
    x, y = _batch(4, rank)
    loss = engine(x, y)
    engine.backward(loss * float("inf"))
    engine.step()
    out["skipped"] = engine.skipped_steps
    out["log"] = records.messages
    return out


def test_unequal_micro_batches_refused_counts_exact_and_fp16_overflow_logged(tmp_path: Path) -> None:
    results = run_distributed(_batch_sizes_and_overflow, 2, str(tmp_path / "ckpt"), timeout=240)
    for rank, out in enumerate(results):
        assert out["first_step"].startswith(
            "micro-batches of different sizes on different data-parallel ranks: in step 1 the ranks trained on "
            "rank 0: 4, rank 1: 3 samples (train_micro_batch_size_per_gpu is 4)."
        )
        assert out["unchanged"] is True  # refused before the optimizer step
        assert out["global_samples"] == 4 * 2 + 4 * 2 + 2 * 2
        assert out["later_step"].startswith(
            "micro-batches of different sizes on different data-parallel ranks: in step 2 the ranks trained on "
            "rank 0: 4, rank 1: 3 samples"
        )
        assert out["nothing_saved"] == []  # refused before writing; no .partial left
        assert out["skipped"] == 1
    overflow = "step 1 skipped: fp16 gradients overflowed (inf/nan) at loss scale 256; the loss scale is now 128"
    assert overflow in results[0]["log"]
    assert overflow not in results[1]["log"]  # logged once, by rank 0
