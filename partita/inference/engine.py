"""``InferenceEngine``: DeepSpeed's inference engine surface over the model's own modules.

What ``init_inference`` builds, in order (each step optional, from the config):

1. cast the model to ``dtype`` (fp16, DeepSpeed's default; bf16; fp32; int8 keeps the float
   parts in the model's own dtype and quantizes the linear weights in step 4);
2. split it across ``tensor_parallel.tp_size`` ranks with the AutoTP plans training uses
   (partita/inference/parallel.py);
3. load ``checkpoint`` into the split model, each rank reading only its part
   (partita/inference/checkpoint.py);
4. weight-only int8/int4 (partita/inference/quantize.py, torchao);
5. place it: on this rank's GPU, left where it is (``keep_module_on_host``), or in host memory
   streamed block by block to the GPU (ZeRO-Inference: ``zero.stage`` 3 with
   ``offload_param.device`` "cpu"; partita/inference/host_stream.py);
6. ``enable_cuda_graph``: decoding under torch.compile with CUDA graphs over a static KV cache
   (partita/inference/compiled.py).

DeepSpeed replaces layers with its own kernels (``replace_with_kernel_inject``); partita keeps
the model's modules (split by AutoTP where tp_size > 1), so outputs are the model's own up to
floating-point reduction order, and ``generate`` is the model's own ``generate``.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from torch import nn

from partita.config.base import ConfigError
from partita.inference.config import InferenceConfig, describe, merge_config_and_kwargs, parse_inference_config

logger = logging.getLogger("partita")

__all__ = ["InferenceEngine", "init_inference"]


def init_inference(model: nn.Module, config: dict | str | None = None, **kwargs: Any) -> InferenceEngine:
    """DeepSpeed's ``deepspeed.init_inference``: ``config`` is a dict or the path of a JSON file,
    ``kwargs`` are more keys (a key given both ways must have the same value). Returns an
    :class:`InferenceEngine`; ``engine.module`` is the (split, loaded, placed) model."""
    return InferenceEngine(model, config=parse_inference_config(merge_config_and_kwargs(config, kwargs)))


class InferenceEngine(nn.Module):
    """``engine(...)`` / ``engine.forward`` run the module without autograd; ``engine.generate``
    is the module's ``generate`` with the ``max_out_tokens`` check; other attributes fall
    through to the module. ``mp_world_size`` is the tensor-parallel size and ``mp_group`` its
    process group (None at tp 1), as in DeepSpeed."""

    def __init__(self, model: nn.Module, config: InferenceConfig | dict | None = None) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"init_inference needs a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(config, InferenceConfig):
            config = parse_inference_config(dict(config or {}))
        self.module = model
        self._config = config
        # DeepSpeed keeps the model's config under this name (its _get_model_config_generate).
        self.config = getattr(model, "config", None) if config.config is None else config.config
        self.dtype = config.torch_dtype
        self.mpu = None
        self.checkpoint = config.checkpoint
        self.host_stream = None
        self._is_compiled = False
        self._decode_caches: dict[int, Any] | None = None  # batch -> the reference GPT's reused KV cache
        self._static_decoder = None  # enable_cuda_graph on a Hugging Face model (partita/inference/static_decode.py)
        self._fallbacks_logged: set[str] = set()
        self._build(model, config)

    # ------------------------------------------------------------------ building

    def _build(self, model: nn.Module, cfg: InferenceConfig) -> None:
        from partita.distributed.init import current_device
        from partita.inference.parallel import build_inference_topology, split_model
        from partita.zero.freed import is_freed

        if any(p.is_meta for p in model.parameters()):
            raise ConfigError("init_inference: the model has parameters on the meta device; build it on the CPU (its "
                              "weights are then replaced by checkpoint=...)")
        if any(is_freed(p) for p in model.parameters()):
            raise ConfigError(
                "init_inference: the model's parameters are ZeRO-3 shards (a training engine's module, or a model built "
                "under partita.zero.Init); generate from the training engine (engine.generate / engine.module.generate), "
                "or build the model plainly and pass checkpoint=<the engine's save_checkpoint dir>")
        tp = cfg.tp_size
        if cfg.enable_cuda_graph and tp > 1:
            raise ConfigError(f"enable_cuda_graph with tensor_parallel.tp_size = {tp} is not supported yet (DeepSpeed "
                              "refuses it too): capturing the tensor-parallel all-reduces in CUDA graphs is not verified yet; "
                              "use tp_size 1 with enable_cuda_graph, or tp_size > 1 without it")
        if cfg.enable_cuda_graph and cfg.streams_weights:
            raise ConfigError("enable_cuda_graph with zero.offload_param (weights streamed from host memory) is not "
                              "possible: each block's weights are copied in by hooks, which a CUDA graph cannot replay; "
                              "set one of them off")
        device = current_device()
        self.device = device
        self.topology = build_inference_topology(tp, device)  # refuses a tp_size the launch cannot hold
        if self.dtype is not torch.int8:
            model.to(dtype=self.dtype)
        self.mp_world_size = tp
        self.mp_group = self.topology.tensor_group if self.topology is not None and tp > 1 else None
        resident = device.type == "cuda" and not cfg.keep_module_on_host and not cfg.streams_weights
        if tp > 1:
            if device.type == "cuda" and not resident:
                raise ConfigError("tensor_parallel.tp_size > 1 with keep_module_on_host or zero.offload_param is not "
                                  "supported yet on GPUs: the split broadcasts through NCCL from the GPU; keep the module "
                                  "on the GPU (drop those keys) or use tp_size 1")
            if resident:
                model.to(device)  # NCCL broadcasts GPU tensors: the split runs on the device
            split_model(model, self.topology, cfg.injection_policy)
        if cfg.checkpoint is not None:
            from partita.inference.checkpoint import load_weights

            logger.info("init_inference: loaded %s",
                        load_weights(model, cfg.checkpoint, base_dir=cfg.base_dir, training_mp_size=cfg.training_mp_size))
        if resident:
            model.to(device)
        if cfg.quant_bits is not None:
            from partita.inference.quantize import quantize_weights

            # Streamed weights stay on the host but are packed for the device whose kernels use them.
            quantize_weights(model, bits=cfg.quant_bits, group_size=cfg.quant.weight.group_size,
                             device=device if cfg.streams_weights else None)
        if cfg.streams_weights:
            from partita.inference.host_stream import HostStreamedWeights

            offload = cfg.zero.offload_param
            self.host_stream = HostStreamedWeights(model, device, prefetch=offload.prefetch, pin_memory=offload.pin_memory)
        model.eval()
        if cfg.enable_cuda_graph:
            self._compile_decoding(model, device)
        logger.info("init_inference: %s on %s", describe(cfg), device)

    def _compile_decoding(self, model: nn.Module, device: torch.device) -> None:
        if device.type != "cuda":
            warnings.warn(
                f"init_inference: enable_cuda_graph=True has no effect on {device.type} (CUDA graphs need a CUDA "
                "device); decoding runs eagerly, as DeepSpeed does off CUDA", stacklevel=4)
            return
        self._enable_compiled_decoding()

    def _enable_compiled_decoding(self, **options: Any) -> None:
        """Compile the decoding (``options``: enable_compiled_decoding's; tests pass the eager backend)."""
        from partita.inference.compiled import enable_compiled_decoding

        what, self._static_decoder = enable_compiled_decoding(self.module, max_out_tokens=self._config.max_out_tokens,
                                                             **options)
        logger.info("init_inference: %s", what)
        if callable(getattr(self.module, "new_kv_cache", None)):
            # The reference GPT: one cache per batch size, reused by every generate call, so the
            # captured decode graph's buffers keep their addresses (no re-capture per call).
            self._decode_caches = {}

    def _decode_cache(self, batch: int) -> Any:
        if batch not in self._decode_caches:
            size = min(self._config.max_out_tokens, self.module.config.block_size)
            self._decode_caches[batch] = self.module.new_kv_cache(size)
        return self._decode_caches[batch]

    # ------------------------------------------------------------------ DeepSpeed's surface

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return self.module(*inputs, **kwargs)

    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """The module's ``generate`` (Hugging Face's, or the reference GPT's); refuses a call
        whose prompt plus new tokens exceed ``max_out_tokens``."""
        if not callable(getattr(self.module, "generate", None)):
            raise AttributeError(f"{type(self.module).__name__} has no generate(); call the engine (its forward) instead")
        self._check_length(inputs, kwargs)
        prompt = kwargs.get("input_ids", kwargs.get("idx", inputs[0] if inputs else None))
        if self._decode_caches is not None and "kv_cache" not in kwargs and isinstance(prompt, torch.Tensor):
            kwargs["kv_cache"] = self._decode_cache(prompt.shape[0])
        if self._static_decoder is not None:
            from partita.inference.static_decode import unsupported_reason

            call = dict(kwargs)
            if inputs:  # generate(input_ids, ...), Hugging Face's positional form
                call["input_ids"], rest = inputs[0], inputs[1:]
                if rest:
                    call["_positional"] = rest
            reason = unsupported_reason(call, getattr(self.module, "generation_config", None))
            if reason is None:
                return self._static_decoder.generate(**call)
            if reason not in self._fallbacks_logged:
                self._fallbacks_logged.add(reason)
                logger.info("init_inference: this generate call runs the model's own generate, eagerly (%s)", reason)
        with torch.no_grad():
            return self.module.generate(*inputs, **kwargs)

    def _check_length(self, inputs: tuple, kwargs: dict) -> None:
        prompt = kwargs.get("input_ids", kwargs.get("idx", inputs[0] if inputs else None))
        if not isinstance(prompt, torch.Tensor):
            return
        length = prompt.shape[-1]
        new = kwargs.get("max_new_tokens", inputs[1] if len(inputs) > 1 and isinstance(inputs[1], int) else None)
        total = None if new is None else length + new
        if total is None and kwargs.get("max_length") is not None:
            total = kwargs["max_length"]
        if total is None:
            gen = kwargs.get("generation_config") or getattr(self.module, "generation_config", None)
            if gen is not None and getattr(gen, "max_new_tokens", None) is not None:
                new = gen.max_new_tokens
                total = length + new
            elif gen is not None and getattr(gen, "max_length", None) is not None:
                total = max(gen.max_length, length)
        limit = self._config.max_out_tokens
        if total is not None and total > limit:
            asked = f"{length} prompt + {new} new" if new is not None else f"max_length {total}, prompt {length}"
            raise ValueError(
                f"generate asks for {total} tokens ({asked}) but max_out_tokens is {limit}; pass "
                f"max_out_tokens={total} (DeepSpeed's max_tokens) to init_inference, or ask for fewer tokens")

    def compile(self, backend: str = "inductor", compile_kwargs: dict | None = None) -> None:
        """DeepSpeed's ``engine.compile``: ``torch.compile`` the module in place (once)."""
        if self._is_compiled:
            return
        self.module.compile(backend=backend, **(compile_kwargs or {}))
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        return self._is_compiled

    @property
    def tp_rank(self) -> int:
        """This rank's index on the tensor axis (0 at tp 1)."""
        return self.topology.tensor_rank if self.topology is not None else 0

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in {"module", "__setstate__"}:
                raise
        return getattr(self.module, name)
