"""partita: ZeRO data-parallel training for a plain PyTorch loop and a DeepSpeed-style config.

    engine, optimizer, dataloader, lr_scheduler = partita.initialize(model=model, config="ds.json")
    loss = engine(batch); engine.backward(loss); engine.step()

DeepSpeed's public paths work under ``import partita as deepspeed``: ``deepspeed.zero.Init``,
``deepspeed.checkpointing.checkpoint``, ``deepspeed.comm``, ``deepspeed.accelerator.get_accelerator``,
``deepspeed.utils.logger``, ``deepspeed.runtime.zero.partition_parameters``,
``deepspeed.add_config_arguments``, ``deepspeed.init_distributed``, ``deepspeed.DeepSpeedEngine``.
Every subpackage is an attribute of this package from a bare ``import partita`` on, imported
on first use; DeepSpeed names partita deliberately lacks raise
:class:`partita.deepspeed_compat.MissingDeepSpeedFeature` saying what to use instead.
"""

from __future__ import annotations

from typing import Any

from partita.version import __version__  # noqa: F401 - re-exported

# Top-level functions and classes, imported on first use: name -> (module, attribute).
_LAZY: dict[str, tuple[str, str]] = {
    "initialize": ("partita.bootstrap", "initialize"),
    "add_config_arguments": ("partita.runtime.arguments", "add_config_arguments"),
    "init_distributed": ("partita.comm.comm", "init_distributed"),
    "DeepSpeedEngine": ("partita.engine", "Engine"),
    "Engine": ("partita.engine", "Engine"),
    "logger": ("partita.utils.logging", "logger"),
    "log_dist": ("partita.utils.logging", "log_dist"),
    "MissingDeepSpeedFeature": ("partita.deepspeed_compat", "MissingDeepSpeedFeature"),
    "init_inference": ("partita.inference.engine", "init_inference"),
    "InferenceEngine": ("partita.inference.engine", "InferenceEngine"),
    "DeepSpeedInferenceConfig": ("partita.inference.config", "InferenceConfig"),
    "default_inference_config": ("partita.inference.config", "default_inference_config"),
}
# DeepSpeed's top-level aliases of names inside a subpackage partita may have (pipeline
# parallelism is being added): resolved from that package when it exists, else reported missing.
_FROM_SUBPACKAGE: dict[str, tuple[str, str]] = {
    "PipelineModule": ("partita.pipe", "PipelineModule"),
    "PipelineEngine": ("partita.pipe", "PipelineEngine"),
}

__all__ = ["initialize", "add_config_arguments", "init_distributed", "DeepSpeedEngine", "logger", "log_dist", "__version__"]


def _import(name: str):
    import importlib

    return importlib.import_module(name)


def _has_submodule(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(f"{__name__}.{name}") is not None


def __getattr__(name: str) -> Any:
    # Lazy: the `partita` console command imports this package and should not pay for torch,
    # the engine or the config just to print help or launch torchrun.
    if name in _LAZY:
        module, attribute = _LAZY[name]
        value = getattr(_import(module), attribute)
        globals()[name] = value
        return value
    if name in _FROM_SUBPACKAGE and _has_submodule(_FROM_SUBPACKAGE[name][0].split(".")[1]):
        module, attribute = _FROM_SUBPACKAGE[name]
        found = getattr(_import(module), attribute, None)
        if found is not None:
            return found
    if not name.startswith("_") and name.isidentifier() and _has_submodule(name):
        return _import(f"{__name__}.{name}")  # the import also binds it as this package's attribute
    from partita.deepspeed_compat import missing_top_level

    missing_top_level(name)  # a DeepSpeed name partita lacks: raises, saying what to use instead
    raise AttributeError(f"module 'partita' has no attribute {name!r}")


def __dir__() -> list[str]:
    import pkgutil

    subpackages = [info.name for info in pkgutil.iter_modules(__path__) if not info.name.startswith("_")]
    public = {n for n in globals() if not n.startswith("_") or n.startswith("__")} - {"Any", "annotations"}
    return sorted(public | set(_LAZY) | set(subpackages))
