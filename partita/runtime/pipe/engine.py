"""``deepspeed.runtime.pipe.engine.PipelineEngine``: partita's :class:`partita.pipe.engine.PipelineEngine`,
what ``partita.initialize`` returns for a PipelineModule (``train_batch``, ``eval_batch``).

Subclassing it to replace DeepSpeed's instruction handlers (``_exec_forward_pass``,
``_exec_backward_pass``, ... as Megatron-DeepSpeed's zero-bubble engine does) has no effect:
partita's engine runs torch.distributed.pipelining schedules, chosen by the config's
``pipeline.schedule`` (``"zero_bubble"`` among them).
"""

from partita.pipe.engine import PipelineEngine

__all__ = ["PipelineEngine"]
