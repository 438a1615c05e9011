"""The host AdamW step that reads 16-bit gradients: one ``torch.compile``d pass over flat
(fp32 master, fp32 ``exp_avg``, fp32 ``exp_avg_sq``, bf16/fp16/fp32 gradient) tensors.

Why: the offloaded (ZeRO-Offload) step is held by the host's memory bandwidth. torch's fused
CPU AdamW needs every tensor in one dtype, so a bf16 gradient had to sit in a host fp32 buffer
(4 bytes written by the copy engine, 4 read by the step, and 4 written *back* by the kernel
when it unscales in place). Here the gradient is read as it came down (2 bytes) and upcast in
registers; inductor's C++ backend vectorises the element-wise graph, so no hand-written kernel.

Exactness: the result is bit-identical to ``torch.optim.AdamW(fused=True)`` on the same values
with the gradient upcast to fp32 (and its ``grad_scale``), i.e. to today's host step, on
every element (the last ``len % 64`` elements, which hold those that kernel steps in a scalar
loop that rounds differently, are handed to torch's kernel itself). The rest it steps by doing
the kernel's operations in the kernel's order and precision:

- the scalars are computed in Python float64 and rounded to fp32 once, as the kernel's
  ``scalar_t(double)`` casts do, and passed as 0-d tensors (a new lr does not recompile);
- ``exp_avg.lerp_(grad, 1 - beta1)`` is one fused multiply-add in the kernel, and so is the last
  multiply-add of ``exp_avg_sq * beta2 + (1 - beta2) * g * g`` (contracted by the compiler
  that built torch; found by comparing bits). Inductor's CPU
  backend has no FMA (it compiles with ``-ffp-contract=off``), so the FMA is emulated exactly:
  the product of two fp32 values is exact in fp64, the fp64 sum's rounding error is recovered
  with TwoSum, and the one case where rounding that sum to fp32 is a double rounding (the sum
  is exactly an fp32 midpoint, the exact value is not) is detected and resolved by the error's sign;
- every other operation is one IEEE fp32 operation, which inductor keeps as written
  (``-fno-unsafe-math-optimizations``, no contraction).

``tests/test_host_adamw_bf16.py`` checks the bit-identity, over 5 steps with a changing lr,
weight decay and a grad scale, against torch's fused kernel and within fp32 rounding of the
plain (for-loop) ``torch.optim.AdamW``. Which multiply-adds torch's kernel contracts is a
property of the torch build and its CPU dispatch (measured: torch 2.13 wheel, AVX-512): on
another, run that test there; a mismatch shows as last-bit differences, not as wrong training.
"""

from __future__ import annotations

import math
import threading
import warnings

import torch

# Compiled once per (gradient dtype, lerp branch); sizes are symbolic (dynamic=True), so a
# new flat-buffer length does not recompile.
_COMPILED: dict[tuple, object] = {}
_LOCK = threading.Lock()
GRAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Elements before the tail handed to torch's kernel: a multiple of every CPU SIMD width.
TAIL_ALIGN = 64


def _fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` rounded once to fp32 (a, b, c fp32), as ``vec::fmadd`` does.

    In fp64 the product is exact (24 + 24 bits < 53) and the sum's rounding error is exact
    (TwoSum; inductor does not reassociate). Rounding that fp64 sum to fp32 gives the fp32 FMA's
    result except when the sum landed exactly on a midpoint between two fp32 values while the
    exact value is off it (the double rounding): then the error's sign picks the right side.
    Only arithmetic, compares and selects: inductor vectorises all of it (bit casts it does not)."""
    product = a.to(torch.float64) * b.to(torch.float64)
    addend = c.to(torch.float64)
    total = product + addend
    back = total - product
    error = (product - (total - back)) + (addend - back)
    near = total.to(torch.float32).to(torch.float64)
    # ``total`` is a midpoint iff the reflection of ``near`` across it, 2 total - near, is the other
    # fp32 neighbour (exact: Sterbenz); no other point between two neighbours mirrors onto one.
    # Then the exact value lies on the other neighbour's side iff the error has the sign of
    # total - near (never when the error is 0: ties stay ties-to-even, as in the FMA).
    mirror = 2 * total - near
    other = mirror.to(torch.float32).to(torch.float64)
    # Nested selects on fp64 only: combining masks (&) or selecting fp32 values under fp64 masks
    # made inductor's vector code 4x slower (measured at 2^24 elements, one thread).
    return torch.where(other == mirror, torch.where(error * (total - near) > 0, other, near), near).to(torch.float32)


def _adamw_update(param, exp_avg, exp_avg_sq, grad, grad_scale, decay, lerp_weight, beta2, one_minus_beta2,
                  bias_correction2_sqrt, eps, neg_step_size, *, lerp_from_grad: bool) -> None:
    g = grad.to(torch.float32) / grad_scale
    p = param * decay
    m = exp_avg
    # The kernel's lerp: m + w (g - m) for |w| < 0.5, else g + (w - 1)(g - m); lerp_weight is the
    # fp32 coefficient (w or w - 1) of whichever branch.
    m_new = _fma_f32(lerp_weight, g - m, g if lerp_from_grad else m)
    # The kernel's ``v * beta2 + (1 - beta2) * g * g`` is compiled with contraction: the last
    # multiply and the add are one FMA there (measured: bit-identical only this way).
    v_new = _fma_f32(one_minus_beta2 * g, g, exp_avg_sq * beta2)
    denom = torch.sqrt(v_new) / bias_correction2_sqrt + eps
    p_new = p + neg_step_size * m_new / denom
    exp_avg.copy_(m_new)
    exp_avg_sq.copy_(v_new)
    param.copy_(p_new)


def _compiled(grad_dtype: torch.dtype, lerp_from_grad: bool):
    key = (grad_dtype, lerp_from_grad)
    if key in _COMPILED:
        return _COMPILED[key]  # None: it failed to compile
    with _LOCK:
        fn = _COMPILED.get(key)
        if key not in _COMPILED:
            def update(*args):
                _adamw_update(*args, lerp_from_grad=lerp_from_grad)

            fn = torch.compile(update, fullgraph=True, dynamic=True)
            _COMPILED[key] = fn
    return fn


_COMPILED_OK: dict[tuple, bool] = {}


def _first_call(update, args, key) -> None:
    """The first call compiles; where that fails (no C++ compiler on the host, an unsupported
    platform), warn once and let torch's fused kernel step everything on an fp32 copy of the
    gradient: exactly the same values, without the byte saving."""
    try:
        update(*args)
        _COMPILED_OK[key] = True
    except Exception as error:  # noqa: BLE001 - inductor raises many kinds; the fallback is exact
        warnings.warn(f"partita: the compiled host AdamW for {key[0]} gradients did not compile "
                      f"({type(error).__name__}: {str(error)[:200]}); stepping on an fp32 copy of the "
                      "gradients with torch's fused AdamW instead (same results, more host memory traffic)",
                      RuntimeWarning, stacklevel=3)
        _COMPILED[key] = None


def _f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


@torch.no_grad()
def host_adamw_step(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, *,
                    step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                    grad_scale: torch.Tensor | float | None = None) -> None:
    """One AdamW step, in place, over flat CPU tensors: ``param``, ``exp_avg`` and
    ``exp_avg_sq`` fp32, ``grad`` bf16, fp16 or fp32 (read, never written).

    ``step`` is the step number after this one (1 on the first step), as torch's ``state["step"]``
    after its increment. ``grad_scale``: the gradients are divided by it first (the loss scale
    times the clip divisor; torch's fused ``grad_scale``). Decoupled weight decay as AdamW;
    no amsgrad, no maximize.
    """
    _check(param, exp_avg, exp_avg_sq, grad, step)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = math.sqrt(1 - beta2**step)
    lerp_weight = 1 - beta1
    lerp_from_grad = not abs(lerp_weight) < 0.5
    coefficient = _f32(lerp_weight)
    if lerp_from_grad:
        coefficient = coefficient - 1  # fp32, as the kernel's ``lerp_weight - Vec(1)``
    if grad_scale is None:
        grad_scale = 1.0
    scale = grad_scale.to(torch.float32) if isinstance(grad_scale, torch.Tensor) else _f32(grad_scale)
    body = param.numel() - param.numel() % TAIL_ALIGN
    update = _compiled(grad.dtype, lerp_from_grad) if body else None
    if update is not None:
        args = (param[:body], exp_avg[:body], exp_avg_sq[:body], grad[:body], scale.reshape(()),
                _f32(1 - lr * weight_decay), coefficient, _f32(beta2), _f32(1 - beta2), _f32(bias_correction2_sqrt),
                _f32(eps), _f32(-(lr / bias_correction1)))
        if _COMPILED_OK.get((grad.dtype, lerp_from_grad)):
            update(*args)
        else:
            _first_call(update, args, (grad.dtype, lerp_from_grad))
        if _COMPILED.get((grad.dtype, lerp_from_grad)) is None:  # it could not compile: torch's kernel steps all
            body = 0
    if body < param.numel():
        # The fused kernel steps the last len % (SIMD width) elements in a scalar loop that rounds
        # differently; torch's own kernel steps this tail (< 64 elements, an fp32 copy of the
        # grad: it unscales in place), so the whole call stays bit-identical to it.
        torch._fused_adamw_(
            [param[body:]], [grad[body:].to(torch.float32)], [exp_avg[body:]], [exp_avg_sq[body:]], [],
            [torch.tensor(float(step), dtype=torch.float32)], lr=lr, beta1=beta1, beta2=beta2,
            weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False, grad_scale=scale.reshape(()),
            found_inf=None,
        )


def _check(param, exp_avg, exp_avg_sq, grad, step) -> None:
    for name, tensor in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if tensor.dtype != torch.float32 or tensor.device.type != "cpu" or tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError(f"host_adamw_step: {name} must be a flat contiguous fp32 CPU tensor, got "
                             f"{tensor.dtype} {tuple(tensor.shape)} on {tensor.device}")
        if tensor.numel() != param.numel():
            raise ValueError(f"host_adamw_step: {name} has {tensor.numel()} elements, param {param.numel()}")
    if grad.dtype not in GRAD_DTYPES or grad.device.type != "cpu" or grad.shape != param.shape or not grad.is_contiguous():
        raise ValueError(f"host_adamw_step: grad must be a flat contiguous bf16/fp16/fp32 CPU tensor shaped like "
                         f"param {tuple(param.shape)}, got {grad.dtype} {tuple(grad.shape)} on {grad.device}")
    if step < 1:
        raise ValueError(f"host_adamw_step: step is the count after this step (>= 1), got {step}")
