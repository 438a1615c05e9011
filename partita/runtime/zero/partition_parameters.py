"""``deepspeed.runtime.zero.partition_parameters``: where DeepSpeed defines ``zero.Init``.

Hugging Face Transformers and other libraries import ``Init``, ``GatheredParameters`` and
``register_external_parameter`` from this path. They are partita's (:mod:`partita.zero`):
``Init`` builds a model already sharded for ZeRO-3, ``GatheredParameters`` makes sharded
parameters whole for a block of code, ``register_external_parameter`` is described in
:mod:`partita.zero.external`. ``ZeroParamStatus`` is refused: partita records no ``ds_status``
on parameters.
"""

from partita.runtime._missing import refuse
from partita.zero import GatheredParameters, Init
from partita.zero.external import register_external_parameter, unregister_external_parameter

__all__ = ["GatheredParameters", "Init", "register_external_parameter", "unregister_external_parameter"]

MISSING = {
    "ZeroParamStatus": (
        "deepspeed.runtime.zero.partition_parameters.ZeroParamStatus is not in partita: partita puts no ds_id / "
        "ds_status attributes on parameters (their state is kept by the engine), so code that picks parameters by "
        "p.ds_status would pick none; gather with partita.zero.GatheredParameters(params) (parameters that are "
        "already whole are left as they are)"
    ),
}

__getattr__ = refuse(__name__, MISSING)
