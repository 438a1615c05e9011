"""Parameter gradient hooks that do not keep their owner alive.

Why: ``Tensor.register_post_accumulate_grad_hook`` stores the hook where autograd's C++ node holds
it, out of reach of Python's cycle collector. A hook that is a bound method of the reducer (or the
ZeRO-3 gatherer, or the one-rank weight manager) then makes every parameter hold that object,
which holds the parameter groups, their fp32 masters and the optimizer states: a cycle the
collector cannot see, so an engine that was dropped kept all of it (GPU memory included) for the
life of the process. Here the parameter holds only a weak reference to the method's object: once
the engine is gone, the hook is a no-op and everything it served is freed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["register_weak_grad_hook"]


def register_weak_grad_hook(param: torch.Tensor, method: Callable[[torch.Tensor], None]) -> RemovableHandle:
    """``param.register_post_accumulate_grad_hook(method)`` for a bound ``method``, holding its
    object weakly (a no-op once that object is collected)."""
    ref = weakref.WeakMethod(method)

    def hook(tensor: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(tensor)

    return param.register_post_accumulate_grad_hook(hook)
