"""``generation.cuda_graph``: a training engine's ``generate`` through partita's static-KV-cache loop
(partita/inference/rollouts.py). On CPU the loop runs under dynamo's capture ("eager" backend, the
same graphs without CUDA): greedy tokens equal Hugging Face's generate from the same weights after
training steps, at ZeRO 0 and at ZeRO-3 on 2 ranks finishing at different lengths; settings the loop
does not implement fall back to generate; streamed ZeRO-3 sessions and CPU-only runs fall back."""

from __future__ import annotations

import contextlib
import logging

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from tests.harness import run_distributed  # noqa: E402

VOCAB, PROMPT = 96, 6
NEW = {0: 5, 1: 12}  # new tokens per rank: ranks finish apart (gather once: no collective per token)


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                        hidden_size=32, intermediate_size=64, vocab_size=VOCAB,
                                        max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0))


def _engine(stage: int, mode: str = "auto"):
    import partita

    zero = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_generation=mode)
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
              "zero_optimization": zero, "generation": {"cuda_graph": True}, "steps_per_print": 1000}
    engine, *_ = partita.initialize(model=_model(), config=config)
    return engine


def _train(engine, steps: int) -> None:
    batch = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        out = engine(input_ids=batch, labels=batch)
        engine.backward(out.loss)
        engine.step()


def _both(engine, ids: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(Hugging Face's generate, the static loop) on the engine's current weights."""
    sessions = engine._generation
    decoding, sessions._static_decoding = sessions._static_decoding, None
    try:
        reference = engine.module.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
    finally:
        sessions._static_decoding = decoding
    return reference, engine.module.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)


@contextlib.contextmanager
def _log_lines(level: int):
    """The partita logger's messages (a handler on the logger itself: initialize may turn its
    propagation off, so pytest's caplog would miss them)."""
    lines: list[str] = []
    handler = logging.Handler(level)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("partita")
    old = logger.level
    logger.setLevel(level)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


@pytest.fixture(autouse=True)
def no_process_group_left():
    """initialize() in this process starts a one-rank process group: later tests expect none."""
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def capture_on_cpu(monkeypatch):
    import partita.inference.rollouts as rollouts

    monkeypatch.setattr(rollouts, "CPU_CAPTURE_BACKEND", "eager")


def test_stage0_greedy_equals_generate_after_training(capture_on_cpu):
    engine = _engine(0)
    ids = torch.randint(1, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(3))
    for _ in range(2):  # the optimizer moved the weights in place: the captured step reads the new values
        _train(engine, 1)
        reference, got = _both(engine, ids, max_new_tokens=9, min_new_tokens=9, do_sample=False)
        assert torch.equal(reference, got)
    assert engine._generation._static_decoding._decoder is not None  # the loop served the calls


def test_input_require_grads_hook_is_off_for_the_decode_and_back_after(capture_on_cpu):
    # Trainer/TRL register it for gradient checkpointing; dynamo in torch 2.11 cannot capture its
    # requires_grad_() (the H200 GRPO run failed on it): off for the decode, registered again after.
    engine = _engine(0)
    engine.module.enable_input_require_grads()
    ids = torch.randint(1, VOCAB, (2, PROMPT), generator=torch.Generator().manual_seed(6))
    reference, got = _both(engine, ids, max_new_tokens=7, do_sample=False)
    assert torch.equal(reference, got)
    assert engine._generation._static_decoding._decoder is not None
    assert getattr(engine.module, "_require_grads_hook", None) is not None  # registered again


def test_fallback_for_settings_the_loop_does_not_implement(capture_on_cpu):
    engine = _engine(0)
    ids = torch.randint(1, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(4))
    with _log_lines(logging.INFO) as lines:
        reference, got = _both(engine, ids, max_new_tokens=6, do_sample=False, repetition_penalty=1.3)
    assert torch.equal(reference, got)
    assert engine._generation._static_decoding._decoder is None  # generate served it
    assert ("generation.cuda_graph: this generate call runs Hugging Face's generate (generation settings the "
            "static-cache loop does not implement: repetition_penalty=1.3)") in lines


def test_settings_resolve_as_generate_does():
    from transformers import GenerationConfig

    from partita.inference.static_decode import Settings

    model_config = GenerationConfig(temperature=0.7)
    settings = Settings({"generation_config": GenerationConfig(do_sample=True, top_p=0.9)}, model_config)
    assert (settings.get("do_sample"), settings.get("top_p"), settings.get("temperature"), settings.get("top_k")) == (
        True, 0.9, 0.7, 50)  # top_k: Hugging Face's default when neither config sets it
    assert Settings({"num_beams": 2}, model_config).unsupported() == ["num_beams=2"]
    assert Settings({}, GenerationConfig(repetition_penalty=1.0)).unsupported() == []


def test_cpu_without_capture_backend_warns_and_generates():
    with _log_lines(logging.WARNING) as lines:
        engine = _engine(0)
    assert ("generation.cuda_graph has no effect on cpu (CUDA graphs need a CUDA device); generate runs as "
            "usual") in lines
    ids = torch.randint(1, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(5))
    reference, got = _both(engine, ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(reference, got)


def test_section_is_strict():
    from partita.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="generation.cuda_graphs"):
        load_config({"train_micro_batch_size_per_gpu": 1, "generation": {"cuda_graphs": True}})


def zero3_two_ranks() -> dict:
    import os

    import partita.inference.rollouts as rollouts

    rank = int(os.environ["RANK"])
    rollouts.CPU_CAPTURE_BACKEND = "eager"
    out = {}
    for mode in ("gather_once", "stream"):
        engine = _engine(3, mode)
        _train(engine, 2)
        ids = torch.randint(1, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(20 + rank))
        reference, got = _both(engine, ids, max_new_tokens=NEW[rank], min_new_tokens=NEW[rank], do_sample=False)
        out[mode] = (torch.equal(reference, got), got.shape[1], engine._generation._static_decoding._decoder is not None)
    return out


def test_zero3_two_ranks_gather_once_uses_the_loop_stream_does_not():
    results = run_distributed(zero3_two_ranks, 2)
    for rank, result in enumerate(results):
        assert result["gather_once"] == (True, PROMPT + NEW[rank], True)
        assert result["stream"] == (True, PROMPT + NEW[rank], False)  # every rank runs every forward: generate
