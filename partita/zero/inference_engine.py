"""The engine ``initialize`` returns for ZeRO-Inference (ZeRO-3, no optimizer): forward and generate.

Everything that reads the model works as on a training engine: ``engine(...)``, ``engine.generate``
and ``engine.module.generate`` (partita/zero/generation.py), ``GatheredParameters`` for reading,
``save_16bit_model``. What needs an optimizer refuses with the fix (see [Note: inference-only
ZeRO-3] in partita/zero/inference.py).
"""

from __future__ import annotations

from typing import Any

import torch

from partita.config import ConfigError
from partita.engine import Engine

_FIX = (
    "this engine was built for inference only (ZeRO stage 3 with no optimizer: ZeRO-Inference); to train, "
    "add an \"optimizer\" section to the config (e.g. {\"type\": \"AdamW\", \"params\": {\"lr\": 3e-4}}) or "
    "pass optimizer=... to partita.initialize"
)


def refuse(what: str) -> ConfigError:
    return ConfigError(f"{what}: {_FIX}")


class ZeroInferenceEngine(Engine):
    """A ZeRO-3 engine without optimizer, gradient reducer or fp32 masters."""

    def finish_pending_step(self) -> None:
        """No optimizer: no update can be pending."""

    def destroy(self) -> None:
        """Release the offloaded shards (pinned buffers, swap files) and undo ``module.generate``."""
        from partita.zero.generation import uninstall_generate

        uninstall_generate(self.module, self._generate_wrapper)
        if self.zero.gatherer is not None:
            self.zero.gatherer.close()
        self._step_log.close()

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> torch.Tensor:
        raise refuse("engine.backward()")

    def step(self) -> None:
        raise refuse("engine.step()")

    def zero_grad(self) -> None:
        raise refuse("engine.zero_grad()")

    def get_lr(self) -> list[float]:
        raise refuse("engine.get_lr()")

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> bool:
        raise refuse("engine.save_checkpoint() (a training checkpoint holds optimizer state; "
                     "engine.save_16bit_model() writes the weights)")

    def load_checkpoint(self, *args: Any, **kwargs: Any):
        raise ConfigError(
            "engine.load_checkpoint() on an inference-only engine: load the weights into the model before "
            "partita.initialize (model.load_state_dict, from_pretrained), or use partita.init_inference("
            "model, checkpoint=...), which reads partita training checkpoints at any layout"
        )

    def get_fp32_state_dict(self, rank0_only: bool = True) -> dict:
        raise refuse("engine.get_fp32_state_dict() (there are no fp32 masters; engine.save_16bit_model() "
                     "exports the weights)")
