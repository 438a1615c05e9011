"""Per-rank memory estimates for partita training runs, and the fastest setup that fits.

``estimate_memory(model, setup)`` predicts accelerator, CPU and NVMe bytes per rank, split
into parameters, gradients, optimizer states (fp32 master included), activations and
buffers. Model states are derived from partita's own layout rules and match its allocation
exactly; activations use a formula for partita's reference GPT (validated against measured
saved-tensor bytes); buffers are upper estimates. ``MemoryEstimate.reserved_accelerator`` adds
the CUDA caching allocator's rounding and fragmentation (:mod:`partita.estimate.allocator`).
``recommend_config(model, "141GB")`` walks the setups from fastest to slowest and returns the
first whose predicted reserved memory fits, with the reasons.
The ``partita estimate`` command is the same from a shell.
"""

from partita.estimate.core import estimate_memory
from partita.estimate.inputs import STAGING_BYTES, Checkpointing, EstimateError, GPTShape, Setup, parse_bytes
from partita.estimate.recommend import Recommendation, recommend_config
from partita.estimate.result import Line, MemoryEstimate

__all__ = [
    "STAGING_BYTES",
    "Checkpointing",
    "EstimateError",
    "GPTShape",
    "Line",
    "MemoryEstimate",
    "Recommendation",
    "Setup",
    "estimate_memory",
    "parse_bytes",
    "recommend_config",
]
