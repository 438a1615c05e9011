"""The batch-size triple: fill in what the config leaves out, and check that it adds up.

DeepSpeed's rule is ``train_batch_size == micro_batch x gradient_accumulation_steps x
data-parallel ranks``; any one (or two) of the three may be omitted and is inferred.
The rules below are DeepSpeed's (``runtime/config.py``), but where DeepSpeed floors a
division and then fails an assertion, partita says which number does not divide and
which values would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from partita.config.base import ConfigError

if TYPE_CHECKING:
    from partita.config.root import PartitaConfig

_TRAIN = "train_batch_size"
_MICRO = "train_micro_batch_size_per_gpu"
_GAS = "gradient_accumulation_steps"


@dataclass(frozen=True)
class BatchSizes:
    """The resolved triple; ``train == micro * gas * data-parallel ranks`` holds."""

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int


def resolve_batch_sizes(config: PartitaConfig, *, dp_world_size: int) -> BatchSizes:
    """Infer the missing batch sizes as DeepSpeed does and check that the three agree.

    Args:
        config: the loaded config (``None`` fields, or ``"auto"`` in the JSON, are inferred).
        dp_world_size: the number of data-parallel ranks.

    Rules: train + micro -> gas = train / (micro x ranks); train + gas -> micro =
    train / (ranks x gas); micro + gas -> train = micro x gas x ranks; only train ->
    gas = 1, micro = train / ranks; only micro -> gas = 1, train = micro x ranks.

    Raises:
        ConfigError: none of train/micro is given, or the numbers do not divide or agree;
            the message shows all three numbers, the rank count and values that would work.
    """
    if isinstance(dp_world_size, bool) or not isinstance(dp_world_size, int) or dp_world_size < 1:
        raise ValueError(f"dp_world_size must be an integer >= 1, got {dp_world_size!r}")
    return infer_batch_sizes(
        train=config.train_batch_size,
        micro=config.train_micro_batch_size_per_gpu,
        gas=config.gradient_accumulation_steps,
        ranks=dp_world_size,
    )


def infer_batch_sizes(*, train: int | None, micro: int | None, gas: int | None, ranks: int) -> BatchSizes:
    """:func:`resolve_batch_sizes` on plain numbers (None = not given)."""
    for name, value in ((_TRAIN, train), (_MICRO, micro), (_GAS, gas)):
        if value is not None and value < 1:
            raise ConfigError(f"{name} = {value}: must be an integer >= 1 (or omitted to infer it)")
    if train is None and micro is None:
        given = f" (only {_GAS} = {gas} is given)" if gas is not None else ""
        raise ConfigError(
            f"no batch size in the config{given}: set {_TRAIN} (samples per optimizer step over "
            f"all ranks) or {_MICRO} (samples per rank per forward pass), or both"
        )
    if train is not None and train % ranks != 0:
        raise ConfigError(_indivisible_by_ranks(train, ranks))

    if train is not None and micro is not None and gas is not None:
        if train != micro * gas * ranks:
            raise ConfigError(_mismatch(train, micro, gas, ranks))
        return BatchSizes(train, micro, gas)
    if train is not None and micro is not None:
        if train % (micro * ranks) != 0:
            raise ConfigError(_micro_does_not_divide(train, micro, ranks))
        return BatchSizes(train, micro, train // (micro * ranks))
    if train is not None and gas is not None:
        if train % (ranks * gas) != 0:
            raise ConfigError(_gas_does_not_divide(train, gas, ranks))
        return BatchSizes(train, train // (ranks * gas), gas)
    if train is not None:
        return BatchSizes(train, train // ranks, 1)
    # Only the micro-batch (and maybe gas) is left: train and micro are not both None.
    steps = 1 if gas is None else gas
    return BatchSizes(micro * steps * ranks, micro, steps)  # type: ignore[operator]


def _ranks(ranks: int) -> str:
    return f"{ranks} data-parallel rank{'s' if ranks != 1 else ''}"


def _multiples(value: int, step: int) -> str:
    """The multiples of ``step`` just below and above ``value``, as "8 or 16"."""
    below = value // step * step
    above = below + step
    return f"{below} or {above}" if below >= step else str(above)


def _divisors_near(number: int, target: int, *, limit: int = 3) -> list[int]:
    """Divisors of ``number`` closest to ``target``, ascending."""
    divisors = [d for d in range(1, number + 1) if number % d == 0] if number <= 1_000_000 else [1, number]
    return sorted(sorted(divisors, key=lambda d: (abs(d - target), d))[:limit])


def _join_or(values: list[int]) -> str:
    text = [str(v) for v in values]
    return text[0] if len(text) == 1 else ", ".join(text[:-1]) + " or " + text[-1]


def _indivisible_by_ranks(train: int, ranks: int) -> str:
    return (
        f"{_TRAIN} = {train} cannot be split evenly over {_ranks(ranks)} (every rank must get "
        f"the same number of samples); use a multiple of {ranks}, e.g. {_multiples(train, ranks)}, "
        f"or run on a number of ranks that divides {train}"
    )


def _mismatch(train: int, micro: int, gas: int, ranks: int) -> str:
    product = micro * gas * ranks
    fixes = [f"set {_TRAIN} to {product}"]
    if train % (micro * ranks) == 0:
        fixes.append(f"{_GAS} to {train // (micro * ranks)}")
    if train % (gas * ranks) == 0:
        fixes.append(f"{_MICRO} to {train // (gas * ranks)}")
    fixes_text = ", or ".join(fixes)
    return (
        f"batch sizes disagree: {_TRAIN} = {train}, but {_MICRO} ({micro}) x {_GAS} ({gas}) x "
        f"{_ranks(ranks)} = {product}. {fixes_text}; or remove one of the three keys and "
        "partita infers it"
    )


def _micro_does_not_divide(train: int, micro: int, ranks: int) -> str:
    step = micro * ranks
    micro_options = _divisors_near(train // ranks, micro)
    return (
        f"{_TRAIN} = {train} is not a multiple of {_MICRO} ({micro}) x {_ranks(ranks)} = {step}, "
        f"so {_GAS} ({train} / {step}) is not a whole number. With {_ranks(ranks)} and micro-batch "
        f"{micro}, set {_TRAIN} to {_multiples(train, step)}; or keep {_TRAIN} = {train} and set "
        f"{_MICRO} to {_join_or(micro_options)}"
    )


def _gas_does_not_divide(train: int, gas: int, ranks: int) -> str:
    step = gas * ranks
    gas_options = _divisors_near(train // ranks, gas)
    return (
        f"{_TRAIN} = {train} is not a multiple of {_GAS} ({gas}) x {_ranks(ranks)} = {step}, "
        f"so {_MICRO} ({train} / {step}) is not a whole number. With {_ranks(ranks)} and {gas} "
        f"accumulation steps, set {_TRAIN} to {_multiples(train, step)}; or keep {_TRAIN} = "
        f"{train} and set {_GAS} to {_join_or(gas_options)}"
    )
