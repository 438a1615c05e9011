"""``enable_cuda_graph=True``: decoding under torch.compile with CUDA graphs over a static KV cache.

What partita runs instead of DeepSpeed's captured kernels. One decode step reads every weight
once and does little arithmetic, so at batch 1 its time is kernel launches plus memory traffic;
a CUDA graph replays the whole step's kernels with one launch, and a static cache (buffers of a
fixed shape, written in place at the current position) is what makes the step's shapes and
addresses the same every token, which a graph needs.

- Hugging Face models: partita's static-cache loop (:mod:`partita.inference.static_decode`): the
  prompt runs eagerly, every decode step is one captured graph with the argmax inside it.
  transformers' own recipe (``cache_implementation="static"`` + a ``CompileConfig``) is not used: on
  an H200 (torch 2.11, transformers 5.17) it decodes Llama-3-8B at 135 tokens/s against the loop's 191
  (benchmarks/results/inference_decode_*_2026-12-04.json). A ``generate`` call the loop does not
  implement (beams, logits processors, ...) runs the model's own ``generate``, eagerly, and says why.
  A new (batch, cache length) pair compiles once; lengths are bucketed (static_decode.CACHE_BUCKET).
- The reference GPT (``partita.models.gpt.GPT``, whose ``generate`` uses a static KV cache of
  its own): its ``decode_step`` is compiled the same way.

Without CUDA there are no CUDA graphs: :func:`enable_compiled_decoding` is not called on a CPU
model (the engine warns and decodes eagerly, as DeepSpeed ignores the flag off CUDA), because
compiling on CPU costs minutes per shape for small gains. Tests reach this code on CPU with the
``eager`` backend (dynamo tracing, no code generation), which proves the decode step captures as
one graph (``fullgraph=True``) and decodes the same tokens.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger("partita")

__all__ = ["enable_compiled_decoding", "is_hf_generator"]


def is_hf_generator(module: nn.Module) -> bool:
    """A Hugging Face model whose ``generate`` takes a generation config (GenerationMixin)."""
    return hasattr(module, "generation_config") and hasattr(module, "_valid_auto_compile_criteria")


def enable_compiled_decoding(module: nn.Module, *, backend: str = "inductor", max_out_tokens: int | None = None,
                             mode: str | None = "reduce-overhead"):
    """Compile ``module``'s decoding; returns ``(what was done, for the log; the StaticDecoder for a
    Hugging Face model, else None)``. ``backend="eager"``: dynamo's capture only (tests on CPU).
    ``mode`` applies to the reference GPT's decode step. Raises ValueError for a model whose
    generation partita cannot compile."""
    if is_hf_generator(module):
        from partita.inference.static_decode import StaticDecoder

        decoder = StaticDecoder(module, compile=True, backend=backend, max_out_tokens=max_out_tokens)
        return f"static KV cache, decode steps captured by torch.compile (backend {backend!r}, CUDA graphs)", decoder
    step = getattr(module, "decode_step", None)
    if callable(step):
        module.decode_step = torch.compile(step, mode=mode, backend=backend, fullgraph=True, dynamic=False)
        return f"decode_step under torch.compile(mode={mode!r}, backend={backend!r}, fullgraph=True)", None
    raise ValueError(
        f"enable_cuda_graph: {type(module).__name__} is neither a Hugging Face generation model nor has a decode_step "
        "(the reference GPT's); partita compiles only those. Set enable_cuda_graph=False, or compile your model "
        "with engine.compile()"
    )
