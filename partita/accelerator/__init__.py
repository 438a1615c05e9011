"""DeepSpeed's ``deepspeed.accelerator`` under partita's name: ``get_accelerator()``.

    from partita.accelerator import get_accelerator
    device = get_accelerator().device_name(engine.local_rank)   # "cuda:0", or "cpu"

partita itself runs on CUDA or the CPU, so there are two accelerators
(:mod:`partita.accelerator.real_accelerator`).
"""

from partita.accelerator.real_accelerator import (
    Accelerator,
    CpuAccelerator,
    CudaAccelerator,
    get_accelerator,
    is_current_accelerator_supported,
    set_accelerator,
)

DeepSpeedAccelerator = Accelerator  # DeepSpeed's name for the base class

__all__ = [
    "Accelerator",
    "CpuAccelerator",
    "CudaAccelerator",
    "DeepSpeedAccelerator",
    "get_accelerator",
    "is_current_accelerator_supported",
    "set_accelerator",
]
