"""The ``compile`` config section: torch.compile each repeated block of the model.

DeepSpeed's ``compile`` section configures DeepCompile, its ZeRO-aware graph passes, and the
compilation itself happens when the user calls ``engine.compile(backend, compile_kwargs)``.
partita accepts the same section and the same method, and compiles differently: each of the
model's repeated blocks gets its own ``torch.compile`` region whose boundary is the block's
``forward``. ZeRO's hooks (ZeRO-3's all-gathers and frees, the gradient reducer's hooks) run in
eager Python around those regions, so the regions never contain a collective or a storage
resize and are not broken or recompiled by them.

Keys:

- ``deepcompile`` (DeepSpeed, default false): only false is accepted; DeepCompile is not
  implemented. The other DeepCompile knobs (``free_activation``, ``offload_activation``, ...)
  are accepted at their DeepSpeed defaults and refused otherwise (``partita.config.unsupported``).
- partita only: ``enabled`` compiles at ``initialize``; ``backend``, ``mode``, ``fullgraph``,
  ``dynamic`` are ``torch.compile``'s arguments of the same names; ``block_types`` picks the
  blocks as ``activation_checkpointing.block_types`` does.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import Field, model_validator

from partita.config.base import PARTITA_KEY, StrictSection

Mode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]

# Keys that only mean something when the section compiles; set with enabled false they
# would be silently ignored, which the config refuses.
_COMPILE_OPTIONS = ("backend", "mode", "fullgraph", "dynamic", "block_types")


class CompileConfig(StrictSection):
    """Compile the model's repeated blocks with torch.compile (see the module docstring)."""

    enabled: bool = Field(
        False,
        description=(
            "partita only: at initialize, compile each repeated block of the model (or the whole "
            "model when it has none) with torch.compile. Default false (engine.compile() still works)."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    backend: str = Field(
        "inductor",
        description=(
            "partita only: torch.compile's backend (a name from torch._dynamo.list_backends(), e.g. "
            "\"inductor\", \"aot_eager\", \"eager\"). Default \"inductor\", as DeepSpeed's engine.compile."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    mode: Mode | None = Field(
        None,
        description=(
            "partita only: torch.compile's mode. null uses torch's default. ZeRO-3 refuses the modes "
            "that use CUDA graphs (\"reduce-overhead\", \"max-autotune\"). Default null."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    fullgraph: bool = Field(
        False,
        description="partita only: torch.compile's fullgraph: a graph break inside a block is an error. Default false.",
        json_schema_extra=PARTITA_KEY,
    )
    dynamic: bool | None = Field(
        None,
        description=(
            "partita only: torch.compile's dynamic: true compiles shape-generic kernels up front, false "
            "never does, null lets torch decide after a shape change. Default null."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    block_types: list[str] | None = Field(
        None,
        description=(
            "partita only: class names of the blocks to compile. Default null (the largest "
            "nn.ModuleList whose items share one type; the whole model if there is none)."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    deepcompile: bool = Field(
        False,
        description="DeepSpeed's DeepCompile switch; only false is accepted (not implemented). Default false.",
    )

    @model_validator(mode="after")
    def _checks(self) -> CompileConfig:
        if self.deepcompile:
            raise ValueError(
                "deepcompile: true asks for DeepSpeed's DeepCompile (ZeRO-aware graph passes), which "
                "partita does not implement. partita compiles each repeated block with torch.compile and "
                "keeps ZeRO's hooks outside the compiled regions, which works at every ZeRO stage: set "
                "\"deepcompile\": false (or remove it) and \"enabled\": true"
            )
        given = [key for key in _COMPILE_OPTIONS if key in self.model_fields_set]
        if given and not self.enabled:
            raise ValueError(
                f"{', '.join(given)} only {'applies' if len(given) == 1 else 'apply'} when compile.enabled is true "
                "(enabled is false, so nothing "
                "is compiled at initialize); set \"enabled\": true, or remove them and pass the settings "
                "to engine.compile(backend=..., compile_kwargs={...})"
            )
        if not self.backend.strip():
            raise ValueError(
                f"backend is {json.dumps(self.backend)}; give a torch.compile backend name such as \"inductor\" "
                "(fused kernels) or \"aot_eager\" (tracing only, for debugging)"
            )
        if self.block_types is not None and not self.block_types:
            raise ValueError(
                f"block_types is {json.dumps(self.block_types)}; give class names such as [\"Block\"] or null"
            )
        return self
