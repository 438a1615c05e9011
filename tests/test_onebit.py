"""1-bit Adam (OneBitAdam) with ZeRO-1/2: warm-up bit-identical to Adam, compressed-phase bytes,
training close to Adam, refusals."""

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
    partitions = [g.layout.partition_numel for g in engine.optimizer.groups]
    return losses, snapshots, records, partitions


def _refusal(stage: int) -> str:
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
    refusal = _refusal(0 if stage == 1 else 3)
    return (adam[0], onebit[0], [s for s in adam[1][:WARM]], [s for s in onebit[1][:WARM]], onebit[2], onebit[3],
            refusal)


def test_sign_packing_round_trip():
    from partita.optim.onebit_comm import pack_signs, packed_row_bytes, unpack_signs

    x = torch.tensor([[0.5, -1.0, 0.0, -0.0, 3.0, -2.0, 1.0, -1e-9, 7.0, -7.0, 1.0]])
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 2)
    assert packed_row_bytes(11) == 2 + 4
    expected = torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(unpack_signs(packed, 11), expected)


@pytest.mark.parametrize("stage", [1, 2])
def test_onebit_adam_zero(stage):
    world = 2
    results = run_distributed(_run_all, world, stage)
    adam_losses, onebit_losses, adam_warm, onebit_warm, records, partitions, refusal = results[0]
    assert refusal == (
        "optimizer type 'OneBitAdam' runs with zero_optimization.stage 1 or 2 over two or more data-parallel ranks "
        "(its compressed exchange replaces the gradient reduce-scatter of the ZeRO partitions; stage 0 and 3 are not "
        "built); set zero_optimization.stage to 1 or 2, or use type \"AdamW\"")
    # Warm-up: torch's AdamW itself, bit for bit (weights after every warm-up step).
    for a, b in zip(adam_warm, onebit_warm):
        for name in a:
            assert torch.equal(a[name], b[name]), name
    assert adam_losses[:WARM] == onebit_losses[:WARM]
    # The compressed step: no gradient reduce-scatter; the momentum goes as 1 bit per element plus a
    # 4-byte scale per row, through one all-to-all and one all-gather.
    ops = {(op, purpose.split(":")[0]) for op, purpose, _ in records}
    assert not any(op == "reduce_scatter_tensor" for op, _ in ops), records
    from partita.optim.onebit_comm import packed_row_bytes

    compressed = sum(b for op, purpose, b in records if purpose.startswith("1-bit Adam momentum exchange: compressed"))
    # Per group (partition p): an all-to-all and an all-gather of world rows of ceil(p / 8) + 4 bytes.
    assert compressed == sum(2 * world * packed_row_bytes(p) for p in partitions), records
    # What crosses each link (nccl-tests bus bytes): an all-reduce moves 2(n-1)/n of its message, an
    # all-to-all or all-gather (n-1)/n. Against the fp16 gradient all-reduce (DeepSpeed's 16x):
    link = (world - 1) / world
    fp16_all_reduce_bus = sum(2 * link * 2 * world * p for p in partitions)
    compressed_bus = link * compressed
    scales_and_rounding_bus = link * sum(2 * world * (4 + 1) for _ in partitions)  # <= 5 bytes per row
    assert compressed_bus <= fp16_all_reduce_bus / 16 + scales_and_rounding_bus
    # Against ZeRO-1/2's fp16 reduce-scatter ((n-1)/n of 2 bytes per element) it is 1/8.
    fp16_reduce_scatter_bus = sum(link * 2 * world * p for p in partitions)
    assert compressed_bus <= fp16_reduce_scatter_bus / 8 + scales_and_rounding_bus
    # Training: the tiny model's loss falls as with Adam, within 5% of Adam's after 40 steps. Why 5%:
    # sign compression changes each step's update direction by design; on this model the 1-bit run
    # ends 2.4% above Adam (2.641 vs 2.580), while a broken exchange fails: exp_avg taken from the
    # wrong rank's row stops the loss falling, a fixed scale instead of the RMS ends 32% off.
    assert onebit_losses[-1] < onebit_losses[0] * 0.8
    assert abs(onebit_losses[-1] - adam_losses[-1]) <= 0.05 * adam_losses[-1], (onebit_losses[-1], adam_losses[-1])
    # Every rank ends with the same weights (the exchange is identical everywhere).
    assert results[1][1] == onebit_losses


@pytest.mark.parametrize(
    "kind, needle",
    [("ZeroOneAdam", "DeepSpeed's ZeroOneAdam is not implemented in partita yet. Supported: "),
     ("OneBitLamb", "DeepSpeed's OneBitLamb is not implemented in partita yet. Supported: ")],
)
def test_unbuilt_one_bit_types_are_refused(kind, needle):
    from partita.config import load_config
    from partita.config.base import ConfigError

    with pytest.raises(ConfigError) as info:
        load_config({"train_batch_size": 8, "optimizer": {"type": kind, "params": {}}})
    assert needle in str(info.value) and "OneBitAdam" in str(info.value)


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


def save_continue_and_resume(root: str) -> dict:
    engine = _engine()
    _steps(engine, range(CKPT_AT))
    errors = [e.clone() for e in engine.optimizer.inner.worker_errors]
    assert all(e is not None and e.abs().sum() > 0 for e in errors)  # the error feedback is live
    engine.save_checkpoint(root)
    _steps(engine, range(CKPT_AT, CKPT_END))
    straight = _weights(engine)
    resumed = _engine()
    resumed.load_checkpoint(root)
    loaded = [e.clone() for e in resumed.optimizer.inner.worker_errors]
    _steps(resumed, range(CKPT_AT, CKPT_END))
    return {"straight": straight, "resumed": _weights(resumed),
            "same_errors": all(torch.equal(a, b) for a, b in zip(errors, loaded))}


def load_on_fewer_ranks(root: str) -> dict:
    from partita.checkpoint.reshard import ShardReader
    from partita.checkpoint.snapshot import param_names
    from partita.optim.onebit_checkpoint import worker_error_entries, worker_error_key

    engine = _engine(stage=1)
    engine.load_checkpoint(root)
    names = param_names(engine.module)
    mine = dict(worker_error_entries(engine.optimizer.inner, names))
    with ShardReader(Path(root) / f"global_step{CKPT_AT}") as reader:
        mean = {k: sum(reader.tensor(f"rank{s:05d}.safetensors", k) for s in range(4)) / 4 for k in mine}
    _steps(engine, range(CKPT_AT, CKPT_END))
    finite = all(torch.isfinite(p).all() for p in engine.module.parameters())
    return {"mean_errors": all(torch.allclose(mine[k], mean[k], rtol=0, atol=1e-7) for k in mine),
            "keys": sorted(mine) == sorted(worker_error_key(names[p]) for g in engine.optimizer.groups for p in g.params),
            "finite": finite}


def test_checkpoint_resume_keeps_error_feedback_and_reshards(tmp_path):
    root = str(tmp_path / "ckpt")
    first = run_distributed(save_continue_and_resume, 4, root)
    for rank_result in first:
        for name, value in rank_result["straight"].items():
            assert torch.equal(value, rank_result["resumed"][name]), name
        assert rank_result["same_errors"]
    second = run_distributed(load_on_fewer_ranks, 2, root)
    for rank_result in second:
        assert rank_result["mean_errors"] and rank_result["keys"] and rank_result["finite"]
