"""``deepspeed.runtime.data_pipeline.data_routing.helper``: random-LTD's model converters, refused
(Megatron-DeepSpeed's training loop and DeepSpeedExamples' data-efficiency examples import them)."""

from partita.runtime._missing import refuse
from partita.runtime.data_pipeline import _WHY

__all__: list[str] = []

MISSING = {
    name: f"deepspeed.runtime.data_pipeline.data_routing.helper.{name} (random-LTD) is not in partita: {_WHY}"
    for name in ("convert_to_random_ltd", "save_without_random_ltd", "remove_random_ltd_state_dict")
}

__getattr__ = refuse(__name__, MISSING)
