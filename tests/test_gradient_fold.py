"""``zero_optimization.one_rank_gradient_fold`` (partita/zero/fold_choice.py): which rule "auto" picks,
the estimator's peaks of the rules, and the refusals. That the rules train bitwise alike is in
tests/test_memory_one_rank.py and tests/test_streamed_step.py."""

from __future__ import annotations

import pytest
import torch

from partita.config import ConfigError, PartitaConfig, load_config
from partita.estimate import GPTShape, estimate_memory
from partita.estimate.inputs import Setup
from partita.estimate.model_info import model_info
from partita.zero.fold_choice import resolve_gradient_fold

GIB = 2**30


def _gpt_1_3b():
    from partita.models.gpt import GPT, GPTConfig

    with torch.device("meta"):  # never allocated: the estimator reads shapes only
        return GPT(GPTConfig(vocab_size=50304, block_size=2048, n_layer=24, n_head=16, n_embd=2048))


def _cfg(micro_batch: int, *, stage: int = 2, checkpoint: bool = False, fused: bool | None = False, gas: int = 1,
         optimizer: str = "AdamW", **zero) -> PartitaConfig:
    # fused False (the default here): "stream" does not apply, and "auto" picks between early and end.
    params = {"lr": 1e-4} if fused is None else {"lr": 1e-4, "fused": fused}
    raw = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": gas, "bf16": {"enabled": True},
           "optimizer": {"type": optimizer, "params": params}, "zero_optimization": {"stage": stage, **zero}}
    if checkpoint:
        raw["activation_checkpointing"] = {"policy": "every"}
    return PartitaConfig.model_validate(raw)


def _choice(cfg: PartitaConfig, model=None, *, world_size: int = 1, client_optimizer=None) -> str:
    model = model if model is not None else _gpt_1_3b()
    out = resolve_gradient_fold(cfg, model, [{"params": list(model.parameters())}], world_size=world_size,
                                client_optimizer=client_optimizer, gradient_accumulation_steps=cfg.gradient_accumulation_steps)
    return out.zero_optimization.one_rank_gradient_fold


def _peak(micro_batch: int, stage: int, checkpointing: str, end: bool, *, stream: bool = False,
          shape: GPTShape = GPTShape(2048, 24, 16, 50304, 2048)) -> float:
    setup = Setup(dtype="bf16", stage=stage, micro_batch=micro_batch, checkpointing=checkpointing,
                  fold_gradients_at_end=end or stream, streamed_step=stream)
    return estimate_memory(model_info(shape), setup).peak_accelerator / GIB


def test_estimated_peaks_of_the_streamed_step():
    # No fp32 partition: measured on one H200 (benchmarks/results/2026-12-01-report.md) GPT-1.3B micro-batch 1 20.05 GiB
    # at stages 1-2, 19.14 at stage 3 (FSDP2 20.24; early 23.30), micro-batch 2 23.31, micro-batch 8 48.33 (both FSDP2's),
    # GPT-6.7B ZeRO-3 checkpointed 88.04 (FSDP2 100.81; early 101.38).
    assert round(_peak(1, 2, "none", False, stream=True), 2) == 19.82  # the end of backward: the blocks are back
    assert round(_peak(1, 3, "none", False, stream=True), 2) == 19.56
    assert round(_peak(2, 2, "none", False, stream=True), 2) == 23.63  # the start of backward, as with end
    assert round(_peak(8, 2, "none", False, stream=True), 2) == 49.81
    assert round(_peak(1, 3, "every", False, stream=True, shape=GPTShape(4096, 32, 32, 50304, 2048)), 2) == 88.19
    assert round(_peak(1, 3, "every", False, shape=GPTShape(4096, 32, 32, 50304, 2048)), 2) == 101.71


def test_auto_takes_stream_wherever_it_applies():
    assert _choice(_cfg(1, fused=None)) == "stream"  # this torch has a fused AdamW on CPU
    assert _choice(_cfg(8, stage=3, fused=True, checkpoint=True)) == "stream"
    assert _choice(_cfg(2, fused=None), torch.nn.Linear(8, 8)) == "stream"  # any model: it never holds more
    assert _choice(_cfg(2, stage=1, gas=2, fused=None)) == "stream"  # stages 0-1 accumulate in param.grad anyway
    assert _choice(_cfg(2, stage=2, gas=2, fused=None)) == "end"  # stage 2 sums in fp32: the estimate decides
    assert _choice(_cfg(2, fused=None, optimizer="SGD")) == "end"
    assert _choice(_cfg(2, fused=None), world_size=2) == "early"
    assert _choice(_cfg(2, fused=None, offload_optimizer={"device": "cpu"})) == "early"
    model = _gpt_1_3b()
    adamw = lambda fused: torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)  # noqa: E731
    assert _choice(_cfg(2, fused=None), model, client_optimizer=adamw(True)) == "stream"
    assert _choice(_cfg(2, fused=None), model, client_optimizer=adamw(False)) == "end"
    # The estimator reads the same choice from the config (assuming an accelerator's fused kernel).
    assert Setup.from_config(_cfg(1, fused=None), world_size=1).streamed_step
    assert not Setup.from_config(_cfg(1, fused=False), world_size=1).streamed_step
    assert not Setup.from_config(_cfg(1, fused=None), world_size=2).streamed_step


def test_estimated_peaks_of_both_rules():
    # GPT-1.3B, one rank. "end" frees each block's weights again after its backward
    # (one_rank_weights.py): before that, with 2.25 GiB of block weights beside the gradients at
    # the end of backward, the estimate was 24.70 at micro-batch 1 (the figure benchmarks/results/2026-12-01-report.md
    # recorded for the rule before early folding) and 24.89 at micro-batch 2 (measured: 24.57).
    assert round(_peak(1, 2, "none", True), 2) == 22.45
    assert round(_peak(1, 2, "none", False), 2) == 23.29
    assert round(_peak(2, 2, "none", False), 2) == 26.48 and round(_peak(2, 2, "none", True), 2) == 23.63
    assert round(_peak(8, 2, "none", False), 2) == round(_peak(8, 2, "none", True), 2) == 49.81
    # ZeRO-3 releases each block after its backward itself: unchanged (measured: 23.31, FSDP2's).
    assert round(_peak(2, 3, "none", True), 2) == 23.92


def test_auto_takes_end_only_where_it_saves_five_percent():
    assert _choice(_cfg(2)) == "end"  # 23.63 against 26.48 GiB: 10.8% less
    assert _choice(_cfg(2, stage=3)) == "end"  # 23.92 against 26.68: 10.3%
    assert _choice(_cfg(1, stage=3)) == "end"  # 22.25 against 23.49: 5.3%
    assert _choice(_cfg(1)) == "early"  # 22.45 against 23.29: 3.6%, not worth end's slower step
    assert _choice(_cfg(2, checkpoint=True)) == "early"  # 22.64 against 22.88: 1%
    assert _choice(_cfg(8)) == "early"  # equal peaks
    assert _choice(_cfg(2, stage=3, checkpoint=True)) == "early"  # 21.29 < 22.44


def test_auto_is_early_where_the_estimate_cannot_choose():
    linear = torch.nn.Linear(8, 8)
    assert _choice(_cfg(2), linear) == "early"  # no walk of backward for other models
    assert _choice(_cfg(2), world_size=2) == "early"  # ranks to reduce over: nothing to hold
    assert _choice(_cfg(2, offload_optimizer={"device": "cpu"})) == "early"  # gradients go to the host
    assert _choice(_cfg(2, one_rank_gradient_fold="end"), linear) == "end"  # a given rule is kept


def test_end_with_optimizer_offload_is_refused():
    with pytest.raises(ConfigError, match='one_rank_gradient_fold "end" holds every param.grad on the accelerator'):
        load_config({"zero_optimization": {"stage": 2, "one_rank_gradient_fold": "end",
                                           "offload_optimizer": {"device": "cpu"}}})
    with pytest.raises(ConfigError, match="one_rank_gradient_fold"):
        load_config({"zero_optimization": {"one_rank_gradient_fold": "late"}})
