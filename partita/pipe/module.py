"""DeepSpeed's ``PipelineModule``, ``LayerSpec`` and ``TiedLayerSpec`` (``deepspeed.pipe``).

A pipeline model is a flat list of layers; each passes a tensor (or a tuple of tensors) to the
next, and the last stage's output goes to ``loss_fn(outputs, labels)``. The list is partitioned
into stages (:mod:`partita.pipe.partition`) and each rank builds **only the layers of its own
stage(s)**: a ``LayerSpec`` is a recipe, constructed on its owner, so no rank ever holds the
whole model. Parameter counts for the ``"parameters"`` partition come from building each spec on
the meta device (no memory), where DeepSpeed builds every layer for real on every rank.

Stage ``s`` is held by the ranks whose pipe coordinate is ``s``; the pipe axis is the outermost
of partita's mesh (:mod:`partita.distributed.topology`), so those are the global ranks
``s * R .. (s + 1) * R - 1`` with ``R = world / num_stages``. With ``virtual_stages=v`` (the
interleaved schedules) the list is cut into ``num_stages * v`` parts and rank ``r`` holds parts
``r, r + num_stages, ...`` (torch's loop mapping, stage ``i`` on pipe rank ``i % num_stages``).

Tied layers (``TiedLayerSpec`` with one ``key``): one module per stage that uses the key, shared
by every use on that stage; across stages, the first owner's weights are broadcast at
``initialize`` and the gradients of the tied attributes are summed over the owners after every
batch (:meth:`PipelineModule.tied_groups`), DeepSpeed's ``_exec_reduce_tied_grads``.
State-dict keys keep the global layer index (``"3.weight"``) and ``"tied_modules.<key>.<name>"``
for tied modules, as DeepSpeed's.

ZeRO-3: :meth:`PipelineModule.zero3_units` gives the gatherer each built layer and one
:class:`TiedCall` per tied key as units (torch's PipelineStage never runs this module's own
forward, where the root unit would be gathered).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from partita.pipe.partition import partition_by_method
from partita.pipe.topology import mesh_sizes


__all__ = ["LayerSpec", "TiedLayerSpec", "PipelineModule", "StageChunk"]


class LayerSpec:
    """A layer to build later: ``LayerSpec(nn.Linear, 16, 16)`` builds ``nn.Linear(16, 16)``
    on the stage that owns it only."""

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise ValueError(f"LayerSpec needs an nn.Module subclass, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer shared by every position that names the same ``key`` (an embedding and the LM head).

    ``forward_fn(module, inputs)`` replaces ``module(inputs)`` at this position (the head:
    ``lambda emb, x: x @ emb.weight.t()``); ``tied_weight_attr`` names the attribute(s) whose
    gradients are summed across the stages that hold the key.
    """

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        *module_args: Any,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        tied_weight_attr: str | Sequence[str] = "weight",
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        if not isinstance(key, str) or not key or "." in key:
            raise ValueError(f"TiedLayerSpec key must be a non-empty string without '.', got {key!r}")
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)

    def __repr__(self) -> str:
        return f"TiedLayerSpec({self.key!r}, {self.typename.__name__})"


@dataclass(frozen=True)
class TiedGroup:
    """One tied key across stages: this rank's module, the owners' group, whether it counts the norm."""

    key: str
    module: nn.Module
    params: tuple[nn.Parameter, ...]
    owner_stages: tuple[int, ...]
    group: dist.ProcessGroup | None  # None: one owner stage, nothing to sum
    src_rank: int  # global rank of the first owner in this rank's tie group (broadcast source)
    counts_in_norm: bool  # False on every owner but the first: the gradient norm counts a tie once


class StageChunk(nn.Module):
    """One contiguous run of layers: the submodule a ``PipelineStage`` runs.

    ``forward(*args)`` takes the previous stage's outputs as positional arguments (torch's
    pipelining passes a tuple output on as ``*args``) and gives layers DeepSpeed's single
    argument: the tensor itself, or the tuple.
    """

    def __init__(self, index: int, layers: list[tuple[int, Any]], owner: "PipelineModule") -> None:
        super().__init__()
        self.index = index
        self.layer_indices = [i for i, _ in layers]
        self._owner = [owner]  # a list: not registered as a child module (no cycle in modules())
        self._calls: list[Callable[[Any], Any]] = []
        # ZeRO-3 only (PipelineModule.zero3_units): tied layers called through their TiedCall unit.
        self._unit_calls: dict[int, Callable[[Any], Any]] = {}
        # Registered here too (the same objects as the PipelineModule's), so a PipelineStage sees
        # exactly this chunk's parameters: the zero-bubble schedules take weight gradients from it.
        self.tied_modules = nn.ModuleDict()
        for i, layer in layers:
            if isinstance(layer, nn.Module):
                self.add_module(str(i), layer)
            elif isinstance(layer, partial) and layer.args and isinstance(layer.args[0], nn.Module):
                key = next(k for k, m in owner.tied_modules.items() if m is layer.args[0])
                self.tied_modules[key] = layer.args[0]
            self._calls.append(layer)

    def forward(self, *args: Any) -> Any:
        x = args[0] if len(args) == 1 else args
        owner = self._owner[0]  # train()/eval() reach the PipelineModule, not this unregistered chunk
        interval = owner.activation_checkpoint_interval
        if interval <= 0 or not (owner.training and torch.is_grad_enabled()):
            return self.run_layers(0, len(self._calls), x)
        use_reentrant = owner.checkpoint_use_reentrant
        for start in range(0, len(self._calls), interval):
            x = checkpoint(self.run_layers, start, min(start + interval, len(self._calls)), x, use_reentrant=use_reentrant)
        return x

    def run_layers(self, start: int, stop: int, x: Any) -> Any:
        """Layers ``start .. stop - 1`` of this chunk; a layer that raises gets a note naming the
        stage, the layer, what it was given (shapes and dtypes) and where that came from."""
        for k in range(start, stop):
            try:
                x = self._unit_calls.get(k, self._calls[k])(x)
            except Exception as error:
                _add_note(error, self._failure_note(k, x))
                raise
        return x

    def _failure_note(self, k: int, x: Any) -> str:
        from partita.pipe.failure import describe

        owner = self._owner[0]
        index = self.layer_indices[k]
        if k > 0:
            source = f"the output of layer {self.layer_indices[k - 1]}"
        elif self.index == 0:
            source = "the batch's inputs"
        else:
            source = f"the activation pipeline stage {(self.index - 1) % owner.num_stages} sent"
        return (f"pipeline stage {self.index % owner.num_stages}: layer {index} ({_type_name(owner._layer_specs[index])}"
                f"{_expects(self._calls[k])}) failed on {source}: {describe(x)}")


def _expects(layer: Any) -> str:
    """What a layer's first parameterised submodule takes, for the failure note."""
    module = layer.args[0] if isinstance(layer, partial) and layer.args else layer
    if not isinstance(module, nn.Module):
        return ""
    for name, sub in module.named_modules():
        where = f" '{name}'" if name else ""
        if isinstance(sub, nn.Linear):
            return f", whose first Linear{where} takes (..., {sub.in_features}) floats"
        if isinstance(sub, nn.Embedding):
            return f", whose first Embedding{where} takes integer ids below {sub.num_embeddings}"
        if isinstance(sub, nn.LayerNorm):
            return f", whose first LayerNorm{where} takes (..., {', '.join(map(str, sub.normalized_shape))})"
    return ""


def _add_note(error: BaseException, note: str) -> None:
    # Python 3.11's add_note keeps the error's type and prints the note with the traceback; on
    # 3.10 the note is kept in __notes__ (partita's pipeline failure report reads it).
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:
        error.__notes__ = [*getattr(error, "__notes__", []), note]


class TiedCall(nn.Module):
    """ZeRO-3's unit for one tied module on this rank: every use of the key (the module called
    directly, or ``forward_fn(module, x)``) goes through this module's call, so the gatherer's
    forward hooks on it fire and gather the tied parameters even where only a function reads them.
    Never registered as a submodule (the state dict keeps ``tied_modules.<key>.<name>``)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: Any, forward_fn: Callable[[nn.Module, Any], Any] | None = None) -> Any:
        return self.module(x) if forward_fn is None else forward_fn(self.module, x)


class PipelineModule(nn.Module):
    """DeepSpeed's ``PipelineModule``: a layer list partitioned into ``num_stages`` stages.

    ``torch.distributed`` must be initialised first (``partita.init_distributed()``): the stage
    this rank builds depends on its rank. ``topology``: None, a
    :class:`partita.distributed.topology.Topology` (its pipe size is taken), or DeepSpeed's
    ``ProcessTopology`` / ``PipeDataParallelTopology`` / ``PipeModelDataParallelTopology``
    (partita's, :mod:`partita.pipe.topology`, or DeepSpeed's own objects): its ``pipe``, ``data``
    and ``model`` axes become partita's pipe, data and tensor axes, and a topology that puts any
    rank elsewhere than partita's mesh does, or does not cover the world, is a ValueError
    (:func:`partita.pipe.topology.mesh_sizes`); ``initialize`` then checks the config agrees
    (:meth:`check_topology`). ``virtual_stages`` (partita only): model chunks per rank for the
    interleaved schedules (config ``pipeline.schedule``).
    """

    def __init__(
        self,
        layers: Sequence[Any],
        num_stages: int | None = None,
        topology: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], None] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Any = None,
        checkpointable_layers: Any = None,
        *,
        virtual_stages: int = 1,
    ) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError(
                "PipelineModule needs torch.distributed to be initialised (each rank builds only its own "
                "stage): call partita.init_distributed() (deepspeed.init_distributed()) before building it"
            )
        if activation_checkpoint_func is not None or checkpointable_layers is not None:
            raise NotImplementedError(
                "PipelineModule(activation_checkpoint_func=..., checkpointable_layers=...) is not implemented: "
                "partita checkpoints every run of activation_checkpoint_interval layers with "
                "torch.utils.checkpoint; leave both unset"
            )
        if seed_fn is not None:
            raise NotImplementedError("PipelineModule(seed_fn=...) is not implemented; use seed_layers=True with base_seed")
        world = dist.get_world_size()
        # DeepSpeed's topology as given, and its sizes on partita's axes (None for partita's own
        # Topology or num_stages: the config decides the mesh then).
        self.process_topology = topology if _is_deepspeed_topology(topology) else None
        self.topology_sizes: dict[str, int] | None = None
        if topology is not None:
            if self.process_topology is not None:
                self.topology_sizes = mesh_sizes(topology, world)
                pipe_size = self.topology_sizes["pipe"]
            else:
                pipe_size = getattr(topology, "pipe_size", None)
            if pipe_size is None:
                raise ValueError(
                    f"PipelineModule(topology=...) takes a partita Topology or a DeepSpeed ProcessTopology "
                    f"(partita.runtime.pipe.topology), got {type(topology).__name__}; or pass num_stages=<int> instead"
                )
            if num_stages is not None and num_stages != pipe_size:
                raise ValueError(f"num_stages={num_stages} disagrees with the topology's pipe size {pipe_size}; give one")
            num_stages = pipe_size
        if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
            raise ValueError(f"PipelineModule needs num_stages=<int >= 1> (or a topology), got {num_stages!r}")
        if world % num_stages != 0:
            raise ValueError(
                f"num_stages={num_stages} does not divide the world size {world}: launch a multiple of "
                f"{num_stages} processes or choose a divisor of {world}"
            )
        if not isinstance(virtual_stages, int) or virtual_stages < 1:
            raise ValueError(f"virtual_stages={virtual_stages!r} must be an int >= 1")
        if not isinstance(activation_checkpoint_interval, int) or activation_checkpoint_interval < 0:
            raise ValueError(f"activation_checkpoint_interval={activation_checkpoint_interval!r} must be an int >= 0")
        if not layers:
            raise ValueError("PipelineModule needs a non-empty list of layers")
        for i, layer in enumerate(layers):
            if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
                raise ValueError(f"layer {i} is {type(layer).__name__}: give an nn.Module, a LayerSpec or a callable")

        self.num_stages = num_stages
        self.virtual_stages = virtual_stages
        self.loss_fn = loss_fn
        self.seed_layers = seed_layers
        self.base_seed = base_seed
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.checkpoint_use_reentrant = False
        self._layer_specs = list(layers)
        self.ranks_per_stage = world // num_stages
        self.stage_id = dist.get_rank() // self.ranks_per_stage  # mesh_sizes checked DeepSpeed's get_coord(rank).pipe agrees
        self.global_rank = dist.get_rank()

        num_parts = num_stages * virtual_stages
        self.parts = partition_by_method(
            partition_method, num_parts=num_parts,
            param_counts=[_trainable_numel(layer) for layer in self._layer_specs],
            type_names=[_type_name(layer) for layer in self._layer_specs],
        )
        sizes = [self.parts[p + 1] - self.parts[p] for p in range(num_parts)]
        if min(sizes) == 0:
            raise ValueError(
                f"partition_method={partition_method!r} leaves a stage without layers: {len(self._layer_specs)} layers "
                f"into {num_parts} stages gives layer counts {sizes}; use fewer stages (or virtual_stages), more "
                "layers, or another partition_method"
            )
        self.chunk_ids = [self.stage_id + k * num_stages for k in range(virtual_stages)]
        self.tied_modules = nn.ModuleDict()
        self._tied_specs: dict[str, TiedLayerSpec] = {}
        self.chunks: list[StageChunk] = []
        for chunk_id in self.chunk_ids:
            built = [(i, self._build_layer(i)) for i in range(self.parts[chunk_id], self.parts[chunk_id + 1])]
            for i, layer in built:
                if isinstance(layer, nn.Module) and not isinstance(self._layer_specs[i], TiedLayerSpec):
                    self.add_module(str(i), layer)
            self.chunks.append(StageChunk(chunk_id, built, self))
        self._tied_groups = self._build_tied_groups()
        self._tied_calls: dict[str, TiedCall] | None = None  # ZeRO-3's tied units, built by zero3_units()

    # ------------------------------------------------------------------ building
    def _build_layer(self, index: int) -> Any:
        spec = self._layer_specs[index]
        if isinstance(spec, TiedLayerSpec):
            self._tied_specs.setdefault(spec.key, spec)
            if spec.key not in self.tied_modules:
                # Seeded by the key's first position in the whole list, so every owner builds the same weights.
                first = next(i for i, s in enumerate(self._layer_specs) if isinstance(s, TiedLayerSpec) and s.key == spec.key)
                self.tied_modules[spec.key] = self._seeded(first, spec.build)
            module = self.tied_modules[spec.key]
            return module if spec.forward_fn is None else partial(spec.forward_fn, module)
        if isinstance(spec, LayerSpec):
            return self._seeded(index, spec.build)
        return spec  # an nn.Module given built (DeepSpeed allows it), or a plain callable

    def _seeded(self, index: int, build: Callable[[], nn.Module]) -> nn.Module:
        """``seed_layers``: layer ``i`` is built under seed ``base_seed + i`` (DeepSpeed's rule),
        so its initial weights do not depend on the number of stages."""
        if not self.seed_layers:
            return build()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.base_seed + index)
            return build()

    def _owner_stages(self, key: str) -> tuple[int, ...]:
        owners = []
        for part in range(self.num_stages * self.virtual_stages):
            for i in range(self.parts[part], self.parts[part + 1]):
                spec = self._layer_specs[i]
                if isinstance(spec, TiedLayerSpec) and spec.key == key:
                    owners.append(part % self.num_stages)
        return tuple(sorted(set(owners)))

    def _build_tied_groups(self) -> list[TiedGroup]:
        """One process group per tied key spanning its owner stages (every rank creates every group,
        in the same order: ``new_group`` is collective over the world)."""
        keys = sorted({s.key for s in self._layer_specs if isinstance(s, TiedLayerSpec)})
        mine: list[TiedGroup] = []
        offset = self.global_rank % self.ranks_per_stage
        for key in keys:
            owners = self._owner_stages(key)
            group = None
            if len(owners) > 1:
                for off in range(self.ranks_per_stage):
                    ranks = [s * self.ranks_per_stage + off for s in owners]
                    created = dist.new_group(ranks=ranks)
                    if off == offset and self.stage_id in owners:
                        group = created
            if key in self.tied_modules:
                module = self.tied_modules[key]
                params = []
                for attr in self._tied_specs[key].tied_weight_attr:
                    param = getattr(module, attr, None)
                    if not isinstance(param, nn.Parameter):
                        raise ValueError(f"TiedLayerSpec {key!r}: tied_weight_attr {attr!r} is not a parameter of "
                                         f"{type(module).__name__}")
                    params.append(param)
                mine.append(TiedGroup(key, module, tuple(params), owners, group,
                                      src_rank=owners[0] * self.ranks_per_stage + offset,
                                      counts_in_norm=self.stage_id == owners[0]))
        return mine

    def rebind_layers(self) -> None:
        """Point each chunk at the layers registered on this module now: tensor parallelism
        (partita/tensor_parallel) replaces a layer given as a bare ``nn.Linear`` in its parent,
        which for a top-level layer is this module, not the chunk that runs it. Tied modules
        must not be replaced (their forward_fn and tie groups hold them): an error says so."""
        for chunk in self.chunks:
            for k, index in enumerate(chunk.layer_indices):
                spec, call = self._layer_specs[index], chunk._calls[k]
                if not isinstance(spec, TiedLayerSpec):
                    continue
                key = spec.key
                used = call.args[0] if isinstance(call, partial) else call
                if used is not self.tied_modules[key]:
                    raise NotImplementedError(
                        f"tensor parallelism split the tied layer {key!r} (TiedLayerSpec): tied layers stay replicated "
                        "under pipelines; change tensor_parallel.partition_config.layer_specs so no rule matches "
                        f"'tied_modules.{key}'"
                    )
        for tied in self._tied_groups:
            current = {id(p) for p in tied.module.parameters()}
            if any(id(p) not in current for p in tied.params):
                raise NotImplementedError(
                    f"tensor parallelism split a parameter of the tied layer {tied.key!r} (TiedLayerSpec): tied layers "
                    "stay replicated under pipelines; change tensor_parallel.partition_config.layer_specs so no rule "
                    f"matches inside 'tied_modules.{tied.key}'"
                )
        for chunk in self.chunks:
            for k, index in enumerate(chunk.layer_indices):
                current = self._modules.get(str(index))
                if isinstance(chunk._calls[k], nn.Module) and current is not None and current is not chunk._calls[k]:
                    chunk._calls[k] = current
                    chunk._modules[str(index)] = current

    def zero3_units(self) -> list[nn.Module]:
        """ZeRO-3's units for this rank (partita/zero/units.py find_units consults this method):
        each built layer, and one :class:`TiedCall` per tied key. torch's PipelineStage calls the
        chunks, never this module's forward, so nothing may be left to the root unit. The first
        call routes every tied use through its TiedCall; later calls return the same units.

        [Note: pipeline stages] With no root forward bracketing a step and micro-batches
        interleaved (1F1B), the gatherer turns its trace off for such a model (no prefetch, no
        reuse): each unit is gathered on demand for every micro-batch's forward and backward, each
        backward gather after the rank-agreement check. The ranks of a stage's ZeRO group run the
        same schedule, so they gather the same units in the same order."""
        if self._tied_calls is None:
            self._tied_calls = {key: TiedCall(module) for key, module in self.tied_modules.items()}
            for chunk in self.chunks:
                for k, index in enumerate(chunk.layer_indices):
                    spec = self._layer_specs[index]
                    if isinstance(spec, TiedLayerSpec):
                        chunk._unit_calls[k] = partial(self._tied_calls[spec.key], forward_fn=spec.forward_fn)
        layers = [m for name, m in self._modules.items() if name != "tied_modules" and m is not None]
        return layers + list(self._tied_calls.values())

    # ------------------------------------------------------------------ queries
    def check_topology(self, topology: Any) -> None:
        """At ``initialize``: a DeepSpeed topology given to this module must describe the mesh the
        config built (``topology``, partita's): its ``model`` axis is the config's tensor size and
        its ``data`` axis partita's data x sequence (the ZeRO group). No-op without one."""
        if self.topology_sizes is None:
            return
        from partita.config.base import ConfigError

        built = {"pipe": topology.pipe_size, "data": topology.data_size * topology.sequence_size,
                 "tensor": topology.tensor_size}
        if built != self.topology_sizes:
            given = ", ".join(f"{_DEEPSPEED_AXIS[a]}={n}" for a, n in self.topology_sizes.items())
            mesh = ", ".join(f"{_DEEPSPEED_AXIS[a]}={n}" for a, n in built.items())
            raise ConfigError(
                f"the PipelineModule's topology ({given}) disagrees with the mesh the config builds ({mesh}; model is "
                f"tensor_parallel.autotp_size, data is what pipe x tensor leave): set \"tensor_parallel\": "
                f"{{\"autotp_size\": {self.topology_sizes['tensor']}}} (or build the topology with "
                f"num_mp={topology.tensor_size})"
            )

    def tied_groups(self) -> list[TiedGroup]:
        """This rank's tied keys (only those it owns)."""
        return list(self._tied_groups)

    def uncounted_in_norm(self) -> list[nn.Parameter]:
        """Parameters of tied modules another stage counts in the global gradient norm (this rank's
        copies of every tied module whose first owner is another stage)."""
        return [p for t in self._tied_groups if not t.counts_in_norm for p in t.module.parameters()]

    def partition_summary(self) -> list[dict[str, Any]]:
        """Per pipeline stage (part): its layer range, layer names and trainable-parameter count."""
        rows = []
        for part in range(len(self.parts) - 1):
            lo, hi = self.parts[part], self.parts[part + 1]
            counts = [_trainable_numel(self._layer_specs[i]) for i in range(lo, hi)]
            rows.append({"stage": part, "layers": (lo, hi), "names": [_type_name(self._layer_specs[i]) for i in range(lo, hi)],
                         "parameters": sum(counts)})
        return rows

    def forward(self, forward_input: Any) -> Any:
        """This rank's layers in order (every stage's on one stage: the whole model at num_stages=1)."""
        x = forward_input
        for chunk in self.chunks:
            x = chunk(*x) if isinstance(x, tuple) else chunk(x)
        return x


_DEEPSPEED_AXIS = {"pipe": "pipe", "data": "data", "tensor": "model"}


def _is_deepspeed_topology(topology: Any) -> bool:
    """DeepSpeed's ProcessTopology interface (partita's classes or DeepSpeed's own objects)."""
    return all(callable(getattr(topology, name, None)) for name in ("get_axis_names", "get_dim", "get_coord"))


def _type_name(layer: Any) -> str | None:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


def _trainable_numel(layer: Any) -> int:
    """Trainable parameters of one layer; a LayerSpec is built on the meta device (no memory).
    A tied layer counts at each position, as DeepSpeed counts it."""
    if isinstance(layer, LayerSpec):
        try:
            with torch.device("meta"):
                layer = layer.build()
        except Exception:  # noqa: BLE001 - a constructor that needs real data (.item(), numpy): build it for real, as DeepSpeed does
            layer = layer.build()
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0
