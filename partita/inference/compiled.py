"""``enable_cuda_graph=True``: decoding under torch.compile with CUDA graphs over a static KV cache.

What partita runs instead of DeepSpeed's captured kernels. One decode step reads every weight
once and does little arithmetic, so at batch 1 its time is kernel launches plus memory traffic;
a CUDA graph replays the whole step's kernels with one launch, and a static cache (buffers of a
fixed shape, written in place at the current position) is what makes the step's shapes and
addresses the same every token, which a graph needs.

- Hugging Face models: transformers' own recipe. The generation config gets
  ``cache_implementation="static"`` and a ``CompileConfig(fullgraph=True, mode="reduce-overhead")``;
  ``generate`` then runs the prompt (prefill) eagerly and every decode step through
  ``torch.compile`` of the model's forward, with Inductor's CUDA graphs (``reduce-overhead``). A
  new total length (prompt + new tokens) is a new static shape: the first call at a length
  compiles, later ones replay.
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


def enable_compiled_decoding(module: nn.Module, *, mode: str | None = "reduce-overhead", backend: str = "inductor",
                             all_devices: bool = False) -> str:
    """Make ``module.generate`` decode through torch.compile over a static cache; returns what was
    done (for the log). ``all_devices``: compile on a CPU model too (tests, with ``backend="eager"``).
    Raises ValueError for a model whose generation partita cannot compile."""
    if is_hf_generator(module):
        from transformers import CompileConfig

        config = module.generation_config
        config.cache_implementation = "static"
        compile_config = CompileConfig(fullgraph=True, dynamic=False, backend=backend, mode=mode)
        if all_devices:
            compile_config._compile_all_devices = True  # transformers' own switch for compiling off-GPU
        config.compile_config = compile_config
        return f"static KV cache, decode step under torch.compile(mode={mode!r}, backend={backend!r}, fullgraph=True)"
    step = getattr(module, "decode_step", None)
    if callable(step):
        module.decode_step = torch.compile(step, mode=mode, backend=backend, fullgraph=True, dynamic=False)
        return f"decode_step under torch.compile(mode={mode!r}, backend={backend!r}, fullgraph=True)"
    raise ValueError(
        f"enable_cuda_graph: {type(module).__name__} is neither a Hugging Face generation model nor has a decode_step "
        "(the reference GPT's); partita compiles only those. Set enable_cuda_graph=False, or compile your model "
        "with engine.compile()"
    )
