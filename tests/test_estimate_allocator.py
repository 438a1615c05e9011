"""partita.estimate's caching-allocator model (rounding, segments, PYTORCH_CUDA_ALLOC_CONF, the
calibrated fragmentation and its fit from the recorded H200 runs), the fit decisions made on
predicted reserved memory (the tune sweep that ran out of memory), and the recommendation for a
13 B GPT on one H200: the tiered "auto" split within the given disk."""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest

from partita.estimate import EstimateError, GPTShape, Setup, estimate_memory, recommend_config
from partita.estimate.allocator import (
    FRAGMENTATION, MIB, AllocatorConfigError, AllocatorModel, allocator_from_conf, fragmentation_terms, page_size,
    round_size, segment_size,
)
from partita.estimate.allocator_calibration import TUNE_RUN, fit, leave_one_out, residuals, tune_run_check

GIB = 2**30
H200 = 139.8 * GIB  # torch.cuda.get_device_properties(0).total_memory on the recorded H200s


# ----------------------------------------------------------------------------- rounding


@pytest.mark.parametrize("nbytes,rounded", [
    (0, 512), (1, 512), (511, 512), (512, 512), (513, 1024), (4 * 1000, 4096), (MIB, MIB), (MIB + 1, MIB + 512),
    (12_582_913, 12_583_424),
])
def test_round_size(nbytes, rounded):
    assert round_size(nbytes) == rounded


@pytest.mark.parametrize("nbytes,segment,page", [
    (4, 2 * MIB, 2 * MIB), (MIB, 2 * MIB, 2 * MIB),  # small pool: 2 MiB segments
    (MIB + 1, 20 * MIB, 20 * MIB), (10 * MIB - 512, 20 * MIB, 20 * MIB),  # 1-10 MiB: a 20 MiB segment
    (10 * MIB, 10 * MIB, 20 * MIB), (10 * MIB + 1, 12 * MIB, 20 * MIB),  # larger: rounded up to 2 MiB
    (34 * GIB + 3, 34 * GIB + 2 * MIB, 20 * MIB),
])
def test_segment_and_page_sizes(nbytes, segment, page):
    assert segment_size(nbytes) == segment and page_size(nbytes) == page


def test_round_size_refuses_negative():
    with pytest.raises(AllocatorConfigError, match="-1 bytes"):
        round_size(-1)


def test_allocator_conf():
    assert allocator_from_conf(environ={}) == AllocatorModel("expandable")  # partita run's default
    assert allocator_from_conf("") == AllocatorModel("default")
    assert allocator_from_conf("expandable_segments:True") == AllocatorModel("expandable")
    assert allocator_from_conf("expandable_segments:False,max_split_size_mb:512") == AllocatorModel("default", 512)
    assert allocator_from_conf("garbage_collection_threshold:0.6") == AllocatorModel("default")
    with pytest.raises(AllocatorConfigError, match="not key:value"):
        allocator_from_conf("expandable_segments")
    with pytest.raises(AllocatorConfigError, match="whole number"):
        allocator_from_conf("max_split_size_mb:big")
    with pytest.raises(EstimateError, match="allocator 'cuda' is not one of"):
        Setup(allocator="cuda")
    with pytest.raises(EstimateError, match="applies to allocator default"):
        Setup(max_split_size_mb=512)
    with pytest.raises(EstimateError, match=">= 20"):
        Setup(allocator="default", max_split_size_mb=8)


def test_reserved_parts():
    shape = GPTShape.preset("gpt2-124m")
    none = estimate_memory(shape, micro_batch=8, allocator="none")
    assert none.reserved_accelerator == none.peak_accelerator
    e = estimate_memory(shape, micro_batch=8)
    r = e.reserved
    a, r_, g = FRAGMENTATION["expandable"]
    states = e.model_states("accelerator")
    assert fragmentation_terms(e) == (states, 0, e.peak_accelerator - states)  # no checkpointing, no gathers
    assert r.allocated == e.peak_accelerator and r.pages == 22 * MIB
    assert r.fragmentation == int(a * states + g * (e.peak_accelerator - states))
    assert 0 < r.rounding < MIB  # the step tensors (4 B -> 512 B) and unaligned small tensors
    assert e.reserved_accelerator == r.allocated + r.rounding + r.pages + r.fragmentation
    fixed = estimate_memory(shape, micro_batch=8, allocator="default")
    assert fixed.reserved_accelerator > e.reserved_accelerator  # fixed segments fragment more
    assert "reserved" in e.table() and "fragmentation" in e.table()


# ----------------------------------------------------------------------------- calibration


def test_fragmentation_terms_split_recompute_and_recycled_blocks():
    """Checkpointing's recompute is its own term; ZeRO-3's gathered parameters (re-requested at one
    size, reusing their own blocks) add none."""
    shape = GPTShape(1024, 24, 16, 50304, 1024)
    e = estimate_memory(shape, stage=3, micro_batch=8, checkpointing="every")
    lines = {line.kind: line.nbytes for line in e.lines if line.device == "accelerator" and line.kind}
    states, recompute, rest = fragmentation_terms(e)
    assert states == e.model_states() and recompute == lines["recompute"] > 0
    assert rest == e.peak_accelerator - states - recompute - lines["gathered"]
    a, r, g = FRAGMENTATION["expandable"]
    assert e.reserved.fragmentation == int(a * states + r * recompute + g * rest)


def test_fragmentation_constants_are_the_fit_of_the_records():
    assert fit() == FRAGMENTATION
    assert FRAGMENTATION == {"expandable": (0.023, 3.7, 0.052), "default": (0.108, 3.7, 0.181)}


# Predicted reserved GiB of the 12 settings of benchmarks/results/estimator_accuracy_h200_2026-12-03.json
# (measured: max_memory_reserved on one H200, torch 2.11) and each one's error when the fit leaves it out.
_H200_2026_12_03 = {
    "s0_125m_mb16": (17.555, 17.609, +0.0031), "s1_125m_mb32": (32.295, 33.710, +0.0438),
    "s0_125m_mb64": (63.045, 65.912, +0.0455), "s1_125m_mb32_fixed": (37.721, 37.747, -0.1443),
    "s2_350m_mb8_every": (11.080, 11.081, -0.0298), "s3_350m_mb8": (15.604, 16.292, +0.0441),
    "s3_350m_frozen": (9.422, 9.784, +0.0385), "s1_760m_mb4_selective": (21.266, 21.442, +0.0083),
    "s2_760m_tiled": (12.389, 12.689, +0.0242), "s2_1.3b_mb2": (24.150, 24.312, +0.0067),
    "s3_1.3b_mb4_every": (22.877, 23.708, +0.0363), "s0_1.3b_mb1_every": (20.396, 20.734, +0.0166),
}


def test_h200_settings_within_five_percent_and_never_under():
    rows = residuals()
    assert len(rows) == 12 + 13
    for source, measured, predicted, error in rows[:12]:
        want = _H200_2026_12_03[source]
        assert (round(measured, 3), round(predicted, 3)) == want[:2], source
        assert 0.0 <= error < 0.05, (source, measured, predicted)
    for source, measured, predicted, error in rows[12:]:  # the largest-GPT runs of 2026-12-01
        assert 0.0 <= error < 0.05, (source, measured, predicted)


def test_leave_one_out():
    for source, _, error in leave_one_out():
        assert round(error, 4) == _H200_2026_12_03[source][2], source


# ----------------------------------------------------------------------------- the tune sweep


def test_held_logits_leave_a_hole_the_loss_gradients_cannot_use():
    """A loop that keeps each step's logits through the next forward: reserved gains the 16-bit logits'
    bytes beside the start of backward (the peak there); nothing in fp32 (each fp32 loss gradient is
    as large as the logits and reuses their block) or with a tiled loss (no logits); the tensor bytes
    never change."""
    from partita.estimate.core import held_logits_hole

    shape = GPTShape.preset("gpt2-124m")
    b, s, v = 32, 1024, 50304
    plain = estimate_memory(shape, micro_batch=b)
    held = estimate_memory(shape, micro_batch=b, logits_held_to_next_step=True)
    assert held.lines == plain.lines and held.peak_accelerator == plain.peak_accelerator
    assert held.peak("accelerator")[1] == "start of backward"
    assert held_logits_hole(held) == (b * s * v * 2, held.peak_accelerator)
    assert held.reserved.held_logits == b * s * v * 2 == held.reserved.to_dict()["held_logits_bytes"]
    assert held.reserved_accelerator == plain.reserved_accelerator + b * s * v * 2
    assert "logits held to the next step" in held.setup.describe() and "held logits' hole" in held.table()
    assert "held logits" not in plain.table()
    for options in ({"dtype": "fp32"}, {"loss_tile_tokens": 4096}):
        a = estimate_memory(shape, micro_batch=b, **options)
        h = estimate_memory(shape, micro_batch=b, logits_held_to_next_step=True, **options)
        assert h.reserved.held_logits == 0 and h.reserved_accelerator == a.reserved_accelerator, options
    # A peak after the start of backward (16 GB of accumulated stage-0 gradients) by more than the
    # hole: the hole is refilled (the logits' own gradient takes it) before that peak.
    late = estimate_memory(GPTShape(4096, 4, 32, 50304, 256), micro_batch=1, gradient_accumulation_steps=2,
                           logits_held_to_next_step=True)
    hole, beside = held_logits_hole(late)
    assert beside + hole < late.peak_accelerator and late.reserved.held_logits == 0
    with pytest.raises(EstimateError, match="logits_held_to_next_step must be True or False"):
        Setup(logits_held_to_next_step="yes")


def test_tune_sweep_prunes_what_ran_out_of_memory():
    """partita tune on one H200, GPT-2 124M, micro-batches 32/128/192 x stages 0/3 x checkpointing
    none/every (docs/guides/autotuning.md, examples/train_gpt.py's loop): micro-batch 128 without
    checkpointing was estimated at 124 GiB, launched, and ran out of memory at both stages (98.6 GiB
    allocated, 15.7 GiB cached but unusable, asking 24.56 GiB). The tuner's guard models that loop's
    held logits: the trial's need is predicted, slightly above (never below) what it asked for; it is
    pruned; the trials that finished still run; the micro-batch 192 ones stay pruned."""
    from partita.autotune.config import AutotuningConfig
    from partita.autotune.space import TrialPoint
    from partita.autotune.tuner import TuneOptions, _Estimator

    needed, predicted = tune_run_check()
    assert round(needed / GIB, 2) == 138.86 == round(sum(TUNE_RUN) / GIB, 2)
    assert 0.0 <= predicted / needed - 1.0 < 0.05 and round(predicted / GIB, 1) == 142.6
    budget = 0.95 * H200
    # The fitted model alone (the benchmark's loop, which drops its logits) would launch it again.
    alone = estimate_memory(GPTShape.preset("gpt2-124m"), stage=0, micro_batch=128)
    assert round(alone.reserved_accelerator / GIB, 1) == 130.3 < budget / GIB < needed / GIB
    expected = {(32, "none"): "run", (32, "every"): "run", (128, "none"): "pruned", (128, "every"): "run",
                (192, "none"): "pruned", (192, "every"): "pruned"}
    for allocator, oom_case in (("expandable", "pruned"), ("none", "run")):
        opts = TuneOptions(script="x.py", script_args=(), base_config={"bf16": {"enabled": True}},
                           autotuning=AutotuningConfig(), nproc=1, model=GPTShape.preset("gpt2-124m"),
                           allocator=allocator)
        estimator = _Estimator(opts)
        for stage in (0, 3):
            for (mb, ckpt), outcome in expected.items():
                point = TrialPoint(stage=stage, micro_batch=mb, gradient_accumulation_steps=1, checkpointing=ckpt,
                                   offload="none", world_size=1)
                verdict = "pruned" if estimator(point) > budget else "run"
                if (allocator, mb, ckpt) == ("expandable", 128, "none"):
                    assert round(estimator(point) / GIB, 1) == (142.6 if stage == 0 else 142.7)
                want = oom_case if (mb, ckpt) == (128, "none") else outcome
                assert verdict == want, (allocator, stage, mb, ckpt, estimator(point) / GIB)


# ----------------------------------------------------------------------------- 13 B on one H200


_13B = GPTShape(5120, 40, 40, 50304, 2048)


def test_13b_recommends_the_tiered_split_within_the_disk():
    old = estimate_memory(_13B, stage=1, offload_optimizer="nvme")  # what was recommended before
    assert round(old.nvme / GIB, 1) == 95.8 and old.reserved_accelerator < 0.35 * 141e9
    rec = recommend_config(_13B, "141GB", cpu_memory="120GB", nvme_memory="64GB")
    setup, estimate = rec.setup, rec.chosen.estimate
    assert setup.offload_optimizer == "auto" and (setup.stage, str(setup.checkpointing)) == (1, "none")
    accelerator, cpu, nvme = setup.offload_tiers
    assert 0.40 < accelerator < 0.45 and nvme == 0.0  # 43% of the optimizer state stays on the GPU
    assert 0.9 * rec.usable < estimate.reserved_accelerator <= rec.usable  # the GPU is used, not 35% of it
    assert estimate.peak_cpu <= 120e9 and estimate.nvme <= 64e9
    assert "tiered" in rec.explanation() and "no NVMe" in rec.explanation()


def test_13b_disk_is_honoured_and_refusal_names_the_short_tier():
    # Less host memory: the split needs NVMe, and never more than the disk given.
    rec = recommend_config(_13B, "141GB", cpu_memory="80GB", nvme_memory="64GB", sub_group_size=10**8)
    assert rec.setup.offload_tiers[2] > 0 and 0 < rec.chosen.estimate.nvme <= 64e9
    none = recommend_config(_13B, "141GB", cpu_memory="20GB", nvme_memory="5GB", sub_group_size=10**8)
    assert none.chosen is None
    text = none.explanation()
    assert "Nothing fits" in text and "Closest tiered split" in text and "tier is short" in text


def test_cli_nvme_memory_and_path(tmp_path, monkeypatch, capsys):
    from partita.launcher.cli import main

    flags = ["estimate", "--model", "gpt", "--d-model", "5120", "--n-layers", "40", "--n-heads", "40", "--vocab",
             "50304", "--seq-len", "2048", "--gpu-memory", "141GB", "--cpu-memory", "80GB",
             "--json"]
    Usage = namedtuple("Usage", "total used free")
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**12, 0, 64 * 10**9) if str(p) == str(tmp_path)
                        else real(p))
    import json

    assert main(flags + ["--nvme-path", str(tmp_path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["nvme_memory_bytes"] == 64 * 10**9 and 0 < out["chosen"]["nvme_bytes"] <= 64 * 10**9
    assert main(flags + ["--nvme-memory", "1GB"]) == 1  # the split needs more disk than that
    assert main(flags + ["--nvme-path", str(tmp_path / "missing")]) == 2
    assert "is not an existing directory" in capsys.readouterr().err
