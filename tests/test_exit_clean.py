"""partita's exit path (:mod:`partita.distributed.shutdown`): no gloo abort at exit, exit codes kept.

The abort itself is a race (a gloo worker thread still dropping a finished collective when the
interpreter finalizes), so a handful of launches rarely shows it; what the exit path guarantees,
and what is tested deterministically here, is its cause removed: after the teardown no process
group is left alive and every gloo worker thread has been joined.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.harness import run_distributed

REPO = Path(__file__).resolve().parent.parent


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _train_then_teardown(stage: int, keep_group: bool) -> dict:
    import torch
    import torch.distributed as dist

    import partita
    from partita.distributed.shutdown import teardown_process_groups

    before = _threads()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    engine, _, _, _ = partita.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage}})
    import torch.distributed.nn.functional  # noqa: F401 - binds group.WORLD as a default argument

    for _ in range(2):
        engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
        engine.step()
    loss = torch.ones(1)
    dist.all_reduce(loss)  # a script's last collective, right before the end
    users_group = dist.new_group([0, 1]) if keep_group else None
    during = _threads()
    survivors = teardown_process_groups()
    return {"before": before, "during": during, "after": _threads(), "survivors": survivors,
            "initialized": dist.is_initialized(), "engine_alive": engine is not None, "kept": users_group is not None}


@pytest.mark.parametrize("stage", [0, 3])
def test_teardown_joins_every_gloo_thread_while_the_engine_is_alive(stage: int) -> None:
    for rank in run_distributed(_train_then_teardown, 2, stage, False):
        # gloo's worker and transport threads existed, and none is left once the groups are down,
        # although the engine (whose parts hold the groups) is still referenced.
        assert rank["during"] > rank["before"]
        assert (rank["survivors"], rank["after"], rank["initialized"]) == (0, rank["before"], False)
        assert rank["engine_alive"]


def test_a_group_the_user_keeps_is_reported_as_surviving() -> None:
    for rank in run_distributed(_train_then_teardown, 2, 1, True):
        assert rank["survivors"] == 1 and rank["kept"]
        assert rank["after"] < rank["during"]  # partita's own groups did go


def _start_script(script: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE"):
        env.pop(name, None)
    return subprocess.Popen([sys.executable, str(script), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


FAILING = """
    import sys
    import torch, torch.distributed as dist
    from partita.distributed import init_distributed
    init_distributed(backend="gloo")
    t = torch.ones(3)
    dist.all_reduce(t)
    if sys.argv[1] == "exit":
        sys.exit(3)
    if sys.argv[1] == "raise":
        raise ValueError("boom")
    if sys.argv[1] == "stuck":
        import partita.distributed.shutdown as shutdown, time
        shutdown.TEARDOWN_TIMEOUT_S = 0.5
        shutdown.teardown_process_groups = lambda: time.sleep(60)  # a collective that never ends
"""


FAILING_CASES = [
    ("exit", 3, ""),
    ("raise", 1, "ValueError: boom"),
    ("stuck", 1, "tearing down the process groups at exit took more than 0.5 s"),
]


@pytest.fixture(scope="module")
def failing_runs(tmp_path_factory) -> dict[str, tuple[int, str]]:
    """Every mode's (exit code, stderr), the three one-process scripts run side by side: each is
    a single thread importing torch, so together they keep both cores busy instead of one."""
    script = tmp_path_factory.mktemp("failing") / "script.py"
    script.write_text(textwrap.dedent(FAILING))
    procs = {mode: _start_script(script, mode) for mode, _, _ in FAILING_CASES}
    try:
        results = {}
        for mode, proc in procs.items():
            _, stderr = proc.communicate(timeout=240)
            results[mode] = (proc.returncode, stderr)
        return results
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()


@pytest.mark.parametrize(("mode", "code", "message"), FAILING_CASES)
def test_exit_path_keeps_failures_failing_and_never_hangs(failing_runs, mode: str, code: int, message: str) -> None:
    returncode, stderr = failing_runs[mode]
    assert returncode == code, stderr
    assert message in stderr
    assert "terminate called" not in stderr


def test_launched_scripts_end_with_status_0_and_no_abort() -> None:
    # Three 2-rank launches (ZeRO 1-3, async checkpoint, csv_monitor and tensorboard) of the stress
    # script's worker, which ends without destroy() or os._exit(); benchmarks/exit_abort_stress.py
    # runs the 50-launch count.
    pytest.importorskip("tensorboard")
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "exit_abort_stress.py"), "--launches", "3", "--offset", "17"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "launches=3 aborts=0 other_failures=0" in done.stdout
    assert "terminate called" not in done.stdout + done.stderr
