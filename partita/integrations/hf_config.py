"""Fill a DeepSpeed-style config from Hugging Face ``TrainingArguments``, as transformers does
for DeepSpeed (``HfTrainerDeepSpeedConfig``): ``"auto"`` (or a missing key) takes the
Trainer's value, and an explicit value that disagrees with the Trainer is an error, because
the Trainer's loop and partita's engine must agree on batch sizes, accumulation and clipping
or the run silently trains something else.

Filled (config key <- TrainingArguments field):

- ``train_micro_batch_size_per_gpu`` <- ``per_device_train_batch_size``;
  ``gradient_accumulation_steps`` <- ``gradient_accumulation_steps``;
  ``train_batch_size`` <- micro x accumulation x world size;
  ``gradient_clipping`` <- ``max_grad_norm``;
- ``optimizer.params``: ``lr`` <- ``learning_rate``, ``betas`` <- ``(adam_beta1, adam_beta2)``,
  ``eps`` <- ``adam_epsilon``, ``weight_decay`` <- ``weight_decay``. Without an ``optimizer``
  section, an AdamW one is built from these (``optim`` must be an AdamW variant);
- ``scheduler.params`` ``"auto"`` only (WarmupLR / WarmupDecayLR / WarmupCosineLR):
  ``warmup_min_lr`` <- 0, ``warmup_max_lr`` <- ``learning_rate``, ``warmup_num_steps`` <-
  ``get_warmup_steps(max_steps)``, ``total_num_steps`` <- ``max_steps``. Without a
  ``scheduler`` section the Trainer's own ``lr_scheduler_type`` schedule is used (see
  :mod:`partita.integrations.hf`);
- ``fp16.enabled`` <- ``fp16``, ``bf16.enabled`` <- ``bf16``.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

__all__ = ["read_config", "resolve_trainer_config"]

_MISSING = object()


def resolve_trainer_config(
    config: dict | str | os.PathLike, args: Any, *, world_size: int, max_steps: int
) -> dict:
    """A copy of ``config`` (a dict or a JSON file's path) with the Trainer's values filled in.

    Raises:
        ValueError: an explicit config value disagrees with ``args`` (the message names both
            and the fix), or the config is not a JSON object.
        NotImplementedError: no ``optimizer`` section and ``args.optim`` is not an AdamW variant.
    """
    cfg = read_config(config)
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    _fill(cfg, "train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size")
    _fill(cfg, "gradient_accumulation_steps", accumulation, "gradient_accumulation_steps")
    _fill(cfg, "train_batch_size", micro * accumulation * world_size,
          f"per_device_train_batch_size x gradient_accumulation_steps x {world_size} ranks")
    _fill(cfg, "gradient_clipping", float(args.max_grad_norm or 0.0), "max_grad_norm")
    adam = {
        "lr": (args.learning_rate, "learning_rate"),
        "betas": ([args.adam_beta1, args.adam_beta2], "adam_beta1, adam_beta2"),
        "eps": (args.adam_epsilon, "adam_epsilon"),
        "weight_decay": (args.weight_decay, "weight_decay"),
    }
    if cfg.get("optimizer") is None:
        optim = str(getattr(args.optim, "value", args.optim))
        if not optim.startswith("adamw"):
            raise NotImplementedError(
                f"TrainingArguments(optim={optim!r}) has no partita equivalent built in; add an \"optimizer\" "
                "section to the partita config (e.g. {\"type\": \"AdamW\", \"params\": {\"lr\": \"auto\"}})"
            )
        cfg["optimizer"] = {"type": "AdamW", "params": {}}
    params = cfg["optimizer"].setdefault("params", {})
    for key, (value, source) in adam.items():
        if key in params or cfg["optimizer"].get("type", "").lower().startswith("adam"):
            _fill(params, key, value, source, path=f"optimizer.params.{key}")
    scheduler = cfg.get("scheduler")
    if isinstance(scheduler, dict):
        warmup = args.get_warmup_steps(max_steps)
        autos = {"warmup_min_lr": 0.0, "warmup_max_lr": args.learning_rate, "warmup_num_steps": warmup,
                 "total_num_steps": max_steps}
        for key, value in autos.items():
            if scheduler.get("params", {}).get(key) == "auto":
                scheduler["params"][key] = value
    for section, enabled in (("fp16", bool(args.fp16)), ("bf16", bool(args.bf16))):
        given = cfg.get(section)
        if given is None:
            if enabled:
                cfg[section] = {"enabled": True}
            continue
        _fill(given, "enabled", enabled, section, path=f"{section}.enabled")
    return cfg


def read_config(config: dict | str | os.PathLike, *, caller: str = "the partita config") -> dict:
    """A private copy of a config given as a dict or a JSON file's path (``caller`` names the
    argument in the error)."""
    if isinstance(config, (str, os.PathLike)):
        with open(config, encoding="utf-8") as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"{caller} must be a dict or a JSON file's path, got {type(config).__name__}")
    return copy.deepcopy(config)


def _fill(section: dict, key: str, value: Any, source: str, *, path: str | None = None) -> None:
    given = section.get(key, _MISSING)
    if given is _MISSING or given is None or given == "auto":
        section[key] = value
        return
    same = list(given) == list(value) if isinstance(value, list) and isinstance(given, (list, tuple)) else given == value
    if not same:
        raise ValueError(
            f"partita config {path or key}={given!r} disagrees with TrainingArguments ({source} gives {value!r}); "
            f"set it to \"auto\" in the config or make the two agree"
        )
