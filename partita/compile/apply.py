"""Compile a model's repeated blocks with torch.compile, in place, at every ZeRO stage.

Regions are the blocks activation checkpointing finds (the items of the largest
``nn.ModuleList`` of one block type, or ``block_types``); a model without repeated blocks is
compiled whole. Each region is the block's ``forward`` (see
:mod:`partita.compile.compiled_forward` for why not ``nn.Module.compile()``), so:

- ZeRO-3's gather/release hooks and the ``autograd.Function`` that regathers a block before
  its backward run eagerly around the compiled forward; parameters whose storage ZeRO-3 frees
  between uses are whole whenever compiled code runs. Guards do not look at storage sizes, so
  freeing and refilling storage in place causes no recompiles.
- the gradient reducer's post-accumulate-grad hooks run in eager autograd after the compiled
  backward has produced each gradient (stages 0-3 alike).
- a block checkpointed by activation checkpointing keeps its checkpoint in eager Python and
  compiles the function inside it (torch.compile cannot trace partita's CPU-offloaded
  checkpoint; compiled code inside an eager checkpoint works for every policy).

What does not mix, refused with the reason: under ZeRO-3, a compiled region that would contain
another ZeRO-3 unit (its hooks would be traced), ``nn.Module.compile()``/``torch.compile(model)``
applied by the user before ``initialize``, and the modes that record CUDA graphs (they
remember parameter addresses, which ZeRO-3 reallocates at every gather).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Callable

from torch import nn

from partita.activation_checkpointing.apply import BlockTypes, CheckpointedForward, find_repeated_blocks
from partita.compile.compiled_forward import CompiledForward, CompileSettings, CompileStats
from partita.compile.config import CompileConfig

logger = logging.getLogger("partita")

__all__ = ["compile_blocks", "compiled_blocks", "compile_stats", "apply_config", "compile_engine"]

# torch.compile modes that record CUDA graphs (torch._inductor.list_mode_options()).
_CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def compile_blocks(
    model: nn.Module,
    *,
    backend: str | Callable = "inductor",
    block_types: BlockTypes | None = None,
    zero_stage: int = 0,
    **compile_kwargs: Any,
) -> list[str]:
    """Compile ``model``'s repeated blocks in place; return the names of the compiled regions.

    Args:
        model: the model; blocks keep their identity, class and ``state_dict`` keys.
        backend: torch.compile's backend (a registered name or a callable).
        block_types: classes (or class names) of the blocks; None finds the largest
            ``nn.ModuleList`` of one block type, and compiles the whole model if there is none.
        zero_stage: the ZeRO stage the model trains under (3 adds the checks in the module docstring).
        **compile_kwargs: other torch.compile arguments (``mode``, ``fullgraph``, ``dynamic``,
            ``options``, ...).

    Compiling again with the same settings does nothing; with other settings it is an error.
    """
    settings = _settings(backend, compile_kwargs)
    already = compiled_blocks(model)
    if already:
        previous = _settings_of(model)
        if previous == settings:
            return []  # DeepSpeed's engine.compile() also returns quietly when already compiled
        raise ValueError(
            f"the model is already compiled ({len(already)} regions, {previous.describe()}); torch.compile "
            f"settings cannot be changed in place to {settings.describe()}: compile once, either with the "
            "config's compile section or with engine.compile(...)"
        )
    regions = _regions(model, block_types)
    if zero_stage == 3:
        check_zero3(model, settings, regions)
    names = []
    for name, module in regions:
        _compile_region(module, name=name or type(module).__name__, settings=settings)
        names.append(name)
    return names


def _regions(model: nn.Module, block_types: BlockTypes | None) -> list[tuple[str, nn.Module]]:
    if block_types is not None:
        return find_repeated_blocks(model, block_types=block_types)
    try:
        return find_repeated_blocks(model)
    except ValueError:
        logger.info(
            "compile: %s has no nn.ModuleList of two or more blocks of one type; compiling the whole model's "
            "forward as one region (set compile.block_types to compile blocks instead)",
            type(model).__name__,
        )
        return [("", model)]


def _compile_region(module: nn.Module, *, name: str, settings: CompileSettings) -> None:
    own = module.__dict__.get("forward")
    if isinstance(own, CheckpointedForward):
        # Compile inside the eager checkpoint: the recompute then reruns the compiled function.
        own.inner = CompiledForward(own.inner, name=name, settings=settings)
    else:
        # The bound forward (the class's, or an instance override) becomes the compiled one.
        module.forward = CompiledForward(module.forward, name=name, settings=settings)


def _compiled_of(module: nn.Module) -> CompiledForward | None:
    own = module.__dict__.get("forward")
    if isinstance(own, CompiledForward):
        return own
    if isinstance(own, CheckpointedForward) and isinstance(own.inner, CompiledForward):
        return own.inner  # compiled inside the checkpoint, or checkpointed after compiling
    return None


def compiled_blocks(model: nn.Module) -> list[str]:
    """Names of the regions of ``model`` compiled by partita ("" is the model itself)."""
    return [name for name, module in model.named_modules() if _compiled_of(module) is not None]


def compile_stats(model: nn.Module) -> dict[str, CompileStats]:
    """Per compiled region: graphs TorchDynamo built during its calls, recompiles, graph breaks."""
    return {name: c.stats for name, m in model.named_modules() if (c := _compiled_of(m)) is not None}


def _settings_of(model: nn.Module) -> CompileSettings:
    return next(c.settings for m in model.modules() if (c := _compiled_of(m)) is not None)


def _settings(backend: str | Callable, compile_kwargs: dict[str, Any]) -> CompileSettings:
    import torch

    accepted = set(inspect.signature(torch.compile).parameters) - {"model", "backend"}
    unknown = sorted(set(compile_kwargs) - accepted)
    if unknown:
        raise ValueError(
            f"compile_kwargs {unknown} are not torch.compile arguments; this torch accepts {sorted(accepted)}"
        )
    if isinstance(backend, str):
        from torch._dynamo import list_backends

        known = list_backends(exclude_tags=())
        if backend not in known:
            raise ValueError(
                f"compile backend {backend!r} is not registered with torch.compile; choose one of {known} "
                "(\"inductor\" generates fused kernels, \"aot_eager\" only traces, for debugging) or register "
                "your own with torch._dynamo.register_backend"
            )
    elif not callable(backend):
        raise ValueError(f"compile backend must be a backend name or a callable, got {type(backend).__name__}")
    if compile_kwargs.get("mode") is not None and compile_kwargs.get("options") is not None:
        raise ValueError("give torch.compile either mode or options, not both (torch refuses the pair)")
    # Spelled-out defaults (the config always passes fullgraph and dynamic; mode "default" is
    # torch's None) are dropped, so equal settings compare equal however they were written.
    defaults = {name: p.default for name, p in inspect.signature(torch.compile).parameters.items()}
    def is_default(key: str, value: Any) -> bool:
        default = defaults.get(key, inspect.Parameter.empty)
        return value is default or (isinstance(value, bool) and value == default) or (key, value) == ("mode", "default")

    return CompileSettings(backend=backend, kwargs={k: v for k, v in compile_kwargs.items() if not is_default(k, v)})


def check_zero3(
    model: nn.Module,
    settings: CompileSettings | None = None,
    regions: list[tuple[str, nn.Module]] | None = None,
) -> None:
    """Refuse, with the reason, the ways of compiling that break ZeRO-3 (see the module docstring).
    ``regions``: the regions about to be compiled (default: those already compiled)."""
    if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
        raise NotImplementedError(
            "ZeRO-3 got a model wrapped by torch.compile(model): TorchDynamo would trace ZeRO-3's parameter "
            "gathering hooks on its blocks (with torch 2.13 it fails at the first forward). Pass the plain "
            "model and set \"compile\": {\"enabled\": true} in the config (or call engine.compile()): partita "
            "compiles each block with the hooks kept outside the compiled regions"
        )
    wrapped = [name or "(the model)" for name, m in model.named_modules() if getattr(m, "_compiled_call_impl", None)]
    if wrapped:
        raise NotImplementedError(
            f"ZeRO-3 got modules compiled with nn.Module.compile(): {wrapped[:3]}. That compiles the module's "
            "hooks too, so TorchDynamo would trace ZeRO-3's parameter gathering (with torch 2.13 the process "
            "crashes at the first forward). Do not call .compile() on the model; set \"compile\": "
            "{\"enabled\": true} in the config (or call engine.compile()): partita compiles each block's "
            "forward, hooks outside"
        )
    mode = settings.kwargs.get("mode") if settings is not None else None
    if mode in _CUDA_GRAPH_MODES:
        raise NotImplementedError(
            f"compile mode {mode!r} records CUDA graphs, which replay fixed parameter addresses, while ZeRO-3 "
            "reallocates every parameter's storage at each gather; use mode \"max-autotune-no-cudagraphs\" or "
            "\"default\" (or null) with ZeRO-3, or ZeRO stage 0-2 for CUDA graphs"
        )
    if regions is None:
        regions = [(name, m) for name, m in model.named_modules() if _compiled_of(m) is not None]
    _check_no_unit_inside(model, regions)


def _check_no_unit_inside(model: nn.Module, regions: list[tuple[str, nn.Module]]) -> None:
    """A compiled region must not contain a ZeRO-3 unit below it: that unit's gather hooks
    would run inside the compiled code."""
    from partita.zero.units import find_units

    units = find_units(model)[1:]  # the root's own hooks run around any region
    for name, region in regions:
        inner = [u for u in units if u is not region and any(m is u for m in region.modules())]
        if inner:
            unit_names = [n for n, m in model.named_modules() if any(m is u for u in inner)][:3]
            raise NotImplementedError(
                f"under ZeRO-3, the compiled region {name or type(model).__name__!r} contains ZeRO-3 units "
                f"{unit_names} (children of an nn.ModuleList, gathered by hooks that cannot run inside compiled "
                f"code); compile the units themselves: set compile.block_types to "
                f"{sorted({type(u).__name__ for u in inner})}"
            )


def apply_config(model: nn.Module, section: CompileConfig, *, zero_stage: int) -> list[str]:
    """What ``initialize`` does with the ``compile`` section (and the ZeRO-3 checks, always)."""
    if not section.enabled:
        if zero_stage == 3:
            check_zero3(model)  # a model compiled by hand would otherwise fail later, at the first forward
        return []
    kwargs: dict[str, Any] = {"fullgraph": section.fullgraph, "dynamic": section.dynamic}
    if section.mode is not None:
        kwargs["mode"] = section.mode
    names = compile_blocks(
        model, backend=section.backend, block_types=section.block_types, zero_stage=zero_stage, **kwargs
    )
    _log_compiled(model, names)
    return names


def _log_compiled(model: nn.Module, names: list[str]) -> None:
    if names:
        regions = "the whole model" if names == [""] else f"{len(names)} blocks ({names[0]} ... {names[-1]})"
        logger.info("compile: torch.compile regions: %s; %s", regions, _settings_of(model).describe())


def compile_engine(
    engine: Any,
    backend: str | Callable = "inductor",
    compile_kwargs: dict[str, Any] | None = None,
    schedule: Any = None,
    *,
    block_types: BlockTypes | None = None,
) -> list[str]:
    """``engine.compile(...)``: DeepSpeed's method, compiling per block (see :func:`compile_blocks`)."""
    if schedule is not None:
        raise NotImplementedError(
            "engine.compile(schedule=...) takes DeepSpeed DeepCompile passes, which partita does not implement; "
            "drop schedule: partita compiles each repeated block with torch.compile"
        )
    if compile_kwargs is not None and not isinstance(compile_kwargs, dict):
        raise ValueError(
            f"compile_kwargs must be a dict of torch.compile arguments, got {type(compile_kwargs).__name__}"
        )
    stage = engine.config.zero_optimization.stage if engine.config is not None else 0
    names = compile_blocks(
        engine.module, backend=backend, block_types=block_types, zero_stage=stage, **(compile_kwargs or {})
    )
    _log_compiled(engine.module, names)
    return names
