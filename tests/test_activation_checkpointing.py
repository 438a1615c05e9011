"""Activation checkpointing: same gradients as without it, fewer saved tensors, keys unchanged.

The oracle for every policy is the same model run without checkpointing, with dropout on
and the same seed: recompute must replay the RNG, so gradients are bitwise equal.
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import partita.checkpointing as ds_checkpointing
from partita.activation_checkpointing import (
    apply_activation_checkpointing,
    checkpointed_blocks,
    find_repeated_blocks,
    remove_activation_checkpointing,
)
from partita.activation_checkpointing.core import settings
from partita.models.gpt import GPT, Block, GPTConfig
from tests.harness import run_distributed

LAYERS = 4


@pytest.fixture(autouse=True)
def _fresh_settings():
    ds_checkpointing.reset()
    yield
    ds_checkpointing.reset()


def _gpt(dropout: float = 0.2) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=LAYERS, n_head=2, n_embd=32, block_size=16, dropout=dropout))


def _batch() -> torch.Tensor:
    return torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(5))


def _grads_and_saved(model: nn.Module, x: torch.Tensor) -> tuple[dict[str, torch.Tensor], int]:
    """Gradients of one seeded step, and how many tensors autograd saved through the hooks."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the dropout masks
    saved = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(x, x)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, saved


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _ops_run_in_backward(model: nn.Module, x: torch.Tensor) -> Counter[str]:
    torch.manual_seed(1)
    _, loss = model(x, x)
    with _OpCounter() as counter:  # CPU backward runs on this thread, so the mode sees recompute
        loss.backward()
    return counter.counts


@pytest.mark.parametrize(
    ("policy", "options", "wrapped"),
    [
        ("every", {}, [f"blocks.{i}" for i in range(LAYERS)]),
        ("every_k", {"k": 2}, ["blocks.1", "blocks.3"]),
        ("selective", {}, [f"blocks.{i}" for i in range(LAYERS)]),
        ("every", {"cpu_offload": True}, [f"blocks.{i}" for i in range(LAYERS)]),
        ("selective", {"cpu_offload": True}, [f"blocks.{i}" for i in range(LAYERS)]),
    ],
)
def test_policy_gives_identical_gradients_with_dropout(policy: str, options: dict, wrapped: list[str]) -> None:
    model, x = _gpt(), _batch()
    reference, _ = _grads_and_saved(model, x)
    assert apply_activation_checkpointing(model, policy=policy, **options) == wrapped
    grads, _ = _grads_and_saved(model, x)
    for name, expected in reference.items():
        assert torch.equal(grads[name], expected), name


def test_saved_tensor_counts_per_policy() -> None:
    model, x = _gpt(), _batch()
    # Saved tensors of one block alone, so the expected totals follow from the structure.
    block_saved = 0

    def pack(t):
        nonlocal block_saved
        block_saved += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        torch.manual_seed(1)
        model.blocks[0](torch.randn(3, 16, 32, requires_grad=True))
    _, plain = _grads_and_saved(model, x)
    outside = plain - LAYERS * block_saved
    assert block_saved > 10 and outside > 0

    apply_activation_checkpointing(model, policy="every")
    assert _grads_and_saved(model, x)[1] == outside + LAYERS  # one saved input per block
    remove_activation_checkpointing(model)
    apply_activation_checkpointing(model, policy="every_k", k=2)
    assert _grads_and_saved(model, x)[1] == outside + 2 * block_saved + 2
    remove_activation_checkpointing(model)
    # Offloaded: the block inputs go through save_on_cpu's hooks instead of ours.
    apply_activation_checkpointing(model, policy="every", cpu_offload=True)
    assert _grads_and_saved(model, x)[1] == outside


def test_selective_keeps_matmuls_and_recomputes_elementwise() -> None:
    model, x = _gpt(), _batch()
    assert _ops_run_in_backward(model, x)["addmm"] == 0  # linear backward uses mm, never addmm
    apply_activation_checkpointing(model, policy="every")
    full = _ops_run_in_backward(model, x)
    remove_activation_checkpointing(model)
    apply_activation_checkpointing(model, policy="selective")
    selective = _ops_run_in_backward(model, x)
    # Full recompute re-runs the 4 linear layers of every block; selective re-runs none.
    assert full["addmm"] == 4 * LAYERS and selective["addmm"] == 0
    # Both recompute GELU and LayerNorm (2 per block) and every dropout mask (3 per block).
    assert full["gelu"] == selective["gelu"] == LAYERS
    assert full["native_layer_norm"] == selective["native_layer_norm"] == 2 * LAYERS
    assert full["bernoulli_"] == selective["bernoulli_"] == 3 * LAYERS


def test_state_dict_keys_identity_and_removal() -> None:
    model = _gpt()
    keys = list(model.state_dict())
    blocks_before = list(model.blocks)
    names = apply_activation_checkpointing(model, policy="every")
    assert list(model.state_dict()) == keys
    assert list(model.blocks) == blocks_before and all(type(b) is Block for b in model.blocks)
    assert checkpointed_blocks(model) == names
    model.load_state_dict(_gpt().state_dict())  # loads with the unchanged keys
    with pytest.raises(ValueError, match="already checkpointed"):
        apply_activation_checkpointing(model, policy="selective")
    assert remove_activation_checkpointing(model) == names
    assert checkpointed_blocks(model) == [] and "forward" not in model.blocks[0].__dict__


def test_first_input_without_grad() -> None:
    # Reentrant checkpointing (DeepSpeed's) gives these parameters no gradient at all.
    torch.manual_seed(0)
    model = nn.Sequential(nn.ModuleList([nn.Linear(6, 6) for _ in range(3)]))
    stack = model[0]
    x = torch.randn(4, 6)  # requires_grad=False

    def run() -> list[torch.Tensor]:
        stack.zero_grad(set_to_none=True)
        h = x
        for layer in stack:
            h = torch.tanh(layer(h))
        h.sum().backward()
        return [p.grad.clone() for p in stack.parameters()]

    reference = run()
    assert apply_activation_checkpointing(model, policy="every") == ["0.0", "0.1", "0.2"]
    assert all(torch.equal(a, b) for a, b in zip(run(), reference))


def test_block_detection() -> None:
    model = _gpt()
    assert [n for n, _ in find_repeated_blocks(model)] == [f"blocks.{i}" for i in range(LAYERS)]
    assert [n for n, _ in find_repeated_blocks(model, block_types="MLP")] == [f"blocks.{i}.mlp" for i in range(LAYERS)]
    # Outermost matches only: the MLPs inside the Blocks are covered by their Block.
    found = [n for n, _ in find_repeated_blocks(model, block_types=(Block, nn.Linear))]
    assert found == [f"blocks.{i}" for i in range(LAYERS)] + ["lm_head"]
    with pytest.raises(ValueError, match="no nn.ModuleList"):
        find_repeated_blocks(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="no module of block_types"):
        find_repeated_blocks(model, block_types="Transformer")
    with pytest.raises(ValueError, match="only applies to policy 'every_k'"):
        apply_activation_checkpointing(model, policy="every", k=2)
    with pytest.raises(ValueError, match="policy='sometimes'"):
        apply_activation_checkpointing(model, policy="sometimes")


def test_deepspeed_functional_api() -> None:
    assert not ds_checkpointing.is_configured()
    with pytest.raises(NotImplementedError, match="model parallelism"):
        ds_checkpointing.configure(object())
    ds_checkpointing.configure(
        None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True, "profile": True}}, profile=False
    )
    assert ds_checkpointing.is_configured()
    assert settings().checkpoint_in_cpu is True and settings().profile is False  # keyword wins
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds_checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=4)
    messages = " ".join(str(w.message) for w in caught)
    assert "partition_activations has no effect" in messages and "no model parallelism" in messages
    assert "contiguous_memory_optimization has no effect" in messages and "number_checkpoints" in messages

    layer = nn.Linear(5, 5)
    x = torch.randn(2, 5, requires_grad=True)
    expected = torch.autograd.grad(torch.tanh(layer(x)).sum(), [x, layer.weight])
    ds_checkpointing.configure(None, checkpoint_in_cpu=True, profile=True)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("partita").addHandler(handler)
    previous = logging.getLogger("partita").level
    logging.getLogger("partita").setLevel(logging.INFO)
    try:
        out = ds_checkpointing.checkpoint(lambda t: torch.tanh(layer(t)), x)
        got = torch.autograd.grad(out.sum(), [x, layer.weight])
    finally:
        logging.getLogger("partita").removeHandler(handler)
        logging.getLogger("partita").setLevel(previous)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert [r.split(": ")[1].split()[0] for r in records] == ["forward", "recompute"]
    ds_checkpointing.reset()
    assert not ds_checkpointing.is_configured() and settings().checkpoint_in_cpu is False


def _train_gpt_under_zero(configs: list[dict], stage: int = 2) -> list[dict]:
    import partita

    out = []
    for section in configs:
        model = _gpt(dropout=0.1)
        cfg = {
            "train_batch_size": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage},
            "seed": 3,
            "steps_per_print": 1000,
            "activation_checkpointing": section,
        }
        engine, _, _, _ = partita.initialize(model=model, config=cfg)
        rank = engine.topology.rank
        x = torch.randint(0, 256, (3, 4, 16), generator=torch.Generator().manual_seed(7))
        losses = []
        for step in range(3):
            _, loss = engine(x[step, 2 * rank : 2 * rank + 2], x[step, 2 * rank : 2 * rank + 2])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out.append({"wrapped": checkpointed_blocks(model), "losses": losses,
                    "params": {n: p.detach().clone() for n, p in model.named_parameters()}})  # fmt: skip
    return out


def _train_under_stages(configs: list[dict], stages: list[int]) -> list[list[dict]]:
    return [_train_gpt_under_zero(configs, stage) for stage in stages]


def test_initialize_applies_the_policy_under_zero_on_two_ranks() -> None:
    # ZeRO-2 (sharded gradients) and ZeRO-3 (blocks are also the units gathered just in time:
    # recompute runs while the block is gathered for its backward).
    configs = [{}, {"policy": "every"}, {"policy": "selective", "cpu_checkpointing": True}, {"policy": "every_k", "k": 3}]
    per_rank = run_distributed(_train_under_stages, 2, configs, [2, 3], timeout=150)
    for per_stage in per_rank:
        for plain, *checkpointed in per_stage:
            assert plain["wrapped"] == []
            expected_wrapped = [[f"blocks.{i}" for i in range(LAYERS)]] * 2 + [["blocks.2"]]
            for result, wrapped in zip(checkpointed, expected_wrapped):
                assert result["wrapped"] == wrapped
                assert result["losses"] == plain["losses"]
                for name, value in plain["params"].items():
                    assert torch.equal(result["params"][name], value), name
    assert per_rank[0][0][1]["params"]["tok_emb.weight"].equal(per_rank[1][0][1]["params"]["tok_emb.weight"])
