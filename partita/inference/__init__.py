"""Inference: ``partita.init_inference`` (DeepSpeed's ``deepspeed.init_inference``).

    engine = partita.init_inference(model, tensor_parallel={"tp_size": 2}, dtype=torch.bfloat16,
                                    checkpoint="runs/ckpt", enable_cuda_graph=True)
    tokens = engine.generate(input_ids, max_new_tokens=64)

The engine runs the model's own modules, split across tensor ranks by the AutoTP plans training
uses, loads a partita training checkpoint saved at any layout at the requested tp_size, and can
quantize weights (int8/int4, torchao), stream them from host memory (ZeRO-Inference) and decode
under torch.compile with CUDA graphs. See docs/guides/init-inference.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["InferenceConfig", "InferenceEngine", "default_inference_config", "init_inference"]

_LAZY = {
    "init_inference": ("partita.inference.engine", "init_inference"),
    "InferenceEngine": ("partita.inference.engine", "InferenceEngine"),
    "InferenceConfig": ("partita.inference.config", "InferenceConfig"),
    # DeepSpeed's name of the config class.
    "DeepSpeedInferenceConfig": ("partita.inference.config", "InferenceConfig"),
    "default_inference_config": ("partita.inference.config", "default_inference_config"),
}


def __getattr__(name: str) -> Any:
    # Lazy: importing partita.inference (H4's quantize / host_stream live here too) stays cheap.
    if name in _LAZY:
        import importlib

        module, attribute = _LAZY[name]
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'partita.inference' has no attribute {name!r}")
