"""Checkpoints: exact resume in fresh processes, resharding on load, damage detection and
fallback, refused client_state, rank-mismatch failures, and the `partita checkpoint` command.

Spawned runs are few and grouped (spawning is the cost): one world-2 run trains four
configurations straight through and saves along the way; a world-4 run, then a world-1 run
reshard (and save again in their layouts); a fresh world-2 run resumes each configuration and
loads the world-1 and world-4 checkpoints; the command-line checks run in the pytest process.
"""

from __future__ import annotations

import ast
import json
import logging
import random
import shutil
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from partita.checkpoint import wait_for_pending_save
from partita.checkpoint.cli import main as checkpoint_main
from partita.checkpoint.errors import CheckpointError
from partita.checkpoint.jsoncodec import decode, encode
from partita.checkpoint.reshard import ShardReader
from partita.checkpoint.rng import capture_rng, restore_rng, rng_metadata
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


# (result key, run name, config of the loading layout, checkpoint directory under root, directory
# to save to again right after loading (the same state, written by the new layout) or None)
ReshardJob = tuple[str, str, dict, str, str | None]


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


def resumed_runs(root: str, jobs: list[ReshardJob]) -> dict:
    """Fresh processes: load the step-K checkpoint and train to N; reshard ``jobs`` (saved at
    worlds 1 and 4) onto world 2. Then the rank-mismatch failures."""
    import torch.distributed as dist

    import partita.checkpoint.save as save_module

    out = {}
    for name in RUNS:
        engine, loader = _build(name, rank_seed=999)  # generators differ from the saving run's
        path, client_state = engine.load_checkpoint(f"{root}/{name}", tag=f"global_step{K}")
        assert path == f"{root}/{name}/global_step{K}" and engine.loaded_checkpoint == (path, client_state)
        assert engine.global_steps == K and engine.global_samples == K * GLOBAL_BATCH
        _train(engine, loader, name, range(K, N))
        out[name] = {"final": _full_params(engine), "state": _state(engine), "client_state": client_state}
    out["reshard"] = reshard_runs(root, jobs)

    engine, _ = _build("z2_fp32", _config(2, tag_validation="Fail", handshake_timeout_seconds=1.5))
    rank = dist.get_rank()
    errors = {}
    try:  # different tags on the ranks with tag_validation "Fail"
        engine.save_checkpoint(f"{root}/mismatch", tag=f"t{rank}")
    except CheckpointError as error:
        errors["tags"] = str(error)

    # Rank 1 is stuck writing its file for longer than distributed.timeout_seconds (1 s): rank 0
    # must give up after that time, naming rank 1, and rank 1 must not wait for rank 0 forever.
    stuck, _ = _build("z2_fp32", {**_config(2), "distributed": {"timeout_seconds": 1}})
    if rank == 1:
        write_files = save_module._write_files

        def slow_write(snapshot, partial):
            time.sleep(2.5)
            return write_files(snapshot, partial)

        save_module._write_files = slow_write
    try:
        stuck.save_checkpoint(f"{root}/stuck")
    except CheckpointError as error:
        errors["stuck"] = str(error)
    finally:
        if rank == 1:
            save_module._write_files = write_files
    dist.barrier()  # rank 0 (the store's host) stays until rank 1 has given up too

    if rank == 0:  # only rank 0 saves, then loads: each must fail fast, naming rank 1
        for call in ("save", "load"):
            try:
                getattr(engine, f"{call}_checkpoint")(f"{root}/alone")
            except CheckpointError as error:
                errors[f"alone_{call}"] = str(error)
    dist.barrier()
    # Rank 0's failed calls did not happen as far as the other ranks are concerned: a job that
    # caught those errors can still checkpoint with every rank.
    engine.save_checkpoint(f"{root}/together")
    out["together"] = engine.load_checkpoint(f"{root}/together")[0]
    out["errors"] = errors
    return out


def reshard_runs(root: str, jobs: list[ReshardJob]) -> dict:
    """Load a step-K checkpoint at another world size / stage and train to N."""
    out = {}
    for key, name, cfg, source, resave in jobs:
        engine, loader = _build(name, cfg)
        engine.load_checkpoint(f"{root}/{source}", tag=f"global_step{K}")
        if resave is not None:
            engine.save_checkpoint(f"{root}/{resave}")  # tag global_step{K} again
        _train(engine, loader, name, range(K, N))
        out[key] = _full_params(engine)
    return out


def world_one_checks(root: str, jobs: list[ReshardJob]) -> dict:
    """World 1: reshard, then damaged files, fallback, refused client_state, partial loads,
    ``latest`` with save_latest=False, the asynchronous save's ordering."""
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

    # DeepSpeed's partial loads. Weights only: no optimizer state, counters or scheduler, but the client_state.
    fresh, _ = _build("z2_fp32")
    _, client_state = fresh.load_checkpoint(f"{root}/z2_fp32", tag=f"global_step{K}", load_module_only=True)
    out["module_only"] = (_full_params(fresh), fresh.global_steps, len(fresh.optimizer.inner.state),
                          fresh.lr_scheduler.last_epoch, client_state)
    # No optimizer state: weights (from the fp32 masters), counters and scheduler are restored.
    fresh, _ = _build("z2_fp32")
    fresh.load_checkpoint(f"{root}/z2_fp32", load_optimizer_states=False)  # latest: global_step5
    out["no_optimizer"] = (_full_params(fresh), fresh.global_steps, len(fresh.optimizer.inner.state),
                           fresh.lr_scheduler.last_epoch, fresh.get_lr())
    # No scheduler state: it starts over, while the optimizer (its hyperparameters included) is restored.
    fresh, _ = _build("z2_fp32")
    fresh.load_checkpoint(f"{root}/z2_fp32", load_lr_scheduler_states=False)
    steps = [float(s["step"]) for s in fresh.optimizer.inner.state.values()]
    out["no_scheduler"] = (fresh.global_steps, steps, fresh.lr_scheduler.last_epoch, fresh.get_lr())

    # save_latest=False leaves `latest` (and so load_checkpoint(tag=None)) on the earlier tag.
    engine.save_checkpoint(f"{root}/pinned", tag="first")
    engine.save_checkpoint(f"{root}/pinned", tag="second", save_latest=False)
    path, _ = engine.load_checkpoint(f"{root}/pinned")
    out["pinned"] = ((Path(root) / "pinned" / "latest").read_text().strip(), Path(path).name)

    # An asynchronous save returns before its files are written, and the next save first waits
    # for it: at most one CPU copy of the state exists at a time (the bound on extra memory).
    import partita.checkpoint.save as save_module

    events: list[str] = []
    write_files = save_module._write_files

    def slow_write(snapshot, partial):
        events.append(f"write {partial.name}")
        time.sleep(0.3)
        written = write_files(snapshot, partial)
        events.append(f"done {partial.name}")
        return written

    save_module._write_files = slow_write
    try:
        for tag in ("a1", "a2"):
            engine.save_checkpoint(f"{root}/async", tag=tag, async_save=True)
            events.append(f"returned {tag}")
        wait_for_pending_save()
        events.append("waited")
    finally:
        save_module._write_files = write_files
    out["async"] = (events, sorted(p.name for p in (Path(root) / "async").iterdir()))

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


# The reshard chain: each job loads a step-K checkpoint, some save it again right away in their
# own layout (``w4s1``: world 4, stage 1), and train to N. Together the loads cross worlds
# 1 <-> 2 <-> 4 (and 4 -> 1) and stages 0 <-> 1 <-> 2 <-> 3 in both directions.
WORLD4_JOBS: list[ReshardJob] = [
    ("z2 w2s2>w4s1", "z2_fp32", _config(1), "z2_fp32", "z2_w4s1"),
    ("z3 w2s3>w4s2", "z3_fp32", _config(2), "z3_fp32", "z3_w4s2"),
]
WORLD1_JOBS: list[ReshardJob] = [
    ("z2 w2s2>w1s0", "z2_fp32", _config(0), "z2_fp32", "z2_w1s0"),
    ("z3 w2s3>w1s3", "z3_fp32", _config(3), "z3_fp32", None),
    ("z2 w4s1>w1s0", "z2_fp32", _config(0), "z2_w4s1", None),
    ("z3 w4s2>w1s3", "z3_fp32", _config(3), "z3_w4s2", None),
]
WORLD2_JOBS: list[ReshardJob] = [
    ("z2 w1s0>w2s1", "z2_fp32", _config(1), "z2_w1s0", None),
    ("z2 w4s1>w2s2", "z2_fp32", _config(2), "z2_w4s1", None),
]


@pytest.fixture(scope="module")
def world4(saved) -> list[dict]:
    root, _ = saved
    return run_distributed(reshard_runs, 4, str(root), WORLD4_JOBS)


@pytest.fixture(scope="module")
def world1(saved, world4) -> dict:
    root, _ = saved
    (out,) = run_distributed(world_one_checks, 1, str(root), WORLD1_JOBS)  # reads world 4's checkpoints
    return out


@pytest.fixture(scope="module")
def resumed(saved, world1) -> list[dict]:
    root, _ = saved
    return run_distributed(resumed_runs, 2, str(root), WORLD2_JOBS)  # reads worlds 1 and 4's checkpoints


def test_resume_in_fresh_processes_is_bit_identical(saved, resumed) -> None:
    _, straight = saved
    for rank in range(2):
        for name in RUNS:
            # Parameters, fp32 masters, Adam moments and step, lr, loss scale, counters, and the
            # next random numbers of every generator: all equal to the uninterrupted run's.
            _assert_same(resumed[rank][name]["final"], straight[rank][name]["final"], f"rank{rank}.{name}.final")
            _assert_same(resumed[rank][name]["state"], straight[rank][name]["state"], f"rank{rank}.{name}.state")
            _assert_same(resumed[rank][name]["client_state"], CLIENT_STATE, f"{name}.client_state")
    assert straight[0]["z1_fp16"]["state"]["loss_scale"] != 2.0**8  # the fp16 run's scale moved


def test_mismatched_alone_or_stuck_ranks_fail_fast_naming_the_ranks(resumed) -> None:
    errors = resumed[0]["errors"]
    assert "different tags" in errors["tags"] and "'t0'" in errors["tags"] and "'t1'" in errors["tags"]
    assert "different tags" in resumed[1]["errors"]["tags"]
    assert "rank(s) [1] of 2 did not call save_checkpoint within 1.5 s" in errors["alone_save"]
    assert "rank(s) [1] of 2 did not call load_checkpoint within 1.5 s" in errors["alone_load"]
    assert not any(key.startswith("alone") for key in resumed[1]["errors"])
    assert "rank(s) [1] did not finish writing their checkpoint files within 1 s" in errors["stuck"]
    assert "rank 0 did not finish committing the checkpoint within 1 s" in resumed[1]["errors"]["stuck"]
    for rank in range(2):  # after rank 0's lone calls failed, both ranks still checkpoint together
        assert resumed[rank]["together"].endswith("together/global_step0"), resumed[rank]["together"]


def test_reshard_across_world_sizes_and_stages(saved, world4, world1, resumed) -> None:
    _, straight = saved
    results = [(WORLD4_JOBS, world4[0]), (WORLD1_JOBS, world1["reshard"]), (WORLD2_JOBS, resumed[0]["reshard"])]
    for jobs, got in results:
        for key, name, *_ in jobs:
            _assert_close(got[key], straight[0][name]["final"], key)


def test_world1_damage_fallback_and_refusals(world1) -> None:
    out = world1
    path, step, warnings = out["fallback"]
    assert path.endswith(f"damaged/global_step{K}") and step == K
    assert any(f"global_step{N}/rank00001.safetensors: sha256 differs" in w for w in warnings), warnings
    assert any("falling back" in w for w in warnings)
    assert "rank00001.safetensors: sha256 differs from the manifest" in out["corrupt"]
    assert f"global_step{K}/model.safetensors" in out["none_left"] and "truncated" in out["none_left"]
    assert "client_state['bad'] is a builtins.set" in out["refused"]
    assert "plain directory name" in out["bad_tag"]
    (straight_8bit, resumed_8bit) = out["eight_bit"]
    assert straight_8bit[1]["optim"][0]["state1"].dtype == torch.uint8
    _assert_same(resumed_8bit, straight_8bit, "eight_bit")


def test_partial_loads_latest_and_async_save(saved, world1) -> None:
    _, straight = saved
    want = straight[0]["z2_fp32"]
    params, steps, optim_states, scheduler_step, client_state = world1["module_only"]
    _assert_same(params, want["at_k"], "module_only")
    assert (steps, optim_states, scheduler_step) == (0, 0, 0)
    _assert_same(client_state, CLIENT_STATE, "module_only client_state")

    params, steps, optim_states, scheduler_step, lr = world1["no_optimizer"]
    _assert_same(params, want["final"], "no_optimizer")
    assert (steps, optim_states, scheduler_step, lr) == (N, 0, N, want["state"]["lr"])

    steps, adam_steps, scheduler_step, lr = world1["no_scheduler"]
    # The scheduler starts over; the lr is the optimizer's saved one until its next step (DeepSpeed's behaviour).
    assert (steps, adam_steps, scheduler_step, lr) == (N, [float(N), float(N)], 0, want["state"]["lr"])

    assert world1["pinned"] == ("first", "first")

    events, tags = world1["async"]
    assert events.index("returned a1") < events.index("done a1.partial") < events.index("write a2.partial"), events
    assert events[-2:] == ["done a2.partial", "waited"], events
    assert tags == ["a1", "a2", "latest"]


def test_checkpoint_command_inspect_verify_consolidate(saved, tmp_path, capsys, monkeypatch) -> None:
    root, straight = saved
    ckpt = root / "z3_fp32"
    assert checkpoint_main(["inspect", str(ckpt)]) == 0
    listing = capsys.readouterr().out
    assert f"global_step{N}" in listing and "latest" in listing and "stage 3" in listing and "world 2" in listing

    assert checkpoint_main(["verify", str(ckpt)]) == 0
    verified = capsys.readouterr().out
    assert f"global_step{K}: ok" in verified and "verify: " in verified and "(100%)" in verified  # progress
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    (broken / f"global_step{K}" / "meta.json").write_text("{}")
    assert checkpoint_main(["verify", str(broken), "--tag", f"global_step{K}"]) == 1
    assert "meta.json" in capsys.readouterr().out

    # Streaming: when consolidate reads a tensor, no tensor it read before is still alive (the
    # peak is about one parameter, not an output shard or the model).
    alive: list[weakref.ref] = []
    overlaps: list[int] = []

    def tracked(read):
        def wrapper(self, *args, **kwargs):
            overlaps.append(sum(ref() is not None for ref in alive))
            tensor = read(self, *args, **kwargs)
            alive.append(weakref.ref(tensor if tensor._base is None else tensor._base))  # views keep their base
            return tensor

        return wrapper

    monkeypatch.setattr(ShardReader, "read_full", tracked(ShardReader.read_full))
    monkeypatch.setattr(ShardReader, "tensor", tracked(ShardReader.tensor))
    out = tmp_path / "hf"
    assert checkpoint_main(["consolidate", str(ckpt), str(out), "--tag", f"global_step{K}", "--max-shard-size", "2KB"]) == 0
    monkeypatch.undo()
    assert len(overlaps) > 10 and not any(overlaps), overlaps
    progress_lines = capsys.readouterr().out
    assert f"consolidate: {len(overlaps)}/{len(overlaps)} (100%)" in progress_lines, progress_lines
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
    # Tensors safetensors cannot store are refused when encoded (before any rank writes).
    with pytest.raises(CheckpointError, match=r"v\['s'\] is a tensor with layout torch.sparse_coo"):
        encode({"s": torch.eye(2).to_sparse()}, path="v", sink={})
    with pytest.raises(CheckpointError, match=r"v\['c'\] is a tensor of dtype torch.complex64.*view_as_real"):
        encode({"c": torch.ones(2, dtype=torch.complex64)}, path="v", sink={})


def test_rng_states_of_every_generator_cuda_included_round_trip(monkeypatch) -> None:
    """python, numpy and torch CPU for real; CUDA through stand-ins (no GPU here): one state per
    device is captured, and restored onto the devices this machine has."""
    cuda_states = [torch.full((16,), 1, dtype=torch.uint8), torch.full((16,), 2, dtype=torch.uint8)]
    restored: list[tuple[int, torch.Tensor]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [t.clone() for t in cuda_states])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((device, state)))
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    json_state, tensors = capture_rng()
    want = (random.random(), float(np.random.rand()), torch.rand(3))
    assert sorted(tensors) == ["rng/cuda/0", "rng/cuda/1", "rng/torch_cpu"]
    json_state = json.loads(rng_metadata(json_state))  # stored as safetensors metadata text
    random.seed(2)
    np.random.seed(2)
    torch.manual_seed(2)
    restore_rng(json_state, tensors)
    got = (random.random(), float(np.random.rand()), torch.rand(3))
    assert got[:2] == want[:2] and torch.equal(got[2], want[2])
    assert len(restored) == 1 and restored[0][0] == 0 and torch.equal(restored[0][1], cuda_states[0])


def test_partita_never_unpickles() -> None:
    """No pickle loads anywhere in the package, and any torch.load passes weights_only=True."""
    package = Path(__file__).resolve().parents[1] / "partita"
    offenders = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
            where = f"{path.relative_to(package.parent)}:{node.lineno}"
            if owner == "pickle" and node.func.attr in ("load", "loads", "Unpickler"):
                offenders.append(f"{where} pickle.{node.func.attr}")
            if owner == "torch" and node.func.attr == "load":
                safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                           for k in node.keywords)
                if not safe:
                    offenders.append(f"{where} torch.load without weights_only=True")
    assert not offenders, offenders
