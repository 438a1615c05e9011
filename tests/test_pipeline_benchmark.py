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


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1),
                                        ("zero_bubble", 2)])
def test_replay_of_torchs_order_gives_the_closed_form(schedule: str, v: int) -> None:
    for p, m in ((4, 8), (4, 4), (2, 8)):
        assert simulated_bubble(schedule, p, m, v) == pytest.approx([formula_bubble(schedule, p, m, v)] * p, abs=1e-12)
    assert formula_bubble("1f1b", 4, 8) == 3 / 11
    assert formula_bubble("interleaved_1f1b", 4, 8, 2) == 3 / 19
    assert formula_bubble("zero_bubble", 4, 8, 2) == 3 / 51
    assert formula_bubble("zero_bubble", 4, 8, 1) == 3 / 27  # ZB-H1: one chunk per rank
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


def _ev(kind: str, name: str, w0: float, w1: float, cpu: float | None = None) -> list:
    """A timeline event (pipeline_timeline_worker's layout) whose main thread had ``cpu`` seconds
    of CPU (default: all of its wall time)."""
    cpu = w1 - w0 if cpu is None else cpu
    return [kind, name, w0, w1, 100.0, 100.0 + cpu, 200.0, 200.0 + cpu]


def _two_ranks() -> list[list[list]]:
    rank0 = [_ev("batch", "train_batch", 0, 11), _ev("window", "step", 0, 10, cpu=4),
             _ev("compute", "0F0", 1, 2), _ev("post", "send@1", 2, 2.5), _ev("wait", "n1", 2.5, 5, cpu=0),
             _ev("compute", "0B0", 5, 7)]
    rank1 = [_ev("batch", "train_batch", 0, 11), _ev("window", "step", 0, 10, cpu=4.5),
             _ev("wait", "n1", 0, 2, cpu=0), _ev("compute", "1F0", 2, 3), _ev("compute", "loss", 3, 3.5),
             _ev("compute", "1B0", 3.5, 5.5, cpu=0.8)]
    return [rank0, rank1]


def test_timeline_splits_the_window_and_replays_the_executed_order() -> None:
    from pipeline_timeline import _split_configs, breakdown, gantt, parse_config, replay_measured

    rank0, rank1 = _two_ranks()
    b = breakdown(rank0)
    assert (b["window_s"], b["compute_s"], b["wait_s"], b["post_s"], b["other_s"]) == (10, 3, 2.5, 0.5, 4)
    assert b["idle_fraction"] == pytest.approx(0.7)
    assert b["overhead_cpu_s"] == pytest.approx(4 - 3)  # the window's thread CPU outside compute
    assert b["cpu_per_call_ms"] == {"B@s0": 2000.0, "F@s0": 1000.0}
    b1 = breakdown(rank1)
    # the loss counts as compute; compute that lacked the CPU (1B0: 0.8 s of 2) counts as idle in the CPU figure
    assert b1["compute_s"] == pytest.approx(3.5) and b1["idle_fraction_cpu"] == pytest.approx(1 - 2.3 / 10)
    # Replay with the measured CPU costs: 0F0 1 s; 1F0 + loss 1.5 s; 1B0 0.8 s (its CPU time); 0B0 2 s.
    out = replay_measured([rank0, rank1], num_stages=2, v=1)
    assert out["makespan_s"] == pytest.approx(5.3)
    assert out["idle_fraction_per_rank"] == pytest.approx([1 - 3 / 5.3, 1 - 2.3 / 5.3])
    assert out["unit_cost_idle_fraction_per_rank"] == pytest.approx([1 - 3 / 6, 1 - 3 / 6])
    assert gantt(rank0, 10, 10.0) == "-F...BB---"
    assert gantt(rank1, 10, 10.0) == "..Fbb-----"  # lower case: under half the wall time had a core
    assert parse_config('zero_bubble:2@{"a": 1, "b": 2}') == ("zero_bubble", 2, {"a": 1, "b": 2})
    assert parse_config("1f1b") == ("1f1b", 1, {})
    assert _split_configs('zero_bubble:1,x:2@{"a": 1, "b": 2},1f1b:1') == ["zero_bubble:1", 'x:2@{"a": 1, "b": 2}',
                                                                          "1f1b:1"]
