"""``deepspeed.runtime.zero``: ``Init``, ``GatheredParameters``, ``register_external_parameter``
(from :mod:`partita.runtime.zero.partition_parameters`, itself partita's :mod:`partita.zero`)."""

from partita.runtime.zero.partition_parameters import (
    GatheredParameters,
    Init,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = ["GatheredParameters", "Init", "register_external_parameter", "unregister_external_parameter"]
