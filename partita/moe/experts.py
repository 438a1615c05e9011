"""A rank's local experts in DeepSpeed's layout: ``num_local`` real instances of the user's
expert class at ``experts.deepspeed_experts[j]``, whose parameters are rows of stacked storage.

DeepSpeed deep-copies the user's ``expert`` module once per local expert; so does
:class:`Experts`, so client code finds, seeds and inspects ``deepspeed_experts[j]`` exactly as
under DeepSpeed, and state dicts carry DeepSpeed's keys
(``deepspeed_experts.<j>.<name>``). What differs is where the copies' parameters live:
parameter ``name`` of local expert ``j`` is row ``j`` of one ``(num_local, *shape)`` tensor
(partita/moe/stacked.py), so the experts still run as one grouped GEMM over stacked weights:

- an :class:`ExpertMLP` (or ``nn.Sequential(Linear, <activation>, Linear)``) runs as grouped
  GEMMs: ``torch.nn.functional.grouped_mm`` (torch >= 2.10; on CPU in torch 2.13 in fp32 and
  bf16) when a one-time probe on this device and dtype succeeds and the widths meet its
  16-byte stride rule, a loop of per-expert matmuls otherwise; in capacity mode, batched GEMMs;
- any other expert module runs as itself, once per local expert (as DeepSpeed does).

Every local expert takes part in every forward even with no tokens (an empty slice), so each
gets a (zero) gradient and ZeRO's reductions never wait for one that never comes.

``deepspeed_experts`` is an :class:`ExpertList` (indexing, ``len``, iteration, like
DeepSpeed's ``nn.ModuleList``) rather than an ``nn.ModuleList``: ZeRO-3 makes every child of a
ModuleList a unit gathered by its own forward, and the grouped GEMM never calls the experts'
forwards; as plain children the experts' parameters are gathered with the enclosing unit.
"""

from __future__ import annotations

import copy
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from partita.moe.stacked import RowsCache, allocate_rows, expert_linear, rows_view, stack_params

__all__ = ["ExpertList", "ExpertMLP", "Experts", "grouped_mm_available"]


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
    if type(expert) is ExpertMLP:  # a subclass may override forward
        return "fc1", "fc2", expert.activation
    if type(expert) is nn.Sequential and len(expert) == 3:
        first, act, second = expert
        if (type(first) is nn.Linear and type(second) is nn.Linear and type(act) in _ACTIVATION_MODULES
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
                with torch.enable_grad():  # the first forward may run under no_grad
                    x = torch.randn(8, 8, device=device, dtype=dtype, requires_grad=True)
                    w = torch.randn(2, 8, 8, device=device, dtype=dtype, requires_grad=True)
                    offs = torch.tensor([3, 8], dtype=torch.int32, device=device)
                    y = fn(x, w, offs=offs)
                    y.backward(torch.ones_like(y))
                    wgrad = fn(x.detach().t(), torch.ones_like(y), offs=offs)  # the weight gradient's form
                ok = bool(torch.allclose(y[:3].float(), (x[:3] @ w[0]).float(), atol=1e-2, rtol=1e-2)
                          and wgrad.shape == (2, 8, 8))
            except (RuntimeError, TypeError, NotImplementedError):
                ok = False
        _PROBED[key] = ok
    return _PROBED[key]


class ExpertList(nn.Module):
    """DeepSpeed's ``deepspeed_experts``: the local experts as children ``"0"``, ``"1"``, ...
    (indexing, ``len`` and iteration as an ``nn.ModuleList``; see the module docstring for why
    it is not one)."""

    def __init__(self, experts: list[nn.Module]) -> None:
        super().__init__()
        for j, expert in enumerate(experts):
            self.add_module(str(j), expert)

    def __getitem__(self, index: int) -> nn.Module:
        if isinstance(index, slice):
            return list(self._modules.values())[index]
        n = len(self._modules)
        if not -n <= index < n:
            raise IndexError(f"local expert index {index} out of range: this rank holds {n} experts")
        return self._modules[str(index % n)]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())


class Experts(nn.Module):
    """DeepSpeed's ``Experts``: ``num_local_experts`` copies of ``expert`` in ``deepspeed_experts``
    (see the module docstring). ``expert_group_name`` is accepted for DeepSpeed's signature."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None) -> None:
        super().__init__()
        if num_local_experts < 1:
            raise ValueError(f"num_local_experts={num_local_experts} must be >= 1")
        self.num_local_experts = num_local_experts
        self.expert_group_name = expert_group_name
        template = dict(expert.named_parameters())
        rows = {name: allocate_rows([p] * num_local_experts) for name, p in template.items()}
        copies = []
        for j in range(num_local_experts):
            # Seeding deepcopy's memo with row-view parameters: the copy gets them in place of
            # copies of the template's parameters (buffers and everything else are copied).
            memo = {id(p): nn.Parameter(rows[name][j], requires_grad=p.requires_grad) for name, p in template.items()}
            copies.append(copy.deepcopy(expert, memo))
        self.deepspeed_experts = ExpertList(copies)
        self._names = list(template)
        self._mlp = _mlp_structure(expert)
        self._rows = RowsCache()  # per parameter name: are the experts' rows one storage (checked cheaply)

    @property
    def num_local(self) -> int:
        return self.num_local_experts

    def expert_params(self, name: str) -> list[nn.Parameter]:
        """Parameter ``name`` of every local expert, in local order."""
        return [e.get_parameter(name) for e in self.deepspeed_experts]

    def stacked(self, name: str) -> torch.Tensor:
        """Parameter ``name`` of every local expert as one ``(num_local, *shape)`` tensor: a view
        of their storage when they are rows of one (no autograd), else a copy."""
        params = self.expert_params(name)
        view = rows_view(params)
        return view if view is not None else torch.stack([p.detach() for p in params])

    def is_stacked(self) -> bool:
        """Whether every expert parameter is a row of one stacked storage (no copy in forward)."""
        return all(rows_view(self.expert_params(name)) is not None for name in self._names)

    def _apply(self, fn, recurse: bool = True):
        # .to() / .half() / .cuda() / to_empty() convert each parameter on its own (param.data =
        # fn(param)): stack the rows again, so forwards need no copy. Before partita.initialize,
        # which is where ZeRO takes over the parameters' storage.
        module = super()._apply(fn, recurse)
        self.restack_()
        self._rows.clear()
        return module

    @torch.no_grad()
    def restack_(self) -> None:
        """Make each expert parameter a row of one stacked storage again (a copy, where they are not)."""
        for name in self._names:
            params = self.expert_params(name)
            if rows_view(params) is not None or any(p.untyped_storage().nbytes() == 0 for p in params):
                continue
            for param, row in zip(params, allocate_rows([p.detach() for p in params])):
                param.data = row

    @property
    def uses_grouped_mm(self) -> bool:
        """Whether a forward on these experts' device and dtype runs torch's grouped matmul."""
        p = self.deepspeed_experts[0].get_parameter(self._names[0])
        return self._grouped_ok(p.device, p.dtype)

    def _grouped_ok(self, device: torch.device, dtype: torch.dtype) -> bool:
        if self._mlp is None:
            return False
        w1 = self.deepspeed_experts[0].get_submodule(self._mlp[0]).weight
        align = 16 // torch.empty((), dtype=dtype).element_size()  # grouped_mm: 16-byte strides
        return all(n % align == 0 for n in w1.shape) and grouped_mm_available(device, dtype)

    def _layers(self) -> tuple[list[nn.Linear], list[nn.Linear], Callable]:
        fc1, fc2, act = self._mlp
        experts = self.deepspeed_experts._modules.values()  # a forward's hot path: no get_submodule
        return [e._modules[fc1] for e in experts], [e._modules[fc2] for e in experts], _ACTIVATIONS[act]

    def _params(self, layers: list[nn.Linear], kind: str):
        """``(parameter of every expert, their rows layout)`` for ``weight`` or ``bias`` of ``layers``."""
        params = [m._parameters[kind] for m in layers]
        return params, self._rows.layout(f"{id(layers[0])}.{kind}", params)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's ``Experts.forward``: ``inputs`` cut into ``num_local`` chunks along dim 1,
        chunk ``j`` through local expert ``j``, concatenated again along dim 1."""
        chunks = inputs.chunk(self.num_local_experts, dim=1)
        return torch.cat([_first(expert(chunk)) for chunk, expert in zip(chunks, self.deepspeed_experts)], dim=1)

    def forward_grouped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Rows of ``x`` sorted by local expert, ``counts[j]`` rows for expert ``j`` -> outputs, same order."""
        if len(counts) != self.num_local_experts:
            raise ValueError(f"got {len(counts)} token counts for {self.num_local_experts} local experts")
        if self._mlp is None:
            chunks = torch.split(x, counts, dim=0)
            return torch.cat([_first(e(c)) for e, c in zip(self.deepspeed_experts, chunks)], dim=0)
        fc1, fc2, act = self._layers()
        if self._grouped_ok(x.device, x.dtype):
            offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(device=x.device, dtype=torch.int32)
            h = expert_linear(x, *self._params(fc1, "weight"), offs=offs)
            if fc1[0].bias is not None:
                h = h + _per_row(stack_params(*self._params(fc1, "bias")), counts)
            y = expert_linear(act(h), *self._params(fc2, "weight"), offs=offs)
            return y + _per_row(stack_params(*self._params(fc2, "bias")), counts) if fc2[0].bias is not None else y
        # Loop fallback: torch without grouped_mm, or widths it cannot take.
        outputs = []
        for j, chunk in enumerate(torch.split(x, counts, dim=0)):
            outputs.append(F.linear(act(F.linear(chunk, fc1[j].weight, fc1[j].bias)), fc2[j].weight, fc2[j].bias))
        return torch.cat(outputs, dim=0)

    def forward_padded(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` of shape ``(num_local, tokens, hidden)`` (capacity mode) -> same shape."""
        if self._mlp is None:
            return torch.stack([_first(e(x[j])) for j, e in enumerate(self.deepspeed_experts)])
        fc1, fc2, act = self._layers()
        h = expert_linear(x, *self._params(fc1, "weight"))
        if fc1[0].bias is not None:
            h = h + stack_params(*self._params(fc1, "bias")).unsqueeze(1)
        y = expert_linear(act(h), *self._params(fc2, "weight"))
        return y + stack_params(*self._params(fc2, "bias")).unsqueeze(1) if fc2[0].bias is not None else y


def _first(out):
    """An expert's output, or its first element when it returns a tuple (output, bias), as DeepSpeed."""
    return out[0] if isinstance(out, tuple) else out


def _per_row(bias: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each row's expert bias, for rows grouped by expert (``counts`` rows each)."""
    repeats = torch.tensor(counts, device=bias.device)
    return torch.repeat_interleave(bias, repeats, dim=0, output_size=sum(counts))
