"""``apply_sequence_tiling``: what ``initialize`` does with the ``sequence_tiling`` section.

- partita's reference GPT: the section sets ``GPTConfig.loss_tile_tokens`` / ``mlp_tile_tokens``
  (through ``GPT.set_sequence_tiling``); a value also set in the model's own config must agree.
- another model: ``mlp_tile_tokens`` tiles the modules named by ``mlp_module_types`` in place
  (:func:`partita.sequence.tiling.apply_tiled_mlp`); ``loss_tile_tokens`` is refused, because the
  loss is the model's own code: it calls :func:`partita.sequence.tiling.tiled_cross_entropy`.

Runs after sequence parallelism (whose GPT loss has a tiled form) and before activation
checkpointing (which then wraps the blocks around the tiled MLPs).
"""

from __future__ import annotations

from torch import nn

from partita.sequence.config import SequenceTilingConfig

__all__ = ["apply_sequence_tiling"]


def apply_sequence_tiling(model: nn.Module, config: SequenceTilingConfig, *, tensor_parallel_size: int = 1) -> list[str]:
    """Apply the section to ``model``; return the names of the modules whose MLP work is tiled."""
    if config.loss_tile_tokens is None and config.mlp_tile_tokens is None:
        return []
    if tensor_parallel_size > 1:
        # Not tested with DTensor shards and sequence-sharded activations: refused rather than guessed.
        raise NotImplementedError(
            f"sequence_tiling with tensor_parallel.autotp_size={tensor_parallel_size} is not implemented: remove the "
            "sequence_tiling section or set autotp_size to 1 (tensor parallelism already splits the MLP and, with "
            "vocab_parallel_lm_head, the logits over the tensor ranks)"
        )
    from partita.models.gpt import GPT, MLP  # the reference model: imported here, models depend on nothing here

    if isinstance(model, GPT):
        return _apply_gpt(model, config, MLP)
    if config.loss_tile_tokens is not None:
        raise ValueError(
            f"sequence_tiling.loss_tile_tokens={config.loss_tile_tokens}: partita tiles the reference GPT's loss; "
            f"{type(model).__name__} computes its own, so call partita.sequence.tiling.tiled_cross_entropy("
            "hidden, lm_head.weight, targets, tile_tokens=...) in it and remove the key"
        )
    if config.mlp_module_types is None:
        raise ValueError(
            f"sequence_tiling.mlp_tile_tokens={config.mlp_tile_tokens} on {type(model).__name__}: name the token-wise "
            "modules to tile with sequence_tiling.mlp_module_types (class names, e.g. [\"LlamaMLP\"])"
        )
    from partita.sequence.tiling import apply_tiled_mlp  # lazily: it imports torch._dynamo (see __init__)

    return apply_tiled_mlp(model, tile_tokens=config.mlp_tile_tokens, module_types=config.mlp_module_types)


def _apply_gpt(model: nn.Module, config: SequenceTilingConfig, mlp_type: type) -> list[str]:
    if config.mlp_module_types is not None:
        raise ValueError(
            "sequence_tiling.mlp_module_types: the reference GPT's dense MLPs are tiled without it; remove the key"
        )
    chosen = {}
    for key in ("loss_tile_tokens", "mlp_tile_tokens"):
        mine, theirs = getattr(config, key), getattr(model.config, key)
        if mine is not None and theirs is not None and mine != theirs:
            raise ValueError(
                f"sequence_tiling.{key}={mine} but the model was built with GPTConfig.{key}={theirs}; set it in one "
                "place (the config or GPTConfig)"
            )
        chosen[key] = mine if mine is not None else theirs
    model.set_sequence_tiling(**chosen)
    if chosen["mlp_tile_tokens"] is None:
        return []
    return [name for name, module in model.named_modules() if isinstance(module, mlp_type)]
