"""The batch-size triple: fill in what the config leaves out, and check that it adds up.

DeepSpeed's rule is ``train_batch_size == micro_batch x gradient_accumulation_steps x
data-parallel ranks``; any one (or two) of the three may be omitted and is inferred.
The rules below are DeepSpeed's (``runtime/config.py``), but where DeepSpeed floors a
division and then fails an assertion, partita says which number does not divide and
which values would.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from partita.config.base import ConfigError

if TYPE_CHECKING:
    from partita.config.root import PartitaConfig

logger = logging.getLogger("partita")

_TRAIN = "train_batch_size"
_MICRO = "train_micro_batch_size_per_gpu"
_GAS = "gradient_accumulation_steps"


@dataclass(frozen=True)
class BatchSizes:
    """The resolved triple; ``train == micro * gas * data-parallel ranks`` holds."""

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int


def resolve_batch_sizes(config: PartitaConfig, *, dp_world_size: int, log: bool = True) -> BatchSizes:
    """Infer the missing batch sizes as DeepSpeed does and check that the three agree.

    Args:
        config: the loaded config (``None`` fields, or ``"auto"`` in the JSON, are inferred).
        dp_world_size: the number of data-parallel ranks.

    Rules: train + micro -> gas = train / (micro x ranks); train + gas -> micro =
    train / (ranks x gas); micro + gas -> train = micro x gas x ranks; only train ->
    gas = 1, micro = train / ranks; only micro -> gas = 1, train = micro x ranks. With
    ``elasticity.enabled`` the section picks all three instead (:func:`elastic_batch_sizes`).

    Raises:
        ConfigError: none of train/micro is given, or the numbers do not divide or agree;
            the message shows all three numbers, the rank count and values that would work.
    """
    if isinstance(dp_world_size, bool) or not isinstance(dp_world_size, int) or dp_world_size < 1:
        raise ValueError(f"dp_world_size must be an integer >= 1, got {dp_world_size!r}")
    section = getattr(config, "elasticity", None)
    if section is not None and section.enabled:
        return elastic_batch_sizes(config, dp_world_size=dp_world_size, log=log)
    return infer_batch_sizes(
        train=config.train_batch_size,
        micro=config.train_micro_batch_size_per_gpu,
        gas=config.gradient_accumulation_steps,
        ranks=dp_world_size,
    )


def elastic_batch_sizes(config: PartitaConfig, *, dp_world_size: int, log: bool = True) -> BatchSizes:
    """The triple from the ``elasticity`` section (:mod:`partita.config.elasticity`): DeepSpeed's rule,
    ``gas = global batch / (micro x ranks)``, so every valid rank count trains on the same global batch."""
    from partita.config.elasticity import check_batch_keys, compute_elastic_batch

    section = config.elasticity
    if section.model_parallel_size > 1:
        raise NotImplementedError(
            f"elasticity.model_parallel_size {section.model_parallel_size}: elastic batch selection with model "
            "parallelism is not implemented yet in partita; leave it at 1 (data-parallel ranks are counted)"
        )
    given = {_TRAIN: config.train_batch_size, _MICRO: config.train_micro_batch_size_per_gpu,
             _GAS: config.gradient_accumulation_steps}
    ignored = check_batch_keys(section, given)
    picked = compute_elastic_batch(section, world_size=dp_world_size)
    gas = picked.train_batch_size // (picked.micro_batch_size * dp_world_size)
    resolved = BatchSizes(picked.train_batch_size, picked.micro_batch_size, gas)
    if not log:
        return resolved
    for key, value in ((_TRAIN, resolved.train_batch_size), (_MICRO, resolved.micro_batch_size), (_GAS, gas)):
        if key in ignored:
            logger.warning("elasticity overrides %s: %s -> %s", key, given[key], value)
    if not picked.world_independent:
        logger.warning(
            "elasticity (version 0.2): %d data-parallel ranks is not one of the valid counts, so the global batch "
            "%d is specific to this count; a resume on another count changes it", dp_world_size, resolved.train_batch_size,
        )
    logger.info("elasticity: global batch %d (micro %d x accumulation %d x %d ranks); valid rank counts %s",
                resolved.train_batch_size, resolved.micro_batch_size, gas, dp_world_size, list(picked.valid_gpus))
    return resolved


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


# ---------------------------------------------------------------------------- resuming on another world size


def saved_batch_sizes(meta: dict) -> BatchSizes | None:
    """The triple the checkpoint's run trained with: its config resolved at its data-parallel size.

    None when the checkpoint's config no longer loads (a key this version refuses): the caller
    then cannot compare and says nothing.
    """
    from partita.checkpoint.jsoncodec import decode
    from partita.config.loader import load_config

    try:
        raw = decode(meta["config"], tensor=lambda key: None)
        return resolve_batch_sizes(load_config(raw), dp_world_size=int(meta["data_parallel_size"]), log=False)
    except (ValueError, KeyError, TypeError, NotImplementedError):
        return None


def check_resumed_batch(engine, checkpoint_dir: str) -> None:
    """What ``engine.load_checkpoint`` calls after a full load (see :func:`reconcile_resumed_batch`)."""
    import json
    from pathlib import Path

    from partita.checkpoint.format import META_FILE

    meta = json.loads((Path(checkpoint_dir) / META_FILE).read_text(encoding="utf-8"))
    reconcile_resumed_batch(engine, saved_batch_sizes(meta), saved_ranks=meta.get("data_parallel_size"))


def reconcile_resumed_batch(engine, saved: BatchSizes | None, *, saved_ranks: int | None) -> None:
    """After a checkpoint load: realign the accumulation window and warn when the global batch changed.

    The engine's window boundary is ``micro_steps % gradient_accumulation_steps``. A job resumed
    on another rank count may have another accumulation (the elasticity section, or a config
    giving ``train_batch_size`` and the micro-batch, recomputes it so the global batch stays),
    and the saved micro-step count, a multiple of the old accumulation, must become one of the
    new: ``micro_steps = global_steps x accumulation``. When the global batch itself changed
    (a config that fixes micro-batch and accumulation, or elasticity version 0.2 off its valid
    counts), the optimizer sees another gradient noise scale: the warning names the learning-rate
    rules that compensate.
    """
    now = engine._batch
    if saved is not None and saved.gradient_accumulation_steps != now.gradient_accumulation_steps:
        engine.micro_steps = engine.global_steps * now.gradient_accumulation_steps
    if saved is None or saved.train_batch_size == now.train_batch_size:
        return
    ratio = now.train_batch_size / saved.train_batch_size
    logger.warning(
        "the global batch changed on resume: the checkpoint trained with train_batch_size %d (%s ranks x micro %d x "
        "accumulation %d), this run uses %d (%d ranks x micro %d x accumulation %d). Scale the learning rate with it: "
        "the linear rule (SGD, large-batch training) multiplies it by %d/%d = %.4g, the square-root rule (Adam-family "
        "optimizers) by sqrt(%.4g) = %.4g. To keep the math instead, set train_batch_size to %d (and the micro-batch; "
        "partita recomputes gradient_accumulation_steps) or use the elasticity section",
        saved.train_batch_size, saved_ranks if saved_ranks is not None else "?", saved.micro_batch_size,
        saved.gradient_accumulation_steps, now.train_batch_size, engine.topology.data_size, now.micro_batch_size,
        now.gradient_accumulation_steps, now.train_batch_size, saved.train_batch_size, ratio, ratio, math.sqrt(ratio),
        saved.train_batch_size,
    )
