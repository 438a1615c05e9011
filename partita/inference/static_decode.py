"""Decoding a Hugging Face causal LM over a static KV cache, the decode step captured in CUDA graphs.

Why partita runs its own loop instead of ``model.generate`` with HF's compile recipe
(``cache_implementation="static"`` + ``torch.compile(model.forward, mode="reduce-overhead")``):
on an H200 with torch 2.11 and transformers 5.17 that recipe fails inside ``generate`` ("accessing
tensor output of CUDAGraphs that has been overwritten by a subsequent run", from the cache's
``index_copy_``): the cache tensors and the logits ``generate`` keeps across steps live in the graph's
memory pool. And plain ``generate`` (dynamic cache, eager) decodes Llama-3-8B at 12% of the HBM
bound at batch 1 (benchmarks/results/inference_decode_*). The loop here keeps the three things a
captured decode step needs:

- the prompt is run eagerly (prefill): that allocates the cache's tensors outside any graph, where
  ``StaticCache`` marks their addresses static (HF's cache documents that prefill must not be compiled);
- every decode step has the same shapes (batch, one token, the cache's full length; positions are
  tensors), so one graph serves every step, and the attention mask is one (batch, cache length) tensor
  built once: the padding of the prompt, ones after it (the causal mask hides the future);
- the step's output (logits of the last position) is consumed before the next replay overwrites it,
  and ``cudagraph_mark_step_begin`` tells the graph tree that a new step begins.

Cache lengths are rounded up to a multiple of ``CACHE_BUCKET`` so that calls with nearby lengths reuse
one compiled graph (a new length compiles again); the cost is attention over at most
``CACHE_BUCKET - 1`` masked positions more.

What the loop does: greedy (``do_sample=False``) and sampling with temperature / top-k / top-p,
``eos_token_id`` (a finished row continues with ``pad_token_id``; the loop stops once every row
finished), ``min_new_tokens``, and Hugging Face's ``streamer`` protocol (``put`` per step). Anything
else ``generate`` accepts (beams, logits processors, ...) is answered by :func:`unsupported_reason`,
and the caller falls back to ``model.generate``.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import nn

CACHE_BUCKET = 128
SUPPORTED = frozenset({
    "input_ids", "attention_mask", "max_new_tokens", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p",
    "eos_token_id", "pad_token_id", "bos_token_id", "streamer", "use_cache", "generation_config", "max_length",
    # Hugging Face's own compile switches (TRL sets disable_compile): the loop is compiled its own way.
    "disable_compile", "cache_implementation",
})


# Generation-config fields the loop does not implement, with the value at which each does nothing.
# A field resolved (call, passed config, the model's, Hugging Face's defaults) to anything else
# sends the call to ``generate``: the loop never silently decodes differently from it.
_NEUTRAL = {
    "num_beams": 1, "num_return_sequences": 1, "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0,
    "min_p": 0.0, "typical_p": 1.0, "top_h": None, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "min_length": 0,
    "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "sequence_bias": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None, "renormalize_logits": False, "remove_invalid_values": False,
    "stop_strings": None, "max_time": None, "guidance_scale": None, "watermarking_config": None,
    "output_scores": False, "output_logits": False, "output_attentions": False, "output_hidden_states": False,
    "return_dict_in_generate": False, "penalty_alpha": None, "dola_layers": None, "prompt_lookup_num_tokens": None,
    "token_healing": False,
}
# Hugging Face's defaults for what neither the call nor a config sets (GenerationConfig's
# _get_default_generation_params in transformers 5; written out for versions without it).
_HF_DEFAULTS = {"max_length": 20, "do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}


class Settings:
    """A ``generate`` call's settings resolved as ``generate`` resolves them: the call's keyword
    arguments, then the ``generation_config`` passed, then the model's, then Hugging Face's defaults."""

    def __init__(self, kwargs: dict[str, Any], model_config) -> None:
        self._layers = [{k: v for k, v in kwargs.items() if k != "generation_config"},
                        kwargs.get("generation_config"), model_config]
        defaults = getattr(type(model_config), "_get_default_generation_params", None) if model_config else None
        self._defaults = {**_HF_DEFAULTS, **(defaults() if callable(defaults) else {})}

    def get(self, name: str, default: Any = None) -> Any:
        for layer in self._layers:
            value = layer.get(name) if isinstance(layer, dict) else getattr(layer, name, None)
            if value is not None:
                return value
        return self._defaults.get(name, default)

    def unsupported(self) -> list[str]:
        out = []
        for name, neutral in _NEUTRAL.items():
            value = self.get(name)
            if value is not None and value != neutral and not (neutral is None and value in ((), [], {})):
                out.append(f"{name}={value!r}")
        return out


def unsupported_reason(kwargs: dict[str, Any], generation_config) -> str | None:
    """Why the static loop cannot serve this ``generate`` call (None: it can); ``generation_config``
    is the model's."""
    extra = sorted(k for k, v in kwargs.items() if k not in SUPPORTED and k not in _NEUTRAL and v is not None)
    if extra:
        return f"generate arguments the static-cache loop does not implement: {', '.join(extra)}"
    settings = Settings(kwargs, generation_config).unsupported()
    if settings:
        return f"generation settings the static-cache loop does not implement: {', '.join(settings)}"
    if kwargs.get("input_ids") is None:
        return "no input_ids (the static-cache loop needs token ids)"
    return None


class StaticDecoder:
    """Decodes with one :class:`transformers.StaticCache` per (batch, length) bucket.

    ``compile=True`` captures the decode step with ``torch.compile(mode="reduce-overhead")``
    (CUDA graphs); ``fullgraph`` must be False where the forward has collectives dynamo cannot
    trace in one graph (tensor parallelism).
    """

    def __init__(self, model: nn.Module, *, compile: bool, fullgraph: bool = True, max_out_tokens: int | None = None,
                 backend: str = "inductor") -> None:
        self.model = model
        self.max_out_tokens = max_out_tokens
        self._compiled = compile
        # Models whose forward can skip the LM head for all but the last position (most HF causal LMs).
        params = inspect.signature(model.forward).parameters
        self._keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        # transformers renamed past_key_values to cache (5.2x) and dropped cache_position, which the
        # cache now counts itself; both spellings are served so one partita runs on either.
        self._cache_key = "cache" if "cache" in params else "past_key_values"
        self._positions = "cache_position" in params
        # Greedy steps take the argmax inside the graph (one launch per token, nothing else on the
        # host); sampling and min_new_tokens need the logits. Each compiles on its first use.
        self._greedy_step = self._compile(self._next_token, fullgraph, backend) if compile else self._next_token
        self._logits_step = self._compile(self._last_logits, fullgraph, backend) if compile else self._last_logits

    @staticmethod
    def _compile(fn, fullgraph: bool, backend: str):
        if backend != "inductor":  # tests on CPU: dynamo's capture alone ("eager": no code generation)
            return torch.compile(fn, fullgraph=fullgraph, dynamic=False, backend=backend)
        # "reduce-overhead" is {"triton.cudagraphs": True}; options and mode exclude each other, so
        # it is spelled out to add coordinate-descent tuning, which tunes the one-row (batch 1)
        # matrix-vector kernels Inductor generates for the decode step (gpt-fast's setting; on an
        # H200, Llama-3-8B at batch 1: 146 -> 194 tokens/s, benchmarks/results/inference_decode_*).
        return torch.compile(fn, fullgraph=fullgraph, dynamic=False,
                             options={"triton.cudagraphs": True, "coordinate_descent_tuning": True})

    def _last_logits(self, tokens: torch.Tensor, positions: torch.Tensor, cache_position: torch.Tensor,
                     mask: torch.Tensor, cache) -> torch.Tensor:
        out = self.model(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True,
                         **self._cache_args(cache, cache_position), **self._keep)
        return out.logits[:, -1, :].float()

    def _next_token(self, tokens: torch.Tensor, positions: torch.Tensor, cache_position: torch.Tensor,
                    mask: torch.Tensor, cache) -> torch.Tensor:
        return self._last_logits(tokens, positions, cache_position, mask, cache).argmax(dim=-1)

    def _cache_args(self, cache, cache_position: torch.Tensor) -> dict[str, Any]:
        args = {self._cache_key: cache}
        if self._positions:
            args["cache_position"] = cache_position
        return args

    @torch.no_grad()
    def generate(self, **kwargs: Any) -> torch.Tensor:
        from transformers import StaticCache

        settings = Settings(kwargs, getattr(self.model, "generation_config", None))
        input_ids: torch.Tensor = kwargs["input_ids"]
        batch, prompt = input_ids.shape
        new = settings.get("max_new_tokens")
        new = int(new if new is not None else settings.get("max_length") - prompt)
        if new < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {new}")
        total = prompt + new
        if self.max_out_tokens is not None and total > self.max_out_tokens:
            raise ValueError(
                f"generate asks for {total} tokens (prompt {prompt} + max_new_tokens {new}) but the inference engine's "
                f"max_out_tokens is {self.max_out_tokens}; raise max_out_tokens in init_inference or generate fewer tokens"
            )
        min_new = int(settings.get("min_new_tokens", 0))
        do_sample = bool(settings.get("do_sample", False))
        temperature = float(settings.get("temperature", 1.0))
        top_k = int(settings.get("top_k", 0) or 0)
        top_p = float(settings.get("top_p", 1.0))
        eos = settings.get("eos_token_id", None)
        eos_ids = None if eos is None else torch.tensor([eos] if isinstance(eos, int) else list(eos), device=input_ids.device)
        pad = settings.get("pad_token_id", None)
        pad = pad if pad is not None else (int(eos_ids[0]) if eos_ids is not None else 0)
        streamer = kwargs.get("streamer")

        device = input_ids.device
        length = math.ceil(total / CACHE_BUCKET) * CACHE_BUCKET
        cache = StaticCache(config=self.model.config, max_cache_len=length)
        prompt_mask = kwargs.get("attention_mask")
        mask = torch.ones(batch, length, dtype=torch.long, device=device)
        if prompt_mask is not None:
            mask[:, :prompt] = prompt_mask
        # Left padding: positions count real tokens only, as generate's do.
        positions = (mask[:, :prompt].cumsum(-1) - 1).clamp(min=0)

        if streamer is not None:
            streamer.put(input_ids.cpu())
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         **self._cache_args(cache, torch.arange(prompt, device=device)), **self._keep)
        logits = out.logits[:, -1, :].float()
        del out
        tokens = torch.empty(batch, total, dtype=input_ids.dtype, device=device)
        tokens[:, :prompt] = input_ids
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        next_position = positions[:, -1:] + 1
        cache_position = torch.tensor([prompt], device=device)
        produced = new
        chosen = None
        for step in range(new):
            if chosen is None or logits is not None:  # the prefill's logits, or a logits step's
                if eos_ids is not None and step < min_new:
                    logits = logits.index_fill(1, eos_ids, -math.inf)  # out of place: a graph's output
                chosen = _choose(logits, do_sample, temperature, top_k, top_p)
            if eos_ids is not None:
                chosen = torch.where(finished, torch.full_like(chosen, pad), chosen)
                finished |= torch.isin(chosen, eos_ids)
            tokens[:, prompt + step] = chosen
            if streamer is not None:
                streamer.put(chosen.cpu())
            if step == new - 1 or (eos_ids is not None and bool(finished.all())):
                produced = step + 1
                break
            if self._compiled:
                torch.compiler.cudagraph_mark_step_begin()
            args = (chosen[:, None], next_position, cache_position, mask, cache)
            if do_sample or (eos_ids is not None and step + 1 < min_new):
                logits = self._logits_step(*args)
            else:
                logits, chosen = None, self._greedy_step(*args).clone()  # clone: the graph's output buffer
            next_position = next_position + 1
            cache_position = cache_position + 1
        if streamer is not None:
            streamer.end()
        return tokens[:, : prompt + produced]


def _choose(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    if not do_sample:
        return logits.argmax(dim=-1)
    logits = logits / max(temperature, 1e-5)
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative - ordered.softmax(-1) > top_p  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(drop.scatter(1, order, drop), -math.inf)
    return torch.multinomial(logits.softmax(-1), 1).squeeze(-1)
