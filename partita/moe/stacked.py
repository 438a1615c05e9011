"""Local experts' parameters as rows of one stacked storage, and the expert GEMMs that read them.

Each local expert is a real instance of the user's expert class (DeepSpeed's layout, see
partita/moe/experts.py), but its parameters are *views*: parameter ``name`` of local expert
``j`` is row ``j`` of one ``(num_local, *shape)`` tensor allocated for that name. So the
grouped GEMM reads every expert's weight as one 3-D tensor with no per-forward copy, while
autograd, ZeRO, the optimizer and checkpoints see ordinary per-expert leaf parameters.

Why the GEMMs are autograd functions of their own (:func:`expert_linear`): gradients must
reach each expert's parameter (a leaf), not a stacked tensor that is no parameter. The
function takes the per-expert weights as inputs, builds the stacked view from them, and in
backward returns one gradient row per expert (views of one stacked gradient, no copy). It
saves the expert parameters themselves for backward, never a stacked tensor, so:

- when the rows are no longer one storage (ZeRO-3 gives every parameter a storage of its own
  and frees it between uses; ``load_state_dict(assign=True)``), the stacked weight is copied
  together for the GEMM and dropped right after, in forward and again in backward: correct,
  one copy of the layer's local expert weights each way, and no extra memory held from
  forward to backward (ZeRO-3's freeing of the parameters is not defeated);
- in every other case (plain torch, ZeRO 0-2, after ``.to()``/``.half()``, which re-stack the
  rows: see ``Experts._apply``) the stacked weight is a view: no copy at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

__all__ = ["RowsCache", "RowsLayout", "allocate_rows", "expert_linear", "find_layout", "rows_view",
           "stack_params", "SEPARATE"]


def allocate_rows(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One ``(n, *shape)`` storage filled with ``tensors`` (same shape, dtype, device); its rows.

    Copies through ``copy_`` (an op ``partita.zero.Init``'s dispatch mode sees: a sharded
    template parameter is gathered for the copy)."""
    first = tensors[0]
    stacked = torch.empty((len(tensors), *first.shape), dtype=first.dtype, device=first.device)
    with torch.no_grad():
        for row, tensor in zip(stacked, tensors):
            row.copy_(tensor)
    return list(stacked.unbind(0))


@dataclass(frozen=True)
class RowsLayout:
    """Where ``n`` equally spaced rows of one storage sit: ``as_strided(size, stride, offset)``
    of the first row's storage is their stack. ``ptrs``: the rows' data pointers when verified."""

    ptrs: tuple[int, ...]
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


# What RowsCache answers for rows verified *not* to be one storage (their stack is a copy).
SEPARATE = RowsLayout((), (), (), -1)


def _ptrs(tensors: Sequence[torch.Tensor]) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in tensors)


def find_layout(tensors: Sequence[torch.Tensor]) -> RowsLayout | None:
    """The layout of ``tensors`` when they are equally spaced rows of one storage with equal
    shapes and strides (what :func:`allocate_rows` makes), None otherwise."""
    first = tensors[0]
    if first.untyped_storage().nbytes() == 0:  # freed (ZeRO-3): no rows to view
        return None
    step = tensors[1].storage_offset() - first.storage_offset() if len(tensors) > 1 else first.numel()
    if step < first.numel():  # overlapping or reversed rows are not a stack
        return None
    storage = first.untyped_storage()._cdata
    for j, tensor in enumerate(tensors):
        if (tensor.untyped_storage()._cdata != storage or tensor.shape != first.shape or tensor.dtype != first.dtype
                or tensor.stride() != first.stride() or tensor.storage_offset() != first.storage_offset() + j * step):
            return None
    return RowsLayout(_ptrs(tensors), (len(tensors), *first.shape), (step, *first.stride()), first.storage_offset())


class RowsCache:
    """Layouts verified once and then re-checked by the rows' data pointers only: verifying 64
    experts' parameters takes milliseconds of Python, the pointer check microseconds. The same
    pointers mean the same rows (a storage cannot be freed and its address reused while the
    rows in it are alive), and ``as_strided`` refuses any view past its storage's end."""

    def __init__(self) -> None:
        self._layouts: dict[str, RowsLayout | tuple[int, ...]] = {}

    def layout(self, key: str, tensors: Sequence[torch.Tensor]) -> RowsLayout:
        """The rows' layout, or :data:`SEPARATE`."""
        ptrs = _ptrs(tensors)
        known = self._layouts.get(key)
        if isinstance(known, RowsLayout) and known.ptrs == ptrs:
            return known
        if known == ptrs:  # verified before: not one storage
            return SEPARATE
        layout = find_layout(tensors)
        self._layouts[key] = layout if layout is not None else ptrs
        return layout if layout is not None else SEPARATE

    def clear(self) -> None:
        self._layouts.clear()


def rows_view(tensors: Sequence[torch.Tensor], layout: RowsLayout | None = None) -> torch.Tensor | None:
    """``torch.stack(tensors)`` as a view of their storage (no autograd), when they are rows of
    one (``layout`` if already known and still valid); None otherwise."""
    if layout is SEPARATE:
        return None
    if layout is None or layout.ptrs != _ptrs(tensors):
        layout = find_layout(tensors)
    if layout is None:
        return None
    return tensors[0].detach().as_strided(layout.size, layout.stride, layout.offset)


def _stacked(tensors: Sequence[torch.Tensor], layout: RowsLayout | None = None) -> torch.Tensor:
    view = rows_view(tensors, layout)
    return view if view is not None else torch.stack([t.detach() for t in tensors])


class _StackParams(torch.autograd.Function):
    """``torch.stack`` of per-expert parameters that is a view when they are rows of one storage
    (biases: what reads it saves nothing of it); the gradient goes back row by row."""

    @staticmethod
    def forward(ctx, layout: RowsLayout | None, *params: torch.Tensor) -> torch.Tensor:
        return _stacked(params, layout)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (None, *grad.unbind(0))


def stack_params(params: Sequence[torch.Tensor], layout: RowsLayout | None = None) -> torch.Tensor:
    """Differentiable ``(n, *shape)`` stack of ``params`` (a view of their storage when it can be)."""
    return _StackParams.apply(layout, *params)


def _grouped_mm():
    return getattr(F, "grouped_mm", None) or torch._grouped_mm


def _gemm_weight(weights: Sequence[torch.Tensor], grouped: bool, layout: RowsLayout | None) -> torch.Tensor:
    """The stacked weight for a GEMM; for the grouped matmul, whose operands need 16-byte aligned
    addresses and strides, a contiguous copy where the view is not (rows that ZeRO laid out
    inside its flat fp32 master with other parameters between them)."""
    w = _stacked(weights, layout)
    if grouped and ((w.stride(0) * w.element_size()) % 16 or w.data_ptr() % 16):
        w = w.contiguous()
    return w


class _ExpertLinear(torch.autograd.Function):
    """``y = x @ W_j^T`` per expert, with ``W`` the stacked weights of ``n`` experts.

    Grouped: ``x`` is ``(rows, in)`` sorted by expert, ``offs`` the int32 cumulative row counts
    (torch's grouped matmul). Batched: ``x`` is ``(n, tokens, in)``, ``offs`` None (``bmm``).
    Saves ``x`` and the expert parameters, never the stacked weight (see the module docstring).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, offs: torch.Tensor | None, layout: RowsLayout | None,
                *weights: torch.Tensor) -> torch.Tensor:
        w = _gemm_weight(weights, offs is not None, layout)  # (n, out, in)
        ctx.save_for_backward(x, offs, *weights)
        ctx.layout = layout  # checked again by the data pointers in backward
        if offs is None:
            return torch.bmm(x, w.transpose(1, 2))
        return _grouped_mm()(x, w.transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, offs, *weights = ctx.saved_tensors
        grad = grad.contiguous()  # grouped_mm rejects the stride-0 gradients of sum() / expand()
        w = _gemm_weight(weights, offs is not None, ctx.layout)
        grad_x = grad_w = None
        if offs is None:
            if ctx.needs_input_grad[0]:
                grad_x = torch.bmm(grad, w)
            if any(ctx.needs_input_grad[2:]):
                grad_w = torch.bmm(grad.transpose(1, 2), x)
        else:
            mm = _grouped_mm()
            if ctx.needs_input_grad[0]:
                grad_x = mm(grad, w, offs=offs)
            if any(ctx.needs_input_grad[2:]):
                # (out, rows) x (rows, in) split along rows: one (out, in) gradient per expert,
                # zeros for an expert without rows.
                grad_w = mm(grad.t(), x, offs=offs)
        del w
        rows = grad_w.unbind(0) if grad_w is not None else (None,) * len(weights)
        return (grad_x, None, None, *rows)


def expert_linear(x: torch.Tensor, weights: Sequence[torch.Tensor], layout: RowsLayout | None = None, *,
                  offs: torch.Tensor | None = None) -> torch.Tensor:
    """Per-expert ``F.linear`` without bias over ``weights`` (one ``(out, in)`` per expert): grouped
    rows with ``offs``, or a batched ``(n, tokens, in)`` input without. ``layout``: the weights'
    rows layout if known (:class:`RowsCache`), else found here."""
    return _ExpertLinear.apply(x, offs, layout, *weights)
