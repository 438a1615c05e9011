"""Pipelines composed with the rest of partita, against single-process torch (fp32 within 1e-5):

- ZeRO-2 inside each stage's data-parallel group (pipe 2 x data 2); ZeRO-3 has its own file, tests/test_pipe_zero3.py;
- tensor parallelism inside each stage (pipe 2 x tensor 2, pipe 2 x tensor 2 x data 2), the
  blocks' MLPs split by ``tensor_parallel.partition_config.layer_specs``;
- fp16 (an overflow on one stage skips the step on every stage) and bf16; the clipping norm
  over all stages equals ``clip_grad_norm_``'s;
- the monitors: the loss from the last stage, the pipeline's samples, the bubble timers.

The model is test_pipe_parity's (a tied embedding/LM head across the first and last stages, a
LayerNorm) with MLP blocks ``x + proj(tanh(fc(x)))`` that tensor parallelism can split
(``fc`` by columns, ``proj`` by rows). One spawn per world size, each checking several runs.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch import nn

from tests.harness import run_distributed
from tests.test_pipe_parity import (BASE_SEED, DIM, MICRO, VOCAB, build_like_the_pipeline, global_batches, lm_head,
                                    lm_loss)

HIDDEN = 8
N_BLOCKS = 4
STEPS = 2
LR, CLIP = 1e-2, 0.05
TP_SPECS = [{"patterns": [r"\.fc$"], "partition_type": "column"}, {"patterns": [r"\.proj$"], "partition_type": "row"}]


class MLPBlock(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, hidden)
        self.proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.tanh(self.fc(x)))


def layer_specs():
    from partita.pipe import LayerSpec, TiedLayerSpec

    return ([TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM)]
            + [LayerSpec(MLPBlock, DIM, HIDDEN) for _ in range(N_BLOCKS)]
            + [LayerSpec(nn.LayerNorm, DIM), TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=lm_head)])


def reference(micro_batches: int, data: int) -> dict:
    """Single-process torch on the whole global batch: losses, pre-clip norms, final weights."""
    built = build_like_the_pipeline(layer_specs())
    embed, blocks = built["embed"], [built[i] for i in range(1, N_BLOCKS + 2)]
    params = [p for m in [embed, *blocks] for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    xs, ys = global_batches(micro_batches, data)
    losses, norms = [], []
    for step in range(STEPS):
        h = embed(xs[step])
        for block in blocks:
            h = block(h)
        loss = lm_loss(lm_head(embed, h), ys[step])
        opt.zero_grad()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(params, CLIP).item())
        opt.step()
        losses.append(loss.item())
    state = {"tied_modules.embed.weight": embed.weight.detach().clone()}
    for i, block in enumerate(blocks, start=1):
        for name, value in block.state_dict().items():
            state[f"{i}.{name}"] = value.clone()
    return {"losses": losses, "norms": norms, "state": state}


def _config(m: int, run: dict) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": m,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": run.get("zero_stage", 0), "reduce_bucket_size": 50},
        "pipeline": {"schedule": run.get("schedule", "1f1b")},
        "steps_per_print": run.get("steps_per_print", 1000),
        "throughput": {"warmup_steps": 0},
    }
    if run.get("tensor", 1) > 1:
        cfg["tensor_parallel"] = {"autotp_size": run["tensor"], "partition_config": {"layer_specs": TP_SPECS}}
    if run.get("precision") == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    if run.get("precision") == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _micro(engine, xs, ys, step: int, m: int) -> list:
    rank = engine.topology.data_rank
    return [(xs[step][(rank * m + k) * MICRO:][:MICRO], ys[step][(rank * m + k) * MICRO:][:MICRO]) for k in range(m)]


def _whole_state(model) -> dict:
    """This rank's state: each tensor-parallel shard with where it lies in the whole tensor."""
    from partita.tensor_parallel.layers import tensor_shard_of

    params = dict(model.named_parameters())
    out = {}
    for key, value in model.state_dict().items():
        shard = tensor_shard_of(params[key]) if key in params else None
        out[key] = (value.detach().float().clone(), None if shard is None else (shard.dim, shard.full_shape, shard.full_ranges()))
    return out


def train_runs(runs: list[dict]) -> list[dict]:
    import torch.distributed as dist

    import partita
    from partita.pipe import PipelineModule

    partita.init_distributed()
    out = []
    for run in runs:
        m, virtual = run["micro_batches"], run.get("virtual_stages", 1)
        if run.get("split_tied"):  # a tensor-parallel rule that matches a tied layer: refused
            from partita.pipe import LayerSpec, TiedLayerSpec

            tied = PipelineModule([TiedLayerSpec("lin", nn.Linear, DIM, DIM), LayerSpec(MLPBlock, DIM, HIDDEN),
                                   TiedLayerSpec("lin", nn.Linear, DIM, DIM)], num_stages=run["stages"], loss_fn=lm_loss)
            cfg = _config(m, run)
            cfg["tensor_parallel"]["partition_config"]["layer_specs"] = [
                {"patterns": [r"^tied_modules\.lin$"], "partition_type": "column"}]
            try:
                partita.initialize(model=tied, config=cfg)
                out.append({"error": None})
            except Exception as error:  # noqa: BLE001 - compared by the test
                out.append({"error": (type(error).__name__, str(error))})
            continue
        model = PipelineModule(layer_specs(), num_stages=run["stages"], loss_fn=lm_loss, partition_method="uniform",
                               seed_layers=True, base_seed=BASE_SEED, virtual_stages=virtual)
        engine, *_ = partita.initialize(model=model, config=_config(m, run))
        xs, ys = global_batches(m, engine.topology.data_size)
        if run.get("wrong_data"):  # the tensor ranks read different samples: a mistake every stage reports
            try:
                engine.train_batch(iter(_micro(engine, xs, ys, engine.topology.tensor_rank, m)))
                out.append({"error": None})
            except Exception as error:  # noqa: BLE001 - compared by the test
                out.append({"error": (type(error).__name__, str(error))})
            continue
        if run.get("raise_backward"):  # a backward that raises on one rank of the last stage only
            if engine.is_last_stage() and engine.topology.data_rank == 0:
                def fail(grad):
                    raise RuntimeError("injected backward failure")

                model.get_submodule(str(N_BLOCKS + 1)).weight.register_hook(fail)
            start = time.monotonic()
            try:
                engine.train_batch(iter(_micro(engine, xs, ys, 0, m)))
                out.append({"error": None})
            except Exception as error:  # noqa: BLE001 - compared by the test
                out.append({"error": (type(error).__name__, str(error)), "seconds": time.monotonic() - start})
            continue
        losses, norms, applied, scales, lines = [], [], [], [], []
        for step in range(STEPS):
            poison = None
            if run.get("poison_step") == step and engine.is_last_stage() and engine.topology.data_rank == 0 \
                    and engine.topology.tensor_rank == 0:
                # An inf in one gradient of one rank of the last stage only.
                weight = model.get_submodule(str(N_BLOCKS + 1)).weight
                poison = weight.register_hook(lambda g: torch.full_like(g, math.inf))
            batch = 0 if run.get("poison_step") is not None else step  # skipped: the same batch again
            losses.append(engine.train_batch(iter(_micro(engine, xs, ys, batch, m))).item())
            if poison is not None:
                poison.remove()
            norms.append(engine.get_global_grad_norm())
            applied.append(engine.was_step_applied())
            scales.append(engine.get_loss_scale())
            lines.append(engine._step_log.last_line)
        out.append({"losses": losses, "norms": norms, "applied": applied, "scales": scales, "lines": lines,
                    "metrics": dict(engine._step_log.last_metrics), "bubble": engine.last_bubble,
                    "samples": engine.global_samples, "skipped": engine.skipped_steps,
                    "state": _whole_state(model), "rank": dist.get_rank(),
                    "coords": (engine.topology.pipe_rank, engine.topology.data_rank, engine.topology.tensor_rank)})
    return out


def _assemble(results: list[list[dict]], r: int) -> dict[str, torch.Tensor]:
    """Whole tensors from every rank's shards; replicas (data ranks, tied copies) must agree exactly."""
    whole: dict[str, torch.Tensor] = {}
    for rank_results in results:
        for key, (value, shard) in rank_results[r]["state"].items():
            if shard is None:
                if key in whole:
                    torch.testing.assert_close(value, whole[key], rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")
                whole[key] = value
                continue
            dim, full_shape, ranges = shard
            target = whole.setdefault(key, torch.full(full_shape, math.nan))
            pieces = value.split([b - a for a, b in ranges], dim=dim)
            for (a, b), piece in zip(ranges, pieces):
                target.narrow(dim, a, b - a).copy_(piece)
    return whole


def _check_parity(results: list[list[dict]], runs: list[dict], r: int) -> None:
    run = runs[r]
    data = len(results) // (run["stages"] * run.get("tensor", 1))
    expected = reference(run["micro_batches"], data)
    for rank_results in results:
        got = rank_results[r]
        assert got["losses"] == pytest.approx(expected["losses"], rel=1e-5), (run, got["rank"])
        # The clipping norm over every stage, tensor shard and data rank: clip_grad_norm_'s.
        assert got["norms"] == pytest.approx(expected["norms"], rel=1e-5), (run, got["rank"])
    whole = _assemble(results, r)
    assert sorted(whole) == sorted(expected["state"]), run
    for key, value in expected["state"].items():
        torch.testing.assert_close(whole[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{run} {k}: {m}")


def test_pipe_2_by_data_2_zero2_precision_and_monitors() -> None:
    runs = [
        {"stages": 2, "micro_batches": 2, "schedule": "1f1b", "zero_stage": 2, "steps_per_print": 1},
        # Weight gradients outside autograd's hooks (zero bubble) reduced under ZeRO-2 all the same.
        {"stages": 2, "micro_batches": 4, "schedule": "zero_bubble", "zero_stage": 2, "virtual_stages": 2},
        # fp16: an inf in the last stage's gradient on one data rank, in the first step only.
        {"stages": 2, "micro_batches": 2, "precision": "fp16", "zero_stage": 1, "poison_step": 0},
        {"stages": 2, "micro_batches": 2, "precision": "bf16", "zero_stage": 2},
        # Last (it tears the process groups down): every stage and data rank fails, naming rank 2.
        {"stages": 2, "micro_batches": 2, "zero_stage": 1, "raise_backward": True},
    ]
    results = run_distributed(train_runs, 4, runs)
    _check_parity(results, runs, 0)
    _check_parity(results, runs, 1)
    expected = reference(2, 2)
    for rank_results in results:
        mon, fp16, bf16 = rank_results[0], rank_results[2], rank_results[3]
        # The step log: the last stage's loss on every rank, the whole pipeline's samples.
        assert mon["metrics"]["train_loss"] == pytest.approx(mon["losses"][-1], rel=1e-6)
        assert mon["samples"] == STEPS * MICRO * 2 * 2
        assert mon["metrics"]["samples_per_sec"] > 0
        bubble = mon["bubble"]
        assert (bubble["schedule"], bubble["stages"], bubble["micro_batches"]) == ("1f1b", 2, 2)
        assert bubble["theory_idle_fraction"] == pytest.approx(1 / 3)
        assert bubble["stage"] == mon["coords"][0]
        assert [s["stage"] for s in bubble["per_stage"]] == [0, 1]
        for s in [bubble, *bubble["per_stage"]]:
            assert 0 < s["compute_s"] <= s["schedule_s"] and 0 <= s["idle_fraction"] < 1
            assert s["idle_s"] == pytest.approx(s["schedule_s"] - s["compute_s"])
        assert bubble["per_stage"] == results[0][0]["bubble"]["per_stage"]  # gathered: the same on every rank
        assert {"pipe_idle_s0", "pipe_idle_s1"} <= set(mon["metrics"])
        assert "pipe_idle_s0=" in mon["lines"][-1] and "pipe_idle_s1=" in mon["lines"][-1]
        # fp16: the poisoned step is skipped on every stage and data rank, the scale halves; the
        # next step runs from the initial weights on the same batch: the same loss exactly.
        assert fp16["applied"] == [False, True] and fp16["skipped"] == 1
        assert fp16["losses"][1] == fp16["losses"][0]
        assert fp16["scales"] == [2.0 ** 7, 2.0 ** 7]
        assert math.isinf(fp16["norms"][0])
        assert fp16["losses"][0] == pytest.approx(expected["losses"][0], rel=2e-3)
        assert bf16["applied"] == [True, True]
        assert bf16["losses"] == pytest.approx(expected["losses"], rel=2e-2)
        assert bf16["norms"] == pytest.approx(expected["norms"], rel=5e-2)
    for rank, rank_results in enumerate(results):
        kind, message = rank_results[4]["error"]
        assert kind == "StageFailure", message
        if rank == 2:
            assert message.startswith("train_batch(): pipeline stage 1 (rank 2) failed; every stage stops: "), message
        else:
            assert message.startswith(f"train_batch() on stage {rank // 2} (rank {rank}) stopped: pipeline stage 1 "
                                      "(rank 2): "), message
        assert "injected backward failure" in message
        assert rank_results[4]["seconds"] < 60  # not the collective timeout (1800 s)


def test_pipe_2_by_tensor_2_matches_torch() -> None:
    runs = [
        {"stages": 2, "micro_batches": 2, "schedule": "1f1b", "zero_stage": 1, "tensor": 2},
        {"stages": 2, "micro_batches": 4, "schedule": "interleaved_1f1b", "zero_stage": 0, "tensor": 2,
         "virtual_stages": 2},
        # The inf on tensor rank 0 of the last stage only: both stages and both tensor ranks skip.
        {"stages": 2, "micro_batches": 2, "precision": "fp16", "zero_stage": 0, "tensor": 2, "poison_step": 0},
        {"stages": 2, "micro_batches": 2, "tensor": 2, "split_tied": True},
        # Last: a failed batch tears the process groups down.
        {"stages": 2, "micro_batches": 2, "tensor": 2, "wrong_data": True},
    ]
    results = run_distributed(train_runs, 4, runs)
    assert [r[0]["coords"] for r in results] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]
    # fc by columns, proj by rows: each tensor rank holds half of every block's MLP.
    shard = results[0][0]["state"]["1.fc.weight"]
    assert tuple(shard[0].shape) == (HIDDEN // 2, DIM) and shard[1][0] == 0
    _check_parity(results, runs, 0)
    _check_parity(results, runs, 1)
    for rank_results in results:
        fp16 = rank_results[2]
        assert fp16["applied"] == [False, True] and fp16["skipped"] == 1 and fp16["scales"] == [2.0 ** 7] * 2
        assert fp16["losses"][1] == fp16["losses"][0]
    for rank, rank_results in enumerate(results):
        assert rank_results[3]["error"] == (
            "NotImplementedError", "tensor parallelism split the tied layer 'lin' (TiedLayerSpec): tied layers stay "
            "replicated under pipelines; change tensor_parallel.partition_config.layer_specs so no rule matches "
            "'tied_modules.lin'")
        kind, message = rank_results[4]["error"]
        assert kind == "StageFailure", message
        # Both stages' tensor ranks read different data; stage 0's report (or stage 1's) names itself.
        assert "tensor ranks of stage" in message and "read different micro-batches" in message


def test_pipe_2_by_tensor_2_by_data_2_matches_torch() -> None:
    runs = [{"stages": 2, "micro_batches": 2, "schedule": "1f1b", "zero_stage": 2, "tensor": 2}]
    results = run_distributed(train_runs, 8, runs)
    assert [r[0]["coords"] for r in results][:4] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    _check_parity(results, runs, 0)
