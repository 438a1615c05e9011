"""``estimate_memory``: assemble model states, activations and buffers into one estimate."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from partita.estimate.activations import gpt_activation_lines
from partita.estimate.allocator import reserved_estimate
from partita.estimate.buffers import buffer_lines
from partita.estimate.inputs import GPTShape, Setup
from partita.estimate.model_info import ModelInfo, model_info
from partita.estimate.model_states import model_state_lines
from partita.estimate.result import BACKWARD, START_BACKWARD, Line, MemoryEstimate
from partita.estimate.timeline import gpt_backward_walk

__all__ = ["estimate_memory", "estimate_for_info", "held_logits_hole"]


def estimate_memory(
    model: nn.Module | GPTShape | int | ModelInfo,
    setup: Setup | None = None,
    *,
    param_groups: list[Any] | None = None,
    **options: Any,
) -> MemoryEstimate:
    """Per-rank accelerator, CPU and NVMe memory of training ``model`` under ``setup``.

    Args:
        model: an ``nn.Module`` (any device, ``meta`` included), a :class:`GPTShape` (partita's
            reference GPT), or a parameter count.
        setup: the training setup; default :class:`Setup` (bf16, stage 0, one rank). Build one
            from a partita config with ``Setup.from_config(path, world_size=N)``.
        param_groups: for a module, the param groups passed to ``partita.initialize``.
        **options: fields of :class:`Setup` overriding ``setup`` (``stage=2``, ``world_size=8``,
            ``checkpointing="selective"``, ``activation_bytes=...``, ...).

    Parameters, gradients and optimizer states match partita's allocation exactly when
    the model has a shape (module or GPT); activations are a formula for the GPT (or the
    given ``activation_bytes``) and unknown otherwise; buffers are upper estimates.
    """
    setup = Setup.resolve(setup, options)
    info = model if isinstance(model, ModelInfo) else model_info(model, param_groups=param_groups)
    return estimate_for_info(info, setup)


def estimate_for_info(info: ModelInfo, setup: Setup) -> MemoryEstimate:
    """:func:`estimate_memory` for an already read model (the recommender reads it once)."""
    lines: list[Line] = model_state_lines(info, setup)
    notes: list[str] = []
    known = True
    if setup.activation_bytes is not None:
        lines.append(Line("activations", "activations (given)", "accelerator", setup.activation_bytes,
                          frozenset({START_BACKWARD, BACKWARD}), exact=False))
    elif info.gpt is not None:
        lines += gpt_activation_lines(info.gpt, setup)
    else:
        known = False
        notes.append("activations unknown for a model without a GPT shape: pass activation_bytes "
                     "(--activation-bytes); totals leave them out")
    lines += buffer_lines(info, setup)
    if not info.exact_layout:
        notes.append("no parameter shapes: padding (< world size elements per parameter) and bucket boundaries "
                     "are those of stand-in tensors of 2**24 elements")
    # The GPT's backward is walked block by block; otherwise every line of the phase counts in full.
    walk = gpt_backward_walk(info, setup, lines) if info.gpt is not None and setup.activation_bytes is None else None
    estimate = MemoryEstimate(model=info.description, setup=setup, lines=tuple(lines), activations_known=known,
                              notes=tuple(notes), backward_walk=walk)
    model = setup.allocator_model()
    if model.max_split_size_mb is not None:
        notes.append("max_split_size_mb: no recorded run calibrates it; reserved memory uses the fixed-segment "
                     "allocator's fragmentation")
    reserved = reserved_estimate(estimate, model, accelerator_tensor_sizes(info, setup),
                                 held_logits=held_logits_hole(estimate))
    return dataclasses.replace(estimate, notes=tuple(notes), reserved=reserved)


def held_logits_hole(estimate: MemoryEstimate) -> tuple[int, int]:
    """``(hole, allocated)``: the bytes of the previous step's logits, freed once the next forward has
    returned, that the loss gradients cannot reuse, and the allocated bytes beside the hole (the start
    of backward, when those gradients are requested). ``(0, 0)`` unless the loop keeps its logits to
    the next step. In fp32 the logits are as large as each fp32 loss gradient, which reuses the hole;
    in 16 bits they are half as large, and the hole stays until the logits' own gradient (the same
    size) takes it, after the peak. A tiled loss returns no logits."""
    if not estimate.setup.logits_held_to_next_step or estimate.setup.dtype_bytes >= 4:
        return 0, 0
    hole = sum(line.nbytes for line in estimate.lines if line.kind == "logits" and line.device == "accelerator")
    return (hole, estimate.total("accelerator", phase=START_BACKWARD)) if hole else (0, 0)


def accelerator_tensor_sizes(info: ModelInfo, setup: Setup) -> list[int]:
    """Bytes of the accelerator tensors the estimate can enumerate one by one (what the allocator
    rounds): each parameter kept whole, each group's master, gradient partition and optimizer
    states, and the GPT's saved activations per block. The rest (buffers) is left unrounded."""
    from partita.estimate.groups import zero_groups
    from partita.estimate.model_states import optimizer_state_bytes, swapped_state_count

    d = setup.dtype_bytes
    sizes: list[int] = []
    groups = [g for g in zero_groups(info, setup)]
    for group in groups:
        if setup.stage < 3 and not group.aliases_params:
            sizes += [d * p.numel for p in group.params]
        elif setup.stage == 3:
            sizes += [d * p.numel for p in group.params if p.numel <= setup.stage3_param_persistence_threshold]
        if group.offloaded:
            continue
        sizes.append(4 * group.partition_numel)  # master (or the fp32 parameters it aliases)
        sizes.append(4 * group.partition_numel)  # gradient partition
        if setup.optimizer in ("Adam", "AdamW", "SGD", "Lion") and optimizer_state_bytes(setup, 1)[0]:
            sizes += [4 * group.partition_numel] * swapped_state_count(setup)
            sizes += [4] if setup.optimizer in ("Adam", "AdamW") else []  # the step tensor
    sizes += [d * f.numel for f in info.frozen]
    if info.gpt is not None and setup.activation_bytes is None:
        b, s, h = setup.micro_batch, setup.seq_len or info.gpt.seq_len, info.gpt.d_model
        bsh = b * s * h * d
        per_block = [bsh, bsh, 3 * bsh, bsh, bsh, bsh] + ([] if setup.mlp_tile_tokens else [4 * bsh, 4 * bsh])
        per_block += [b * s * 4] * 4 + [b * info.gpt.n_heads * s * 4]  # LayerNorm statistics, attention lse
        sizes += per_block * info.gpt.n_layers
    return sizes
