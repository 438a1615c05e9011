"""One process, ZeRO stages 0-2: each block's 16-bit weights are freed between its forward and
its backward, and cast back from the fp32 master just before the backward needs them.

[Note: why this is exact]
With one ZeRO rank the fp32 master partition holds every trainable parameter whole, on the
parameters' device. Outside forward and backward each 16-bit parameter equals its master slice
cast to the model dtype: at the start the master is the exact upcast of the 16-bit weights, so
casting back is exact, and every optimizer step writes the weights back as ``master.to(dtype)``
(``ShardedOptimizer.write_back_params``), which is the same cast as the refill here. Nothing
changes the master between a forward and its backward, so the refilled values are bitwise the
kept ones, and so are every gradient and loss (tests/test_memory_one_rank.py).

[Note: what it saves]
Stages 1-2 at one rank kept the whole 16-bit replica beside every activation at the start of
backward, the step's memory peak (GPT-1.3B: 2.45 GiB, of which 2.25 GiB in the 24 blocks; FSDP2
and partita ZeRO-3 at one rank hold only what runs). Here a *unit* (ZeRO-3's: the children of
every ``nn.ModuleList`` and modules marked with ``set_z3_leaf_modules``,
``param_gatherer.find_units``) frees its parameters' storage in place when its training forward
ends (``untyped_storage().resize_(0)``: the tensors autograd saved keep pointing at the same
storage), and ZeRO-3's identity on the unit's outputs (``GatherBeforeBackward``) refills them
when gradients reach those outputs, before the unit's own backward. Refilled units stay whole:
the backward frees activations much faster than it brings weights back, and at the end of
backward the model is whole again, as ZeRO-1/2 promise between steps. Parameters outside every
unit (embeddings, final norm, tied weights) are never freed. Cost: one cast of each block's
weights per backward (GPT-1.3B: 2.25 GiB written, ~2 ms on an H200).

[Note: freed again after the unit's backward]
With ``zero_optimization.one_rank_gradient_fold "end"`` the peak is the end of backward, where
every full-size ``param.grad`` is held and the fp32 partition is allocated to fold them: there
the refilled weights were dead weight (GPT-1.3B, ZeRO-2, micro-batch 2: 2.25 GiB of a 24.57 GiB
peak on one H200). So under that rule a unit refilled in this backward is freed again once every
one of its parameters' gradients has been accumulated (post-accumulate-grad hooks, registered
after the reducer's, so the gradient is already held), and ``restore`` brings the model back
after ``finish_backward`` has folded the gradients and freed them. The same rule ZeRO-3 releases
a unit by (``ParameterGatherer._release_one``), with the same limits (the module docstring's last
paragraph). It costs one more cast of the blocks' weights per backward; "early" folding, whose
peak is inside the backward, keeps refilled units whole instead, and so does "stream"
(streamed_step.py): its step needs the gradients and the whole model at once either way (the
weights must be whole when ``engine.backward`` returns: ZeRO-1/2 promise whole weights between
backward and step, and reading a freed parameter raises ParameterNotGatheredError), so freeing again
would cost a cast per block and step for 0.15 GiB of GPT-1.3B micro-batch 1's peak (estimated).

[Note: when it is off]
Built only when the whole job is one process (no data, tensor, sequence or pipeline axis), no
optimizer group is offloaded and no update is delayed, the model is not a ``PipelineModule``,
and ``zero_optimization.one_rank_free_weights`` is true (the default). Per unit and forward it
also keeps the weights whole when: the forward runs in eval mode or without grad, inside a
recomputation, or while TorchDynamo traces the hooks; the unit is a compiled region that records
CUDA graphs (they replay fixed addresses); or a parameter was modified in place since the master
was last written into it (``param._version`` moved: ``load_state_dict`` between steps, say), so
the master is not its value until the next step writes it back. A parameter is freed only if it
owns its whole storage alone. Any parameter still freed (a unit whose outputs got no gradient, a
forward without backward) is refilled at the end of ``engine.backward``, by
``engine.finish_pending_step`` (eval, checkpoints, exports) and before ``model.state_dict()``.
A model must turn the key off, as it could not run under ZeRO-3 either, if it reads a block's
weights outside that block's forward, or if a tensor made inside a block reaches the loss other
than through the block's outputs (kept on the module, say) and its backward needs the block's
weights: that backward may run before the gradients reach the block's outputs, on freed storage.
(MoE auxiliary losses are fine: their gate is the one the routing uses, whose backward waits for
the block's outputs; tests/test_memory_one_rank.py has one.)
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

# The class from its defining module: the partita.pipe package would reach partita.engine
# (through its lazy PipelineEngine), which sits above ZeRO.
from partita.pipe.module import PipelineModule
from partita.tensor_containers import tensors_in
from partita.utils.weak_hooks import register_weak_grad_hook
from partita.zero.freed import ONE_RANK, allocate_param, free_param, name_params
from partita.zero.units import GatherBeforeBackward, find_units, in_backward_pass, is_inside, through_function
from partita.zero.shard_group import ShardedParamGroup

__all__ = ["OneRankWeights", "build_one_rank_weights"]


def build_one_rank_weights(
    module: nn.Module,
    groups: list[ShardedParamGroup],
    *,
    enabled: bool,
    world_size: int,
    delayed_update: bool,
    free_after_backward: bool = False,
) -> OneRankWeights | None:
    """The freeing for ``module`` when it applies (see [Note: when it is off]), else None.
    ``free_after_backward``: the reducer holds the gradients until the end of backward ([Note:
    freed again after the unit's backward])."""
    if not enabled or world_size != 1 or delayed_update or isinstance(module, PipelineModule):
        return None
    if any(g.offloaded or g.aliases_params or g.layout.num_shards != 1 for g in groups):
        return None
    weights = OneRankWeights(module, groups, free_after_backward=free_after_backward)
    return weights if weights.num_freeable else None


class OneRankWeights:
    """Frees and refills the 16-bit weights of ``module``'s units (see the module docstring)."""

    def __init__(self, module: nn.Module, groups: list[ShardedParamGroup], *, free_after_backward: bool = False) -> None:
        self._root = module
        # One shard: a parameter's elements start at its partition offset, unpadded.
        self._master_of = {param: (group, spec) for group in groups
                           for param, spec in zip(group.params, group.layout.specs)}
        freeable = _owning_their_storage(module, self._master_of)
        self._units = _one_unit_per_storage(_assign_units(module, freeable), freeable)
        name_params(module.named_parameters(), replace=True)  # error messages name freed parameters
        self._freed: set[nn.Module] = set()
        self._sources: dict[nn.Module, tuple] = {}  # _refill_pairs' cache: masters, their addresses, slices
        # param._version when the master was last written into it (see [Note: when it is off]).
        self._versions: dict[nn.Parameter, int] = {}
        self.synced()
        self.freed_count = 0  # unit forwards that freed their weights (observability and tests)
        self._hooks = []
        for unit in self._units:
            self._hooks.append(unit.register_forward_pre_hook(self._pre_forward))
            self._hooks.append(unit.register_forward_hook(self._post_forward))
        self._hooks.append(module.register_state_dict_pre_hook(lambda *_: self.restore()))
        # [Note: freed again after the unit's backward]: per unit refilled in this backward, its
        # parameters whose gradient has not been accumulated yet.
        self._awaiting_grads: dict[nn.Module, set[nn.Parameter]] | None = None
        if free_after_backward:
            self._awaiting_grads = {}
            self._unit_of = {param: unit for unit, params in self._units.items() for param in params}
            for param in self._unit_of:
                self._hooks.append(register_weak_grad_hook(param, self._on_grad_accumulated))

    @property
    def num_freeable(self) -> int:
        """Elements of the parameters this frees between a unit's forward and its backward."""
        return sum(p.numel() for params in self._units.values() for p in params)

    def synced(self) -> None:
        """The master has just been written into every parameter (``write_back_params``)."""
        self._versions = {p: p._version for params in self._units.values() for p in params}

    def restore(self) -> None:
        """Refill every freed parameter: the model is whole again."""
        for unit in list(self._freed):
            self._refill(unit)
        if self._awaiting_grads:
            self._awaiting_grads.clear()  # units whose parameters got no gradient in that backward

    # ------------------------------------------------------------------ hooks
    def _pre_forward(self, unit: nn.Module, args: Any) -> None:
        if unit in self._freed:  # a second forward before the backward, or a recomputation
            self._refill(unit)

    def on_pre_backward(self, unit: nn.Module) -> None:
        """Gradients reached ``unit``'s outputs (``GatherBeforeBackward``): its weights are needed."""
        if unit in self._freed:
            self._refill(unit)

    def _on_grad_accumulated(self, param: nn.Parameter) -> None:
        unit = self._unit_of[param]
        waiting = self._awaiting_grads.get(unit)
        if waiting is None:
            return  # not refilled in this backward (kept whole in its forward), or already freed again
        waiting.discard(param)
        if not waiting:
            # Every gradient of the unit is in: nothing in this backward reads its weights again
            # (a recomputation would refill them first, in _pre_forward).
            del self._awaiting_grads[unit]
            self._free(unit)

    def _post_forward(self, unit: nn.Module, args: Any, output: Any) -> Any:
        if not (self._root.training and torch.is_grad_enabled()) or in_backward_pass():
            return None  # no backward follows, or this is the recomputation right before it
        if torch.compiler.is_compiling() or _records_cuda_graphs(unit):
            return None
        params = self._units[unit]
        if any(p._version != self._versions[p] for p in params):
            return None  # edited in place since the last write-back: the master is not its value
        if not any(t.requires_grad for t in tensors_in(output)):
            return None  # nothing would bring the weights back before a backward
        self._free(unit)
        self.freed_count += 1
        return through_function(GatherBeforeBackward, self, unit, output)  # a ModelOutput stays one

    def _free(self, unit: nn.Module) -> None:
        for param in self._units[unit]:
            free_param(param, ONE_RANK)  # reads raise until refilled (partita/zero/freed.py)
        self._freed.add(unit)

    @torch.no_grad()
    def _refill(self, unit: nn.Module) -> None:
        # Through .data: neither the resize nor the copy moves the parameter's version counter,
        # so autograd's saved references stay valid. One foreach copy from cached views of the
        # master: this runs twice per unit and step, and at small batches the step is bound by
        # the host (a slice, a view and a copy per parameter were most of it).
        params = self._units[unit]
        for param in params:
            allocate_param(param)
        torch._foreach_copy_([param.data for param in params], self._refill_sources(unit))
        self._freed.discard(unit)
        if self._awaiting_grads is not None and in_backward_pass() and self._root.training:
            self._awaiting_grads[unit] = set(self._units[unit])

    def _refill_sources(self, unit: nn.Module) -> list[torch.Tensor]:
        """The unit's parameters' slices of the master, shaped as the parameters (cached while the
        masters are the tensors, at the addresses, they were cut from)."""
        params = self._units[unit]
        masters = [self._master_of[param][0].master for param in params]
        cached = self._sources.get(unit)
        if cached is None or any(a is not b or a.data_ptr() != ptr for a, b, ptr in zip(cached[0], masters, cached[1])):
            sources = []
            for param, master in zip(params, masters):
                spec = self._master_of[param][1]
                sources.append(master[spec.partition_offset : spec.partition_offset + spec.numel].view(spec.shape))
            cached = self._sources[unit] = (masters, [m.data_ptr() for m in masters], sources)
        return cached[2]

    def remove_hooks(self) -> None:
        self.restore()
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def _owning_their_storage(module: nn.Module, params: Iterable[nn.Parameter]) -> set[nn.Parameter]:
    """The parameters whose storage holds nothing but freeable parameters, which together fill it:
    freeing it frees nothing else. Usually one parameter per storage; MoE experts' parameters are
    rows of one stacked storage (partita/moe/experts.py), freed and refilled together as long as
    they fall in one unit (:func:`_one_unit_per_storage`)."""
    candidates = set(params)
    users: dict[int, list[torch.Tensor]] = {}
    for tensor in list(module.parameters()) + list(module.buffers()):
        users.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
    freeable = set()
    for tensors in users.values():
        storage = tensors[0].untyped_storage()
        if all(t in candidates for t in tensors) and storage.nbytes() == sum(t.numel() * t.element_size() for t in tensors) \
                and all(t.is_contiguous() for t in tensors):
            freeable.update(tensors)
    return freeable


def _one_unit_per_storage(units: dict[nn.Module, list[nn.Parameter]],
                          freeable: set[nn.Parameter]) -> dict[nn.Module, list[nn.Parameter]]:
    """Keep a storage's parameters only when they all fall in one unit: freeing a unit must not
    free the values of a parameter in another unit or one left whole (outside every unit)."""
    users: dict[int, int] = {}
    for param in freeable:
        key = param.untyped_storage().data_ptr()
        users[key] = users.get(key, 0) + 1
    kept = {}
    for unit, params in units.items():
        in_unit: dict[int, int] = {}
        for param in params:
            key = param.untyped_storage().data_ptr()
            in_unit[key] = in_unit.get(key, 0) + 1
        mine = [p for p in params if in_unit[p.untyped_storage().data_ptr()] == users[p.untyped_storage().data_ptr()]]
        if mine:
            kept[unit] = mine
    return kept


def _assign_units(module: nn.Module, freeable: set[nn.Parameter]) -> dict[nn.Module, list[nn.Parameter]]:
    """Each freeable parameter's unit, by ZeRO-3's rule (``ParameterGatherer._assign_units``): the
    innermost unit containing it; one shared by two units that do not nest stays whole (ZeRO-3's
    root), as does everything outside the units."""
    units = find_units(module)[1:]
    owner: dict[nn.Parameter, nn.Module | None] = {}
    for unit in units:  # outermost first: inner units overwrite
        for param in unit.parameters():
            if param in freeable:
                owner[param] = unit
    for unit in units:
        for param in unit.parameters():
            held = owner.get(param)
            if held is not None and held is not unit and not is_inside(held, unit):
                owner[param] = None
    result: dict[nn.Module, list[nn.Parameter]] = {}
    for param, unit in owner.items():
        if unit is not None:
            result.setdefault(unit, []).append(param)
    return result


def _records_cuda_graphs(unit: nn.Module) -> bool:
    """A unit compiled by partita (partita/compile) in a mode that records CUDA graphs."""
    if "forward" not in unit.__dict__:
        return False  # not compiled: the common case, one dict lookup
    from partita.compile.apply import _CUDA_GRAPH_MODES, _compiled_of

    compiled = _compiled_of(unit)
    if compiled is None:
        return False
    kwargs = compiled.settings.kwargs
    return kwargs.get("mode") in _CUDA_GRAPH_MODES or bool((kwargs.get("options") or {}).get("triton.cudagraphs"))
