"""1-bit Adam (OneBitAdam) at ZeRO stages 0-2: warm-up bit-identical to Adam, compressed-phase bytes,
training close to Adam, checkpoints with the error feedback (resume and reshard), refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.harness import run_distributed
from tests.tiny_models import build_model, make_batches, param_groups

LR, GLOBAL_BATCH, WARM, STEPS = 1e-2, 8, 3, 40


def _config(kind: str, stage: int, freeze_step: int = WARM) -> dict:
    params = {"lr": LR, "weight_decay": 0.1, "betas": [0.9, 0.999], "eps": 1e-8}
    if kind == "OneBitAdam":
        params["freeze_step"] = freeze_step
    else:
        params["fused"] = False
    return {
        "train_batch_size": GLOBAL_BATCH,
        "optimizer": {"type": kind, "params": params},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 60},
        "steps_per_print": 1000,
    }


def _train(kind: str, stage: int, steps: int, *, count_bytes_at: int | None = None):
    import torch.distributed as dist

    import partita
    from partita.monitor.comms_logger import COMMS_LOGGER

    model = build_model()
    engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=_config(kind, stage))
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = GLOBAL_BATCH // world
    xs, ys = make_batches(steps, GLOBAL_BATCH)
    losses, snapshots, records = [], [], []
    for step in range(steps):
        if step == count_bytes_at:
            COMMS_LOGGER.enabled = True  # every collective (prof_all, the default)
            COMMS_LOGGER.reset()
        lo = rank * micro
        loss = engine(xs[step][lo : lo + micro], ys[step][lo : lo + micro])
        engine.backward(loss)
        engine.step()
        if step == count_bytes_at:
            records = [(r.op, r.purpose, r.message_bytes) for r in COMMS_LOGGER.records()]
            COMMS_LOGGER.enabled = False
        full = loss.detach().clone()
        dist.all_reduce(full)
        losses.append(full.item() / world)
        snapshots.append({n: p.detach().clone() for n, p in model.named_parameters()})
    chunks = [rows.chunk for rows in engine.optimizer.inner.rows] if kind == "OneBitAdam" else []
    return losses, snapshots, records, chunks


def _refusal(stage: int) -> str | None:
    import partita
    from partita.config.base import ConfigError

    model = build_model()
    try:
        engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model),
                                             config=_config("OneBitAdam", stage))
        engine.backward(engine(*[t[0][:2] for t in make_batches(1, 2)]))
        engine.step()  # stage 3 is found at the first step
    except ConfigError as error:
        return str(error)
    return "not refused"


def _run_all(stage: int):
    adam = _train("Adam", stage, STEPS)
    onebit = _train("OneBitAdam", stage, STEPS, count_bytes_at=WARM + 2)
    refusal = _refusal(3) if stage == 2 else None
    return (adam[0], onebit[0], [s for s in adam[1][:WARM]], [s for s in onebit[1][:WARM]], onebit[2], onebit[3],
            refusal, onebit[1][-1])


def test_sign_packing_round_trip():
    from partita.optim.onebit_comm import pack_signs, packed_row_bytes, unpack_signs

    x = torch.tensor([[0.5, -1.0, 0.0, -0.0, 3.0, -2.0, 1.0, -1e-9, 7.0, -7.0, 1.0]])
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 2)
    assert packed_row_bytes(11) == 2 + 4
    expected = torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(unpack_signs(packed, 11), expected)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_onebit_adam_zero(stage):
    from partita.optim.onebit_comm import packed_row_bytes

    world = 2
    results = run_distributed(_run_all, world, stage)
    adam_losses, onebit_losses, adam_warm, onebit_warm, records, chunks, refusal, final = results[0]
    if stage == 2:
        assert refusal == (
            "optimizer type 'OneBitAdam' runs with zero_optimization.stage 0, 1 or 2 over two or more data-parallel "
            "ranks (its compressed exchange replaces the gradient all-reduce or reduce-scatter; stage 3 is not built); "
            "set zero_optimization.stage to 0, 1 or 2, or use type \"AdamW\"")
    # Warm-up: torch's AdamW itself, bit for bit (weights after every warm-up step).
    for a, b in zip(adam_warm, onebit_warm):
        for name in a:
            assert torch.equal(a[name], b[name]), name
    assert adam_losses[:WARM] == onebit_losses[:WARM]
    # The compressed step sends no gradient collective at all: the 1-bit exchange (an all-to-all and an
    # all-gather per group), one all-reduce of the local norms, and ZeRO's parameter all-gather.
    allowed = ("1-bit Adam momentum exchange", "parameter all-gather after the optimizer step")
    assert records and all(purpose.startswith(allowed) for _, purpose, _ in records), records
    compressed = sum(b for op, purpose, b in records if purpose.startswith("1-bit Adam momentum exchange: compressed"))
    # Per group (rows of c elements): an all-to-all and an all-gather of world rows of ceil(c / 8) + 4 bytes.
    assert compressed == sum(2 * world * packed_row_bytes(c) for c in chunks), records
    # What crosses each link (nccl-tests bus bytes): an all-reduce moves 2(n-1)/n of its message, an
    # all-to-all or all-gather (n-1)/n. Against the fp16 gradient all-reduce (DeepSpeed's 16x) of the
    # same world * c elements:
    link = (world - 1) / world
    fp16_all_reduce_bus = sum(2 * link * 2 * world * c for c in chunks)
    compressed_bus = link * compressed
    scales_and_rounding_bus = link * sum(2 * world * (4 + 1) for _ in chunks)  # <= 5 bytes per row
    assert compressed_bus <= fp16_all_reduce_bus / 16 + scales_and_rounding_bus
    # Against ZeRO-1/2's fp16 reduce-scatter ((n-1)/n of 2 bytes per element) it is 1/8.
    fp16_reduce_scatter_bus = sum(link * 2 * world * c for c in chunks)
    assert compressed_bus <= fp16_reduce_scatter_bus / 8 + scales_and_rounding_bus
    # Training: the tiny model's loss falls as with Adam, within 5% of Adam's after 40 steps. Why 5%:
    # sign compression changes each step's update direction by design; on this model the 1-bit run
    # ends 2.4% above Adam (2.641 vs 2.580), while a broken exchange fails: exp_avg taken from the
    # wrong rank's row stops the loss falling, a fixed scale instead of the RMS ends 32% off.
    assert onebit_losses[-1] < onebit_losses[0] * 0.8
    assert abs(onebit_losses[-1] - adam_losses[-1]) <= 0.05 * adam_losses[-1], (onebit_losses[-1], adam_losses[-1])
    # Every rank ends with the same weights: every rank decodes the same synchronised momentum.
    for name, value in final.items():
        assert torch.equal(value, results[1][-1][name]), name


def test_onebit_adam_params_validated():
    from partita.config import load_config
    from partita.config.base import ConfigError

    cfg = load_config({"train_batch_size": 8, "optimizer": {"type": "onebitadam", "params": {"freeze_step": 5}}})
    assert cfg.optimizer.type == "OneBitAdam" and cfg.optimizer.params.freeze_step == 5
    with pytest.raises(ConfigError, match="freeze_step"):
        load_config({"train_batch_size": 8, "optimizer": {"type": "OneBitAdam", "params": {"freeze_step": 0}}})
    with pytest.raises(ConfigError, match="comm_backend_name 'mpi': partita compresses through torch.distributed"):
        load_config({"train_batch_size": 8, "optimizer": {"type": "OneBitAdam", "params": {"comm_backend_name": "mpi"}}})
    with pytest.raises(ConfigError, match="amsgrad=true is not supported by OneBitAdam"):
        load_config({"train_batch_size": 8, "optimizer": {"type": "OneBitAdam", "params": {"amsgrad": True}}})
    # DeepSpeed's own example keys load as they are.
    deepspeed = {"lr": 4e-4, "freeze_step": 23000, "cuda_aware": False, "comm_backend_name": "nccl",
                 "weight_decay": 0.01, "bias_correction": True}
    assert load_config({"train_batch_size": 8, "optimizer": {"type": "OneBitAdam", "params": deepspeed}}).optimizer


# ---------------------------------------------------------------------------- checkpoints

CKPT_AT, CKPT_END = WARM + 3, WARM + 6  # saved three steps into the compressed phase


def _engine(stage: int = 2):
    import partita

    model = build_model()
    cfg = {**_config("OneBitAdam", stage), "checkpoint": {"handshake_timeout_seconds": 20}}
    engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    return engine


def _steps(engine, steps: range) -> None:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    micro = GLOBAL_BATCH // world
    xs, ys = make_batches(CKPT_END, GLOBAL_BATCH)
    for step in steps:
        engine.backward(engine(xs[step][rank * micro : (rank + 1) * micro], ys[step][rank * micro : (rank + 1) * micro]))
        engine.step()


def _weights(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _whole_server_errors(engine) -> dict[str, torch.Tensor]:
    """Every parameter's server error over all its elements (each element has one owner rank)."""
    import torch.distributed as dist

    from partita.checkpoint.snapshot import param_names

    inner, names, out = engine.optimizer.inner, param_names(engine.module), {}
    for g, (group, rows) in enumerate(zip(inner.zero_groups, inner.rows)):
        matrix = rows.empty()
        matrix[rows.rank] = inner.server_error(g)
        dist.all_reduce(matrix)
        out.update({names[p]: rows.take(matrix, spec).clone() for p, spec in zip(group.params, group.layout.specs)})
    return out


def save_continue_and_resume(root: str) -> dict:
    out = {}
    for stage in (2, 0):
        where = f"{root}/stage{stage}"
        engine = _engine(stage)
        _steps(engine, range(CKPT_AT))
        errors = [e.clone() for e in engine.optimizer.inner.worker_errors]
        assert all(e is not None and e.abs().sum() > 0 for e in errors)  # the error feedback is live
        servers = _whole_server_errors(engine)
        assert all(v.abs().sum() > 0 for v in servers.values() if v.numel() > 9)
        engine.save_checkpoint(where)
        _steps(engine, range(CKPT_AT, CKPT_END))
        straight = _weights(engine)
        resumed = _engine(stage)
        resumed.load_checkpoint(where)
        loaded = [e.clone() for e in resumed.optimizer.inner.worker_errors]
        _steps(resumed, range(CKPT_AT, CKPT_END))
        out[stage] = {"straight": straight, "resumed": _weights(resumed), "servers": servers,
                      "same_errors": all(torch.equal(a, b) for a, b in zip(errors, loaded))}
    return out


def load_on_fewer_ranks(root: str, saved_servers: dict) -> dict:
    from partita.checkpoint.reshard import ShardReader
    from partita.checkpoint.snapshot import param_names
    from partita.optim.onebit_checkpoint import worker_error_entries, worker_error_key

    out = {}
    for saved_stage, stage in ((2, 0), (0, 1)):  # across world sizes and across stages
        where = f"{root}/stage{saved_stage}"
        engine = _engine(stage)
        engine.load_checkpoint(where)
        names = param_names(engine.module)
        mine = {k: v for k, v in worker_error_entries(engine.optimizer.inner, names) if k.startswith("onebit/worker")}
        with ShardReader(Path(where) / f"global_step{CKPT_AT}") as reader:
            mean = {k: sum(reader.tensor(f"rank{s:05d}.safetensors", k) for s in range(4)) / 4 for k in mine}
        servers = _whole_server_errors(engine)
        _steps(engine, range(CKPT_AT, CKPT_END))
        out[saved_stage] = {
            "mean_errors": all(torch.allclose(mine[k], mean[k], rtol=0, atol=1e-7) for k in mine),
            "keys": sorted(mine) == sorted(worker_error_key(names[p]) for g in engine.optimizer.groups for p in g.params),
            "servers": all(torch.equal(servers[k], v) for k, v in saved_servers[saved_stage].items()),
            "finite": all(torch.isfinite(p).all() for p in engine.module.parameters()),
        }
    return out


def test_checkpoint_resume_keeps_error_feedback_and_reshards(tmp_path):
    root = str(tmp_path / "ckpt")
    first = run_distributed(save_continue_and_resume, 4, root)
    for rank_result in first:
        for stage, result in rank_result.items():
            for name, value in result["straight"].items():
                assert torch.equal(value, result["resumed"][name]), (stage, name)
            assert result["same_errors"], stage
    saved_servers = {stage: result["servers"] for stage, result in first[0].items()}
    second = run_distributed(load_on_fewer_ranks, 2, root, saved_servers)
    for rank_result in second:
        for saved_stage, result in rank_result.items():
            assert result == {"mean_errors": True, "keys": True, "servers": True, "finite": True}, saved_stage
