"""Tensor parallelism over the topology's ``tensor`` axis (Megatron's column/row layout).

``apply_tensor_parallel(model, group=..., plan={...})`` splits a model by a plan of module-name
patterns; ``initialize`` applies it from the ``tensor_parallel`` config section
(:func:`partita.tensor_parallel.setup.apply_config`).
"""

from partita.tensor_parallel.apply import Style, TensorParallelPlan, apply_tensor_parallel
from partita.tensor_parallel.layers import TensorShard, tensor_shard_of

__all__ = ["Style", "TensorParallelPlan", "TensorShard", "apply_tensor_parallel", "tensor_shard_of"]
