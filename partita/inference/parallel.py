"""Tensor parallelism for ``init_inference``: the training AutoTP plans and layers, on a topology
whose ``tensor`` axis is ``tp_size`` (the ``data`` axis holds the replicas).

Nothing here is inference-specific splitting: the plan comes from
:func:`partita.tensor_parallel.plans.plan_for` (the reference GPT's Megatron plan; GPT-2,
Llama/Mistral/Qwen with grouped-query attention and BERT through AutoTP) and the split from
:func:`partita.tensor_parallel.apply_tensor_parallel`, exactly as ``initialize`` splits a model
for training. What is added is the inference-side checking: a head count the tensor size does not
divide is a ConfigError listing the sizes that work, before anything is split.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from partita.config.base import ConfigError
from partita.distributed import collectives
from partita.distributed.topology import Axis, Topology, build_topology, resolve_mesh_shape

if TYPE_CHECKING:
    from partita.tensor_parallel.apply import TensorParallelPlan

logger = logging.getLogger("partita")

__all__ = ["build_inference_topology", "policy_plan", "split_model", "valid_tp_sizes"]


def build_inference_topology(tp_size: int, device: torch.device) -> Topology | None:
    """The topology (tensor axis ``tp_size``, replicas on ``data``), or None for a single process
    at tp 1 that has no process group (nothing to start then, as DeepSpeed starts none)."""
    from partita.distributed.init import detect_launch_env, init_distributed

    world = dist.get_world_size() if dist.is_initialized() else detect_launch_env().world_size
    if tp_size == 1 and not dist.is_initialized() and world == 1:
        return None
    try:
        # Checked before any process group starts: a refused call leaves none behind.
        resolve_mesh_shape(world_size=world, sizes={Axis.DATA: None, Axis.TENSOR: tp_size})
    except ValueError:
        raise ConfigError(
            f"tensor_parallel.tp_size = {tp_size} does not divide the {world} launched process(es); launch a multiple "
            f"of {tp_size} processes (partita run --nproc {tp_size} / torchrun --nproc-per-node {tp_size}) or set "
            f"tp_size to a divisor of {world}"
        ) from None
    init_distributed(backend="auto")
    return build_topology(device_type=device.type, sizes={Axis.TENSOR: tp_size})


def valid_tp_sizes(counts: dict[str, int], limit: int = 64) -> list[int]:
    """Tensor sizes that divide every count (head counts, and the vocabulary where it is split)."""
    common = math.gcd(*counts.values()) if counts else limit
    return [k for k in range(1, min(common, limit) + 1) if common % k == 0]


def split_model(module: nn.Module, topology: Topology, injection_policy=None) -> dict[str, str]:
    """Split ``module`` across ``topology``'s tensor axis with its built-in plan (or the plan
    ``injection_policy`` describes); returns module name -> style. Raises ConfigError for an
    unknown architecture or a size that does not fit."""
    from partita.tensor_parallel.apply import apply_tensor_parallel
    from partita.tensor_parallel.autotp import fix_attention_widths
    from partita.tensor_parallel.plans import plan_for

    size = topology.tensor_size
    try:
        plan = plan_for(module, sequence_parallel=False) if injection_policy is None else policy_plan(module, injection_policy)
    except NotImplementedError as error:
        # The plan's message speaks of the training key; init_inference's is tp_size.
        why = str(error).replace("tensor_parallel.autotp_size", "tensor_parallel.tp_size")
        raise ConfigError(f"tensor_parallel.tp_size = {size}: {why}") from None
    if plan is None:
        raise ConfigError(
            f"tensor_parallel.tp_size = {size}: partita has no tensor-parallel plan for {type(module).__name__} (it "
            "knows the reference GPT, GPT-2, Llama/Mistral/Qwen-style and BERT-style models); split it yourself with "
            "partita.tensor_parallel.apply_tensor_parallel(model, group=..., plan={...}) and pass tp_size 1"
        )
    counts = dict(plan.head_counts)
    if plan.vocab_size is not None:
        counts["vocab_size"] = plan.vocab_size
    bad = {name: count for name, count in counts.items() if count % size}
    if bad:
        listed = ", ".join(f"{name} = {count}" for name, count in bad.items())
        raise ConfigError(
            f"tensor_parallel.tp_size = {size} does not divide {listed} of {type(module).__name__} (each rank holds "
            f"whole heads); valid tp_size values for this model: {valid_tp_sizes(counts)}"
        )
    result = apply_tensor_parallel(module, group=topology.tensor_group, plan=plan)
    fix_attention_widths(module, size)
    _same_random_stream(topology)
    split = sum(1 for style in result.styles.values() if style in ("column", "row", "embedding"))
    logger.info("init_inference: %s; %d layers split across %d tensor ranks", topology.describe(), split, size)
    return result.styles


# Fused q/k/v projections by name: split chunk by chunk so every rank keeps whole heads of each.
_FUSED_QKV = ("c_attn", "qkv", "query_key_value")


def policy_plan(module: nn.Module, policy) -> "TensorParallelPlan":
    """DeepSpeed's ``injection_policy``: inside every module of a listed layer class, the linear
    layers named in its tuple are row-parallel (their partial outputs are summed across the tensor
    ranks) and every other linear layer is column-parallel, as DeepSpeed's user-specified tensor
    parallelism splits them. Head counts are checked from the model's config where it has them."""
    from partita.tensor_parallel.apply import Style, TensorParallelPlan
    from partita.tensor_parallel.autotp import is_hf_conv1d

    modules = list(module.named_modules())
    styles: dict[str, Style] = {}
    for layer, names in policy.items():
        names = tuple(names) if isinstance(names, (tuple, list)) else (names,)
        label = layer.__name__ if isinstance(layer, type) else layer
        owners = [(n, m) for n, m in modules if (type(m) is layer if isinstance(layer, type) else type(m).__name__ == layer)]
        if not owners:
            raise ConfigError(f"injection_policy: {type(module).__name__} has no module of class {label}; name the class "
                              "of its transformer layers (e.g. LlamaDecoderLayer)")
        for name in names:
            if not any(sub == name or sub.endswith("." + name) for _, owner in owners for sub, _ in owner.named_modules()):
                raise ConfigError(f"injection_policy: no layer named {name!r} inside {label}; give the names of its "
                                  "row-parallel linear layers as they appear in named_modules() (e.g. 'self_attn.o_proj')")
        for prefix, owner in owners:
            for sub, child in owner.named_modules():
                if not (isinstance(child, nn.Linear) or is_hf_conv1d(child)):
                    continue
                row = any(sub == name or sub.endswith("." + name) for name in names)
                fused = not row and sub.rsplit(".", 1)[-1] in _FUSED_QKV
                styles[f"{prefix}.{sub}" if prefix else sub] = Style("row" if row else "column", chunks=3 if fused else 1)
    config = getattr(module, "config", None)
    counts = {a: int(getattr(config, a)) for a in ("n_head", "num_attention_heads", "num_key_value_heads")
              if isinstance(getattr(config, a, None), int)}
    return TensorParallelPlan(styles, head_counts=counts)


@torch.no_grad()
def _same_random_stream(topology: Topology) -> None:
    """Tensor ranks must draw the same samples (do_sample=True): each holds a slice of one model
    and all of them append the token drawn. As DeepSpeed does, every rank takes tensor rank 0's
    generator state (CPU, and the current CUDA device's)."""
    group = topology.tensor_group
    src = dist.get_global_rank(group, 0)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    state = torch.get_rng_state().to(device)
    collectives.broadcast(state, src=src, group=group, purpose="init_inference: random state")
    torch.set_rng_state(state.cpu())
    if torch.cuda.is_available():
        cuda_state = torch.cuda.get_rng_state().to(device)
        collectives.broadcast(cuda_state, src=src, group=group, purpose="init_inference: CUDA random state")
        torch.cuda.set_rng_state(cuda_state.cpu())
