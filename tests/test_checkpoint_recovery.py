"""Failure recovery: a job under `partita run --nproc 2 --max-restarts 1` whose rank 1 is
SIGKILLed once (mid-step, or mid-save) restarts, resumes from the newest complete checkpoint
through ``checkpoint.resume``, and ends with exactly the parameters of an uninterrupted run of the
same job (run on the test harness's 2 ranks)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.harness import run_distributed

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "checkpoint_job.py"


def _launch(tmp: Path, name: str, kill: str) -> tuple[dict[str, torch.Tensor], str, Path]:
    save_dir, out = tmp / f"{name}-ckpt", tmp / f"{name}.safetensors"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    # The restarted attempt shares torchrun's agent store with the dead one; partita's init keeps
    # each attempt's keys apart (no TORCH_DISABLE_SHARE_RDZV_TCP_STORE needed, none inherited).
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    cmd = [sys.executable, "-m", "partita.launcher.cli", "run", "--nproc", "2", "--max-restarts", "1", str(JOB),
           "--save-dir", str(save_dir), "--out", str(out), "--kill", kill, "--marker", str(tmp / f"{name}.marker")]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log[-4000:]
    return load_file(str(out)), log, save_dir


def _plain_job(tmp: str) -> str:
    from tests import checkpoint_job

    return checkpoint_job.main(["--save-dir", f"{tmp}/plain-ckpt", "--out", f"{tmp}/plain.safetensors"])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    # The same job on 2 gloo ranks, without a kill, run in-process on the test harness's ranks
    # rather than through a third `partita run` launch (its launcher and restarts are what the
    # killed runs test; this run only provides the parameters to compare with).
    tmp = tmp_path_factory.mktemp("plain")
    summaries = run_distributed(_plain_job, 2, str(tmp))
    assert summaries == ["finished at step 6, resumed from None"] * 2, summaries
    return load_file(str(tmp / "plain.safetensors"))


@pytest.mark.parametrize("kill", ["run", "save"])
def test_killed_rank_restarts_resumes_and_matches_uninterrupted_run(kill: str, tmp_path: Path, uninterrupted) -> None:
    params, log, save_dir = _launch(tmp_path, kill, kill)
    assert (tmp_path / f"{kill}.marker").exists()  # the kill happened
    # The launcher named the dead rank (and stopped the other one) before restarting.
    assert re.search(r"failed \(exitcode: -9\) local_rank: 1\b", log), log[-4000:]
    # Attempt 1 resumed from global_step2: the last complete checkpoint before the kill
    # (mid-save, global_step4 was being written and must have been ignored).
    assert f"resumed from {save_dir}/global_step2" in log, log[-4000:]
    assert params.keys() == uninterrupted.keys()
    for name, want in uninterrupted.items():
        assert torch.equal(params[name], want), name
    tags = sorted(p.name for p in save_dir.iterdir())
    assert tags == ["global_step2", "global_step4", "global_step6", "latest"], tags  # no .partial left
    assert (save_dir / "latest").read_text().strip() == "global_step6"
