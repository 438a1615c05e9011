"""Checkpoints: exact resume in fresh processes, resharding on load, damage detection and
fallback, refused client_state, rank-mismatch failures, and the `partita checkpoint` command.

Spawned runs are few and grouped (spawning is the cost): one world-2 run trains four
configurations straight through and saves along the way; a fresh world-2 run resumes each;
a world-4 and a world-1 run reshard; the command-line checks run in the pytest process.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from partita.checkpoint.cli import main as checkpoint_main
from partita.checkpoint.errors import CheckpointError
from partita.checkpoint.jsoncodec import decode, encode
from tests.harness import run_distributed
from tests.tiny_models import SEQ, VOCAB, build_block_model, build_model, make_batches, param_groups

N, K, GLOBAL_BATCH = 5, 2, 8
BUILDERS = {"tied": build_model, "blocks": build_block_model}
CLIENT_STATE = {"epoch": 1, "note": "hello", "ema": torch.arange(3.0), "nested": {"betas": (0.9, 0.99), 7: [None, 1.5]}}


def _config(stage: int, precision: str = "fp32", *, gas: int = 2, **checkpoint) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 60, "allgather_bucket_size": 50}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 20  # some parameters sharded, some whole
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 2, "total_num_steps": 20}},
        "gradient_clipping": 0.5,
        "zero_optimization": zero,
        "steps_per_print": 1000,
        "seed": 3,
        "checkpoint": {"handshake_timeout_seconds": 20, **checkpoint},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    return cfg


# name: (model, config, data loader from initialize(), random draws in the loss, async save)
RUNS = {
    "z2_fp32": ("tied", _config(2), False, False, False),
    "z3_fp32": ("blocks", _config(3), False, False, False),
    "z1_fp16": ("tied", _config(1, "fp16", async_save=True), False, True, True),
    "z0_bf16_loader": ("tied", _config(0, "bf16", gas=1), True, True, False),
}


def _dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(5)
    return torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (28, SEQ), generator=g), torch.randint(0, VOCAB, (28, SEQ), generator=g))


# ---------------------------------------------------------------------------- on every rank


def _build(name: str, config: dict | None = None, rank_seed: int = 0):
    import torch.distributed as dist

    import partita

    model_name, cfg, with_loader, _, _ = RUNS[name]
    model = BUILDERS[model_name]()
    extra = {"training_data": _dataset()} if with_loader else {}
    engine, _, loader, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=config or cfg, **extra)
    # Different generator states on every rank, as dropout would have.
    seed = rank_seed + dist.get_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return engine, loader


def _train(engine, loader, name: str, steps: range) -> None:
    import torch.distributed as dist

    from partita.data import infinite_batches

    noisy = RUNS[name][3]
    world, rank = dist.get_world_size(), dist.get_rank()
    gas, micro = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
    xs, ys = make_batches(N, GLOBAL_BATCH)
    batches = infinite_batches(loader) if loader is not None else None
    for step in steps:
        for m in range(gas):
            if batches is not None:
                x, y = next(batches)
            else:
                lo = (m * world + rank) * micro
                x, y = xs[step][lo : lo + micro], ys[step][lo : lo + micro]
            loss = engine(x, y)
            if noisy:  # every generator feeds the result: a wrongly restored one changes the weights
                loss = loss * (1 + 0.01 * (torch.rand(()).item() + random.random() + float(np.random.rand())))
            engine.backward(loss)
            engine.step()


def _full_params(engine) -> dict[str, torch.Tensor]:
    gatherer = engine.zero.gatherer
    sharded = [p for p in engine.module.parameters() if gatherer is not None and gatherer.is_sharded_param(p)]
    if sharded:
        gatherer.gather(sharded)
    params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    if sharded:
        gatherer.release(sharded)
    return params


def _state(engine) -> dict:
    """Everything that must match exactly after a resume on the same layout."""
    optimizer = engine.optimizer
    return {
        "masters": [g.master.clone() for g in optimizer.groups],
        "optim": [
            {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.inner.state.get(g.master, {}).items()}
            for g in optimizer.groups
        ],
        "lr": engine.get_lr(),
        "loss_scale": engine.get_loss_scale(),
        "counters": (engine.global_steps, engine.global_samples, engine.skipped_steps, engine.micro_steps),
        "rng": (torch.rand(3), random.random(), float(np.random.rand())),
    }


def straight_runs(root: str) -> dict:
    """Train every run N steps, saving after K (and N) steps; saving must not disturb training."""
    out = {}
    for name, (_, _, _, _, async_save) in RUNS.items():
        engine, loader = _build(name, rank_seed=100)
        _train(engine, loader, name, range(K))
        engine.save_checkpoint(f"{root}/{name}", client_state=CLIENT_STATE)  # async for z1 (config)
        at_k = _full_params(engine)
        _train(engine, loader, name, range(K, N))
        engine.save_checkpoint(f"{root}/{name}", async_save=False)
        out[name] = {"final": _full_params(engine), "at_k": at_k, "state": _state(engine)}
    return out


def resumed_runs(root: str) -> dict:
    """Fresh processes: load the step-K checkpoint and train to N. Then the rank-mismatch failures."""
    import torch.distributed as dist

    out = {}
    for name in RUNS:
        engine, loader = _build(name, rank_seed=999)  # generators differ from the saving run's
        path, client_state = engine.load_checkpoint(f"{root}/{name}", tag=f"global_step{K}")
        assert path == f"{root}/{name}/global_step{K}" and engine.loaded_checkpoint == (path, client_state)
        assert engine.global_steps == K and engine.global_samples == K * GLOBAL_BATCH
        _train(engine, loader, name, range(K, N))
        out[name] = {"final": _full_params(engine), "state": _state(engine), "client_state": client_state}

    engine, _ = _build("z2_fp32", _config(2, tag_validation="Fail", handshake_timeout_seconds=1.5))
    rank = dist.get_rank()
    errors = {}
    try:  # different tags on the ranks with tag_validation "Fail"
        engine.save_checkpoint(f"{root}/mismatch", tag=f"t{rank}")
    except CheckpointError as error:
        errors["tags"] = str(error)
    if rank == 0:  # only rank 0 saves: must fail fast, naming rank 1
        try:
            engine.save_checkpoint(f"{root}/alone")
        except CheckpointError as error:
            errors["alone"] = str(error)
    out["errors"] = errors
    return out


def reshard_runs(root: str, jobs: list[tuple[str, dict]]) -> dict:
    """Load a world-2 checkpoint at another world size / stage and train to N."""
    out = {}
    for name, cfg in jobs:
        engine, loader = _build(name, cfg)
        engine.load_checkpoint(f"{root}/{name}", tag=f"global_step{K}")
        _train(engine, loader, name, range(K, N))
        out[name] = _full_params(engine)
    return out


def world_one_checks(root: str, jobs: list[tuple[str, dict]]) -> dict:
    """World 1: reshard, then damaged files, fallback, refused client_state, weights-only load."""
    out = {"reshard": reshard_runs(root, jobs)}
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    engine, _ = _build("z2_fp32")
    logging.getLogger("partita").addHandler(handler)

    damaged = Path(root) / "damaged"
    shutil.copytree(Path(root) / "z2_fp32", damaged)
    victim = damaged / f"global_step{N}" / "rank00001.safetensors"
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, one byte flipped
    victim.write_bytes(bytes(raw))
    path, _ = engine.load_checkpoint(str(damaged))  # latest -> global_step5 is damaged: falls back
    out["fallback"] = (path, engine.global_steps, [r.getMessage() for r in records if r.levelno >= logging.WARNING])
    for tag in (f"global_step{N}",):
        try:
            engine.load_checkpoint(str(damaged), tag=tag)
        except CheckpointError as error:
            out["corrupt"] = str(error)
    model_file = damaged / f"global_step{K}" / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:-10])  # truncated
    try:
        engine.load_checkpoint(str(damaged))
    except CheckpointError as error:
        out["none_left"] = str(error)

    try:
        engine.save_checkpoint(f"{root}/refused", client_state={"ok": 1, "bad": {1, 2}})
    except CheckpointError as error:
        out["refused"] = str(error)
    try:
        engine.save_checkpoint(f"{root}/refused", tag="a/b")
    except CheckpointError as error:
        out["bad_tag"] = str(error)

    fresh, _ = _build("z2_fp32")
    fresh.load_checkpoint(f"{root}/z2_fp32", load_module_only=True)  # latest: global_step5
    out["module_only"] = (_full_params(fresh), fresh.global_steps, len(fresh.optimizer.inner.state))

    # 8-bit AdamW (uint8 codes, per-block scales): saved per parameter, block by block; resumes exactly.
    cfg = _config(2)
    cfg["optimizer"] = {"type": "AdamW8bit", "params": {"lr": 1e-2, "weight_decay": 0.1}}
    runs = []
    for resume in (False, True):
        engine, _ = _build("z2_fp32", cfg)
        if resume:
            engine.load_checkpoint(f"{root}/eight_bit")
        else:
            _train(engine, None, "z2_fp32", range(K))
            engine.save_checkpoint(f"{root}/eight_bit")
        _train(engine, None, "z2_fp32", range(K, N))
        runs.append((_full_params(engine), _state(engine)))
    out["eight_bit"] = runs
    return out


# ---------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("ckpt")
    return root, run_distributed(straight_runs, 2, str(root))


def _assert_same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _assert_close(got: dict, want: dict, where: str, tol: float = 1e-6) -> None:
    for name, w in want.items():
        err = float((got[name] - w).norm() / w.norm().clamp_min(1e-12))
        assert err < tol, (where, name, err)


def test_resume_in_fresh_processes_is_bit_identical(saved) -> None:
    root, straight = saved
    resumed = run_distributed(resumed_runs, 2, str(root))
    for rank in range(2):
        for name in RUNS:
            # Parameters, fp32 masters, Adam moments and step, lr, loss scale, counters, and the
            # next random numbers of every generator: all equal to the uninterrupted run's.
            _assert_same(resumed[rank][name]["final"], straight[rank][name]["final"], f"rank{rank}.{name}.final")
            _assert_same(resumed[rank][name]["state"], straight[rank][name]["state"], f"rank{rank}.{name}.state")
            _assert_same(resumed[rank][name]["client_state"], CLIENT_STATE, f"{name}.client_state")
    assert straight[0]["z1_fp16"]["state"]["loss_scale"] != 2.0**8  # the fp16 run's scale moved
    errors = resumed[0]["errors"]
    assert "different tags" in errors["tags"] and "'t0'" in errors["tags"] and "'t1'" in errors["tags"]
    assert "different tags" in resumed[1]["errors"]["tags"]
    assert "rank(s) [1] of 2 did not call save_checkpoint within 1.5 s" in errors["alone"]
    assert "alone" not in resumed[1]["errors"]


def test_reshard_world2_stage2_and_stage3_to_world4(saved) -> None:
    root, straight = saved
    jobs = [("z2_fp32", _config(1)), ("z3_fp32", _config(2))]  # stage 2 -> 1, stage 3 -> 2
    got = run_distributed(reshard_runs, 4, str(root), jobs)
    for name, _ in jobs:
        _assert_close(got[0][name], straight[0][name]["final"], f"world4 {name}")


def test_world1_reshard_damage_fallback_and_refusals(saved) -> None:
    root, straight = saved
    jobs = [("z2_fp32", _config(0)), ("z3_fp32", _config(3))]  # stage 2 -> 0, stage 3 (world 2 -> 1)
    (out,) = run_distributed(world_one_checks, 1, str(root), jobs)
    for name, _ in jobs:
        _assert_close(out["reshard"][name], straight[0][name]["final"], f"world1 {name}")

    path, step, warnings = out["fallback"]
    assert path.endswith(f"damaged/global_step{K}") and step == K
    assert any(f"global_step{N}/rank00001.safetensors: sha256 differs" in w for w in warnings), warnings
    assert any("falling back" in w for w in warnings)
    assert "rank00001.safetensors: sha256 differs from the manifest" in out["corrupt"]
    assert f"global_step{K}/model.safetensors" in out["none_left"] and "truncated" in out["none_left"]
    assert "client_state['bad'] is a builtins.set" in out["refused"]
    assert "plain directory name" in out["bad_tag"]
    params, steps, optim_states = out["module_only"]
    _assert_same(params, straight[0]["z2_fp32"]["final"], "module_only")
    assert steps == 0 and optim_states == 0
    (straight_8bit, resumed_8bit) = out["eight_bit"]
    assert straight_8bit[1]["optim"][0]["state1"].dtype == torch.uint8
    _assert_same(resumed_8bit, straight_8bit, "eight_bit")


def test_checkpoint_command_inspect_verify_consolidate(saved, tmp_path, capsys) -> None:
    root, straight = saved
    ckpt = root / "z3_fp32"
    assert checkpoint_main(["inspect", str(ckpt)]) == 0
    listing = capsys.readouterr().out
    assert f"global_step{N}" in listing and "latest" in listing and "stage 3" in listing and "world 2" in listing

    assert checkpoint_main(["verify", str(ckpt)]) == 0
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    (broken / f"global_step{K}" / "meta.json").write_text("{}")
    assert checkpoint_main(["verify", str(broken), "--tag", f"global_step{K}"]) == 1
    assert "meta.json" in capsys.readouterr().out

    out = tmp_path / "hf"
    assert checkpoint_main(["consolidate", str(ckpt), str(out), "--tag", f"global_step{K}", "--max-shard-size", "2KB"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    loaded = {}
    for name in files:
        with safe_open(str(out / name), "pt") as f:
            assert f.metadata()["format"] == "pt"
            loaded.update({k: f.get_tensor(k) for k in f.keys()})
    want = straight[0]["z3_fp32"]["at_k"]
    assert index["metadata"]["tied_weights"] == {"head.weight": "embed.weight"}
    assert set(loaded) | {"head.weight"} == set(build_block_model().state_dict())
    for name, tensor in want.items():
        if name != "head.weight":
            assert torch.equal(loaded[name], tensor), name  # fp32 masters, exact
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in loaded.values())

    assert checkpoint_main(["consolidate", str(ckpt), str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    with safe_open(str(tmp_path / "bf16" / "model-00001-of-00001.safetensors"), "pt") as f:
        assert f.get_tensor("embed.weight").dtype == torch.bfloat16
        assert f.get_tensor("blocks.0.gain").dtype == torch.bfloat16


def test_json_codec_round_trip_and_refusal() -> None:
    sink: dict[str, torch.Tensor] = {}
    value = {"a": (1, 2.5, float("inf")), 3: [None, True, "x"], "t": torch.ones(2), "__tuple__": 1}
    encoded = json.loads(json.dumps(encode(value, path="v", sink=sink)))
    back = decode(encoded, tensor=sink.__getitem__)
    assert back.keys() == value.keys() and back["a"] == (1, 2.5, float("inf")) and back[3] == [None, True, "x"]
    assert torch.equal(back["t"], value["t"]) and back["__tuple__"] == 1
    lookalike = {"__tensor__": "not a tensor"}  # a user dict that looks like a marker stays a dict
    assert decode(json.loads(json.dumps(encode(lookalike, path="v", sink={}))), tensor=sink.__getitem__) == lookalike
    with pytest.raises(CheckpointError, match=r"v\['x'\]\[1\] is a numpy.int64"):
        encode({"x": [1, np.int64(2)]}, path="v", sink={})
