"""Checkpoint one region: DeepSpeed's ``configure`` / ``checkpoint`` / ``is_configured`` / ``reset``.

Everything is built on ``torch.utils.checkpoint.checkpoint`` in non-reentrant mode:

- it works when no input requires grad (a block fed by a frozen embedding, or the first
  block under ZeRO-3), where DeepSpeed's reentrant checkpoint silently produces no
  parameter gradients;
- ``preserve_rng_state=True`` replays the CPU and accelerator RNG state on recompute, so
  dropout draws the same masks and gradients equal an un-checkpointed run;
- CPU offload wraps the call in ``torch.autograd.graph.save_on_cpu``. Non-reentrant
  checkpoint saves its inputs through the saved-tensor hooks active *outside* its region
  (inside, its own hooks take over), so exactly the tensors a checkpoint keeps go to CPU.

The module-level settings exist because DeepSpeed's API is module-level
(``deepspeed.checkpointing.configure(...)`` then ``checkpoint(fn, *args)`` anywhere in the
model code); :func:`partita.activation_checkpointing.apply_activation_checkpointing` reads
the same ``synchronize`` and ``profile`` settings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import warnings
from typing import Any, Callable, ContextManager

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import noop_context_fn

from partita.activation_checkpointing.config import ActivationCheckpointingConfig

logger = logging.getLogger("partita")

__all__ = ["Settings", "configure", "checkpoint", "is_configured", "reset", "settings", "run_checkpointed"]


@dataclasses.dataclass(frozen=True)
class Settings:
    """What :func:`configure` set; the defaults are DeepSpeed's."""

    partition_activations: bool = False
    contiguous_checkpointing: bool = False
    num_checkpoints: int | None = None
    checkpoint_in_cpu: bool = False
    synchronize: bool = False
    profile: bool = False


_settings = Settings()
_configured = False


def settings() -> Settings:
    """The settings in force (DeepSpeed's defaults until :func:`configure` runs)."""
    return _settings


def is_configured() -> bool:
    """True once :func:`configure` has run (and :func:`reset` has not run since)."""
    return _configured


def reset() -> None:
    """Back to DeepSpeed's defaults and 'not configured'."""
    global _settings, _configured
    _settings = Settings()
    _configured = False


def configure(
    mpu_: Any,
    deepspeed_config: ActivationCheckpointingConfig | Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Set how :func:`checkpoint` behaves, with DeepSpeed's call shape.

    Args:
        mpu_: DeepSpeed's model-parallel unit. partita has no model parallelism: pass None.
        deepspeed_config: a config (dict, path of a JSON file, ``PartitaConfig``) whose
            ``activation_checkpointing`` section is read, or that section itself.
        partition_activations, contiguous_checkpointing, num_checkpoints: accepted; they
            have no effect in partita (a warning says why).
        checkpoint_in_cpu: keep the checkpointed inputs in CPU memory until backward.
        synchronize: synchronize the accelerator at the boundaries of every region.
        profile: log the forward and recompute time of every region.

    Keyword values override the config's, as in DeepSpeed.
    """
    global _settings, _configured
    if mpu_ is not None:
        raise NotImplementedError(
            "configure(mpu_=...): model parallelism is not implemented in partita yet, so there is "
            "no model-parallel group to partition activations over; pass None"
        )
    section = _section_of(deepspeed_config)
    chosen = Settings(
        partition_activations=_pick(partition_activations, section.partition_activations),
        contiguous_checkpointing=_pick(contiguous_checkpointing, section.contiguous_memory_optimization),
        num_checkpoints=_pick(num_checkpoints, section.number_checkpoints),
        checkpoint_in_cpu=_pick(checkpoint_in_cpu, section.cpu_checkpointing),
        synchronize=_pick(synchronize, section.synchronize_checkpoint_boundary),
        profile=_pick(profile, section.profile),
    )
    _warn_no_effect(chosen)
    _settings = chosen
    _configured = True


def _pick(explicit: Any, from_config: Any) -> Any:
    return from_config if explicit is None else explicit


def _section_of(config: Any) -> ActivationCheckpointingConfig:
    if config is None:
        return ActivationCheckpointingConfig()
    if isinstance(config, ActivationCheckpointingConfig):
        return config
    from partita.config import PartitaConfig, load_config  # the root config imports this package

    if not isinstance(config, PartitaConfig):
        if not isinstance(config, (dict, str, os.PathLike)):
            raise TypeError(
                "deepspeed_config must be a dict, a path to a JSON config, a PartitaConfig or an "
                f"ActivationCheckpointingConfig, got {type(config).__name__}"
            )
        config = load_config(config)
    return config.activation_checkpointing


def _warn_no_effect(chosen: Settings) -> None:
    if chosen.partition_activations:
        warnings.warn(
            "activation_checkpointing.partition_activations has no effect in partita: it splits "
            "checkpoints across model-parallel ranks, and partita has no model parallelism (each "
            "data-parallel rank's activations are its own). Use cpu_checkpointing to move them off "
            "the accelerator.",
            stacklevel=3,
        )
    if chosen.contiguous_checkpointing:
        warnings.warn(
            "activation_checkpointing.contiguous_memory_optimization has no effect in partita: "
            "checkpoints are ordinary tensors of torch's caching allocator. Against fragmentation "
            "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.",
            stacklevel=3,
        )
    if chosen.num_checkpoints is not None:
        warnings.warn(
            "activation_checkpointing.number_checkpoints has no effect in partita: it only sizes "
            "DeepSpeed's contiguous_memory_optimization buffer.",
            stacklevel=3,
        )


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """Run ``function(*args)`` without keeping its intermediate activations; recompute them in backward.

    DeepSpeed's ``deepspeed.checkpointing.checkpoint`` call shape, with the settings of
    :func:`configure` (DeepSpeed's defaults when it was not called).
    """
    return run_checkpointed(function, args, {}, cpu_offload=_settings.checkpoint_in_cpu)


def run_checkpointed(
    function: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    *,
    cpu_offload: bool,
    context_fn: Callable[[], tuple[ContextManager, ContextManager]] = noop_context_fn,
    name: str | None = None,
) -> Any:
    """The one place partita calls torch's checkpoint (plain, selective, offloaded)."""
    if _settings.synchronize or _settings.profile:
        function = _Instrumented(function, name or getattr(function, "__qualname__", "checkpoint"))
    offload = _save_on_cpu(args) if cpu_offload else contextlib.nullcontext()
    with offload:
        return torch_checkpoint(
            function, *args, use_reentrant=False, preserve_rng_state=True, context_fn=context_fn, **kwargs
        )


def _save_on_cpu(args: tuple) -> ContextManager:
    # Pinned host memory makes the device->host copies asynchronous; CPU tensors stay put.
    on_cuda = any(torch.is_tensor(a) and a.is_cuda for a in args)
    return torch.autograd.graph.save_on_cpu(pin_memory=on_cuda)


def _synchronize() -> None:
    # torch.cuda (not torch.accelerator, which needs torch >= 2.6); nothing to wait for on CPU.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class _Instrumented:
    """Wraps one checkpointed call: the first run is the forward, any later run a recompute."""

    def __init__(self, function: Callable[..., Any], name: str) -> None:
        self.function = function
        self.name = name
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        phase = "forward" if self.calls == 0 else "recompute"
        self.calls += 1
        if _settings.synchronize:
            _synchronize()
        start = time.perf_counter()
        try:
            return self.function(*args, **kwargs)
        finally:
            # ``finally``: torch stops a recompute early by raising from inside the function
            # once every needed tensor is rebuilt; that partial run is the recompute's cost.
            if _settings.synchronize or _settings.profile:
                _synchronize()  # an asynchronous accelerator is only timed after a synchronize
            if _settings.profile:
                elapsed_ms = (time.perf_counter() - start) * 1e3
                logger.info("activation checkpoint %s: %s %.3f ms", self.name, phase, elapsed_ms)
