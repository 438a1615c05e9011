"""The multi-rank examples (examples/zero3.py, tensor_parallel.py, pipeline.py, expert_parallel.py,
sequence_parallel.py) run at world size 2 (gloo, CPU) and do what their docstrings say: each
trains, its per-step losses (the global batch's mean) equal a plain single-process PyTorch run of
the same model on the same batches within 1e-5, and rank 0 prints that verdict. One of them is
also launched the way a user launches it, ``partita run --nproc 2 examples/zero3.py``."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import run_distributed

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
STEPS = 4


def _run_example(name: str, argv: list[str]) -> tuple[dict, str]:
    """One rank (a fresh process): the example's ``main`` as the script would run it, with what it
    printed. The script's folder goes on sys.path, as Python puts it there for a script."""
    sys.path.insert(0, str(EXAMPLES))
    module = importlib.import_module(name)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = module.main(argv)
    return summary, out.getvalue()


# name -> (extra argv, the printed name of the run, what else rank 0 reports)
CASES = {
    "zero3": ([], "ZeRO-3 over 2 ranks", None),
    "tensor_parallel": ([], "tensor parallel over 2 ranks (data 1)", "of the model's 34,688 weights on this rank"),
    "pipeline": ([], "pipeline over 2 stages (data 1)", "pipeline: stage 0 holds layers 0-2 of 5"),
    "expert_parallel": ([], "expert parallel over 2 ranks", "rank 0 holds experts [0, 1] of 4"),
    "sequence_parallel": (["--mode", "ring"], "sequence parallel (ring) over 2 ranks", None),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_at_two_ranks_equals_single_process_torch(name: str) -> None:
    argv, title, also = CASES[name]
    (first, printed), (second, quiet) = run_distributed(_run_example, 2, name, ["--steps", str(STEPS), *argv],
                                                        timeout=240.0)
    losses, reference = first["losses"], first["reference"]
    assert len(losses) == STEPS and len(reference) == STEPS
    assert first["max_relative_difference"] <= 1e-5, (losses, reference)
    assert losses[-1] < losses[0] - 0.2, losses  # it trains: bytes are learnable, 4 AdamW steps at lr 3e-3
    assert second["losses"] == losses and second["reference"] is None  # every rank reports the global mean
    assert f"{title}: losses equal a single-process PyTorch run" in printed, printed
    assert also is None or also in printed, printed
    assert quiet == ""  # only rank 0 prints


def test_tensor_parallel_example_holds_about_half_the_weights_per_rank() -> None:
    (first, _), _ = run_distributed(_run_example, 2, "tensor_parallel", ["--steps", "1", "--no-check"], timeout=240.0)
    assert first["reference"] is None and first["max_relative_difference"] is None
    assert 0.5 * 34_688 <= first["weights_on_rank"] < 0.55 * 34_688  # norms and biases after row layers stay whole


def test_a_mismatch_is_printed_and_exits_nonzero(capsys) -> None:
    # Loaded from its file: putting examples/ on this test process's sys.path would let its
    # script names (pipeline, zero3, ...) shadow other modules for the rest of the session.
    spec = importlib.util.spec_from_file_location("examples_shared", EXAMPLES / "_shared.py")
    shared = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shared)
    summary = shared.report("run", [2.0, 1.0], [2.0, 1.001], is_main=True)
    assert shared.exit_code(summary) == 1
    assert "run: losses DIFFER FROM a single-process PyTorch run (max relative difference 1.0e-03" in capsys.readouterr().out
    assert shared.exit_code(shared.report("run", [2.0, 1.0], [2.0, 1.0], is_main=False)) == 0


def test_partita_run_launches_an_example() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "partita.launcher.cli", "run", "--nproc", "2",
                           str(EXAMPLES / "zero3.py"), "--steps", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ZeRO-3 over 2 ranks: losses equal a single-process PyTorch run" in done.stdout, done.stdout
