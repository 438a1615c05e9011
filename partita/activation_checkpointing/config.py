"""The ``activation_checkpointing`` config section: DeepSpeed's six keys plus partita's ``policy``.

DeepSpeed's keys keep their names and defaults. Their meaning in partita:

- ``cpu_checkpointing``: the tensors a checkpoint keeps (each checkpointed block's inputs)
  are stored in CPU memory until backward. DeepSpeed only honours it together with
  ``partition_activations``; partita honours it on its own.
- ``synchronize_checkpoint_boundary``: synchronize the accelerator before and after every
  checkpointed region (a debugging and profiling aid, as in DeepSpeed).
- ``profile``: time every checkpointed region's forward and recompute and log them.
- ``partition_activations``, ``contiguous_memory_optimization``, ``number_checkpoints``:
  accepted, with a warning at ``initialize`` saying why they change nothing here (no model
  parallelism to partition over; checkpoints are ordinary tensors of torch's allocator).

partita-only keys (DeepSpeed leaves it to the model code to call ``checkpoint``):

- ``policy``: null (default) only configures :mod:`partita.checkpointing` for model code
  that calls ``checkpoint(function, *args)`` itself; ``"every"``, ``"every_k"`` or
  ``"selective"`` makes ``initialize`` wrap the model's repeated blocks (see
  :func:`partita.activation_checkpointing.apply_activation_checkpointing`).
- ``k``: with ``"every_k"``, checkpoint every k-th block.
- ``block_types``: class names of the blocks to wrap; null finds the largest
  ``nn.ModuleList`` of blocks of one type.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import Field, model_validator

from partita.config.base import PARTITA_KEY, JsonInt, StrictSection

Policy = Literal["every", "every_k", "selective"]
POLICIES: tuple[str, ...] = ("every", "every_k", "selective")


class ActivationCheckpointingConfig(StrictSection):
    """Trade compute for memory: recompute activations in backward instead of storing them."""

    partition_activations: bool = Field(
        False,
        description=(
            "DeepSpeed: split checkpointed activations across model-parallel ranks. partita has no "
            "model parallelism, so true has no effect (a warning says so). Default false."
        ),
    )
    cpu_checkpointing: bool = Field(
        False,
        description="Keep each checkpoint's saved inputs in CPU memory until backward. Default false.",
    )
    contiguous_memory_optimization: bool = Field(
        False,
        description=(
            "DeepSpeed: copy checkpoints into one preallocated buffer against fragmentation. No "
            "effect in partita (torch's caching allocator; a warning says so). Default false."
        ),
    )
    number_checkpoints: Annotated[JsonInt, Field(ge=1)] | None = Field(
        None,
        description=(
            "DeepSpeed: sizes the contiguous_memory_optimization buffer. No effect in partita. "
            "Default null."
        ),
    )
    synchronize_checkpoint_boundary: bool = Field(
        False,
        description="Synchronize the accelerator at the start and end of every checkpointed region. Default false.",
    )
    profile: bool = Field(
        False,
        description="Log forward and recompute time of every checkpointed region. Default false.",
    )
    policy: Policy | None = Field(
        None,
        description=(
            "partita only: wrap the model's repeated blocks at initialize: \"every\" block, "
            "\"every_k\" (every k-th block) or \"selective\" (every block, keeping matmul and "
            "attention outputs, recomputing elementwise ops). Default null (wrap nothing)."
        ),
        json_schema_extra=PARTITA_KEY,
    )
    k: Annotated[JsonInt, Field(ge=1)] = Field(
        1, description="partita only: with policy \"every_k\", checkpoint every k-th block. Default 1.",
        json_schema_extra=PARTITA_KEY,
    )
    block_types: list[str] | None = Field(
        None,
        description=(
            "partita only: class names of the blocks the policy wraps. Default null (the largest "
            "nn.ModuleList whose items share one type)."
        ),
        json_schema_extra=PARTITA_KEY,
    )

    @model_validator(mode="after")
    def _options_need_their_policy(self) -> ActivationCheckpointingConfig:
        # A key that would be silently ignored is a mistake: say which policy it belongs to.
        if self.k != 1 and self.policy != "every_k":
            raise ValueError(
                f"k={self.k} only applies to policy \"every_k\" (policy is {json.dumps(self.policy)}); set "
                "\"policy\": \"every_k\" or remove k"
            )
        if self.block_types is not None and self.policy is None:
            raise ValueError(
                "block_types only applies when a policy wraps blocks; set \"policy\" (\"every\", "
                "\"every_k\" or \"selective\") or remove block_types"
            )
        if self.block_types is not None and not self.block_types:
            raise ValueError("block_types is an empty list; give class names such as [\"Block\"] or null")
        return self
