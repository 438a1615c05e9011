"""The ``generation`` config section (partita only): how a training engine's ``generate`` decodes.

DeepSpeed's training engine has no such section (its Hybrid Engine for RLHF is a separate
DeepSpeed-Chat path); ``init_inference`` has ``enable_cuda_graph``, which this mirrors for
engines built by :func:`partita.initialize`, so rollouts (TRL's GRPO, RLOO, online DPO) can decode
from the model being trained without a second copy of its weights.
"""

from __future__ import annotations

from pydantic import Field

from partita.config.base import PARTITA_KEY, StrictSection


class GenerationSectionConfig(StrictSection):
    """How ``engine.generate`` / ``engine.module.generate`` decode Hugging Face models."""

    cuda_graph: bool = Field(
        False,
        description=(
            "partita only: decode Hugging Face causal LMs through partita's static-KV-cache loop with each decode "
            "step captured in a CUDA graph (torch.compile), as init_inference's enable_cuda_graph does; at ZeRO-3 "
            "only in gather_once sessions. The first call per (batch, cache length) bucket compiles. Calls the "
            "loop does not implement (beam search, logits processors, repetition_penalty, ...) fall back to "
            "generate, with a log line saying why. No effect on devices without CUDA. Default false."
        ),
        json_schema_extra=PARTITA_KEY,
    )
