"""partita.pipe's API around the parity tests: DeepSpeed's partitioning on known layer lists, the
``pipeline`` config section, eval_batch, and every refusal (type and message)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from partita.config import load_config
from partita.config.base import ConfigError
from partita.pipe.partition import partition_balanced, partition_by_method, partition_uniform
from tests.harness import run_distributed
from tests.test_pipe_parity import BASE_SEED, MICRO, build_like_the_pipeline, global_batches, layer_specs, lm_head, lm_loss

# The parity model's layers: Embedding(11, 8), four Blocks (8x8 Linear), LayerNorm(8), the tied head.
NAMES = ["Embedding", "Block", "Block", "Block", "Block", "LayerNorm", "Embedding"]
COUNTS = [88, 72, 72, 72, 72, 16, 88]


def test_uniform_puts_the_extra_layers_first() -> None:
    assert partition_uniform(7, 2) == [0, 4, 7]
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_uniform(8, 4) == [0, 2, 4, 6, 8]
    assert partition_uniform(2, 4) == [0, 1, 2, 2, 2]  # fewer layers than stages: empty last stages


def test_parameters_balances_the_parameter_count() -> None:
    # Prefix sums 88, 160, 232, 304, ...: a cut after layer 2 gives 232 | 248, the smallest spread.
    assert partition_by_method("parameters", num_parts=2, param_counts=COUNTS, type_names=NAMES) == [0, 3, 7]
    assert partition_balanced([10, 10, 10, 10, 40], 2) == [0, 4, 5]


def test_balanced_is_the_minimum_spread_partition() -> None:
    weights = [1, 2, 3, 4, 5, 6, 7]
    spreads = {}
    for cuts in itertools.combinations(range(1, len(weights)), 2):
        bounds = [0, *cuts, len(weights)]
        sums = [sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])]
        spreads[tuple(bounds)] = max(sums) - min(sums)
    best = min(spreads.values())
    optimal = [b for b, s in spreads.items() if s == best]
    assert len(optimal) == 1  # a unique optimum: no tie rule involved
    assert partition_balanced(weights, 3) == list(optimal[0])


def test_type_regex_balances_matching_layers_case_insensitively() -> None:
    assert partition_by_method("type:block", num_parts=2, param_counts=COUNTS, type_names=NAMES) == [0, 3, 7]
    assert partition_by_method("type:^(Block|LayerNorm)$", num_parts=5, param_counts=COUNTS,
                               type_names=NAMES) == [0, 2, 3, 4, 5, 7]
    with pytest.raises(ValueError, match=r"partition_method 'type:Attention' matches no layer; the layers' class "
                                         r"names are \['Embedding', 'Block'"):
        partition_by_method("type:Attention", num_parts=2, param_counts=COUNTS, type_names=NAMES)
    with pytest.raises(NotImplementedError, match="partition_method='profile' is not implemented"):
        partition_by_method("profile", num_parts=2, param_counts=COUNTS, type_names=NAMES)
    with pytest.raises(ValueError, match="partition_method='size' is not one of"):
        partition_by_method("size", num_parts=2, param_counts=COUNTS, type_names=NAMES)


def _base() -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def test_pipeline_section_keys_and_refusals() -> None:
    from partita.pipe.setup import pipe_size_for

    cfg = load_config({**_base(), "pipeline": {"stages": 2, "partition": "uniform", "seed_layers": True,
                                                "activation_checkpoint_interval": 1, "pipe_partitioned": True,
                                                "grad_partitioned": False, "schedule": "zero_bubble",
                                                "virtual_stages": 2}})
    assert (cfg.pipeline.stages, cfg.pipeline.schedule, cfg.pipeline.virtual_stages) == (2, "zero_bubble", 2)
    assert load_config(_base()).pipeline.schedule == "1f1b"
    with pytest.raises(ConfigError, match="pipeline.schedule"):
        load_config({**_base(), "pipeline": {"schedule": "dualpipe"}})
    with pytest.raises(ConfigError, match="pipeline.microbatches"):
        load_config({**_base(), "pipeline": {"microbatches": 4}})
    with pytest.raises(ConfigError, match=r"pipeline.stages=2 needs a partita.pipe.PipelineModule model \(got Linear\)"):
        pipe_size_for(cfg, nn.Linear(2, 2))
    assert pipe_size_for(load_config(_base()), nn.Linear(2, 2)) == 1


def _config(gas: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "steps_per_print": 1000, **extra}


def _error(call) -> tuple[str, str]:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - the test compares type and message
        return type(error).__name__, str(error)
    return "no error", ""


def api_body() -> dict:
    import partita
    from partita.pipe import LayerSpec, PipelineModule

    partita.init_distributed()
    out: dict = {}

    def module(**kw):
        return PipelineModule(layer_specs(), num_stages=2, loss_fn=lm_loss, partition_method="uniform",
                              seed_layers=True, base_seed=BASE_SEED, **kw)

    out["not_dividing"] = _error(lambda: PipelineModule(layer_specs(), num_stages=3, loss_fn=lm_loss))
    out["empty_stage"] = _error(lambda: PipelineModule([LayerSpec(nn.Linear, 2, 2)] * 3, num_stages=2, loss_fn=lm_loss,
                                                       partition_method="uniform", virtual_stages=2))
    out["1f1b_few"] = _error(lambda: partita.initialize(model=module(), config=_config(1)))
    out["zero3"] = _error(lambda: partita.initialize(model=module(), config=_config(
        2, zero_optimization={"stage": 3}, pipeline={"schedule": "zero_bubble"})))
    out["stages_mismatch"] = _error(lambda: partita.initialize(model=module(), config=_config(2, pipeline={"stages": 1})))
    out["partition_mismatch"] = _error(lambda: partita.initialize(
        model=module(), config=_config(2, pipeline={"partition": "parameters"})))
    out["virtual_mismatch"] = _error(lambda: partita.initialize(
        model=module(), config=_config(2, pipeline={"virtual_stages": 2})))
    out["interleaved_v1"] = _error(lambda: partita.initialize(
        model=module(), config=_config(2, pipeline={"schedule": "interleaved_1f1b"})))

    # fp16 with a loss scale that overflows: the norm is reduced over the pipe axis, so every stage
    # skips the step, halves the scale and keeps its weights.
    fp16, *_ = partita.initialize(model=module(), config=_config(2, fp16={"enabled": True, "initial_scale_power": 30, "hysteresis": 1}))
    before = {k: v.clone() for k, v in fp16.module.state_dict().items()}
    xs16, ys16 = global_batches(2, 1)
    fp16.train_batch(iter([(xs16[0][k * MICRO:(k + 1) * MICRO], ys16[0][k * MICRO:(k + 1) * MICRO]) for k in range(2)]))
    out["fp16"] = (fp16.skipped_steps, fp16.was_step_applied(), fp16.get_loss_scale(),
                   all(torch.equal(v, fp16.module.state_dict()[k]) for k, v in before.items()))

    engine, *_ = partita.initialize(model=module(), config=_config(2))
    out["forward"] = _error(lambda: engine(torch.zeros(1)))
    out["backward"] = _error(lambda: engine.backward(torch.zeros(())))
    out["step"] = _error(lambda: engine.step())
    xs, ys = global_batches(2, 1)
    micro = [(xs[0][k * MICRO:(k + 1) * MICRO], ys[0][k * MICRO:(k + 1) * MICRO]) for k in range(2)]
    out["ran_out"] = _error(lambda: engine.train_batch(iter(micro[:1])))
    out["no_iterator"] = _error(lambda: engine.train_batch())
    out["eval"] = engine.eval_batch(iter(micro)).item()
    out["eval_each"] = engine.eval_batch(iter(micro), reduce_output=None).tolist()
    engine.set_dataiterator(iter(micro))
    out["train"] = engine.train_batch().item()  # train after eval: the schedule re-infers its buffers
    loss, logits = engine.eval_batch(iter(micro), return_logits=True)
    out["eval_after"] = loss.item()
    out["logits"] = None if logits is None else tuple(logits.shape)
    out["first_last"] = (engine.is_first_stage(), engine.is_last_stage())
    return out


def _reference_losses() -> tuple[float, list[float]]:
    """The parity model's loss on global batch 0 (and per micro-batch) at its initial weights."""
    built = build_like_the_pipeline(layer_specs())
    xs, ys = global_batches(2, 1)
    with torch.no_grad():
        h = built["embed"](xs[0])
        for i in range(1, 6):
            h = built[i](h)
        logits = lm_head(built["embed"], h)
        each = [lm_loss(logits[k * MICRO:(k + 1) * MICRO], ys[0][k * MICRO:(k + 1) * MICRO]).item() for k in range(2)]
    return lm_loss(logits, ys[0]).item(), each


def test_engine_api_and_errors_on_two_stages() -> None:
    results = run_distributed(api_body, 2)
    whole, each = _reference_losses()
    for rank, out in enumerate(results):
        assert out["not_dividing"] == ("ValueError", "num_stages=3 does not divide the world size 2: launch a multiple "
                                                     "of 3 processes or choose a divisor of 2")
        assert out["empty_stage"][0] == "ValueError"
        assert "leaves a stage without layers: 3 layers into 4 stages gives layer counts [1, 1, 1, 0]" in out["empty_stage"][1]
        assert out["1f1b_few"][0] == "ConfigError"
        assert ("pipeline.schedule=\"1f1b\" needs at least as many micro-batches (gradient_accumulation_steps=1) "
                "as stages (2)") in out["1f1b_few"][1]
        # ZeRO-3 composes with pipelines (tests/test_pipe_zero3.py), except under the zero-bubble schedule.
        assert out["zero3"] == ("ConfigError", 'zero_optimization.stage=3 with pipeline.schedule="zero_bubble" is not '
                                'supported: use pipeline.schedule "interleaved_1f1b" (or "1f1b", "gpipe") with ZeRO-3, '
                                'or zero_optimization.stage 2')
        assert out["stages_mismatch"][0] == "ConfigError"
        assert "pipeline.stages=1 disagrees with the PipelineModule's num_stages=2" in out["stages_mismatch"][1]
        assert out["partition_mismatch"] == (
            "ConfigError", "pipeline.partition='parameters' disagrees with the PipelineModule's partition_method="
                           "'uniform' (the module is partitioned when built): set them equal or use \"best\"")
        assert out["virtual_mismatch"][0] == "ConfigError"
        assert "PipelineModule(..., virtual_stages=2)" in out["virtual_mismatch"][1]
        assert out["interleaved_v1"][0] == "ConfigError"
        assert "needs at least 2 model chunks per rank" in out["interleaved_v1"][1]
        for call in ("forward", "backward", "step"):
            assert out[call][0] == "PipelineError", call
            assert "train_batch(data_iter)" in out[call][1]
        assert out["ran_out"] == ("RuntimeError", "train_batch(): the data iterator ran out after 1 of 2 micro-batches "
                                                  "(gradient_accumulation_steps); give a longer or repeating iterator")
        assert out["no_iterator"][0] == "ValueError" and "got no data iterator" in out["no_iterator"][1]
        # The same loss on both stages: the reference's at the initial weights, before and after the switch.
        assert out["eval"] == pytest.approx(whole, rel=1e-5)
        assert out["eval_each"] == pytest.approx(each, rel=1e-5)
        assert out["train"] == pytest.approx(whole, rel=1e-5)
        assert out["eval_after"] < out["train"]  # one SGD step on this very batch lowered its loss
        assert out["fp16"] == (1, False, 2.0 ** 29, True)
        assert out["first_last"] == (rank == 0, rank == 1)
        assert out["logits"] == ((4, 5, 11) if rank == 1 else None)


# ---------------------------------------------------------------------------- three stages: mixed dtypes, failures
class IdsEmbedding(nn.Module):
    """Stage 0: (activation, ids) out, a float beside an int64 tensor (DeepSpeed's buffers deadlock on it at 3 stages)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, dim)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.embed(ids), ids


class IdsBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, ids = x
        return h + torch.tanh(self.linear(h)), ids


class IdsHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 11)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, ids = x
        return self.linear(h) + 0.01 * ids.unsqueeze(-1).float()  # the ids reach the last stage intact


def ids_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1))


def _ids_batch() -> list[tuple[torch.Tensor, torch.Tensor]]:
    ids = torch.randint(0, 11, (3, MICRO, 6), generator=torch.Generator().manual_seed(3))
    return [(ids[k, :, :-1], ids[k, :, 1:]) for k in range(3)]


TIMEOUT_S = 60


def three_stage_body() -> dict:
    import time

    import partita
    from partita.pipe import LayerSpec, PipelineModule

    partita.init_distributed()
    config = {**_config(3), "distributed": {"timeout_seconds": TIMEOUT_S}}
    model = PipelineModule([LayerSpec(IdsEmbedding), LayerSpec(IdsBlock), LayerSpec(IdsHead)], num_stages=3,
                           loss_fn=ids_loss, partition_method="uniform", seed_layers=True, base_seed=BASE_SEED)
    engine, *_ = partita.initialize(model=model, config=config)
    data = _ids_batch()
    out: dict = {}
    # Only stages 0 and 2 read: they raise their own error, stage 1 is told which stage failed; nothing ran.
    out["ran_out"] = _error(lambda: engine.train_batch(iter(data[:2])))
    out["losses"] = [engine.train_batch(iter(data)).item() for _ in range(2)]
    # Stage 0 sends 6 features where stage 1's Linear takes 8: every stage fails at the first step,
    # naming stage 1 and its rank, within seconds (not the 60 s collective timeout).
    bad = PipelineModule([LayerSpec(IdsEmbedding, 6), LayerSpec(IdsBlock), LayerSpec(IdsHead)], num_stages=3,
                         loss_fn=ids_loss, partition_method="uniform")
    broken, *_ = partita.initialize(model=bad, config=config)
    start = time.monotonic()
    out["mismatch"] = _error(lambda: broken.train_batch(iter(data)))
    out["seconds"] = time.monotonic() - start
    return out


def _ids_reference() -> list[float]:
    layers = []
    for i, cls in enumerate((IdsEmbedding, IdsBlock, IdsHead)):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(BASE_SEED + i)
            layers.append(cls())
    params = [p for layer in layers for p in layer.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    data = _ids_batch()
    ids, labels = torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])
    losses = []
    for _ in range(2):
        h = ids
        for layer in layers:
            h = layer(h)
        loss = ids_loss(h, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_three_stages_mixed_dtypes_and_failures() -> None:
    results = run_distributed(three_stage_body, 3)
    expected = _ids_reference()
    ran_out = ("RuntimeError", "train_batch(): the data iterator ran out after 2 of 3 micro-batches "
                               "(gradient_accumulation_steps); give a longer or repeating iterator")
    assert results[0]["ran_out"] == ran_out and results[2]["ran_out"] == ran_out
    assert results[1]["ran_out"] == ("StageFailure", f"train_batch() on stage 1 (rank 1) did not run: reading the batch "
                                                     f"failed on stage 0 (rank 0): {ran_out[0]}: {ran_out[1]}")
    cause = ("RuntimeError: mat1 and mat2 shapes cannot be multiplied (10x6 and 8x8) [pipeline stage 1: layer 1 "
             "(IdsBlock, whose first Linear 'linear' takes (..., 8) floats) failed on the activation pipeline stage 0 "
             "sent: ((2, 5, 6) float32, (2, 5) int64)]")
    for rank, out in enumerate(results):
        assert out["losses"] == pytest.approx(expected, rel=1e-5)
        kind, message = out["mismatch"]
        assert kind == "StageFailure"
        if rank == 1:
            assert message == f"train_batch(): pipeline stage 1 (rank 1) failed; every stage stops: {cause}"
        else:
            assert message == f"train_batch() on stage {rank} (rank {rank}) stopped: pipeline stage 1 (rank 1): {cause}"
        assert out["seconds"] < TIMEOUT_S / 2


def test_failure_report_describes_inputs() -> None:
    from partita.pipe.failure import describe
    from partita.pipe.module import _expects

    assert describe((torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64), 5)) == "((2, 3) float32, (2,) int64, int)"
    assert _expects(nn.Embedding(11, 8)) == ", whose first Embedding takes integer ids below 11"
    assert _expects(nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 2))) == ", whose first LayerNorm '0' takes (..., 4)"
    assert _expects(lambda x: x) == ""
