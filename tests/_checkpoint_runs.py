"""What the spawned ranks of tests/test_checkpoint_resume_reshard.py run: the four saved
configurations (RUNS), training them straight through with saves along the way, resharding
loads in other world sizes and stages, the world-1 damage / fallback / async-save checks, and
the fresh-process resumes. Each function returns what the tests compare."""

from __future__ import annotations

import logging
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from partita.checkpoint import wait_for_pending_save
from partita.checkpoint.errors import CheckpointError
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


def full_params(engine, *, as_float: bool = True) -> dict[str, torch.Tensor]:
    """Every parameter whole (ZeRO-3 shards gathered), cloned; upcast to fp32 unless ``as_float`` is off."""
    gatherer = engine.zero.gatherer
    sharded = [p for p in engine.module.parameters() if gatherer is not None and gatherer.is_sharded_param(p)]
    if sharded:
        gatherer.gather(sharded)
    params = {n: (p.detach().float() if as_float else p.detach()).clone() for n, p in engine.module.named_parameters()}
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
        at_k = full_params(engine)
        _train(engine, loader, name, range(K, N))
        engine.save_checkpoint(f"{root}/{name}", async_save=False)
        out[name] = {"final": full_params(engine), "at_k": at_k, "state": _state(engine)}
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
        out[name] = {"final": full_params(engine), "state": _state(engine), "client_state": client_state}
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
        out[key] = full_params(engine)
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
    out["module_only"] = (full_params(fresh), fresh.global_steps, len(fresh.optimizer.inner.state),
                          fresh.lr_scheduler.last_epoch, client_state)
    # No optimizer state: weights (from the fp32 masters), counters and scheduler are restored.
    fresh, _ = _build("z2_fp32")
    fresh.load_checkpoint(f"{root}/z2_fp32", load_optimizer_states=False)  # latest: global_step5
    out["no_optimizer"] = (full_params(fresh), fresh.global_steps, len(fresh.optimizer.inner.state),
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
        runs.append((full_params(engine), _state(engine)))
    out["eight_bit"] = runs
    return out
