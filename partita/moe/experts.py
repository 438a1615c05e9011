"""A rank's local experts: one stacked parameter per expert parameter, expert index first.

DeepSpeed deep-copies the user's ``expert`` module once per local expert. Here the copies'
parameters are *stacked*: a parameter of shape ``s`` in ``expert`` becomes one parameter of
shape ``(num_local, *s)``, row ``j`` being local expert ``j``. Why:

- a checkpoint can key experts by global index with no renaming: local expert ``j`` of expert
  rank ``r`` is global expert ``r * num_local + j``, i.e. a contiguous range of the flattened
  ``(num_experts, *s)`` tensor, which partita's shard format already stores and reshards
  (see :mod:`partita.moe.registry`);
- MLP experts run as one grouped GEMM over the stacked weights (no per-forward stacking copy).

Any expert module without buffers works: it is run once per local expert through
``torch.func.functional_call`` with row ``j`` of every stacked parameter (views, no copies).
An :class:`ExpertMLP` (or ``nn.Sequential(Linear, <activation>, Linear)``) instead runs as
grouped GEMMs: ``torch.nn.functional.grouped_mm`` (torch >= 2.10; runs on CPU in torch 2.13 in
fp32 and bf16) when a one-time probe on this device and dtype succeeds and the widths meet its
16-byte stride rule, a loop of per-expert matmuls otherwise. Every local expert takes part in
every forward even with no tokens (an empty slice), so each gets a (zero) gradient and ZeRO's
reductions never wait for one that never comes.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ExpertMLP", "Experts", "grouped_mm_available"]


class ExpertMLP(nn.Module):
    """``fc2(activation(fc1(x)))``: the usual transformer MLP, recognised for grouped GEMMs."""

    def __init__(self, hidden_size: int, ffn_size: int, *, activation: str = "gelu", bias: bool = True) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation={activation!r}: choose one of {sorted(_ACTIVATIONS)}")
        self.fc1 = nn.Linear(hidden_size, ffn_size, bias=bias)
        self.fc2 = nn.Linear(ffn_size, hidden_size, bias=bias)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(_ACTIVATIONS[self.activation](self.fc1(x)))


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "identity": lambda x: x,
}
_ACTIVATION_MODULES: dict[type, str] = {nn.GELU: "gelu", nn.ReLU: "relu", nn.SiLU: "silu", nn.Identity: "identity"}


def _mlp_structure(expert: nn.Module) -> tuple[str, str, str] | None:
    """``(fc1 name, fc2 name, activation)`` when ``expert`` is a two-layer MLP we can group."""
    if isinstance(expert, ExpertMLP):
        return "fc1", "fc2", expert.activation
    if isinstance(expert, nn.Sequential) and len(expert) == 3:
        first, act, second = expert
        if (isinstance(first, nn.Linear) and isinstance(second, nn.Linear) and type(act) in _ACTIVATION_MODULES
                and (first.bias is None) == (second.bias is None)
                and not (isinstance(act, nn.GELU) and act.approximate != "none")):
            return "0", "2", _ACTIVATION_MODULES[type(act)]
    return None


_PROBED: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped matmul runs forward and backward here (probed once per device type/dtype)."""
    key = (device.type, dtype)
    if key not in _PROBED:
        fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
        ok = False
        if fn is not None:
            try:
                x = torch.randn(8, 8, device=device, dtype=dtype, requires_grad=True)
                w = torch.randn(2, 8, 8, device=device, dtype=dtype, requires_grad=True)
                y = fn(x, w, offs=torch.tensor([3, 8], dtype=torch.int32, device=device))
                y.backward(torch.ones_like(y))
                ok = bool(torch.allclose(y[:3].float(), (x[:3] @ w[0]).float(), atol=1e-2, rtol=1e-2))
            except (RuntimeError, TypeError, NotImplementedError):
                ok = False
        _PROBED[key] = ok
    return _PROBED[key]


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: grouped_mm's backward
    rejects the stride-0 gradients that ``sum()`` or ``expand`` produce."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class Experts(nn.Module):
    """``num_local`` copies of ``expert`` with stacked parameters (see the module docstring)."""

    def __init__(self, expert: nn.Module, num_local: int) -> None:
        super().__init__()
        if num_local < 1:
            raise ValueError(f"num_local={num_local} must be >= 1")
        if any(True for _ in expert.buffers()):
            raise NotImplementedError(
                "experts with buffers (e.g. BatchNorm) are not supported: stacked experts share one module "
                "structure and buffers would need per-expert copies"
            )
        self.num_local = num_local
        self.stacked = copy.deepcopy(expert)
        for name, param in list(self.stacked.named_parameters()):
            owner_name, _, leaf = name.rpartition(".")
            owner = self.stacked.get_submodule(owner_name) if owner_name else self.stacked
            stacked = param.detach().unsqueeze(0).repeat(num_local, *([1] * param.dim())).contiguous()
            setattr(owner, leaf, nn.Parameter(stacked, requires_grad=param.requires_grad))
        self._names = [name for name, _ in self.stacked.named_parameters()]
        self._mlp = _mlp_structure(expert)

    @property
    def uses_grouped_mm(self) -> bool:
        """Whether a forward on these experts' device and dtype runs torch's grouped matmul."""
        p = next(self.stacked.parameters())
        return self._grouped_ok(p.device, p.dtype)

    def _grouped_ok(self, device: torch.device, dtype: torch.dtype) -> bool:
        if self._mlp is None:
            return False
        w1 = self.stacked.get_submodule(self._mlp[0]).weight
        align = 16 // torch.empty((), dtype=dtype).element_size()  # grouped_mm: 16-byte strides
        return all(n % align == 0 for n in w1.shape[1:]) and grouped_mm_available(device, dtype)

    def forward_grouped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows of ``x`` sorted by local expert, ``counts[j]`` rows for expert ``j`` -> outputs, same order."""
        if len(counts) != self.num_local:
            raise ValueError(f"got {len(counts)} token counts for {self.num_local} local experts")
        if self._mlp is not None:
            return self._mlp_forward(x, counts)
        outputs = []
        params = dict(self.stacked.named_parameters())
        for j, chunk in enumerate(torch.split(x, counts, dim=0)):
            outputs.append(torch.func.functional_call(self.stacked, {n: params[n][j] for n in self._names}, (chunk,)))
        return torch.cat(outputs, dim=0)

    def forward_padded(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` of shape ``(num_local, tokens, hidden)`` (capacity mode) -> same shape."""
        if self._mlp is not None:
            fc1, fc2, act = (self.stacked.get_submodule(self._mlp[0]), self.stacked.get_submodule(self._mlp[1]),
                             _ACTIVATIONS[self._mlp[2]])
            h = torch.bmm(x, fc1.weight.transpose(1, 2))
            if fc1.bias is not None:
                h = h + fc1.bias.unsqueeze(1)
            y = torch.bmm(act(h), fc2.weight.transpose(1, 2))
            return y + fc2.bias.unsqueeze(1) if fc2.bias is not None else y
        params = dict(self.stacked.named_parameters())
        return torch.stack([
            torch.func.functional_call(self.stacked, {n: params[n][j] for n in self._names}, (x[j],))
            for j in range(self.num_local)
        ])

    def _mlp_forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        fc1, fc2 = self.stacked.get_submodule(self._mlp[0]), self.stacked.get_submodule(self._mlp[1])
        act = _ACTIVATIONS[self._mlp[2]]
        if self._grouped_ok(x.device, x.dtype):
            fn = getattr(F, "grouped_mm", None) or torch._grouped_mm
            offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(device=x.device, dtype=torch.int32)
            x = _ContiguousGrad.apply(x)
            h = fn(x, fc1.weight.transpose(1, 2), offs=offs)
            h = _ContiguousGrad.apply(h)
            if fc1.bias is not None:
                h = h + _per_row(fc1.bias, counts)
            y = fn(_ContiguousGrad.apply(act(h)), fc2.weight.transpose(1, 2), offs=offs)
            y = _ContiguousGrad.apply(y)
            return y + _per_row(fc2.bias, counts) if fc2.bias is not None else y
        # Loop fallback: torch without grouped_mm, or widths it cannot take.
        outputs = []
        for j, chunk in enumerate(torch.split(x, counts, dim=0)):
            h = F.linear(chunk, fc1.weight[j], None if fc1.bias is None else fc1.bias[j])
            outputs.append(F.linear(act(h), fc2.weight[j], None if fc2.bias is None else fc2.bias[j]))
        return torch.cat(outputs, dim=0)


def _per_row(bias: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each row's expert bias, for rows grouped by expert (``counts`` rows each)."""
    repeats = torch.tensor(counts, device=bias.device)
    return torch.repeat_interleave(bias, repeats, dim=0, output_size=sum(counts))
