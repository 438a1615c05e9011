"""The reference GPT's generation loop: one prefill of the prompt into a static KV cache, then one
``GPT.decode_step`` per new token (partita/models/kv_cache.py says why the cache is static).

What the loop takes care of beyond the step:

- tensor parallelism: a column-parallel LM head (the GPT's own plan) leaves each rank the logits of
  its vocabulary shard; they are gathered (B x vocab per token) before choosing a token, so every
  rank picks the same one; a sampled token is also broadcast from tensor rank 0, so ranks agree
  even when their random generators do not;
- mixture of experts: generation routes without capacity dropping (see :func:`generation_mode`);
- ``synced_gpus`` (Hugging Face's meaning): ranks whose model runs collectives in every forward
  (ZeRO-3's parameter gathers, expert all-to-alls) keep stepping until every rank is done.

Sequence parallelism is refused: it splits each sequence across ranks, and a decode step has one
token. Pipeline stages never reach here: a pipeline is a ``partita.pipe.PipelineModule``, which
has no ``generate`` (partita's pipeline engines train).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["generate", "generation_mode", "check_generation_supported", "whole_vocab_logits"]


def generate(
    model: nn.Module,
    idx: torch.Tensor | None = None,
    max_new_tokens: int | None = None,
    *,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    synced_gpus: bool = False,
    kv_cache=None,
) -> torch.Tensor:
    """Continue the prompts ``idx`` (B, T) of a :class:`~partita.models.gpt.GPT` by up to
    ``max_new_tokens`` tokens; returns the prompts and the new tokens, a (B, T + n) LongTensor.

    - ``input_ids`` / ``attention_mask``: Hugging Face's names; the mask must be all ones
      (prompts of one length: left padding is not supported).
    - ``do_sample``: False picks the argmax; True samples from softmax(logits / ``temperature``),
      restricted to the ``top_k`` most likely tokens when given, drawing from ``generator``
      (a ``torch.Generator`` on the model's device) for reproducible samples.
    - ``eos_token_id`` (an id or several): a row that emitted one keeps emitting the first; the
      loop stops once every row has (so n may be < max_new_tokens).
    - ``synced_gpus``: run decode steps until every rank of the default process group is done,
      as Hugging Face does for ZeRO-3 (a rank done early runs steps whose tokens it discards).
    - ``kv_cache``: a cache from ``model.new_kv_cache(max_len)`` to reuse across calls (same
      addresses for a compiled decode step); default: a new one of T + max_new_tokens slots.

    The model runs in eval mode (dropout off) under ``torch.no_grad`` and is put back in its mode.
    """
    prompt = _prompt(idx, input_ids, attention_mask)
    _check_options(max_new_tokens, do_sample, temperature, top_k)
    check_generation_supported(model)
    block_size, length = model.config.block_size, prompt.size(1)
    total = length + max_new_tokens
    if total > block_size:
        raise ValueError(
            f"cannot generate {max_new_tokens} tokens after a prompt of {length}: prompt + max_new_tokens = {total} "
            f"exceeds block_size {block_size} (the position embedding has block_size rows); ask for at most "
            f"{max(block_size - length, 0)} new tokens or shorten the prompt to at most {max(block_size - max_new_tokens, 0)} tokens"
        )
    cache = model.new_kv_cache(total) if kv_cache is None else kv_cache
    if cache.max_len < total:
        raise ValueError(f"kv_cache has max_len {cache.max_len} < prompt + max_new_tokens = {total}; "
                         f"build it with model.new_kv_cache({total}) or larger")
    eos = _eos_tensor(eos_token_id, prompt.device)
    synced = synced_gpus and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    pick = functools.partial(_choose, model, do_sample=do_sample, temperature=temperature, top_k=top_k, generator=generator)
    with generation_mode(model):
        return _decode(model, prompt, cache, max_new_tokens, pick, eos, synced)


def _decode(model: nn.Module, prompt: torch.Tensor, cache, max_new_tokens: int, pick, eos: torch.Tensor | None,
            synced: bool) -> torch.Tensor:
    """The prefill, then a token and a decode step at a time until this rank (and, when
    ``synced``, every rank) is done; returns the prompt and the tokens chosen."""
    batch, length = prompt.shape
    out = torch.empty(batch, length + max_new_tokens, dtype=torch.long, device=prompt.device)
    out[:, :length] = prompt
    logits, _ = model(prompt, kv_cache=cache, logits_to_keep=1)
    logits = logits[:, -1]
    position = torch.full((1,), length, dtype=torch.long, device=prompt.device)
    finished = torch.zeros(batch, dtype=torch.bool, device=prompt.device)
    done, producing = 0, True  # new tokens written; whether this rank still wants more
    while True:
        if producing:
            choice = pick(whole_vocab_logits(model, logits))
            if eos is not None:
                choice = torch.where(finished, eos[0], choice)
                finished |= torch.isin(choice, eos)
            out[:, length + done] = choice
            done += 1
            token = choice.unsqueeze(1)
            producing = done < max_new_tokens and not (eos is not None and bool(finished.all()))
        if not _anyone_continues(producing, synced, prompt.device):
            return out[:, :length + done]
        if producing:
            logits = model.decode_step(token, position, cache)
            position += 1
        else:
            # Another rank is still generating: run the same step (its collectives must meet ours) on
            # the last token at its own slot, and discard the logits.
            model.decode_step(token, torch.full_like(position, length + done - 1), cache)


def _anyone_continues(mine: bool, synced: bool, device: torch.device) -> bool:
    if not synced:
        return mine
    from partita.distributed import collectives

    flag = torch.tensor([1.0 if mine else 0.0], device=device)
    collectives.all_reduce(flag, group=None, op=dist.ReduceOp.MAX, purpose="generate (synced_gpus): any rank still generating")
    return bool(flag.item())


@contextlib.contextmanager
def generation_mode(model: nn.Module) -> Iterator[None]:
    """Eval mode, no autograd, and mixture-of-experts layers routed without dropping, for the
    duration of a generation; the model's previous mode and MoE settings come back afterwards.

    Why dropless: in eval partita's MoE (as DeepSpeed's) still drops the assignments beyond
    ``eval_capacity_factor`` x tokens / experts (at least ``min_capacity``). A token's output
    would then depend on the other tokens of the same forward: a prompt prefilled at once would
    not match the same prompt decoded token by token, and a row would change with its batch
    mates. Dropless routing (``drop_tokens=False``) gives every token its top-k experts."""
    was_training = model.training
    gates = [m for m in model.modules() if hasattr(m, "drop_tokens") and hasattr(m, "deepspeed_moe")]
    dropping = [m.drop_tokens for m in gates]
    model.eval()
    for m in gates:
        m.drop_tokens = False
    try:
        with torch.no_grad():
            yield
    finally:
        for m, value in zip(gates, dropping):
            m.drop_tokens = value
        model.train(was_training)


def check_generation_supported(model: nn.Module) -> None:
    """Refuse the model layouts under which a KV-cached generation would compute something else."""
    for name, module in model.named_modules():
        if getattr(module, "sequence_parallel", False) is True and hasattr(module, "tensor_size"):
            raise NotImplementedError(
                f"generate with tensor_parallel.sequence_parallel is not supported ({name or type(model).__name__} runs "
                "on sequence shards): sequence parallelism splits every sequence across the tensor ranks, and a decode "
                "step has one token; build the model for generation with sequence_parallel false (same weights)"
            )
        attend = vars(module).get("attend")
        # Tensor parallelism wraps attend for its dropout stream (functools.wraps: __wrapped__ is the
        # module's own method); any other replacement changes what attention computes.
        if attend is not None and getattr(getattr(attend, "__wrapped__", None), "__self__", None) is not module:
            raise NotImplementedError(
                f"generate with {name}.attend replaced (sequence parallelism: Ulysses or ring attention; or sparse "
                "attention) is not supported: the KV cache runs the model's own dense causal attention on whole "
                "sequences, and sequence parallelism splits each sequence across ranks while a decode step has "
                "one token; generate with a model built without sequence_parallel_size / sparse_attention (same weights)"
            )


def whole_vocab_logits(model: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """(B, vocab) logits: as they are when the head computes the whole vocabulary, gathered
    from the tensor ranks when a column-parallel head left this rank its shard."""
    vocab = model.config.vocab_size
    if logits.size(-1) == vocab:
        return logits
    group = getattr(model.lm_head, "group", None)
    if group is None:
        raise RuntimeError(
            f"generate: the LM head gives {logits.size(-1)} logits per token for a vocabulary of {vocab}, and "
            f"{type(model.lm_head).__name__} is not a tensor-parallel layer: the head must give the whole vocabulary "
            "or be partita's ColumnParallelLinear"
        )
    from partita.tensor_parallel.comm import all_gather_along  # only under tensor parallelism

    whole = all_gather_along(logits, logits.dim() - 1, group, "tensor parallel: generate gathers the vocabulary logits")
    if whole.size(-1) != vocab:
        raise RuntimeError(f"generate: gathered {whole.size(-1)} logits for a vocabulary of {vocab}")
    return whole


def _choose(model: nn.Module, logits: torch.Tensor, *, do_sample: bool, temperature: float, top_k: int | None,
            generator: torch.Generator | None) -> torch.Tensor:
    if not do_sample:
        return logits.argmax(dim=-1)
    scores = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(scores, min(top_k, scores.size(-1)), dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    choice = torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator).squeeze(1)
    group = _tensor_group(model)
    if group is not None:
        # Every tensor rank must continue with the same token: the gathered logits agree bit for
        # bit, the random streams need not (each rank's generator, or torch's default one).
        from partita.distributed import collectives

        collectives.broadcast(choice, src=dist.get_global_rank(group, 0), group=group,
                              purpose="tensor parallel: generate broadcasts the sampled token")
    return choice


def _tensor_group(model: nn.Module):
    for module in model.modules():
        if hasattr(module, "tensor_size") and getattr(module, "tensor_size") > 1 and hasattr(module, "group"):
            return module.group
    return None


def _prompt(idx, input_ids, attention_mask) -> torch.Tensor:
    if idx is not None and input_ids is not None:
        raise ValueError("give the prompt once: idx (positional) or input_ids=, not both")
    prompt = idx if idx is not None else input_ids
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 2 or prompt.dtype != torch.long or prompt.size(1) < 1:
        shape = f"a {prompt.dtype} tensor of shape {tuple(prompt.shape)}" if isinstance(prompt, torch.Tensor) else repr(prompt)
        raise ValueError(f"generate needs the prompt token ids as a (batch, seq >= 1) LongTensor, got {shape}")
    if attention_mask is not None:
        if tuple(attention_mask.shape) != tuple(prompt.shape):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, the prompt {tuple(prompt.shape)}")
        if not bool((attention_mask != 0).all()):
            raise ValueError(
                "attention_mask has zeros (padded prompts): the reference GPT's generate does not support padding; "
                "generate prompts of one length per call (or one prompt at a time)"
            )
    return prompt


def _check_options(max_new_tokens, do_sample: bool, temperature: float, top_k) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}; for the most likely token use do_sample=False")
    if not do_sample and (temperature != 1.0 or top_k is not None):
        warnings.warn("generate: temperature and top_k have no effect with do_sample=False (greedy); pass "
                      "do_sample=True to sample", stacklevel=3)


def _eos_tensor(eos_token_id, device: torch.device) -> torch.Tensor | None:
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ValueError(f"eos_token_id must be a token id or a non-empty list of them, got {eos_token_id!r}")
    return torch.tensor(ids, dtype=torch.long, device=device)
