"""``deepspeed.runtime.zero.partition_parameters``: where DeepSpeed defines ``zero.Init``.

Hugging Face Transformers and other libraries import ``Init``, ``GatheredParameters`` and
``register_external_parameter`` from this path. They are partita's (:mod:`partita.zero`):
``Init`` builds a model already sharded for ZeRO-3, ``GatheredParameters`` makes sharded
parameters whole for a block of code, ``register_external_parameter`` is described in
:mod:`partita.zero.external`.
"""

from partita.zero import GatheredParameters, Init
from partita.zero.external import register_external_parameter, unregister_external_parameter

__all__ = ["GatheredParameters", "Init", "register_external_parameter", "unregister_external_parameter"]
