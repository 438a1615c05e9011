"""CUDA-graph decoding for training engines (config ``generation.cuda_graph``): rollouts from the
model being trained, at init_inference's decode speed.

RLHF loops (TRL's GRPO, RLOO, online DPO) generate from the policy every step, and Hugging Face's
``generate`` is bound by the host at the batch sizes they use: each token launches every kernel of
every layer from Python. On one H200, a GRPO step of a 0.5B Qwen2 policy (16 completions of 256
tokens) spends most of its 8 s there (benchmarks/grpo_step_gpu.py). The engine's generation session
(partita/zero/generation.py) already makes the weights whole for the call (ZeRO-3: gathered once);
this module gives it partita's static-cache loop (partita/inference/static_decode.py), whose decode
step is captured once per (batch, cache length) bucket and replayed per token.

Weights move between calls: the optimizer updates them in place and ZeRO-3 gathers into buffers
that may lie elsewhere next time. A captured graph reads its inputs' addresses, so torch.compile's
CUDA-graph trees re-record when a weight's address changed (correct, costs a capture) and replay
otherwise; the weights' values are read at replay, so in-place updates are always seen.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

import torch
from torch import nn

logger = logging.getLogger("partita")

# Tests set this to "eager" to run the loop on CPU under dynamo's capture (no CUDA graphs, no code
# generation); left None, devices without CUDA decode with ``generate``.
CPU_CAPTURE_BACKEND: str | None = None


def _device_of(module: nn.Module) -> torch.device | None:
    for param in module.parameters():
        return param.device
    return None


@contextlib.contextmanager
def _input_grad_hooks_off(module: nn.Module) -> Iterator[None]:
    """Hugging Face's ``enable_input_require_grads`` hook (Trainer and TRL register it for gradient
    checkpointing and adapters) sets ``requires_grad`` on the embedding's output, which dynamo cannot
    capture; a no-grad decode needs none, so it is removed for the call and registered again after
    (transformers' own pair of methods)."""
    active = getattr(module, "_require_grads_hooks", None) or getattr(module, "_require_grads_hook", None)
    if not active:
        yield
        return
    module.disable_input_require_grads()
    try:
        yield
    finally:
        module.enable_input_require_grads()


class RolloutDecoding:
    """One engine's compiled decoding of its module (built on first use, kept for the engine's life)."""

    def __init__(self, module: nn.Module, *, rank: int = 0) -> None:
        from partita.inference.compiled import is_hf_generator

        self._module = module
        self._rank = rank
        self._decoder = None
        self._logged: str | None = None
        device = _device_of(module)
        self.backend = "inductor" if device is not None and device.type == "cuda" else CPU_CAPTURE_BACKEND
        if not is_hf_generator(module):
            self.disabled = (f"generation.cuda_graph: {type(module).__name__} is not a Hugging Face generation model "
                             "(a PeftModel: merge or generate from its base model); generate runs as usual")
        elif self.backend is None:
            where = device.type if device is not None else "a model without parameters"
            self.disabled = (f"generation.cuda_graph has no effect on {where} (CUDA graphs need a CUDA device); "
                             "generate runs as usual")
        else:
            self.disabled = None
        if self.disabled and rank == 0:
            logger.warning(self.disabled)

    def prepare(self, args: tuple, kwargs: dict) -> Callable[[], Any] | None:
        """The call as a thunk through the static-cache loop, or None (``generate`` serves it; why is
        logged once per distinct reason)."""
        if self.disabled:
            return None
        from partita.inference.static_decode import StaticDecoder, unsupported_reason

        call = dict(kwargs)
        if call.get("synced_gpus") is False:
            call.pop("synced_gpus")
        if args:
            if len(args) > 1 or not torch.is_tensor(args[0]) or "input_ids" in call:
                self._log("positional arguments other than input_ids")
                return None
            call["input_ids"] = args[0]
        reason = unsupported_reason(call, getattr(self._module, "generation_config", None))
        if reason is not None:
            self._log(reason)
            return None
        if self._decoder is None:
            self._decoder = StaticDecoder(self._module, compile=True, backend=self.backend)

        def decode() -> Any:
            with _input_grad_hooks_off(self._module):
                return self._decoder.generate(**call)

        return decode

    def _log(self, reason: str) -> None:
        if reason != self._logged and self._rank == 0:
            self._logged = reason
            logger.info("generation.cuda_graph: this generate call runs Hugging Face's generate (%s)", reason)
