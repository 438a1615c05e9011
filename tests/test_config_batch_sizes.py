"""Batch sizes: train_batch_size, the micro-batch and gradient accumulation inferred from any two
(and the world size), and errors that show every number and consistent fixes."""

from __future__ import annotations

import pytest

from partita.config import BatchSizes, ConfigError, load_config, resolve_batch_sizes
from partita.config.batch import infer_batch_sizes


# ----------------------------------------------------------------------------- batch sizes


@pytest.mark.parametrize(
    ("train", "micro", "gas", "ranks", "expected"),
    [
        (32, 4, None, 4, (32, 4, 2)),  # train + micro -> gas
        (32, None, 2, 4, (32, 4, 2)),  # train + gas -> micro
        (None, 4, 2, 4, (32, 4, 2)),  # micro + gas -> train
        (32, None, None, 4, (32, 8, 1)),  # only train -> gas 1
        (None, 4, None, 4, (16, 4, 1)),  # only micro -> gas 1
        (32, 4, 2, 4, (32, 4, 2)),  # all three agree
        (6, None, None, 1, (6, 6, 1)),  # one process
    ],
)
def test_batch_inference_table(train: int | None, micro: int | None, gas: int | None, ranks: int, expected: tuple) -> None:
    cfg = load_config(
        {
            k: v
            for k, v in {
                "train_batch_size": train,
                "train_micro_batch_size_per_gpu": micro,
                "gradient_accumulation_steps": gas,
            }.items()
            if v is not None
        }
    )
    assert resolve_batch_sizes(cfg, dp_world_size=ranks) == BatchSizes(*expected)


def test_no_batch_size_given() -> None:
    with pytest.raises(ConfigError, match=r"^no batch size in the config: set train_batch_size .* or train_micro_batch_size_per_gpu"):
        resolve_batch_sizes(load_config({}), dp_world_size=2)
    with pytest.raises(ConfigError, match=r"^no batch size in the config \(only gradient_accumulation_steps = 4 is given\)"):
        resolve_batch_sizes(load_config({"gradient_accumulation_steps": 4}), dp_world_size=2)


def test_train_batch_not_divisible_by_world_size() -> None:
    with pytest.raises(ConfigError) as caught:
        infer_batch_sizes(train=10, micro=None, gas=None, ranks=4)
    assert str(caught.value) == (
        "train_batch_size = 10 cannot be split evenly over 4 data-parallel ranks (every rank must get the same "
        "number of samples); use a multiple of 4, e.g. 8 or 12, or run on a number of ranks that divides 10"
    )


def test_mismatched_triple_shows_all_numbers_and_consistent_fixes() -> None:
    with pytest.raises(ConfigError) as caught:
        infer_batch_sizes(train=32, micro=2, gas=2, ranks=4)
    assert str(caught.value) == (
        "batch sizes disagree: train_batch_size = 32, but train_micro_batch_size_per_gpu (2) x "
        "gradient_accumulation_steps (2) x 4 data-parallel ranks = 16. set train_batch_size to 16, or "
        "gradient_accumulation_steps to 4, or train_micro_batch_size_per_gpu to 4; or remove one of the three "
        "keys and partita infers it"
    )
    # Each suggested fix does make the triple agree.
    for train, micro, gas in ((16, 2, 2), (32, 2, 4), (32, 4, 2)):
        assert infer_batch_sizes(train=train, micro=micro, gas=gas, ranks=4) == BatchSizes(train, micro, gas)


def test_train_not_a_multiple_of_micro_times_ranks() -> None:
    with pytest.raises(ConfigError) as caught:
        infer_batch_sizes(train=12, micro=2, gas=None, ranks=4)
    assert str(caught.value) == (
        "train_batch_size = 12 is not a multiple of train_micro_batch_size_per_gpu (2) x 4 data-parallel ranks = 8, "
        "so gradient_accumulation_steps (12 / 8) is not a whole number. With 4 data-parallel ranks and micro-batch "
        "2, set train_batch_size to 8 or 16; or keep train_batch_size = 12 and set train_micro_batch_size_per_gpu "
        "to 1 or 3"
    )
    for train, micro in ((8, 2), (16, 2), (12, 1), (12, 3)):
        assert infer_batch_sizes(train=train, micro=micro, gas=None, ranks=4).train_batch_size == train


def test_train_not_a_multiple_of_gas_times_ranks() -> None:
    with pytest.raises(ConfigError) as caught:
        infer_batch_sizes(train=12, micro=None, gas=4, ranks=2)
    assert str(caught.value) == (
        "train_batch_size = 12 is not a multiple of gradient_accumulation_steps (4) x 2 data-parallel ranks = 8, "
        "so train_micro_batch_size_per_gpu (12 / 8) is not a whole number. With 2 data-parallel ranks and 4 "
        "accumulation steps, set train_batch_size to 8 or 16; or keep train_batch_size = 12 and set "
        "gradient_accumulation_steps to 2, 3 or 6"
    )


def test_train_smaller_than_one_micro_batch_per_rank() -> None:
    with pytest.raises(ConfigError, match=r"set train_batch_size to 16;"):
        infer_batch_sizes(train=8, micro=4, gas=None, ranks=4)


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="dp_world_size must be an integer >= 1, got 0"):
        resolve_batch_sizes(load_config({"train_batch_size": 8}), dp_world_size=0)
