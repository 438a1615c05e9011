"""``deepspeed.runtime.zero``: ``Init``, ``GatheredParameters``, ``register_external_parameter``
(from :mod:`partita.runtime.zero.partition_parameters`, itself partita's :mod:`partita.zero`)."""

from partita.runtime.zero.partition_parameters import (
    GatheredParameters,
    Init,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = ["GatheredParameters", "Init", "register_external_parameter", "unregister_external_parameter"]

from partita.runtime._missing import submodules  # noqa: E402

# stage_1_and_2, stage3, offload_config, config, partition_parameters: on first use.
__getattr__ = submodules(__name__)
