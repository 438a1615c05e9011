"""The pipeline benchmark's arithmetic (benchmarks/pipeline_cpu.py, pipeline_theory.py), without
processes: the theory it prints and the figures it computes from the workers' records.

The benchmark itself needs 4 gloo processes and DeepSpeed; these tests make sure that what it
records is computed from what it measured (the suite's pattern in test_benchmark_suite.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from pipeline_cpu import markdown, summarize  # noqa: E402
from pipeline_theory import formula_bubble, replay, simulated_bubble, single_stage_ops  # noqa: E402


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2)])
def test_replay_of_torchs_order_gives_the_closed_form(schedule: str, v: int) -> None:
    for p, m in ((4, 8), (4, 4), (2, 8)):
        assert simulated_bubble(schedule, p, m, v) == pytest.approx([formula_bubble(schedule, p, m, v)] * p, abs=1e-12)
    assert formula_bubble("1f1b", 4, 8) == 3 / 11
    assert formula_bubble("interleaved_1f1b", 4, 8, 2) == 3 / 19
    assert formula_bubble("zero_bubble", 4, 8, 2) == 3 / 51
    from partita.pipe.bubble import theory_idle_fraction  # what engine.last_bubble reports

    assert theory_idle_fraction(4, 8, "interleaved_1f1b", 2) == 3 / 19
    with pytest.raises(ValueError, match="no idle-fraction formula for pipeline schedule 'dualpipe'"):
        theory_idle_fraction(4, 8, "dualpipe")


def test_replay_counts_waiting_and_refuses_a_deadlock() -> None:
    # 1F1B at p=2, m=2: F costs 1, B 2; stage 1 starts at t=1 and stage 0's last B ends at t=9.
    ops = single_stage_ops("1f1b", 2, 2)
    assert ops[1] == [(1, "F", 0), (1, "B", 0), (1, "F", 1), (1, "B", 1)]
    assert replay(ops, 2, 1) == pytest.approx([1 - 6 / 9, 1 - 6 / 9])
    with pytest.raises(RuntimeError, match="deadlock"):
        replay([[(0, "B", 0), (0, "F", 0)], [(1, "F", 0), (1, "B", 0)]], 2, 1)


def _record(step_s: float, window_s: float, compute_s: float, loss: float = 1.5) -> dict:
    return {"step_s": step_s, "window_s": window_s, "compute_s": compute_s, "compute_cpu_s": compute_s / 2,
            "cpu_s": 0.1, "loss": loss, "parts": {}}


def test_summary_takes_the_slowest_rank_and_the_median_over_batches() -> None:
    def rank(r: int, engine: str, schedule: str) -> list[dict]:
        steps = [_record(1.0 + 0.1 * r + b, 1.0, 0.5 + 0.1 * r) for b in range(3)]
        return [{"engine": engine, "schedule": schedule, "virtual_stages": 1, "micro_batches": 4,
                 "warmup": [_record(9.0, 9.0, 1.0, loss=2.25)], "steps": steps}]

    launches = [{"engine": "partita", "ranks": [rank(r, "partita", "1f1b") for r in range(2)]},
                {"engine": "deepspeed", "ranks": [rank(r, "deepspeed", "1f1b") for r in range(2)]},
                {"engine": "deepspeed", "error": "RuntimeError: x"}]
    rows = summarize(launches, 2)
    assert [r["engine"] for r in rows] == ["partita", "deepspeed"]
    row = rows[0]
    assert row["timed_batches"] == 3
    assert row["step_ms_median"] == pytest.approx(2100.0)  # slowest rank (1.1 s + batch), median batch
    assert row["idle_fraction_per_stage"] == pytest.approx([0.5, 0.4])
    assert row["theory_idle_fraction"] == pytest.approx(1 / 5)
    assert row["core_share_during_compute"] == pytest.approx(0.5)
    assert row["first_batch_loss"] == 2.25
    table = markdown(rows)
    assert "| 4 | partita 1f1b | 2100; 1100–3100 | 1.00× | 0.50 / 0.40 (0.45) | 0.200 | 0.50 |" in table
