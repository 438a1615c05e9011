"""partita.estimate for frozen parameters built under zero.Init at ZeRO-3 (sharded: 1/N of the
16-bit weights per rank, no gradient, master or optimizer state), byte for byte against real
engines at 1 and 2 ranks; and sequence tiling's activations (tiled loss, tiled MLP) against the
saved-tensor bytes a forward really keeps."""

from __future__ import annotations

import os

import pytest
import torch

from partita.estimate import GPTShape, Setup, estimate_memory
from partita.estimate.activations import SAVED_KINDS
from partita.estimate.model_info import model_info
from tests._estimate_helpers import _ACT_BATCH, _ACT_SHAPE, _batch, saved_tensor_bytes
from tests.harness import run_distributed

# pos_emb (5 x 9 = 45 elements) and one block's qkv weight (9 x 27) are frozen and above the
# persistence threshold (30): sharded. ln_1 of block 0 (9 + 9) is frozen and persistent: whole.
_FROZEN = ("pos_emb.weight", "blocks.1.attn.qkv.weight", "blocks.0.ln_1.weight", "blocks.0.ln_1.bias")


def _build(cfg: dict, use_init: bool):
    import partita
    from partita.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=13, block_size=5, n_layer=2, n_head=3, n_embd=9)
    if use_init:
        with partita.zero.Init(config_dict_or_path=cfg):
            model = GPT(config)
    else:
        model = GPT(config)
    for name, param in model.named_parameters():
        if name in _FROZEN:
            param.requires_grad_(False)
    return model


def _bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def measure_frozen(cases: list[tuple[str, bool]]) -> list[dict]:
    """One optimizer step per (dtype, built under zero.Init) at ZeRO-3; measured and estimated bytes."""
    import partita

    world = int(os.environ["WORLD_SIZE"])
    out = []
    for dtype, use_init in cases:
        cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 30}, "steps_per_print": 1000}
        if dtype != "fp32":
            cfg[dtype] = {"enabled": True}
        model = _build(cfg, use_init)
        groups = model.optimizer_param_groups(0.1)
        info = model_info(model, param_groups=groups)  # before initialize: zero.Init's shards are still known
        engine, _, _, _ = partita.initialize(model=model, model_parameters=groups, config=cfg)
        fold = engine.config.zero_optimization.one_rank_gradient_fold  # what initialize chose runs
        estimate = estimate_memory(info, Setup.from_config(cfg, world_size=world, streamed_step=fold == "stream",
                                                           fold_gradients_at_end=fold in ("end", "stream")))
        g = torch.Generator().manual_seed(int(os.environ["RANK"]))
        x = torch.randint(0, 13, (2, 5), generator=g)
        engine.backward(engine(x, x)[1])
        grads = sum(grp.grad_partition.untyped_storage().nbytes() for grp in engine.optimizer.groups
                    if grp.grad_partition is not None)
        engine.step()
        gatherer = engine.zero.gatherer
        frozen = gatherer.frozen.nbytes() if gatherer.frozen is not None else 0
        trainable = {p for grp in engine.optimizer.groups for p in grp.params}
        whole_frozen = _bytes(p for p in model.parameters() if p not in trainable)
        opt = engine.optimizer
        masters = _bytes(grp.master for grp in opt.groups)
        states = _bytes(t for st in opt.inner.state.values() for t in st.values() if torch.is_tensor(t))
        lines = {line.item: line.nbytes for line in estimate.lines}
        out.append({
            "case": (dtype, use_init),
            "measured": {"frozen shards": frozen, "frozen whole": whole_frozen, "optimizer states": masters + states,
                         "gradients": grads},
            "estimated": {"frozen shards": lines.get("frozen parameter shards (zero.Init, sharded)", 0),
                          "frozen whole": lines.get("frozen parameters", 0),
                          "optimizer states": estimate.by_category("accelerator")["optimizer states"],
                          "gradients": sum(x.nbytes for x in estimate.lines if x.kind == "grad_partition")},
            "frozen_numel": [p.numel() for p in model.parameters() if p not in trainable],
        })
    return out


_CASES = [("fp32", True), ("bf16", True), ("bf16", False)]


@pytest.mark.parametrize("world", [1, 2])
def test_frozen_zero_init_params_exact(world):
    results = run_distributed(measure_frozen, world, _CASES)
    for rank in results:
        for r in rank:
            assert r["measured"] == r["estimated"], r["case"]
        by_case = {r["case"]: r["measured"] for r in rank}
        # Under zero.Init each rank keeps ceil(numel / N) of each sharded frozen parameter (45 and 243
        # elements) in the model dtype; the persistent ln_1 (18 elements) stays whole.
        shard = -(-45 // world) + -(-243 // world)
        assert by_case[("bf16", True)]["frozen shards"] == 2 * shard
        assert by_case[("fp32", True)]["frozen shards"] == 4 * shard
        assert by_case[("bf16", True)]["frozen whole"] == 2 * 18
        # Built whole (no zero.Init), every frozen parameter stays whole on every rank.
        assert by_case[("bf16", False)] == {**by_case[("bf16", True)], "frozen shards": 0,
                                             "frozen whole": 2 * (45 + 243 + 18)}


def test_frozen_zero_init_estimate_of_a_shape():
    # Setup.frozen_zero_init says how frozen parameters were built when the module cannot (meta).
    with torch.device("meta"):
        model = _build({}, use_init=False)
    info = model_info(model, param_groups=model.optimizer_param_groups(0.1))
    sharded = estimate_memory(info, stage=3, world_size=4, stage3_param_persistence_threshold=30, frozen_zero_init=True)
    whole = estimate_memory(info, stage=3, world_size=4, stage3_param_persistence_threshold=30)
    lines = {x.item: x.nbytes for x in sharded.lines}
    assert lines["frozen parameter shards (zero.Init, sharded)"] == 2 * (12 + 61)
    assert lines["frozen parameters"] == 2 * 18
    assert {x.item: x.nbytes for x in whole.lines}["frozen parameters"] == 2 * (45 + 243 + 18)
    # Below stage 3 nothing is sharded.
    assert "frozen parameter shards (zero.Init, sharded)" not in {
        x.item for x in estimate_memory(info, stage=2, world_size=4, frozen_zero_init=True).lines}


# ----------------------------------------------------------------------------- sequence tiling


def _tiled_model(dtype: torch.dtype, loss_tile: int | None, mlp_tile: int | None, policy: str | None):
    from partita.activation_checkpointing.apply import apply_activation_checkpointing
    from partita.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    s = _ACT_SHAPE
    model = GPT(GPTConfig(vocab_size=s.vocab, block_size=s.seq_len, n_layer=s.n_layers, n_head=s.n_heads,
                          n_embd=s.d_model, loss_tile_tokens=loss_tile, mlp_tile_tokens=mlp_tile)).to(dtype)
    if policy is not None:
        apply_activation_checkpointing(model, policy=policy)
    return model


def _saved_predicted(dtype: str, **options) -> int:
    estimate = estimate_memory(_ACT_SHAPE, dtype=dtype, micro_batch=_ACT_BATCH, **options)
    return sum(x.nbytes for x in estimate.lines if x.kind in SAVED_KINDS)


# (dtype, loss tile, MLP tile, checkpointing): measured saved-tensor bytes of the forward on CPU
# (torch 2.13), pinned so that a change in the tiled code shows up here first.
_TILED = [
    ("fp32", 64, None, None, None),
    ("fp32", None, 48, None, None),
    ("fp32", 100, 48, None, None),
    ("bf16", 64, 64, None, None),
    ("fp32", 64, 48, "every", None),
]


@pytest.mark.parametrize("dtype,loss_tile,mlp_tile,policy,_", _TILED)
def test_tiled_activations_match_saved_bytes(dtype, loss_tile, mlp_tile, policy, _):
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    idx, targets = _batch()
    measured = saved_tensor_bytes(_tiled_model(torch_dtype, loss_tile, mlp_tile, policy), idx, targets)
    predicted = _saved_predicted(dtype, loss_tile_tokens=loss_tile, mlp_tile_tokens=mlp_tile,
                                 checkpointing=policy or "none")
    untiled = _saved_predicted(dtype, checkpointing=policy or "none")
    assert predicted < untiled
    assert abs(measured - predicted) <= 0.01 * measured, (measured, predicted)


def test_tiled_activation_exact_figures():
    """fp32, both tiled: the formula is exact up to one scalar autograd saves for the mean."""
    idx, targets = _batch()
    measured = saved_tensor_bytes(_tiled_model(torch.float32, 64, 48, None), idx, targets)
    predicted = _saved_predicted("fp32", loss_tile_tokens=64, mlp_tile_tokens=48)
    b, s, h, a, L = _ACT_BATCH, _ACT_SHAPE.seq_len, _ACT_SHAPE.d_model, _ACT_SHAPE.n_heads, _ACT_SHAPE.n_layers
    block = 4 * (8 * b * s * h) + 2 * (2 * b * s * 4) + b * a * s * 4  # 8bsh + LayerNorm stats + lse
    head = 4 * 2 * b * s * h + 2 * b * s * 4 + 4 * b * s  # final norm in/out + stats + per-token lse
    assert predicted == L * block + head + 2 * b * s * 8 + s * 8
    assert measured == predicted + _LOSS_SCALARS


_LOSS_SCALARS = 8  # the mean's divisor, the int64 count of scored tokens, saved by the division


def test_tiling_lowers_the_peak_and_the_loss_tile_sets_the_backward_transient():
    shape = GPTShape.preset("gpt-1.3b")
    plain = estimate_memory(shape, micro_batch=1, seq_len=2048, checkpointing="every")
    tiled = estimate_memory(shape, micro_batch=1, seq_len=2048, checkpointing="every", loss_tile_tokens=512,
                            mlp_tile_tokens=1024)
    assert tiled.peak_accelerator < plain.peak_accelerator
    grads = {x.kind: x.nbytes for x in tiled.lines}["loss_grads"]
    v, h = shape.vocab, shape.d_model
    assert grads == 512 * v * (4 + 2) + 4 * v * h + 2048 * h * 2
    assert "logits" not in {x.kind for x in tiled.lines}
    with pytest.raises(NotImplementedError, match="selective"):
        Setup(mlp_tile_tokens=64, checkpointing="selective")
