"""ZeRO-3 with frozen parameters (requires_grad=False), built with and without ``zero.Init``.

Under zero.Init a frozen parameter used to stay freed for good (no optimizer group, so nothing
gathered it): the first forward failed with "setStorage: ... out of bounds for storage of size
0" and reading it inside GatheredParameters segfaulted. Now it stays sharded and is gathered with
its unit (partita/zero/frozen_params.py); built whole, it stays whole on every rank as before.

BlockNet (tests/tiny_models.py) with FREEZE: a whole block (blocks.1, a unit with no trainable
parameter, between trainable ones), one weight of the block called twice per forward
(blocks.0.down.weight), and the final norm (the root unit's). Every parameter is sharded
(persistence threshold 0). The oracle is single-process torch AdamW with the same frozen set.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils.checkpoint import checkpoint

from tests.harness import run_distributed
from tests.tiny_models import VOCAB, BlockNet, build_block_model, make_batches, param_groups, reference_train_model

LR, CLIP, STEPS, GLOBAL_BATCH = 1e-2, 0.5, 3, 8
FREEZE = ("blocks.1.", "blocks.0.down.weight", "norm.")
FROZEN_KEYS = ("blocks.1.norm.weight", "blocks.1.norm.bias", "blocks.1.up.weight", "blocks.1.up.bias",
               "blocks.1.down.weight", "blocks.1.down.bias", "blocks.0.down.weight", "norm.weight", "norm.bias")


def _config(precision: str = "fp32") -> dict:
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 60, "allgather_bucket_size": 50,
                              "stage3_param_persistence_threshold": 0},
        "steps_per_print": 1000,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def freeze(model, names=FREEZE):
    for name, param in model.named_parameters():
        if any(name.startswith(prefix) for prefix in names):
            param.requires_grad_(False)
    return model


def build_frozen() -> torch.nn.Module:
    return freeze(build_block_model())


class CheckpointedBlockNet(BlockNet):
    """Every block call under torch's non-reentrant activation checkpointing: a block's forward
    (frozen parameters included) is recomputed in the backward."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for block in [*self.blocks, self.blocks[0]]:
            h = checkpoint(block, h, use_reentrant=False)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


class KwargsBlockNet(BlockNet):
    """Blocks called with keyword arguments, as Hugging Face models call their layers."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        for block in [*self.blocks, self.blocks[0]]:
            h = block(h=h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def _build(use_init: bool, cfg: dict, names=FREEZE, model_class=BlockNet):
    import partita

    torch.manual_seed(0)  # build_block_model's seed
    if use_init:
        with partita.zero.Init(config_dict_or_path=cfg):
            model = model_class()
    else:
        model = model_class()
    freeze(model, names)  # after construction, as users do (also after zero.Init)
    engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    return engine, model


def _gathered_state(model) -> dict[str, torch.Tensor]:
    import partita

    with partita.zero.GatheredParameters(list(model.parameters())):
        return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def _train(engine, model, *, watch_release: bool = False) -> dict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    gatherer = engine.zero.gatherer
    seen: list = []
    if watch_release:
        # When the gradient reaches the output of blocks.0's first call, blocks.1's backward is over:
        # its frozen parameters (no gradient hook) must be freed by then, not only at the end of backward.
        calls = [0]

        def on_output(module, args, output):
            calls[0] += 1
            if calls[0] % 2 == 1 and output.requires_grad:
                output.register_hook(lambda g: seen.append(
                    [gatherer.state_of(p).value for p in model.blocks[1].parameters()]))

        model.blocks[0].register_forward_hook(on_output)
    xs, ys = make_batches(STEPS, GLOBAL_BATCH)
    micro = engine.train_micro_batch_size_per_gpu()
    losses = []
    for step in range(STEPS):
        lo = rank * micro
        loss = engine(xs[step][lo : lo + micro], ys[step][lo : lo + micro])
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norm": engine.get_global_grad_norm(), "released_in_backward": seen,
            "gathered_after_step": gatherer.num_gathered(), "world": world}


def _parity_body(save_dir: str | None) -> dict:
    import torch.distributed as dist

    import partita
    from partita.zero.state_dict_guard import NotGatheredPlaceholder

    from partita.distributed.init import init_distributed

    init_distributed()
    rank = dist.get_rank()
    out: dict = {}
    for use_init in (False, True):
        engine, model = _build(use_init, _config())
        gatherer = engine.zero.gatherer
        frozen = [p for p in model.parameters() if not p.requires_grad]
        run = {
            "sharded": [gatherer.is_sharded_param(p) for p in frozen],
            "bytes_before": sum(p.untyped_storage().nbytes() for p in frozen),
            "placeholders": sorted(k for k, v in model.state_dict().items() if isinstance(v, NotGatheredPlaceholder)),
        }
        run.update(_train(engine, model, watch_release=use_init))
        run["bytes_after"] = sum(p.untyped_storage().nbytes() for p in frozen)
        run["params"] = _gathered_state(model)
        with torch.no_grad():  # an eval forward gathers frozen parameters too, and frees them
            engine.eval()
            xs, ys = make_batches(1, GLOBAL_BATCH)
            run["eval_loss"] = float(engine(xs[0][:2], ys[0][:2]))
            engine.train()
        run["gathered_after_eval"] = gatherer.num_gathered()
        run["fp32"] = engine.get_fp32_state_dict()
        run["consolidated"] = engine._zero3_consolidated_16bit_state_dict()
        if save_dir is not None:
            name = "init" if use_init else "plain"
            engine.save_checkpoint(f"{save_dir}/{name}", tag="t")
            engine.save_16bit_model(save_dir, f"{name}.safetensors")
        # An edit on rank 0 inside GatheredParameters(modifier_rank=0) reaches every rank, sharded or whole.
        edited = [model.blocks[1].up.weight, model.norm.bias]
        with partita.zero.GatheredParameters(edited, modifier_rank=0):
            if rank == 0:
                for p in edited:
                    p.data.fill_(0.25)
        after = _gathered_state(model)
        run["edited"] = [float(after[k].sum()) for k in ("blocks.1.up.weight", "norm.bias")]
        out["init" if use_init else "plain"] = run
    # The case first reported: BlockNet as it comes (only blocks.1.up frozen), under zero.Init.
    engine, model = _build(True, _config(), names=("blocks.1.up.",))
    out["blocknet"] = {**_train(engine, model), "params": _gathered_state(model)}
    if dist.get_world_size() == 2:
        # bf16: frozen shards in the model dtype, gathered with bf16 trainable ones.
        engine, model = _build(True, _config("bf16"))
        out["bf16"] = {**_train(engine, model), "params": _gathered_state(model)}
        # Activation checkpointing (recomputation gathers them again), and offload_param "cpu"
        # (the trainable pieces of a gather come from host memory, the frozen ones beside them).
        offload = _config()
        offload["zero_optimization"]["offload_param"] = {"device": "cpu"}
        for name, cfg, model_class in (("checkpointed", _config(), CheckpointedBlockNet),
                                       ("offload", offload, BlockNet), ("kwargs", _config(), KwargsBlockNet)):
            engine, model = _build(True, cfg, model_class=model_class)
            out[name] = {**_train(engine, model, watch_release=name == "kwargs"), "params": _gathered_state(model)}
    return out


def _load_body(save_dir: str) -> dict:
    """Fresh engines (built with and without zero.Init) loading both checkpoints."""
    out = {}
    for source in ("init", "plain"):
        for use_init in (True, False):
            engine, model = _build(use_init, _config())
            engine.load_checkpoint(f"{save_dir}/{source}", tag="t")
            loaded = _gathered_state(model)
            _train(engine, model)  # gathers work after a load
            out[(source, use_init)] = loaded
        engine, model = _build(True, _config())
        engine.load_checkpoint(f"{save_dir}/{source}", tag="t", load_module_only=True)
        out[(source, "module_only")] = _gathered_state(model)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _check_against_torch(params: dict, initial: dict, reference: dict, where: str, frozen_keys=FROZEN_KEYS) -> None:
    for name, want in reference.items():
        if name in frozen_keys:
            assert torch.equal(params[name], initial[name]), (where, name)  # never moved
        else:
            assert _rel(params[name], want) < 1e-5, (where, name, _rel(params[name], want))


@pytest.fixture(scope="module")
def reference():
    trained, norms = reference_train_model(build_frozen, num_steps=STEPS, global_batch=GLOBAL_BATCH, lr=LR, clip=CLIP)
    return build_block_model().state_dict(), trained, norms


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    save_dir = tmp_path_factory.mktemp("frozen")
    return save_dir, run_distributed(_parity_body, 2, str(save_dir), timeout=180)


def _check_parity(per_rank: list[dict], reference) -> None:
    initial, trained, norms = reference
    for out in per_rank:
        for kind in ("plain", "init"):
            run, where = out[kind], f"{kind} world={out[kind]['world']}"
            _check_against_torch(run["params"], initial, trained, where)
            assert abs(run["norm"] - norms[-1]) / norms[-1] < 1e-5, (where, run["norm"], norms[-1])
            assert run["gathered_after_step"] == 0 and run["gathered_after_eval"] == 0, where
            assert run["edited"] == [0.25 * 77, 0.25 * 7], where  # 11x7 weight, 7 biases
            if out is not per_rank[0]:  # the exports are rank 0's
                assert run["fp32"] == {} and run["consolidated"] is None, where
                continue
            for name, want in trained.items():  # frozen ones with their real values
                ref = initial[name] if name in FROZEN_KEYS else want
                assert _rel(run["fp32"][name], ref) < 1e-5, (where, "fp32", name)
                assert _rel(run["consolidated"][name].float(), ref) < 1e-5, (where, "16-bit", name)
        plain, init = out["plain"], out["init"]
        assert not any(plain["sharded"]) and plain["bytes_before"] > 0  # built whole: whole, as before
        assert not set(plain["placeholders"]) & set(FROZEN_KEYS)
        assert all(init["sharded"]) and init["bytes_before"] == 0 and init["bytes_after"] == 0
        assert set(FROZEN_KEYS) <= set(init["placeholders"])
        # blocks.1 (frozen, inputs need gradients) freed right after its backward, every step.
        assert init["released_in_backward"] == [["sharded"] * 6] * STEPS, init["released_in_backward"]
        assert plain["losses"] == init["losses"]  # the same model, sharded or not
        blocknet, _ = reference_train_model(build_block_model, num_steps=STEPS, global_batch=GLOBAL_BATCH, lr=LR,
                                            clip=CLIP)
        _check_against_torch(out["blocknet"]["params"], initial, blocknet, "blocknet",
                             frozen_keys=("blocks.1.up.weight", "blocks.1.up.bias"))
    for other in per_rank[1:]:
        assert all(torch.equal(other["init"]["params"][k], per_rank[0]["init"]["params"][k]) for k in trained)


@pytest.mark.parametrize("world_size", [1, 4])
def test_frozen_params_match_torch(world_size, reference) -> None:
    _check_parity(run_distributed(_parity_body, world_size, None, timeout=180), reference)


def test_frozen_params_match_torch_world2_and_bf16(world2, reference) -> None:
    _, per_rank = world2
    _check_parity(per_rank, reference)
    initial, trained, _ = reference
    for out in per_rank:
        for name in ("checkpointed", "offload", "kwargs"):
            _check_against_torch(out[name]["params"], initial, trained, name)
            assert out[name]["gathered_after_step"] == 0, name
        assert out["kwargs"]["released_in_backward"] == [["sharded"] * 6] * STEPS  # keyword inputs hooked too
        bf16 = out["bf16"]
        assert all(torch.isfinite(torch.tensor(bf16["losses"])))
        for name in FROZEN_KEYS:
            assert torch.equal(bf16["params"][name], initial[name].bfloat16().float()), name


def test_checkpoints_and_exports_hold_frozen_values(world2, reference) -> None:
    from partita.checkpoint.consolidate import consolidate, load_consolidated

    save_dir, per_rank = world2
    initial = reference[0]
    saved = per_rank[0]["init"]["params"]  # values when saved (the edit came after)
    meta = json.loads((save_dir / "init" / "t" / "meta.json").read_text())
    assert sorted(meta["model"]["frozen_shards"]) == sorted(k for k in FROZEN_KEYS)
    assert not set(FROZEN_KEYS) & set(meta["model"]["tensors"])  # not in the model file: each rank wrote its shard
    plain_meta = json.loads((save_dir / "plain" / "t" / "meta.json").read_text())
    assert plain_meta["model"]["frozen_shards"] == {} and set(FROZEN_KEYS) <= set(plain_meta["model"]["tensors"])
    for name in ("init", "plain"):  # save_16bit_model
        weights = load_file(str(save_dir / f"{name}.safetensors"))
        for key, want in per_rank[0][name]["params"].items():
            if key != "head.weight":  # tied: stored once, under embed.weight
                assert torch.equal(weights[key].float(), want), (name, key)
    consolidate(save_dir / "init" / "t", save_dir / "hf")
    consolidated = load_consolidated(save_dir / "hf")
    for key, want in saved.items():
        assert torch.equal(consolidated[key], want), key
    # Loads at world 1 (2 -> 1: each checkpoint into models built with and without zero.Init) and 2.
    for world in (1, 2):
        for result in run_distributed(_load_body, world, str(save_dir), timeout=180):
            for (source, target), loaded in result.items():
                want = per_rank[0][source]["params"]
                for key, value in want.items():
                    assert torch.equal(loaded[key], value), (world, source, target, key)
                for key in FROZEN_KEYS:
                    assert torch.equal(loaded[key], initial[key]), (world, source, target, key)
