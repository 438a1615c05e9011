"""Built-in tensor-parallel plans, and the choice of plan for a model.

The reference GPT (:mod:`partita.models.gpt`), Megatron's layout:

- ``tok_emb``: vocabulary-parallel embedding; ``lm_head`` (tied to it): column-parallel over
  the vocabulary, its logits never gathered; ``lm_loss``: the vocabulary-parallel cross-entropy;
- ``attn.qkv`` and ``mlp.fc`` column-parallel (q, k and v split chunk by chunk: whole heads per
  rank), ``attn.proj`` and ``mlp.proj`` row-parallel;
- attention dropout: a stream per tensor rank (a sharded region);
- with sequence parallelism, the LayerNorms run on sequence shards, the embedding dropout enters
  the sequence-sharded region and the residual dropouts (on shards then) get per-rank streams.
"""

from __future__ import annotations

import functools

from torch import nn

from partita.tensor_parallel.apply import Style, TensorParallelPlan
from partita.tensor_parallel.rng import tensor_parallel_rng

__all__ = ["gpt_plan", "plan_for"]


def gpt_plan(model: nn.Module, *, sequence_parallel: bool) -> TensorParallelPlan:
    cfg = model.config
    if cfg.moe_every:
        raise NotImplementedError(
            "tensor parallelism of the reference GPT with MoE blocks (GPTConfig.moe_every) is not implemented: "
            "spread the experts with moe_ep_size instead, or set tensor_parallel.autotp_size to 1"
        )
    styles = {
        "tok_emb": Style("embedding"),
        "blocks.*.attn.qkv": Style("column", chunks=3),
        "blocks.*.attn.proj": Style("row"),
        "blocks.*.mlp.fc": Style("column"),
        "blocks.*.mlp.proj": Style("row"),
        "lm_head": Style("column"),
        "lm_loss": Style("vocab_loss"),
        "pos_emb": Style("replicate"),
    }
    if sequence_parallel:
        styles.update({
            "drop": Style("sequence_scatter"),
            "blocks.*.ln_1": Style("sequence_norm"),
            "blocks.*.ln_2": Style("sequence_norm"),
            "ln_f": Style("sequence_norm"),
            "blocks.*.attn.resid_dropout": Style("sharded_dropout"),
            "blocks.*.mlp.dropout": Style("sharded_dropout"),
        })
    return TensorParallelPlan(styles, head_counts={"n_head": cfg.n_head}, vocab_size=cfg.vocab_size)


def fork_attention_rng(model: nn.Module, tensor_rank: int) -> None:
    """Attention dropout runs inside SDPA on this rank's heads: give each rank its own stream.

    ``attend`` is a method, not a module, so it is wrapped on the instance (only when the model
    has attention dropout; with p = 0 nothing changes).
    """
    from partita.models.gpt import CausalSelfAttention

    for module in model.modules():
        if isinstance(module, CausalSelfAttention) and module.dropout > 0:
            plain = module.attend

            @functools.wraps(plain)
            def attend(q, k, v, _plain=plain, _module=module):
                if not _module.training:
                    return _plain(q, k, v)
                with tensor_parallel_rng(tensor_rank, q.device):
                    return _plain(q, k, v)

            module.attend = attend


def plan_for(model: nn.Module, *, sequence_parallel: bool) -> TensorParallelPlan | None:
    """The built-in plan for ``model``, or None when partita does not know its architecture."""
    from partita.models.gpt import GPT

    if isinstance(model, GPT):
        return gpt_plan(model, sequence_parallel=sequence_parallel)
    from partita.tensor_parallel.autotp import autotp_plan

    plan = autotp_plan(model)
    if plan is not None and sequence_parallel:
        raise NotImplementedError(
            f"tensor_parallel.sequence_parallel is implemented for partita's reference GPT, not yet for "
            f"{type(model).__name__} under AutoTP; set it to false"
        )
    return plan
