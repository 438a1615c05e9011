"""Tensor parallelism's correctness details: dropout streams, the collective volume per step
(Megatron's formula, exactly), and composition with mixed precision, activation checkpointing,
CPU optimizer offload, 8-bit states and compile."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.test_tensor_parallel import GLOBAL_BATCH, SEQ, _batches, _config, _gpt, _reference, whole_params

# ----------------------------------------------------------------------------- dropout streams


def test_sharded_regions_draw_per_rank_streams_replicated_regions_agree() -> None:
    from partita.tensor_parallel.rng import tensor_parallel_rng

    def run(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        torch.manual_seed(1234)  # every tensor rank has the same global state
        with tensor_parallel_rng(rank, torch.device("cpu")):
            inside = torch.rand(8)
        after = torch.rand(8)  # back on the global stream
        return inside, after, torch.get_rng_state()

    r0, r1, r0_again = run(0), run(1), run(0)
    assert not torch.equal(r0[0], r1[0])  # sharded region: different masks per tensor rank
    assert torch.equal(r0[1], r1[1]) and torch.equal(r0[2], r1[2])  # replicated region: in step
    # A pure function of the global state: checkpoint recompute (which restores it) redraws the same masks.
    assert torch.equal(r0[0], r0_again[0])


def _train_dropout(cfg: dict) -> dict:
    import partita
    from partita.tensor_parallel.layers import is_tensor_replicated

    torch.manual_seed(5)
    model = _gpt(dropout=0.3)
    engine, *_ = partita.initialize(model=model, config=cfg)
    xs, ys = _batches()
    for step in range(2):
        _, loss = engine(xs[step], ys[step])
        engine.backward(loss)
        engine.step()
    metrics = engine._step_log.last_metrics  # steps_per_print 2: the print step just ran
    params = {n: p.detach().clone() for n, p in model.named_parameters() if is_tensor_replicated(p)}
    return {"params": params, "tokens_per_sample": metrics["tokens_per_sec"] / metrics["samples_per_sec"]}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_dropout_keeps_replicated_parameters_identical_across_tensor_ranks(sequence_parallel: bool) -> None:
    cfg = {**_config(2, 2, sequence_parallel), "train_batch_size": GLOBAL_BATCH,
           "activation_checkpointing": {"policy": "every"}, "steps_per_print": 2, "throughput": {"warmup_steps": 0}}
    ra, rb = run_distributed(_train_dropout, 2, cfg, timeout=240)
    # Both tensor ranks read the same tokens: they are counted once, not twice.
    assert ra["tokens_per_sample"] == pytest.approx(SEQ, rel=1e-9)
    a, b = ra["params"], rb["params"]
    assert a and a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name  # same stream where replicated, or replicas would drift


# ----------------------------------------------------------------------------- collective volume


def _tensor_parallel_bytes(sequence_parallel: bool) -> dict:
    import partita
    from partita.monitor.comms_logger import COMMS_LOGGER

    model = _gpt()
    cfg = {**_config(0, 2, sequence_parallel), "comms_logger": {"enabled": True, "debug": True}}
    engine, *_ = partita.initialize(model=model, config=cfg)
    xs, ys = _batches()
    shapes = []
    model.blocks[0].ln_1.register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    before = _by_op(COMMS_LOGGER.summary())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = engine(xs[0], ys[0])
    engine.backward(loss)
    after = _by_op(COMMS_LOGGER.summary())
    return {"bytes": {k: after.get(k, 0) - before.get(k, 0) for k in after}, "ln_input": shapes[0],
            "saved_bytes": sum(saved)}


def _by_op(summary) -> dict:
    out: dict = {}
    for row in summary.rows:
        if row.purpose and row.purpose.startswith("tensor parallel"):
            key = (row.op, row.purpose)
            out[key] = out.get(key, 0) + row.message_bytes * row.count
    return out


def test_collective_volume_per_step_follows_megatron() -> None:
    b, s, h, layers, fp32 = GLOBAL_BATCH, SEQ, 32, 2, 4
    bsh = b * s * h * fp32
    plain_run = run_distributed(_tensor_parallel_bytes, 2, False)[0]
    plain = plain_run["bytes"]
    # Megatron without sequence parallelism: 4 all-reduces of b*s*h per block (2 forward, 2
    # backward), plus the embedding's forward all-reduce and the LM head's input-gradient one.
    assert plain[("all_reduce", "tensor parallel: output all-reduce")] == (2 * layers + 1) * bsh
    assert plain[("all_reduce", "tensor parallel: input-gradient all-reduce")] == (2 * layers + 1) * bsh
    # The vocabulary-parallel loss moves 3 floats per token, not b*s*vocab logits.
    assert plain[("all_reduce", "tensor parallel: loss max")] + plain[("all_reduce", "tensor parallel: loss sums")] == 3 * b * s * fp32
    sp_run = run_distributed(_tensor_parallel_bytes, 2, True)[0]
    sp = sp_run["bytes"]
    # The LayerNorm regions run on sequence shards, and the activations autograd keeps shrink.
    assert plain_run["ln_input"] == (b, s, h) and sp_run["ln_input"] == (b, s // 2, h)
    assert sp_run["saved_bytes"] < plain_run["saved_bytes"]
    # With it: each block's all-reduces become reduce-scatter + all-gather pairs of the same bytes.
    gathers = sp[("all_gather_into_tensor", "tensor parallel: sequence all-gather")]
    scatters = sp[("reduce_scatter_tensor", "tensor parallel: sequence reduce-scatter")]
    assert gathers == (2 * layers + 1) * bsh and scatters == 2 * layers * bsh
    assert sp[("reduce_scatter_tensor", "tensor parallel: sequence reduce-scatter in backward")] == (2 * layers + 1) * bsh
    assert sp[("all_gather_into_tensor", "tensor parallel: sequence all-gather in backward")] == (2 * layers + 1) * bsh
    assert ("all_reduce", "tensor parallel: output all-reduce") in sp  # the embedding's (see apply.py)


# ----------------------------------------------------------------------------- composition


def _train_variant(variants: list[dict]) -> list[dict]:
    import partita

    out = []
    for extra in variants:
        model = _gpt()
        cfg = {**_config(extra.pop("stage"), 2, extra.pop("sp", False)), **extra}
        engine, *_ = partita.initialize(model=model, model_parameters=model.optimizer_param_groups(0.1), config=cfg)
        xs, ys = _batches()
        for step in range(xs.shape[0]):
            _, loss = engine(xs[step], ys[step])
            engine.backward(loss)
            engine.step()
        out.append(whole_params(engine, model))
    return out


def test_composes_with_precision_checkpointing_offload_8bit_and_compile() -> None:
    variants = [
        {"stage": 2, "sp": True, "activation_checkpointing": {"policy": "every"}},
        {"stage": 2, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
        {"stage": 3, "compile": {"enabled": True, "backend": "eager"}},
        {"stage": 1, "bf16": {"enabled": True}},
        {"stage": 1, "optimizer": {"type": "AdamW8bit", "params": {"lr": 1e-3}}},
    ]
    results = run_distributed(_train_variant, 2, [dict(v) for v in variants], timeout=420)[0]
    ref, _ = _reference()
    initial = dict(_gpt().named_parameters())
    for variant, got in zip(variants[:3], results[:3]):  # fp32: exact parity
        for name, want in ref.items():
            err = float((got[name] - want).norm() / want.norm())
            assert err < 1e-5, (variant, name, err)
    for name, want in ref.items():  # bf16: close to fp32, a small fraction of how far training moved
        moved = (want - initial[name].detach()).norm()
        if moved > 0:
            assert float((results[3][name] - want).norm() / moved) < 0.1, name
    moved_8bit = sum(float((results[4][n] - initial[n].detach()).norm()) for n in ref)
    assert moved_8bit > 0  # 8-bit AdamW trained (a different optimizer: no parity with SGD's reference)
