"""The estimator's vocabulary: the kinds of tensor, the devices they live on, and the phases of
a training step in which they exist (see :mod:`partita.estimate.result`).

Both the result (:class:`~partita.estimate.result.MemoryEstimate`) and its report tables read
these, so they sit below both.
"""

__all__ = ["ALWAYS", "BACKWARD", "CATEGORIES", "DEVICES", "END_BACKWARD", "PHASES", "START_BACKWARD", "STEP",
           "WRITE_BACK"]

CATEGORIES = ("parameters", "gradients", "optimizer states", "activations", "buffers")
DEVICES = ("accelerator", "cpu", "nvme")
START_BACKWARD = "start of backward"  # every activation saved, plus the loss gradients
BACKWARD = "during backward"  # activations being freed while gradients are reduced
END_BACKWARD = "end of backward"  # gradients folded into the fp32 partition
STEP = "optimizer step"
WRITE_BACK = "weight all-gather after the step"
PHASES = (START_BACKWARD, BACKWARD, END_BACKWARD, STEP, WRITE_BACK)
ALWAYS = frozenset(PHASES)
