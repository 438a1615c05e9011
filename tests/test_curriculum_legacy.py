"""The legacy ``CurriculumScheduler`` (top-level ``"curriculum_learning"``), stand-alone as
Megatron-DeepSpeed uses it: ``update_difficulty(iteration + 1)``.

Pinned values: DeepSpeed 0.18.9's engine on CPU (benchmarks/oracles/deepspeed_legacy_schedules.py, see
tests/test_progressive_layer_drop.py for the command), 20 steps with gradient accumulation 2: the
``curriculum_seqlen`` each step's forwards received (the engine calls update_difficulty(global_steps + 1)).
"""

from __future__ import annotations

import pytest

from partita.config.base import ConfigError
from partita.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
from tests._config_helpers import only_problem

BASE = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": 64}
ROOT = [24, 24, 32, 40, 40, 40, 48, 48, 56, 56, 56, 64, 64, 64, 64, 64, 64, 64, 64, 64]
DISCRETE = [8, 8, 8, 16, 16, 16, 16, 32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 32]
LINEAR = [8, 16, 16, 24, 24, 32, 40, 40, 48, 48, 56, 64, 64, 64, 64, 64, 64, 64, 64, 64]


@pytest.mark.parametrize(
    ("schedule_type", "schedule_config", "expected"),
    [
        ("fixed_root", {"total_curriculum_step": 12, "difficulty_step": 8, "root_degree": 2}, ROOT),
        ("fixed_discrete", {"difficulty": [8, 16, 32], "max_step": [3, 7]}, DISCRETE),
        ("fixed_linear", {"total_curriculum_step": 12, "difficulty_step": 8}, LINEAR),
    ],
)
def test_schedules_match_deepspeed(schedule_type, schedule_config, expected) -> None:
    scheduler = CurriculumScheduler({**BASE, "schedule_type": schedule_type, "schedule_config": schedule_config})
    assert scheduler.get_current_difficulty() == 8
    assert [scheduler.update_difficulty(step + 1) for step in range(20)] == expected
    assert scheduler.get_state()["current_difficulty"] == expected[-1]


def test_state_round_trip_and_the_maximum_holds() -> None:
    config = {**BASE, "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 12, "difficulty_step": 8}}
    first = CurriculumScheduler(config)
    first.update_difficulty(5)
    second = CurriculumScheduler(config)
    second.set_state(dict(first.get_state()))
    assert second.get_current_difficulty() == first.get_current_difficulty() == LINEAR[4] == 24
    second.set_current_difficulty(64)
    assert second.update_difficulty(1) == 64  # at the maximum it no longer moves (DeepSpeed's rule)
    with pytest.raises(ValueError, match="the state lacks schedule_config"):
        second.set_state({"min_difficulty": 8, "max_difficulty": 64, "current_difficulty": 8, "schedule_type": "custom"})


def test_custom_schedule_and_its_missing_function() -> None:
    scheduler = CurriculumScheduler({**BASE, "schedule_type": "custom"})
    with pytest.raises(RuntimeError, match=r"set_custom_get_difficulty\(fn\)"):
        scheduler.update_difficulty(1)
    scheduler.set_custom_get_difficulty(lambda step: 8 * step)
    assert [scheduler.update_difficulty(s) for s in (1, 3, 9, 2)] == [8, 24, 72, 72]


def test_min_below_the_first_step_multiple_starts_at_that_multiple() -> None:
    # DeepSpeed 0.19.8's rule (0.18.9 returned 0 here): min 5, step 8 starts at 8.
    scheduler = CurriculumScheduler({**BASE, "min_difficulty": 5, "schedule_type": "fixed_linear",
                                     "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}})
    assert scheduler.get_difficulty(0) == 8 and scheduler.get_difficulty(10) == 64


@pytest.mark.parametrize(
    ("section", "contains"),
    [
        ({"min_difficulty": 8}, "curriculum learning requires max_difficulty, schedule_type"),
        ({**BASE, "min_difficulty": 80, "schedule_type": "fixed_linear"}, "min_difficulty (80) is greater than max_difficulty (64)"),
        ({**BASE, "schedule_type": "fixed_root", "schedule_config": {"total_curriculum_step": 5, "difficulty_step": 8}},
         'schedule_type "fixed_root" requires schedule_config root_degree'),
        ({**BASE, "schedule_type": "fixed_linear",
          "schedule_config": {"total_curriculum_step": 5, "difficulty_step": 8, "root_degree": 2}},
         'schedule_config root_degree has no effect with schedule_type "fixed_linear"'),
        ({**BASE, "schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [8, 16], "max_step": [3, 7]}},
         "one more difficulty than max_step"),
        ({**BASE, "schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [8, 16, 32], "max_step": [7, 3]}},
         "max_step must increase"),
        ({**BASE, "schedule_type": "linear"}, "curriculum_learning.schedule_type"),
    ],
)
def test_config_errors(section: dict, contains: str) -> None:
    section = {"enabled": True, **section}
    line = only_problem({"curriculum_learning": section})
    assert contains in line, line
    with pytest.raises(ConfigError, match="CurriculumScheduler: "):
        CurriculumScheduler(section)


def test_off_section_needs_nothing_else() -> None:
    from partita.config import load_config

    assert load_config({"curriculum_learning": {"enabled": False}}).curriculum_learning.enabled is False
