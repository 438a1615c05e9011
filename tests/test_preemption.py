"""Save on preemption (``checkpoint.save_on_signal``): a signal to one rank of a 2-rank job under
``partita run`` makes every rank finish its step, save, and exit with the documented code; the
relaunch resumes and ends with parameters bit-identical to an uninterrupted run. Also: a signal
during a save, a second signal, and a deadline too short for the save.

This file is also the training job (``python tests/test_preemption.py --mode ...`` under
``partita run``): rank 1 sends the signals to itself, at fixed points, so each case is exact.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
STEPS, EVERY, SIGNAL_STEP, GLOBAL_BATCH = 6, 2, 2, 8


# ---------------------------------------------------------------------------- the job


def _await_forwarded_signal(ready: Path, rank: int) -> None:
    """Tell the test to signal ``partita run`` (the launcher), then wait until torchrun forwarded it here."""
    from partita.checkpoint import preemption

    if rank == 0:
        ready.write_text("ready\n")
    deadline = time.monotonic() + 60
    while preemption._STATE.signum is None and time.monotonic() < deadline:
        time.sleep(0.05)


def _job() -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    import partita
    import partita.checkpoint.save as save_module
    from tests.tiny_models import build_model, make_batches, param_groups

    parser = argparse.ArgumentParser()
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", choices=["signal", "during-save", "deadline", "launcher"], required=True)
    args = parser.parse_args()
    checkpoint = {"save_dir": args.save_dir, "resume": "latest"}
    if args.mode == "deadline":
        checkpoint["signal_save_deadline_seconds"] = 2.0
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
        "gradient_clipping": 0.5,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 60},
        "steps_per_print": 1000,
        "checkpoint": checkpoint,
    }
    model = build_model()
    engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=config)
    rank, world = dist.get_rank(), dist.get_world_size()
    first_attempt = engine.global_steps == 0
    signal_me = first_attempt and rank == 1  # only one rank ever gets a signal

    if signal_me and args.mode in ("during-save", "deadline"):
        original = save_module.write_safetensors

        def write(path, entries, **kwargs):
            if args.mode == "during-save" and engine.global_steps == EVERY:
                os.kill(os.getpid(), signal.SIGTERM)  # in the middle of the loop's own save
            if args.mode == "during-save" and engine.global_steps == EVERY + 1:
                os.kill(os.getpid(), signal.SIGUSR1)  # a second signal, during the save on preemption
            if args.mode == "deadline" and engine.global_steps == SIGNAL_STEP + 1:
                time.sleep(60)  # a save far longer than the 2 s deadline
            return original(path, entries, **kwargs)

        save_module.write_safetensors = write

    xs, ys = make_batches(STEPS, GLOBAL_BATCH)
    micro = engine.train_micro_batch_size_per_gpu()
    for step in range(engine.global_steps, STEPS):
        for m in range(engine.gradient_accumulation_steps()):
            lo = (m * world + rank) * micro
            engine.backward(engine(xs[step][lo : lo + micro], ys[step][lo : lo + micro]))
            if signal_me and args.mode in ("signal", "deadline") and step == SIGNAL_STEP and m == 0:
                os.kill(os.getpid(), signal.SIGTERM)  # mid-step: the step must still finish
            if first_attempt and args.mode == "launcher" and step == SIGNAL_STEP and m == 0:
                _await_forwarded_signal(Path(args.save_dir).parent / "ready", rank)
            engine.step()
        if (step + 1) % EVERY == 0:
            engine.save_checkpoint()
    if rank == 0:
        save_file({n: p.detach().clone() for n, p in model.named_parameters()}, args.out)
    if args.mode == "signal" and not first_attempt:
        # The oracle, in this same process group: the same job from scratch, never interrupted.
        plain = build_model()
        config.pop("checkpoint")
        again, _, _, _ = partita.initialize(model=plain, model_parameters=param_groups(plain), config=config)
        for step in range(STEPS):
            for m in range(again.gradient_accumulation_steps()):
                lo = (m * world + rank) * micro
                again.backward(again(xs[step][lo : lo + micro], ys[step][lo : lo + micro]))
                again.step()
        if rank == 0:
            save_file({n: p.detach().clone() for n, p in plain.named_parameters()}, args.out + ".plain")
    print(f"rank {rank} finished at step {engine.global_steps}, resumed from {engine.loaded_checkpoint and engine.loaded_checkpoint[0]}")
    sys.stdout.flush()
    os._exit(0)  # skip gloo's destructor (it can abort at teardown on torch 2.13)


# ---------------------------------------------------------------------------- the tests


def _launch(save_dir: Path, out: Path, mode: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "partita.launcher.cli", "run", "--nproc", "2", str(Path(__file__).resolve()),
           "--save-dir", str(save_dir), "--out", str(out), "--mode", mode]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=150)


def _params(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def _assert_bit_identical(got: dict, want: dict) -> None:
    import torch

    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def _tags(save_dir: Path) -> list[str]:
    return sorted(p.name for p in save_dir.iterdir())


def test_sigterm_to_one_rank_saves_exits_and_resumes_bit_identical(tmp_path: Path) -> None:
    from partita.checkpoint.preemption import EXIT_SAVED

    save_dir, out = tmp_path / "ckpt", tmp_path / "out.safetensors"
    first = _launch(save_dir, out, "signal")
    log = first.stdout + first.stderr
    assert first.returncode == EXIT_SAVED, log[-4000:]
    # Rank 1 got SIGTERM during step 3's first micro-batch; both ranks finished that step and saved it.
    assert "preemption (SIGTERM): saving step 3" in log and "preemption (another rank's signal): saving step 3" in log, log[-4000:]
    assert _tags(save_dir) == ["global_step2", "global_step3", "latest"]
    assert (save_dir / "latest").read_text().strip() == "global_step3"
    assert not out.exists()  # the loop stopped: nothing after step 3 ran

    second = _launch(save_dir, out, "signal")
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    assert f"resumed from {save_dir}/global_step3" in second.stdout
    # The relaunch also trained the job from scratch, uninterrupted, in the same process group.
    _assert_bit_identical(_params(out), _params(Path(str(out) + ".plain")))


def test_signal_during_a_save_and_a_second_signal(tmp_path: Path) -> None:
    from partita.checkpoint.preemption import EXIT_SAVED

    save_dir = tmp_path / "ckpt"
    done = _launch(save_dir, tmp_path / "out.safetensors", "during-save")
    log = done.stdout + done.stderr
    assert done.returncode == EXIT_SAVED, log[-4000:]
    # SIGTERM arrived while the loop's save of step 2 was writing: that save completed, the job
    # trained step 3 and saved it; the SIGUSR1 during that second save was ignored.
    assert "preemption (SIGTERM): saving step 3" in log, log[-4000:]
    assert "signal 10 ignored: a save on preemption is under way" in log, log[-4000:]
    assert _tags(save_dir) == ["global_step2", "global_step3", "latest"]
    assert (save_dir / "latest").read_text().strip() == "global_step3"


def test_save_that_misses_the_deadline_exits_201_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    from partita.checkpoint.preemption import EXIT_DEADLINE

    save_dir = tmp_path / "ckpt"
    started = time.monotonic()
    done = _launch(save_dir, tmp_path / "out.safetensors", "deadline")
    log = done.stdout + done.stderr
    assert done.returncode == EXIT_DEADLINE, log[-4000:]
    assert "no checkpoint was completed within checkpoint.signal_save_deadline_seconds = 2 s" in log, log[-4000:]
    assert time.monotonic() - started < 60  # the 60 s write was cut off by the deadline, not waited for
    # The abandoned save stays a .partial directory; latest still names the last complete checkpoint.
    assert _tags(save_dir) == ["global_step2", "global_step3.partial", "latest"]
    assert (save_dir / "latest").read_text().strip() == "global_step2"


def test_sigusr1_to_the_launcher_reaches_every_rank(tmp_path: Path) -> None:
    """SLURM's --signal=USR1@120 signals `partita run`, not the ranks: torchrun must forward it."""
    save_dir, ready = tmp_path / "ckpt", tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "partita.launcher.cli", "run", "--nproc", "2", str(Path(__file__).resolve()),
           "--save-dir", str(save_dir), "--out", str(tmp_path / "out.safetensors"), "--mode", "launcher"]
    launcher = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 150
        while not ready.exists():
            assert time.monotonic() < deadline and launcher.poll() is None, launcher.communicate()[0][-4000:]
            time.sleep(0.05)
        launcher.send_signal(signal.SIGUSR1)
        log, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signal.SIGUSR1, log[-4000:]  # the launcher's status: 138
    assert log.count("preemption (SIGUSR1): saving step 3") == 2, log[-4000:]  # both ranks got it
    assert (save_dir / "latest").read_text().strip() == "global_step3"


def test_config_keys() -> None:
    from partita.config import ConfigError, load_config

    section = load_config({"train_batch_size": 2, "checkpoint": {"save_dir": "/tmp/x"}}).checkpoint
    assert (section.save_on_signal, section.signal_save_deadline_seconds, section.signal_check_interval_steps) == (
        ["SIGTERM", "SIGUSR1"], 60.0, 1)
    assert load_config({"train_batch_size": 2, "checkpoint": {"save_on_signal": []}}).checkpoint.save_on_signal == []
    with pytest.raises(ConfigError, match=r"save_on_signal has \['SIGKILL'\]; use signal names from \['SIGTERM'"):
        load_config({"train_batch_size": 2, "checkpoint": {"save_on_signal": ["SIGKILL"]}})
    with pytest.raises(ConfigError, match="signal_save_deadline_seconds"):
        load_config({"train_batch_size": 2, "checkpoint": {"signal_save_deadline_seconds": 0}})


def test_handler_only_records_and_a_second_signal_is_counted() -> None:
    from partita.checkpoint import preemption

    preemption.reset_signal_state()
    try:
        preemption._STATE.deadline_s = 1000.0
        preemption._on_signal(signal.SIGUSR1, None)
        preemption._on_signal(signal.SIGTERM, None)
        assert preemption._STATE.signum == signal.SIGUSR1 and preemption._STATE.extra_signals == 1
        assert preemption._STATE.deadline_at > time.monotonic() + 900
    finally:
        preemption.reset_signal_state()


def test_guard_is_off_without_save_dir_or_signals() -> None:
    from partita.checkpoint.config import CheckpointConfig
    from partita.checkpoint.preemption import PreemptionGuard

    assert not PreemptionGuard(None, CheckpointConfig()).enabled
    assert not PreemptionGuard(None, CheckpointConfig(save_dir="/tmp/x", save_on_signal=[])).enabled
    assert not PreemptionGuard(None, None).enabled


def test_warns_when_torchrun_would_kill_the_ranks_before_the_deadline(monkeypatch, caplog) -> None:
    import logging

    import torch.distributed.launcher.api as launcher_api

    from partita.checkpoint.preemption import _warn_if_torchrun_cuts_the_save

    class OldLaunchConfig:  # torch < 2.12: no shutdown_timeout field
        __dataclass_fields__: dict = {}

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setattr(launcher_api, "LaunchConfig", OldLaunchConfig)
    logging.getLogger("partita").propagate = True
    try:
        with caplog.at_level(logging.WARNING, logger="partita"):
            _warn_if_torchrun_cuts_the_save(20)
            assert not caplog.records
            _warn_if_torchrun_cuts_the_save(60)
    finally:
        logging.getLogger("partita").propagate = False
    assert "is 60 s, but this torch's torchrun kills the ranks 30 s after it forwards a signal" in caplog.text


if __name__ == "__main__":
    _job()
