"""``apply_activation_checkpointing``: checkpoint a model's repeated blocks by policy, in place.

Each chosen block keeps its identity, its class and its ``state_dict`` keys: instead of
wrapping it in another module (which would insert a name into every key, as torch's
``checkpoint_wrapper`` does, and then needs key-rewriting hooks), an instance attribute
``forward`` shadows the class's ``forward`` and runs it under the checkpoint.
``nn.Module.__call__`` looks ``forward`` up on the instance first, so forward hooks,
``isinstance`` checks, ``named_modules`` and optimizers built over the parameters are all
unaffected, and :func:`remove_activation_checkpointing` undoes it by deleting the attribute.
The block's own forward hooks run once per forward (around the checkpoint), not again on
recompute, which calls the class's ``forward`` directly; its submodules' hooks do run again.
ZeRO-3 gathers a block for its backward before the recompute needs the weights.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from torch import nn
from torch.utils.checkpoint import noop_context_fn

from partita.activation_checkpointing.config import POLICIES, ActivationCheckpointingConfig
from partita.activation_checkpointing.core import configure, run_checkpointed
from partita.activation_checkpointing.selective import selective_context_fn

__all__ = [
    "apply_activation_checkpointing",
    "remove_activation_checkpointing",
    "checkpointed_blocks",
    "find_repeated_blocks",
    "apply_config",
]

BlockTypes = Sequence[type | str] | type | str


class CheckpointedForward:
    """The instance-level ``forward`` of a checkpointed block."""

    def __init__(self, module: nn.Module, *, selective: bool, cpu_offload: bool, name: str) -> None:
        self.inner: Callable[..., Any] = module.forward  # the class's forward, bound
        self.selective = selective
        self.cpu_offload = cpu_offload
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return run_checkpointed(
            self.inner,
            args,
            kwargs,
            cpu_offload=self.cpu_offload,
            context_fn=selective_context_fn if self.selective else noop_context_fn,
            name=self.name,
        )


def apply_activation_checkpointing(
    model: nn.Module,
    *,
    policy: str = "every",
    k: int = 1,
    block_types: BlockTypes | None = None,
    cpu_offload: bool = False,
) -> list[str]:
    """Checkpoint ``model``'s repeated blocks in place; return the names of the wrapped blocks.

    Args:
        model: the model; its blocks are modified in place (keys and identities unchanged).
        policy: ``"every"`` block; ``"every_k"``: every k-th block (the k-th, 2k-th, ...),
            so roughly 1/k of the blocks recompute; ``"selective"``: every block, keeping
            matmul and attention outputs and recomputing elementwise ops.
        k: the stride of ``"every_k"`` (must be 1 for the other policies).
        block_types: classes (or class names) of the blocks to wrap; None picks the
            largest ``nn.ModuleList`` whose items all have one type.
        cpu_offload: keep each checkpoint's saved inputs in CPU memory until backward.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is not one of {', '.join(map(repr, POLICIES))}")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    if k != 1 and policy != "every_k":
        raise ValueError(f"k={k} only applies to policy 'every_k', not {policy!r}; drop k or use 'every_k'")
    blocks = find_repeated_blocks(model, block_types=block_types)
    already = [name for name, block in blocks if isinstance(block.__dict__.get("forward"), CheckpointedForward)]
    if already:
        raise ValueError(
            f"blocks {already[:3]} are already checkpointed; call remove_activation_checkpointing(model) "
            "first (or set the policy in only one place: the config or the API)"
        )
    wrapped = []
    for position, (name, block) in enumerate(blocks):
        if policy == "every_k" and (position + 1) % k != 0:
            continue
        block.forward = CheckpointedForward(
            block, selective=policy == "selective", cpu_offload=cpu_offload, name=name
        )
        wrapped.append(name)
    return wrapped


def remove_activation_checkpointing(model: nn.Module) -> list[str]:
    """Undo :func:`apply_activation_checkpointing`; return the names of the unwrapped blocks."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module.__dict__.get("forward"), CheckpointedForward):
            del module.forward
            names.append(name)
    return names


def checkpointed_blocks(model: nn.Module) -> list[str]:
    """Names of the modules of ``model`` currently checkpointed."""
    return [n for n, m in model.named_modules() if isinstance(m.__dict__.get("forward"), CheckpointedForward)]


def find_repeated_blocks(model: nn.Module, *, block_types: BlockTypes | None = None) -> list[tuple[str, nn.Module]]:
    """The blocks a policy applies to, as ``(qualified name, module)`` in registration order.

    With ``block_types``: every module of those types that is not inside another one.
    Without: the items of the ``nn.ModuleList`` holding the most parameters among those
    of two or more items that all share one type (a transformer's layer list).
    """
    if block_types is not None:
        return _blocks_of_types(model, block_types)
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(item) for item in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > best[0]:
            best = (size, name, module)
    if best is None:
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleList of two or more blocks of one type to "
            "checkpoint; pass block_types=(YourBlock,) (config: \"block_types\": [\"YourBlock\"])"
        )
    _, list_name, blocks = best
    prefix = f"{list_name}." if list_name else ""
    return [(f"{prefix}{index}", block) for index, block in enumerate(blocks)]


def _blocks_of_types(model: nn.Module, block_types: BlockTypes) -> list[tuple[str, nn.Module]]:
    wanted = (block_types,) if isinstance(block_types, (type, str)) else tuple(block_types)
    for item in wanted:
        if not (isinstance(item, str) or (isinstance(item, type) and issubclass(item, nn.Module))):
            raise TypeError(f"block_types holds {item!r}; give nn.Module subclasses or their class names")

    def matches(module: nn.Module) -> bool:
        return any(
            type(module).__name__ == item if isinstance(item, str) else isinstance(module, item) for item in wanted
        )

    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        # Outermost matches only: a block nested in a checkpointed block is recomputed anyway.
        if matches(module) and not any(name.startswith(f"{outer}.") or outer == "" for outer, _ in found):
            found.append((name, module))
    if not found:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"no module of block_types {[getattr(t, '__name__', t) for t in wanted]} in "
            f"{type(model).__name__}; its module classes are {present}"
        )
    return found


def apply_config(model: nn.Module, section: ActivationCheckpointingConfig, *, given: bool) -> list[str]:
    """What ``initialize`` does with the ``activation_checkpointing`` section.

    ``given``: the section is in the user's config. Only then is :mod:`partita.checkpointing`
    configured, so model code that checks ``is_configured()`` before calling ``configure``
    itself keeps working when the section is absent. A policy also wraps the blocks.
    """
    if not given:
        return []
    configure(None, deepspeed_config=section)
    if section.policy is None:
        return []
    return apply_activation_checkpointing(
        model,
        policy=section.policy,
        k=section.k,
        block_types=section.block_types,
        cpu_offload=section.cpu_checkpointing,
    )
