"""The ``elasticity`` section: DeepSpeed's batch selection, its config errors, and a resume on
another world size that keeps the global batch (and the math: parameters equal single-process
torch on that batch).

Expected values were worked out by hand (the derivations are in the comments) and agree with
DeepSpeed 0.18.9's ``compute_elastic_config``, the last release that had the section (0.19
removed it); :func:`test_matches_deepspeed_compute_elastic_config` compares again when a
DeepSpeed that still has ``deepspeed.elasticity`` is installed.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path

import pytest
import torch

from partita.config import ConfigError, load_config, resolve_batch_sizes
from partita.config.elasticity import (
    ElasticityConfig,
    candidate_batch_sizes,
    compute_elastic_batch,
    valid_gpu_counts,
)
from tests.harness import run_distributed
from tests.tiny_models import build_model, make_batches, param_groups, reference_train

DIVISORS_840 = [d for d in range(1, 841) if 840 % d == 0]

# (section, world size) -> (global batch, valid GPU counts, micro-batch)
CASES = [
    # DeepSpeed's documented example. Candidates: 2 x 840, 4 x 360, 6 x 240, lcm 12 x 120 -> {1440, 1680};
    # 1680 splits over every divisor of 840 (32 counts), 1440 over the divisors of 720 (30).
    # On 8 GPUs: 1680 / 8 = 210, the largest micro-batch dividing it is 6, accumulation 35.
    ({"max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "version": 0.1}, 8, (1680, DIVISORS_840, 6)),
    # Candidates 1 x 6 and 2 x 4 -> {6, 8}, both valid on three counts; the larger wins.
    ({"max_train_batch_size": 8, "micro_batch_sizes": [1, 2], "max_gpus": 4, "version": 0.1}, 4, (8, [1, 2, 4], 2)),
    ({"max_train_batch_size": 8, "micro_batch_sizes": [1, 2], "max_gpus": 4, "version": 0.1}, 2, (8, [1, 2, 4], 2)),
    # Same tie, the smaller wins: 6 on 2 GPUs is 3 per GPU, so micro-batch 1.
    ({"max_train_batch_size": 8, "micro_batch_sizes": [1, 2], "max_gpus": 4, "version": 0.1,
      "prefer_larger_batch": False}, 2, (6, [1, 2, 3], 1)),
    # DeepSpeed's own unit-test input (test_basic_10k): 9792 = 17 x 576, valid on 23 counts in [32, 1500].
    ({"max_train_batch_size": 10000, "micro_batch_sizes": [8, 12, 16, 17], "min_gpus": 32, "max_gpus": 1500,
      "version": 0.1}, 64,
     (9792, [32, 34, 36, 48, 51, 64, 68, 72, 96, 102, 136, 144, 153, 192, 204, 272, 288, 306, 408, 576, 612, 816, 1224],
      17)),
    # Version 0.2 counts nodes of 4: cap 2000 / 4 = 500 per node; candidates {360, 432, 480}; 480 fits 11 node
    # counts in [1, 16] (the divisors of 240 up to 16) -> global 1920 on 4, 8, ..., 64 GPUs; 1920 / 8 = 240 -> 6.
    ({"max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "min_gpus": 4, "max_gpus": 64,
      "num_gpus_per_node": 4, "version": 0.2}, 8, (1920, [4, 8, 12, 16, 20, 24, 32, 40, 48, 60, 64], 6)),
    # 6 GPUs is not a valid count: the fallback is the largest multiple of micro x 6 within 2000
    # (166 x 12 = 83 x 24 = 1992 > 55 x 36 = 1980), valid on 6 only; 1992 / 6 = 332 -> micro 4.
    ({"max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6], "min_gpus": 4, "max_gpus": 64,
      "num_gpus_per_node": 4, "version": 0.2}, 6, (1992, [6], 4)),
]


@pytest.mark.parametrize(("section", "world", "expected"), CASES)
def test_batch_selection(section: dict, world: int, expected: tuple) -> None:
    picked = compute_elastic_batch(ElasticityConfig(enabled=True, **section), world_size=world)
    assert (picked.train_batch_size, list(picked.valid_gpus), picked.micro_batch_size) == expected
    # Only version 0.2 off its valid counts gives a batch for this world size alone.
    assert picked.world_independent is (expected[0] != 1992)


def test_candidates_and_valid_counts_by_hand() -> None:
    assert candidate_batch_sizes([2, 4, 6], 2000) == [1440, 1680]
    assert valid_gpu_counts(1440, [2, 4, 6], 1, 10000) == [d for d in range(1, 721) if 720 % d == 0]
    # 3 x 24, 5 x 12, 7 x 12; the least common multiple 105 is above the cap and dropped (DeepSpeed 0.18.9
    # offered it, a batch larger than max_train_batch_size).
    assert candidate_batch_sizes([3, 5, 7], 100) == [60, 72, 84]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed (not in CI)")
def test_matches_deepspeed_compute_elastic_config() -> None:
    try:
        elasticity = importlib.import_module("deepspeed.elasticity")
    except ImportError:
        pytest.skip("this DeepSpeed has no deepspeed.elasticity (0.19 removed it; 0.18.9 is the last with it)")
    import deepspeed

    for section, world, _ in CASES:
        ds = {"elasticity": {"enabled": True, **section}}
        batch, gpus, micro = elasticity.compute_elastic_config(ds, deepspeed.__version__, world_size=world)
        picked = compute_elastic_batch(ElasticityConfig(enabled=True, **section), world_size=world)
        assert (picked.train_batch_size, list(picked.valid_gpus), picked.micro_batch_size) == (int(batch), [int(g) for g in gpus], micro)


def _config(**extra) -> dict:
    return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, **extra}


ELASTIC = {"enabled": True, "max_train_batch_size": 8, "micro_batch_sizes": [1, 2], "max_gpus": 4, "version": 0.1}


def test_resolves_the_triple_per_world_size() -> None:
    config = load_config(_config(elasticity=ELASTIC))
    assert [tuple(vars(resolve_batch_sizes(config, dp_world_size=w)).values()) for w in (1, 2, 4)] == [
        (8, 2, 4), (8, 2, 2), (8, 2, 1)]
    with pytest.raises(ConfigError, match=r"this run has 3 data-parallel GPUs, but global batch 8 .* only splits over \[1, 2, 4\]"):
        resolve_batch_sizes(config, dp_world_size=3)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"enabled": True, "micro_batch_sizes": [2]}, "max_train_batch_size is not set"),
        ({"enabled": True, "max_train_batch_size": 8}, "micro_batch_sizes is not set"),
        ({**ELASTIC, "min_gpus": 8}, r"min_gpus \(8\) is greater than max_gpus \(4\)"),
        ({**ELASTIC, "micro_batch_sizes": [2, 16]}, r"micro_batch_sizes \[16\] exceed max_train_batch_size 8"),
        ({**ELASTIC, "micro_batch_sizes": [0, 2]}, "non-empty list of integers >= 1"),
        ({**ELASTIC, "version": 0.3}, "elasticity.version 0.3 is not one of 0.1 or 0.2"),
        ({**ELASTIC, "model_parallel_size": 2}, "model_parallel_size 2 needs version 0.2"),
        ({**ELASTIC, "version": 0.2, "num_gpus_per_node": 3, "model_parallel_size": 2}, "num_gpus_per_node 3 is not a multiple"),
    ],
)
def test_bad_sections(section: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(_config(elasticity=section))


def test_batch_keys_beside_elasticity(caplog: pytest.LogCaptureFixture) -> None:
    config = load_config(_config(elasticity=ELASTIC, train_batch_size=16, gradient_accumulation_steps=2))
    with pytest.raises(ConfigError, match="also sets train_batch_size, gradient_accumulation_steps; elasticity picks"):
        resolve_batch_sizes(config, dp_world_size=2)
    lenient = load_config(_config(elasticity={**ELASTIC, "ignore_non_elastic_batch_info": True}, train_batch_size=16))
    with caplog.at_level(logging.WARNING, logger="partita"):
        logging.getLogger("partita").propagate = True
        try:
            assert resolve_batch_sizes(lenient, dp_world_size=2).train_batch_size == 8
        finally:
            logging.getLogger("partita").propagate = False
    assert "elasticity overrides train_batch_size: 16 -> 8" in caplog.text


def test_model_parallel_size_is_not_implemented() -> None:
    config = load_config(_config(elasticity={**ELASTIC, "version": 0.2, "num_gpus_per_node": 2, "model_parallel_size": 2}))
    with pytest.raises(NotImplementedError, match="model_parallel_size 2: elastic batch selection with model parallelism"):
        resolve_batch_sizes(config, dp_world_size=2)


def test_disabled_section_changes_nothing() -> None:
    config = load_config(_config(train_batch_size=8, elasticity={"enabled": False}))
    assert resolve_batch_sizes(config, dp_world_size=2) == resolve_batch_sizes(load_config(_config(train_batch_size=8)),
                                                                              dp_world_size=2)


# ---------------------------------------------------------------------------- resume on another world size

LR, CLIP, STEPS, SAVE_AT = 1e-2, 0.5, 4, 2


def _train_config(save_dir: str, batch: dict) -> dict:
    return {
        **batch,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}},
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 60},
        "steps_per_print": 1000,
        "checkpoint": {"save_dir": save_dir, "resume": "latest"},
    }


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _train(jobs: list[tuple[str, dict, int]]) -> list[dict]:
    """Runs on every rank: per job, resume from its directory if it has a checkpoint, train to ``until``, save."""
    return [_train_one(*job) for job in jobs]


def _train_one(save_dir: str, batch: dict, until: int) -> dict:
    import torch.distributed as dist

    import partita

    records = _Records()
    logging.getLogger("partita").addHandler(records)
    model = build_model()
    engine, _, _, _ = partita.initialize(model=model, model_parameters=param_groups(model), config=_train_config(save_dir, batch))
    rank, world = dist.get_rank(), dist.get_world_size()
    resumed_at, micro_after_load = engine.global_steps, engine.micro_steps
    gas, micro = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()
    xs, ys = make_batches(STEPS, engine.train_batch_size())
    for step in range(engine.global_steps, until):
        for m in range(gas):
            start = (m * world + rank) * micro  # the global batch of a step is the same whatever the world size
            engine.backward(engine(xs[step][start : start + micro], ys[step][start : start + micro]))
            engine.step()
    engine.save_checkpoint()
    engine.destroy()
    logging.getLogger("partita").removeHandler(records)
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "resumed_at": resumed_at,
            "micro_after_load": micro_after_load, "gas": gas, "batch": engine.train_batch_size(),
            "warnings": records.messages}


def test_resume_on_another_world_size_keeps_the_global_batch(tmp_path: Path) -> None:
    elastic = {"elasticity": ELASTIC}
    fixed = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}  # 8 on 2 ranks, 4 on 1
    dirs = str(tmp_path / "elastic"), str(tmp_path / "fixed")
    [(first, _), _] = run_distributed(_train, 2, [(dirs[0], elastic, SAVE_AT), (dirs[1], fixed, SAVE_AT)])
    [(resumed, changed)] = run_distributed(_train, 1, [(dirs[0], elastic, STEPS), (dirs[1], fixed, SAVE_AT)])

    assert (first["gas"], resumed["gas"], resumed["batch"]) == (2, 4, 8)  # accumulation recomputed, batch kept
    assert resumed["resumed_at"] == SAVE_AT and resumed["micro_after_load"] == SAVE_AT * 4  # window realigned
    assert not [w for w in resumed["warnings"] if "global batch changed" in w]
    want, _ = reference_train(num_steps=STEPS, global_batch=8, lr=LR, clip=CLIP)
    for name, value in want.items():
        torch.testing.assert_close(resumed["params"][name], value, rtol=1e-5, atol=1e-6, msg=name)

    [warning] = [w for w in changed["warnings"] if "global batch changed" in w]
    assert "trained with train_batch_size 8 (2 ranks x micro 2 x accumulation 2), this run uses 4 (1 ranks x micro 2" in warning
    assert "linear rule (SGD, large-batch training) multiplies it by 4/8 = 0.5" in warning
    assert "square-root rule (Adam-family optimizers) by sqrt(0.5) = 0.7071" in warning
