"""``deepspeed.runtime.pipe.schedule``: DeepSpeed's instruction-level pipeline schedules, refused.

DeepSpeed's PipelineEngine executes lists of instructions (``LoadMicroBatch``, ``ForwardPass``,
``SendActivation``, ...) that a ``PipeSchedule`` subclass yields; Megatron-DeepSpeed writes its
own schedules that way. partita's pipeline engine runs torch.distributed.pipelining's schedules
instead, so none of these names has a partita counterpart: pick the schedule with the config's
``pipeline.schedule``.
"""

from partita.runtime._missing import refuse

__all__: list[str] = []

_WHY = (
    "is not in partita: its pipelines run torch.distributed.pipelining schedules chosen by the config's "
    "pipeline.schedule (\"1f1b\" as DeepSpeed's TrainSchedule, \"gpipe\", \"interleaved_1f1b\", \"zero_bubble\"); "
    "instruction-level schedules (PipeSchedule subclasses yielding PipeInstruction lists) cannot be plugged in"
)

NAMES = ("PipeSchedule", "TrainSchedule", "InferenceSchedule", "DataParallelSchedule", "PipeInstruction",
         "OptimizerStep", "ReduceGrads", "ReduceTiedGrads", "BufferOpInstruction", "LoadMicroBatch", "ForwardPass",
         "BackwardPass", "SendActivation", "RecvActivation", "SendGrad", "RecvGrad")

MISSING = {name: f"deepspeed.runtime.pipe.schedule.{name} {_WHY}" for name in NAMES}

__getattr__ = refuse(__name__, MISSING)
