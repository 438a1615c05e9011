"""ZeRO-Inference through ``partita.initialize`` without an optimizer (issue 28 item 3): every
parameter sharded, no fp32 masters; weights streamed from host memory or swap files (offload_param
cpu, nvme) give the logits resident shards and an unsharded model give, exactly; eval forwards
prefetch the next units; generate works; what needs an optimizer is refused with the fix."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from partita.config import ConfigError  # noqa: E402
from tests.harness import run_distributed  # noqa: E402
from tests.test_zero3_generate import _build, _greedy, _prompt  # noqa: E402

FIX = 'add an "optimizer" section to the config'


def _config(offload: str | None, precision: str = "fp32", nvme_path: str = "") -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if offload == "cpu":
        zero["offload_param"] = {"device": offload, "pin_memory": True}
    elif offload == "nvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 2, "buffer_size": 100_000,
                                 "max_in_cpu": 0}
    cfg = {"zero_optimization": zero, "steps_per_print": 1000}  # no batch size: inference needs none
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def inference_engines(nvme_path: str) -> dict:
    import partita
    import partita.zero

    rank = int(os.environ["RANK"])
    ids = _prompt(rank)
    reference = _build("llama").eval()
    with torch.no_grad():
        want_logits = reference(input_ids=ids).logits
    out = {"want_tokens": _greedy(reference.generate, ids, 6)}
    for offload in (None, "cpu", "nvme"):
        engine, optimizer, _, scheduler = partita.initialize(model=_build("llama"),
                                                             config=_config(offload, nvme_path=nvme_path))
        engine.eval()
        gatherer = engine.zero.gatherer
        name = offload or "resident"
        with torch.no_grad():
            logits = [engine(input_ids=ids).logits for _ in range(3)]  # the first records the unit order
        out[f"{name}_exact"] = all(torch.equal(x, want_logits) for x in logits)
        out[f"{name}_location"] = gatherer.shard_location
        out[f"{name}_prefetches"] = gatherer.eval_prefetch.prefetch_count
        out[f"{name}_tokens"] = _greedy(engine.module.generate, ids, 6)
        out[f"{name}_returned"] = (optimizer, scheduler, engine.optimizer)
        out[f"{name}_freed"] = gatherer.num_gathered()
        out[f"{name}_host_elements"] = sum(g.master.numel() for g in gatherer.storage.groups)
        errors = {}
        loss = engine(input_ids=ids, labels=ids).loss
        for what, call in {"backward": lambda: engine.backward(loss), "step": engine.step,
                           "save_checkpoint": lambda: engine.save_checkpoint("/nonexistent")}.items():
            try:
                call()
            except ConfigError as error:
                errors[what] = str(error)
        try:
            with partita.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=0):
                pass
        except ConfigError as error:
            out[f"{name}_modifier_error"] = str(error)
        out[f"{name}_errors"] = errors
        engine.destroy()
    # bf16: the shards are the model's dtype; the host holds each parameter's bytes / world size, once.
    # A frozen model (requires_grad False everywhere), as inference models usually are.
    engine, _, _, _ = partita.initialize(model=_build("llama").requires_grad_(False), config=_config("cpu", "bf16"))
    engine.eval()
    out["bf16_tokens"] = _greedy(engine.generate, ids, 6)
    out["bf16_want"] = _greedy(_build("llama").to(torch.bfloat16).eval().generate, ids, 6)
    groups = engine.zero.gatherer.storage.groups
    out["bf16_master_dtypes"] = sorted({str(g.master.dtype) for g in groups})
    out["bf16_host_elements"] = sum(g.master.numel() for g in groups)
    out["model_elements"] = sum(p.numel() for p in engine.module.parameters())
    return out


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> list[dict]:
    return run_distributed(inference_engines, 2, str(tmp_path_factory.mktemp("swap")), timeout=300)


def test_streamed_and_resident_logits_equal_the_unsharded_model_exactly(engines) -> None:
    for result in engines:
        assert result["resident_location"] == "accelerator" and result["cpu_location"] == "cpu"
        assert result["nvme_location"] == "nvme" and result["nvme_host_elements"] == 0  # in the swap files only
        assert result["resident_exact"] and result["cpu_exact"] and result["nvme_exact"]


def test_zero_inference_generates_the_unsharded_tokens(engines) -> None:
    for result in engines:
        assert result["resident_tokens"] == result["want_tokens"]
        assert result["cpu_tokens"] == result["nvme_tokens"] == result["want_tokens"]
        assert result["resident_freed"] == result["cpu_freed"] == result["nvme_freed"] == 0


def test_eval_forwards_prefetch_the_next_units_after_the_first(engines) -> None:
    for result in engines:
        # Units: the root and 2 layers. Forward 1 records the order; forwards 2 and 3 prefetch both layers.
        assert result["cpu_prefetches"] == result["nvme_prefetches"] == result["resident_prefetches"] == 4


def test_no_optimizer_no_fp32_masters(engines) -> None:
    for result in engines:
        assert result["cpu_returned"] == (None, None, None)
        assert result["bf16_master_dtypes"] == ["torch.bfloat16"]
        assert result["bf16_tokens"] == result["bf16_want"]  # a frozen bf16 model
        # One shard per rank of every parameter (padding to a multiple of 2 at most one element each).
        assert result["model_elements"] / 2 <= result["bf16_host_elements"] <= result["model_elements"] / 2 + 20


def test_training_calls_are_refused_with_the_fix(engines) -> None:
    for result in engines:
        for name in ("resident", "cpu", "nvme"):
            errors = result[f"{name}_errors"]
            assert set(errors) == {"backward", "step", "save_checkpoint"}
            assert all(FIX in message for message in errors.values()), errors
            assert errors["backward"].startswith("engine.backward(): this engine was built for inference only")
            assert result[f"{name}_modifier_error"].startswith(
                "GatheredParameters(modifier_rank=...) on an inference-only engine")


def test_no_optimizer_below_stage_3_names_the_inference_route() -> None:
    import partita

    with pytest.raises(ValueError) as info:
        partita.initialize(model=torch.nn.Linear(2, 2), config={"train_micro_batch_size_per_gpu": 1,
                                                                 "zero_optimization": {"stage": 2}})
    message = str(info.value)
    assert message.startswith("no optimizer: pass optimizer=")
    assert "for inference only (ZeRO-Inference) set zero_optimization.stage to 3 (it is 2)" in message
    with pytest.raises(ConfigError, match="an lr scheduler was given but no optimizer"):
        partita.initialize(model=torch.nn.Linear(2, 2), config={
            "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 1}}})


def inference_layouts() -> dict:
    """A model built under zero.Init (never whole on any rank) and one under tensor parallelism."""
    import partita
    import partita.zero

    ids = _prompt(0)  # the same prompt on both ranks: tensor ranks must run the same forwards
    want = _greedy(_build("gpt2").eval().generate, ids, 6)
    cfg = _config("cpu")
    with partita.zero.Init(config_dict_or_path=cfg):
        model = _build("gpt2")
    engine, _, _, _ = partita.initialize(model=model, config=cfg)
    engine.eval()
    out = {"want": want, "zero_init": _greedy(engine.generate, ids, 6)}
    engine, _, _, _ = partita.initialize(model=_build("gpt2"), config={**_config(None),
                                                                       "tensor_parallel": {"autotp_size": 2}})
    engine.eval()
    out["tensor_parallel"] = _greedy(engine.generate, ids, 6)
    return out


def test_zero_inference_under_zero_init_and_tensor_parallelism() -> None:
    for result in run_distributed(inference_layouts, 2, timeout=300):
        assert result["zero_init"] == result["want"] and result["tensor_parallel"] == result["want"]


def from_pretrained_logits(directory: str) -> tuple:
    """A model loaded by from_pretrained on CPU keeps its weights in the safetensors file's memory
    map, whose storages cannot be resized: sharding must copy them, not fail freeing them."""
    import partita
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    ids = _prompt(0)
    with torch.no_grad():
        want = model(input_ids=ids).logits
    engine, _, _, _ = partita.initialize(model=model, config=_config(None))
    engine.eval()
    with torch.no_grad():
        got = engine(input_ids=ids).logits
    return want, got


def test_zero_inference_of_a_from_pretrained_model(tmp_path) -> None:
    _build("llama").save_pretrained(tmp_path)
    [(want, got)] = run_distributed(from_pretrained_logits, 1, str(tmp_path), timeout=300)
    assert torch.equal(want, got)
