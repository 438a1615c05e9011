"""AutoTP: tensor-parallel plans for common architectures, found from module names and structure.

DeepSpeed's ``tensor_parallel.autotp_size`` shards Hugging Face models without a hand-written
plan; so does partita, for the architectures below (recognised by their module names, not their
classes, so forks and look-alikes with the same layout work too):

- GPT-2 (``attn.c_attn`` fused q/k/v, ``attn.c_proj``, ``mlp.c_fc``, ``mlp.c_proj``): its layers
  are ``transformers.Conv1D`` — a Linear whose weight is stored transposed ``(in, out)`` — which
  torch's built-in tensor-parallel styles do not cover, hence :class:`Conv1DColumnParallel` and
  :class:`Conv1DRowParallel`; the attention's ``split_size`` is set to the per-rank width;
- Llama / Mistral / Qwen-style blocks (``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``),
  grouped-query attention included (``num_key_value_heads`` must divide by the tensor size);
- BERT (``attention.self.{query,key,value}``, ``attention.output.dense``,
  ``intermediate.dense``, ``output.dense``).

Embeddings and the LM head stay replicated for these models (as DeepSpeed's AutoTP does): they
compute their loss inside ``forward`` from whole-vocabulary logits, which a vocabulary-parallel
head would change. Linear layers outside the plan stay replicated and are logged once.
"""

from __future__ import annotations

import logging

from torch import nn

# The Conv1D layers live a layer below, where apply.py builds them too; re-exported here, their
# historical path (partita.inference.quantize imports them from this module).
from partita.tensor_parallel.conv1d import Conv1DColumnParallel, Conv1DRowParallel, is_hf_conv1d
from partita.tensor_parallel.styles import Style, TensorParallelPlan

logger = logging.getLogger("partita")

__all__ = ["Conv1DColumnParallel", "Conv1DRowParallel", "autotp_plan", "is_hf_conv1d"]


_GPT2 = {
    "*attn.c_attn": Style("column", chunks=3),
    "*attn.c_proj": Style("row"),
    "*mlp.c_fc": Style("column"),
    "*mlp.c_proj": Style("row"),
}
_LLAMA = {
    "*self_attn.q_proj": Style("column"),
    "*self_attn.k_proj": Style("column"),
    "*self_attn.v_proj": Style("column"),
    "*self_attn.o_proj": Style("row"),
    "*mlp.gate_proj": Style("column"),
    "*mlp.up_proj": Style("column"),
    "*mlp.down_proj": Style("row"),
}
_BERT = {
    "*attention.self.query": Style("column"),
    "*attention.self.key": Style("column"),
    "*attention.self.value": Style("column"),
    "*attention.output.dense": Style("row"),
    "*intermediate.dense": Style("column"),
    "*layer.*.output.dense": Style("row"),
}


def autotp_plan(model: nn.Module) -> TensorParallelPlan | None:
    """The plan for a recognised architecture (see the module docstring), or None."""
    names = [name for name, _ in model.named_modules()]
    config = getattr(model, "config", None)

    def head_counts(*attrs: str) -> dict[str, int]:
        return {a: int(getattr(config, a)) for a in attrs if getattr(config, a, None) is not None}

    if any(n.endswith("attn.c_attn") for n in names):
        return TensorParallelPlan(dict(_GPT2), head_counts=head_counts("n_head", "num_attention_heads"))
    if any(n.endswith("self_attn.q_proj") for n in names):
        styles = {k: v for k, v in _LLAMA.items() if any(n.endswith(k[1:]) for n in names)}
        return TensorParallelPlan(styles, head_counts=head_counts("num_attention_heads", "num_key_value_heads"))
    if any(n.endswith("attention.self.query") for n in names):
        return TensorParallelPlan(dict(_BERT), head_counts=head_counts("num_attention_heads"))
    return None


def fix_attention_widths(model: nn.Module, tensor_size: int) -> None:
    """GPT-2's attention splits its fused q/k/v output by ``split_size``: make it the per-rank width."""
    for module in model.modules():
        if hasattr(module, "c_attn") and isinstance(getattr(module, "split_size", None), int):
            module.split_size //= tensor_size


def log_replicated_linears(model: nn.Module, split: set[str]) -> None:
    """Log once which matmul layers the plan left whole (they train correctly, replicated)."""
    whole = [n for n, m in model.named_modules() if (isinstance(m, nn.Linear) or is_hf_conv1d(m)) and n not in split]
    if whole:
        shown = ", ".join(whole[:8]) + (f", … ({len(whole)} in all)" if len(whole) > 8 else "")
        logger.info("tensor parallel: left replicated (no rule splits them): %s", shown)

