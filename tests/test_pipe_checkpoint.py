"""Pipeline checkpoints keyed by layer (partita/pipe/checkpoint.py): saved at pipe 2 x data 2,
loaded at pipe 2 x data 2, pipe 4, pipe 2 x data 1 and one process, at ZeRO 0 and 1.

The model is test_pipe_parity's: a tied embedding (layer 0) and LM head (layer 6, forward_fn),
four blocks and a LayerNorm, so the tie spans the first and last stage at every stage count.
Every layout trains on the same global batch of 8 samples (data ranks x micro-batches x 2).

What must hold: after a load, every parameter, fp32 master and Adam moment (and the step
count) is bit-identical to the saved run's, whatever the layout; the next 2 steps give the
saved layout exactly the losses of the run that never stopped, and the other layouts the same
losses up to the summation order of their gradients (1e-6 relative: other micro-batch and
data-rank splits add the same gradients in another order). Three spawns (4, 2, 1 ranks).

A fourth spawn (4 ranks) saves test_pipe_compose's MLP model at pipe 2 x tensor 2 (the blocks'
MLPs split) and loads it at the same layout and at pipe 2 x data 2 under ZeRO-2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.harness import run_distributed
from tests.test_pipe_parity import BASE_SEED, DIM, MICRO, VOCAB, Block, layer_specs, lm_head, lm_loss

GLOBAL = 8  # samples per global batch in every layout
LR, CLIP = 1e-2, 0.05
SAVED_STEPS, NEXT_STEPS = 2, 2


def _batches() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, VOCAB, (SAVED_STEPS + NEXT_STEPS, GLOBAL, 6), generator=g)
    return ids[..., :-1], ids[..., 1:]


def _config(micro_batches: int, zero_stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": micro_batches,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
        # The learning rate changes every step: a scheduler that did not resume would show in the losses.
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 8}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": zero_stage, "reduce_bucket_size": 50},
        "pipeline": {"schedule": "1f1b" if micro_batches >= 2 else "gpipe"},
        "steps_per_print": 1000,
    }


def _engine(stages: int, zero_stage: int, specs=None, virtual_stages: int = 1, tensor: int = 1):
    import partita
    import torch.distributed as dist
    from partita.pipe import PipelineModule

    micro_batches = GLOBAL // MICRO // (dist.get_world_size() // (stages * tensor))
    model = PipelineModule(specs or layer_specs(), num_stages=stages, loss_fn=lm_loss, partition_method="uniform",
                           seed_layers=True, base_seed=BASE_SEED, virtual_stages=virtual_stages)
    config = _config(micro_batches, zero_stage)
    if virtual_stages > 1:
        config["pipeline"]["schedule"] = "interleaved_1f1b"
    if tensor > 1:
        from tests.test_pipe_compose import TP_SPECS

        config["tensor_parallel"] = {"autotp_size": tensor, "partition_config": {"layer_specs": TP_SPECS}}
    engine, *_ = partita.initialize(model=model, config=config)
    return engine


def _train(engine, steps) -> list[float]:
    xs, ys = _batches()
    m, data, d = engine.micro_batches, engine.topology.data_size, engine.topology.data_rank
    losses = []
    for step in steps:
        micro = [(xs[step][(d * m + k) * MICRO:][:MICRO], ys[step][(d * m + k) * MICRO:][:MICRO]) for k in range(m)]
        assert data * m * MICRO == GLOBAL
        losses.append(engine.train_batch(iter(micro)).item())
    return losses


def _state(engine) -> dict:
    """This rank's weights and its owned ranges of every parameter's fp32 master and Adam moments."""
    from partita.checkpoint.snapshot import param_names

    names = param_names(engine.module)
    inner = engine.optimizer.inner
    pieces = []
    for group in engine.optimizer.groups:
        state = inner.state[group.master]
        for param, spec, (start, end) in group.owned_slices():
            if end > start:
                span = slice(spec.partition_offset, spec.partition_offset + end - start)
                pieces.append((names[param], start, end, spec.numel, float(state["step"]),
                               {k: t[span].clone() for k, t in (("master", group.master), ("exp_avg", state["exp_avg"]),
                                                                ("exp_avg_sq", state["exp_avg_sq"]))}))
    return {"module": {k: v.detach().clone() for k, v in engine.module.state_dict().items()}, "pieces": pieces,
            "lr": engine.get_lr(), "global_steps": engine.global_steps}


def _save_then_reshard_on_4(save_dir: str) -> dict:
    import partita
    from partita.checkpoint import CheckpointMismatchError
    from partita.pipe import LayerSpec

    partita.init_distributed()
    out: dict = {}
    engine = _engine(2, zero_stage=1)  # pipe 2 x data 2
    out["losses_before"] = _train(engine, range(SAVED_STEPS))
    # Asynchronous: written from a CPU copy while the run goes on (the next load waits for it).
    engine.save_checkpoint(save_dir, tag="pipe2x2", client_state={"note": "from pipe 2 x data 2"}, async_save=True)
    out["saved"] = _state(engine)
    out["continued"] = _train(engine, range(SAVED_STEPS, SAVED_STEPS + NEXT_STEPS))

    same = _engine(2, zero_stage=1)
    path, client = same.load_checkpoint(save_dir)  # tag None: the one `latest` names
    out["same"] = {"path": path, "client": client, "state": _state(same),
                   "losses": _train(same, range(SAVED_STEPS, SAVED_STEPS + NEXT_STEPS))}

    pipe4 = _engine(4, zero_stage=0)  # pipe 4 x data 1: the tie between stages 0 and 3
    pipe4.load_checkpoint(save_dir, tag="pipe2x2")
    out["pipe4"] = {"state": _state(pipe4), "losses": _train(pipe4, range(SAVED_STEPS, SAVED_STEPS + NEXT_STEPS))}

    # One more block: layers 5 and 6 move, so the layer keys differ from the checkpoint's.
    longer = layer_specs()
    longer.insert(5, LayerSpec(Block, DIM))
    other = _engine(4, zero_stage=0, specs=longer)
    try:
        other.load_checkpoint(save_dir)
    except CheckpointMismatchError as error:
        out["mismatch"] = str(error)
    return out


def _reshard_on(save_dir: str, stages: int, zero_stage: int, virtual_stages: tuple[int, ...] = (1,)) -> list[dict]:
    import partita

    partita.init_distributed()
    out = []
    for virtual in virtual_stages:
        engine = _engine(stages, zero_stage, virtual_stages=virtual)
        engine.load_checkpoint(save_dir)
        out.append({"state": _state(engine), "losses": _train(engine, range(SAVED_STEPS, SAVED_STEPS + NEXT_STEPS))})
    weights_only = _engine(stages, zero_stage)
    weights_only.load_checkpoint(save_dir, load_module_only=True)
    out.append({"module": {k: v.detach().clone() for k, v in weights_only.module.state_dict().items()},
                "global_steps": weights_only.global_steps})
    return out


def _whole_optimizer_state(engine) -> dict:
    """Each parameter's master and moments as this rank's local tensor, with its tensor-parallel
    split (one data rank: a rank owns every element of its local shards)."""
    from partita.checkpoint.snapshot import param_names
    from partita.tensor_parallel.layers import tensor_shard_of

    assert engine.topology.zero_size == 1
    names, inner, out = param_names(engine.module), engine.optimizer.inner, {}
    for group in engine.optimizer.groups:
        state = inner.state[group.master]
        for param, spec, (start, end) in group.owned_slices():
            span = slice(spec.partition_offset, spec.partition_offset + end - start)
            shard = tensor_shard_of(param)
            out[names[param]] = ({k: t[span].reshape(spec.shape).clone() for k, t in
                                  (("master", group.master), ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"]))},
                                 None if shard is None else (shard.dim, shard.full_shape, shard.full_ranges()))
    return out


def _tensor_pipeline_on_4(save_dir: str) -> dict:
    """Saved at pipe 2 x tensor 2 (the blocks' MLPs split), loaded at the same layout and at
    pipe 2 x data 2 under ZeRO-2 (whole tensors, sharded over the data ranks)."""
    import partita
    from tests.test_pipe_compose import _whole_state
    from tests.test_pipe_compose import layer_specs as mlp_specs

    partita.init_distributed()
    out: dict = {}
    saved = _engine(2, zero_stage=1, specs=mlp_specs(), tensor=2)
    _train(saved, range(SAVED_STEPS))
    saved.save_checkpoint(save_dir, tag="pipe2xtp2")
    out["saved"] = {"weights": _whole_state(saved.module), "optimizer": _whole_optimizer_state(saved)}
    out["continued"] = _train(saved, range(SAVED_STEPS, SAVED_STEPS + NEXT_STEPS))
    same = _engine(2, zero_stage=1, specs=mlp_specs(), tensor=2)
    same.load_checkpoint(save_dir)
    out["same"] = _train(same, range(SAVED_STEPS, SAVED_STEPS + NEXT_STEPS))
    zero2 = _engine(2, zero_stage=2, specs=mlp_specs())
    zero2.load_checkpoint(save_dir)
    out["zero2"] = {"state": _state(zero2), "losses": _train(zero2, range(SAVED_STEPS, SAVED_STEPS + NEXT_STEPS))}
    return out


# ---------------------------------------------------------------------------- helpers of the checks


def _merged(states: list[dict]) -> tuple[dict, dict]:
    """Every rank's weights (replicas and tied copies must agree exactly) and whole flat
    master/moment tensors per parameter, assembled from the owned ranges."""
    weights: dict[str, torch.Tensor] = {}
    flats: dict[str, dict[str, torch.Tensor]] = {}
    steps = set()
    for state in states:
        for key, value in state["module"].items():
            if key in weights:
                assert torch.equal(weights[key], value), key
            weights[key] = value
        for name, start, end, numel, step, tensors in state["pieces"]:
            steps.add(step)
            whole = flats.setdefault(name, {k: torch.full((numel,), float("nan")) for k in tensors})
            for k, t in tensors.items():
                seen = whole[k][start:end]
                assert torch.isnan(seen).all() or torch.equal(seen, t), (name, k)
                seen.copy_(t)
    assert len(steps) <= 1, steps  # every stage and group stepped as often
    for name, whole in flats.items():
        assert not any(torch.isnan(t).any() for t in whole.values()), name  # every element owned by some rank
    return weights, {"flats": flats, "step": steps.pop() if steps else None}


def _assert_identical(got: list[dict], saved: list[dict]) -> None:
    got_w, got_o = _merged(got)
    want_w, want_o = _merged(saved)
    assert sorted(got_w) == sorted(want_w)
    for key in want_w:
        assert torch.equal(got_w[key], want_w[key]), key
    assert got_o["step"] == want_o["step"]
    assert sorted(got_o["flats"]) == sorted(want_o["flats"])
    for name, tensors in want_o["flats"].items():
        for kind, value in tensors.items():
            assert torch.equal(got_o["flats"][name][kind], value), (name, kind)


def _reference_layers() -> nn.Sequential:
    """A plain nn.Sequential of the same layers (the head calls the embedding without registering it)."""

    class TiedHead(nn.Module):
        def __init__(self, embedding: nn.Embedding) -> None:
            super().__init__()
            self.embedding = [embedding]  # a list: not a submodule, so its weight is not this position's key

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return lm_head(self.embedding[0], x)

    specs = layer_specs()
    embedding = specs[0].build()
    return nn.Sequential(embedding, *(s.build() for s in specs[1:-1]), TiedHead(embedding))


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    save_dir = tmp_path_factory.mktemp("pipe_ckpt")
    return save_dir, run_distributed(_save_then_reshard_on_4, 4, str(save_dir), timeout=400)


# ---------------------------------------------------------------------------- tests


def test_same_layout_resumes_bit_identically(saved_run) -> None:
    save_dir, results = saved_run
    saved = [r["saved"] for r in results]
    for r in results:
        assert r["same"]["path"] == str(save_dir / "pipe2x2")
        assert r["same"]["client"] == {"note": "from pipe 2 x data 2"}
        assert r["same"]["state"]["global_steps"] == SAVED_STEPS and r["same"]["state"]["lr"] == r["saved"]["lr"]
        assert r["same"]["losses"] == r["continued"]  # exactly: the same layout adds in the same order
    _assert_identical([r["same"]["state"] for r in results], saved)
    assert (save_dir / "latest").read_text().strip() == "pipe2x2"


def test_pipe_4_loads_pipe_2_by_data_2(saved_run) -> None:
    _, results = saved_run
    _assert_identical([r["pipe4"]["state"] for r in results], [r["saved"] for r in results])
    for r in results:
        assert r["pipe4"]["losses"] == pytest.approx(r["continued"], rel=1e-6, abs=0)


def test_pipe_2_by_data_1_interleaved_and_one_process_load_it(saved_run) -> None:
    save_dir, results = saved_run
    saved = [r["saved"] for r in results]
    # pipe 2 x data 1 also with 2 model chunks per rank (interleaved 1F1B: rank 0 holds layers 0-1 and 4-5).
    for world, stages, zero_stage, virtual in ((2, 2, 1, (1, 2)), (1, 1, 0, (1,))):
        runs = run_distributed(_reshard_on, world, str(save_dir), stages, zero_stage, virtual)
        for v, got in zip(virtual, zip(*runs)):
            _assert_identical([g["state"] for g in got], saved)
            for g in got:
                assert g["losses"] == pytest.approx(results[0]["continued"], rel=1e-6, abs=0), (world, stages, v)
        # load_module_only: the weights (every stage's), neither counters nor optimizer state.
        weights, _ = _merged([r[-1] | {"pieces": []} for r in runs])
        saved_weights, _ = _merged(saved)
        assert sorted(weights) == sorted(saved_weights)
        assert all(torch.equal(weights[k], saved_weights[k]) for k in weights)
        assert [r[-1]["global_steps"] for r in runs] == [0] * world


def test_tied_layer_stored_once(saved_run) -> None:
    save_dir, _ = saved_run
    from safetensors import safe_open

    tag_dir = save_dir / "pipe2x2"
    meta = json.loads((tag_dir / "meta.json").read_text())
    tied = "tied_modules.embed.weight"
    assert meta["pipeline"]["num_stages"] == 2 and meta["pipeline"]["parts"] == [0, 4, 7]
    assert meta["model"]["files"][tied] == "model-stage00000.safetensors"
    holders = []
    for path in sorted(tag_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            holders += [(path.name, k) for k in f.keys() if k.endswith(tied)]
    # The model file of stage 0, and the fp32 master and two moments of the two ZeRO-1 shards of
    # stage 0 (ranks 0 and 1); nothing from stage 1 (ranks 2 and 3), which holds the head's copy.
    assert sorted(holders) == sorted(
        [("model-stage00000.safetensors", tied)]
        + [(f"rank0000{r}.safetensors", f"{kind}/{tied}") for r in (0, 1)
           for kind in ("master", "state/exp_avg", "state/exp_avg_sq")]
    )
    assert [s["file"] for s in meta["optimizer"]["params"][tied]["shards"]] == ["rank00000.safetensors", "rank00001.safetensors"]
    # Each stage's groups, numbered stage after stage; the stage 1 layers' shards in ranks 2 and 3.
    assert {s["file"] for s in meta["optimizer"]["params"]["5.weight"]["shards"]} == {"rank00002.safetensors", "rank00003.safetensors"}


def test_consolidate_gives_the_sequential_state_dict(saved_run, tmp_path, capsys) -> None:
    save_dir, results = saved_run
    from partita.checkpoint.cli import main
    from partita.checkpoint.consolidate import load_consolidated

    assert main(["inspect", str(save_dir)]) == 0 and "world 4 (pipe 2)  stage 1" in capsys.readouterr().out
    assert main(["verify", str(save_dir)]) == 0

    assert main(["consolidate", str(save_dir), str(tmp_path / "out"), "--tag", "pipe2x2"]) == 0
    state = load_consolidated(tmp_path / "out")
    plain = _reference_layers()
    plain.load_state_dict(state, strict=True)  # every key of nn.Sequential(*layers), none more
    weights, opt = _merged([r["saved"] for r in results])
    # The key mapping: layer i's keys stay "<i>.<name>"; the tied module goes to its first position.
    expected = {("0.weight" if k == "tied_modules.embed.weight" else k): v for k, v in weights.items()}
    assert sorted(plain.state_dict()) == sorted(expected)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, expected[key]), key
    # The plain model computes what the pipeline computed: its loss on the next batch is the
    # first continued step's loss (its forward, before that step's update).
    xs, ys = _batches()
    with torch.no_grad():
        loss = lm_loss(plain(xs[SAVED_STEPS]), ys[SAVED_STEPS]).item()
    assert loss == pytest.approx(results[0]["continued"][0], rel=1e-6)


def test_mismatched_layers_name_the_keys(saved_run) -> None:
    _, results = saved_run
    expected = (
        "the layers of the checkpoint (7 layers, saved with 2 stages) do not match this PipelineModule (8 layers): "
        "in this model but not in the checkpoint: layer 5 (5.linear.bias, 5.linear.weight); layer 6 (6.bias, 6.weight); "
        "in the checkpoint but not in this model: layer 5 (5.bias, 5.weight). Build the PipelineModule from the layer "
        "list it was saved with"
    )
    assert [r.get("mismatch") for r in results] == [expected] * 4


def test_sequential_names_alias_a_tied_module_used_as_a_layer() -> None:
    from partita.checkpoint.pipeline_layout import sequential_names

    layout = {"num_layers": 4, "layers": [{"type": "Embedding", "tie": "e", "module": True},
                                          {"type": "Block", "tie": None, "module": True},
                                          {"type": "Embedding", "tie": "e", "module": True},
                                          {"type": "Embedding", "tie": "e", "module": False}]}
    renamed, aliases = sequential_names(["tied_modules.e.weight", "1.linear.weight", "loss_fn.weight"], layout)
    assert renamed == {"tied_modules.e.weight": "0.weight", "1.linear.weight": "1.linear.weight",
                       "loss_fn.weight": "loss_fn.weight"}
    assert aliases == {"2.weight": "0.weight"}


def test_pipe_2_by_tensor_2_loads_at_pipe_2_by_data_2_zero_2(tmp_path) -> None:
    from tests.test_pipe_compose import _assemble

    results = run_distributed(_tensor_pipeline_on_4, 4, str(tmp_path), timeout=400)
    meta = json.loads((tmp_path / "pipe2xtp2" / "meta.json").read_text())
    assert meta["tensor_parallel_size"] == 2 and meta["pipeline_parallel_size"] == 2
    record = meta["optimizer"]["params"]["4.proj.weight"]  # stage 1, split by rows: a piece per tensor rank
    assert record["tensor"]["size"] == 2 and [p["shards"][0]["file"] for p in record["pieces"]] == [
        "rank00002.safetensors", "rank00003.safetensors"]
    assert "4.proj.weight" not in meta["model"]["tensors"]  # tensor shards live as fp32 master pieces only
    for r in results:
        assert r["same"] == r["continued"]  # the same layout: exactly
        assert r["zero2"]["losses"] == pytest.approx(r["continued"], rel=1e-6, abs=0)
    saved_weights = _assemble([[{"state": r["saved"]["weights"]}] for r in results], 0)
    got_weights, got = _merged([r["zero2"]["state"] for r in results])
    assert sorted(got_weights) == sorted(saved_weights)
    for key, value in saved_weights.items():
        assert torch.equal(got_weights[key].float(), value), key
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        saved_kind = _assemble([[{"state": {n: (t[kind], split) for n, (t, split) in r["saved"]["optimizer"].items()}}]
                                for r in results], 0)
        assert sorted(saved_kind) == sorted(got["flats"])
        for name, value in saved_kind.items():
            assert torch.equal(got["flats"][name][kind], value.reshape(-1)), (name, kind)
