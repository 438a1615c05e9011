"""``deepspeed.runtime.bf16_optimizer``: ``BF16_Optimizer`` is refused. partita has no separate
bf16 optimizer wrapper: with ``"bf16": {"enabled": true}`` the ZeRO optimizer at every stage
(0-3) keeps the fp32 masters and steps them (``engine.optimizer``)."""

from partita.runtime._missing import refuse

__all__: list[str] = []

MISSING = {
    "BF16_Optimizer": (
        "deepspeed.runtime.bf16_optimizer.BF16_Optimizer is not in partita: with \"bf16\": {\"enabled\": true} the "
        "ZeRO optimizer at every stage (zero_optimization.stage 0-3) keeps fp32 masters and steps them; use "
        "engine.optimizer, and engine.get_fp32_state_dict() for the fp32 weights"
    ),
}

__getattr__ = refuse(__name__, MISSING)
