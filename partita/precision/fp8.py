"""``apply_fp8``: the ``fp8`` section's strategy, FP8 matmuls through torchao's float8 training.

The chosen ``nn.Linear`` layers are swapped for torchao's ``Float8Linear`` by
``convert_to_float8_training``. A ``Float8Linear`` keeps the *same* ``weight`` and ``bias``
Parameter objects (torchao assigns them to the new module), so parameter groups built before,
the optimizer, ZeRO's fp32 masters and the ``state_dict`` keys (``...weight``, ``...bias``) are
those of the plain model: a checkpoint saved with FP8 on loads with it off and back. Each forward
casts input and weight to FP8 with scales computed from the tensors themselves (torchao's dynamic
scaling), and each backward casts the output gradient the same way.

Order in ``initialize`` (torchtitan's: model converters before any parallelism):

- first, before tensor parallelism (refused: partita's tensor-parallel layers are not torchao's
  float8 TP styles), placement, activation checkpointing, compile and ZeRO;
- activation checkpointing wraps blocks whose linears are already FP8, so the recompute runs
  the same ``Float8Linear`` code; dynamic scaling recomputes each scale from the same tensors,
  so the recompute equals the forward bit for bit (Megatron's bug, a recompute that silently
  runs in bf16, cannot happen: there is no FP8 context to leave);
- compile traces the converted blocks (torchao's casts are traceable and fuse under inductor);
- ZeRO 0-3 see ordinary parameters: every stage gathers and reduces them as without FP8.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import warnings
from typing import Any

import torch
from torch import nn

from partita.activation_checkpointing.apply import find_repeated_blocks
from partita.config.base import ConfigError
from partita.precision.fp8_config import FP8Config

logger = logging.getLogger("partita")

__all__ = ["apply_fp8", "select_fp8_linears", "fp8_linears"]

# torchao 0.17 is the first release built for torch >= 2.11 (stable ABI); the float8 API used here
# (Float8LinearConfig.from_recipe_name, convert_to_float8_training, _auto_filter_for_recipe) is 0.17's.
_MIN_TORCHAO = (0, 17)


def apply_fp8(model: nn.Module, config: Any, topology: Any, *, device: torch.device) -> list[str]:
    """What ``initialize`` does with the ``fp8`` section; returns the names of the FP8 linears.

    ``config`` is the whole :class:`~partita.config.PartitaConfig` (the section, plus the precision,
    compile and tensor-parallel settings it must agree with); ``topology`` the run's mesh.
    """
    section: FP8Config = config.fp8
    if not section.enabled:
        return []
    if topology.tensor_size > 1:
        raise ConfigError(
            f"fp8 with tensor parallelism (tensor_parallel.autotp_size={topology.tensor_size}) is not supported: "
            "partita's tensor-parallel linears are its own modules, not torchao's float8 tensor-parallel styles, "
            "so they would run in bf16 or break. Set fp8.enabled to false, or train FP8 with ZeRO (any stage) "
            "and tensor_parallel.autotp_size 1"
        )
    if config.precision == "fp16":
        raise ConfigError(
            "fp8 with fp16.enabled: torchao's float8 training is built and tested for bf16 (and fp32) models, "
            "and fp16 loss scaling would scale the gradients FP8 rescales again; set \"bf16\": {\"enabled\": "
            "true} instead of fp16 (bf16 needs no loss scaling)"
        )
    if isinstance(model, nn.Linear):
        raise ConfigError(
            "fp8 got a bare nn.Linear as the model: torchao replaces linears inside a parent module, not the "
            "model itself; wrap it (nn.Sequential(linear)) or set fp8.enabled to false"
        )
    float8 = _import_torchao_float8()
    converted = fp8_linears(model)
    if converted:
        raise ConfigError(
            f"fp8.enabled, but the model already has torchao Float8Linear layers ({_names(converted)}): it was "
            "converted before (by convert_to_float8_training or an earlier initialize), and the section cannot "
            "say which of its settings those layers follow; pass an unconverted model, or set fp8.enabled to false "
            "to train it as it is converted"
        )
    fp8_config = dataclasses.replace(
        float8.Float8LinearConfig.from_recipe_name(section.recipe), emulate=section.emulate
    )
    if not section.emulate:
        _check_fp8_matmul(device, section.recipe)
    chosen, skipped = select_fp8_linears(model, section)
    names = {name for name, _ in chosen}
    float8.convert_to_float8_training(model, config=fp8_config, module_filter_fn=lambda _m, fqn: fqn in names)
    if section.all_gather:  # ZeRO-3 unit gathers send these weights as FP8 (partita/zero/fp8_gather.py)
        from partita.zero.fp8_gather import mark_fp8_all_gather

        mark_fp8_all_gather(model, zero_stage=config.zero_optimization.stage)
    _log_plan(section, [name for name, _ in chosen], skipped)
    if not config.compile.enabled:
        warnings.warn(
            "fp8 is on without compile: in eager mode every FP8 cast (amax, scale, cast) is its own kernel, "
            "which eats most of the FP8 gain (torchao: ~6-10% eager against ~25-28% compiled); set "
            "\"compile\": {\"enabled\": true}",
            stacklevel=3,  # the caller of initialize()
        )
    return [name for name, _ in chosen]


def select_fp8_linears(model: nn.Module, section: FP8Config) -> tuple[list[tuple[str, nn.Linear]], dict[str, str]]:
    """The linears the section converts, and the others with the reason each stays in high precision.

    Only plain ``nn.Linear`` layers are candidates: a subclass (a quantised or LoRA linear, a layer
    converted already) has a forward of its own that ``Float8Linear`` would silently replace.
    """
    candidates = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear and n]
    kept = _first_last(model, candidates) if section.keep_first_last_bf16 else set()
    chosen, skipped = [], {}
    if section.filter == "auto":
        passes = _auto_filter(section.recipe)
        for name, module in candidates:
            if name in kept:
                skipped[name] = "keep_first_last_bf16"
            elif passes(module, name):
                chosen.append((name, module))
            else:
                skipped[name] = f"auto filter ({module.out_features}x{module.in_features} too small or not /16)"
        return chosen, skipped
    patterns = list(section.filter)
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n, _ in candidates)]
    if unmatched:
        sample = [n for n, _ in candidates][:6]
        raise ConfigError(
            f"fp8.filter patterns {unmatched} match no nn.Linear of the model; its linears are named like {sample}"
            " (fnmatch patterns over the full module name, e.g. \"blocks.*.mlp.*\"); fix the patterns or use \"auto\""
        )
    for name, module in candidates:
        if not any(fnmatch.fnmatchcase(name, p) for p in patterns):
            skipped[name] = "not matched by fp8.filter"
        elif name in kept:
            skipped[name] = "keep_first_last_bf16"
        elif module.in_features % 16 or module.out_features % 16:
            raise ConfigError(
                f"fp8.filter matches {name!r} (in_features {module.in_features}, out_features {module.out_features}): "
                "FP8 matmuls need both dimensions to be multiples of 16; narrow the patterns so they leave it out, "
                "or use \"auto\", which skips such layers"
            )
        else:
            chosen.append((name, module))
    return chosen, skipped


def fp8_linears(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` that run their matmul in FP8 (torchao ``Float8Linear``)."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return []
    return [name for name, module in model.named_modules() if isinstance(module, Float8Linear)]


def _first_last(model: nn.Module, candidates: list[tuple[str, nn.Linear]]) -> set[str]:
    """keep_first_last_bf16: the linears of the first and last repeated block and those outside every
    block (embedding-adjacent projections, the output head); without repeated blocks, the first and
    last linear in registration order."""
    try:
        blocks = find_repeated_blocks(model)
    except ValueError:  # no nn.ModuleList of two or more blocks of one type
        names = [n for n, _ in candidates]
        return {names[0], names[-1]} if names else set()
    prefixes = [name + "." for name, _ in blocks]
    edge = {prefixes[0], prefixes[-1]}
    kept = set()
    for name, _ in candidates:
        inside = next((p for p in prefixes if name.startswith(p)), None)
        if inside is None or inside in edge:
            kept.add(name)
    return kept


def _auto_filter(recipe: str):
    from torchao.float8 import _auto_filter_for_recipe

    # torchao has no auto-filter for rowwise_with_gw_hp (NotImplementedError); its forward and
    # grad-input matmuls are rowwise, so rowwise's size rules are the nearest.
    return _auto_filter_for_recipe("rowwise" if recipe == "rowwise_with_gw_hp" else recipe, filter_fqns=[])


def _import_torchao_float8():
    try:
        import torchao
        from torchao import float8
    except ImportError as error:
        raise ConfigError(
            f"fp8.enabled needs torchao's float8 training, which cannot be imported ({error}); install a torchao "
            "built for this torch (pip install 'torchao>=0.17,<0.19' for torch 2.11-2.13) or set fp8.enabled to false"
        ) from None
    version = tuple(int(part) for part in torchao.__version__.split("+")[0].split(".")[:2] if part.isdigit())
    if version < _MIN_TORCHAO:
        raise ConfigError(
            f"fp8.enabled needs torchao >= 0.17 (built for torch >= 2.11), found {torchao.__version__}; "
            "pip install 'torchao>=0.17,<0.19' or set fp8.enabled to false"
        )
    return float8


def _check_fp8_matmul(device: torch.device, recipe: str) -> None:
    """Run one tiny FP8 matmul as the recipe will: the device and torch must have the kernel
    (NVIDIA compute capability 8.9+ on CUDA; torch's CPU kernel on the CPU)."""
    a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
    b = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn).t()
    rowwise = recipe != "tensorwise"
    scale_a = torch.ones(16, 1, device=device) if rowwise else torch.ones((), device=device)
    scale_b = torch.ones(1, 16, device=device) if rowwise else torch.ones((), device=device)
    try:
        torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as error:
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        raise ConfigError(
            f"fp8 (recipe {recipe!r}) needs FP8 matmuls, which this device ({where}) cannot run: {str(error)[:200]}. "
            "FP8 tensor cores start at NVIDIA compute capability 8.9 (Ada, Hopper, Blackwell). Set fp8.enabled to "
            "false, or fp8.emulate to true to test the FP8 numerics without the speed"
        ) from None


def _log_plan(section: FP8Config, chosen: list[str], skipped: dict[str, str]) -> None:
    """One line at start: which linears run in FP8 and why the others do not."""
    total = len(chosen) + len(skipped)
    reasons: dict[str, list[str]] = {}
    for name, reason in skipped.items():
        reasons.setdefault(reason.split(" (")[0], []).append(name)
    kept = "; ".join(f"{reason}: {_names(names)}" for reason, names in reasons.items()) or "none"
    logger.info(
        "fp8: %s%s, %d of %d linears in FP8: %s; kept in high precision: %s",
        section.recipe, " (emulated)" if section.emulate else "", len(chosen), total, _names(chosen), kept,
    )


def _names(names: list[str], limit: int = 6) -> str:
    if len(names) <= limit:
        return ", ".join(names) or "none"
    return ", ".join(names[: limit - 1]) + f", ... {names[-1]} ({len(names)})"
