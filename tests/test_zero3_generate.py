"""Generating from a training engine (issue 28 item 2): greedy tokens equal an unsharded model's at
ZeRO-3 (gathered once, streamed with prefetch), via ``engine.module.generate``, TRL's
``GatheredParameters`` pattern and ``engine.generate``; stages 1-2 and tensor parallelism; the
all-gathers counted to show gather-once runs none per token; holds survive a backward."""

from __future__ import annotations

import copy
import os
import pickle

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from tests.harness import run_distributed  # noqa: E402

VOCAB, PROMPT = 96, 5
NEW = {0: 4, 1: 11}  # new tokens per rank: ranks finish at different steps


def _build(family: str, layers: int = 2) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_head=2, n_embd=32, vocab_size=VOCAB, n_positions=32,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                          eos_token_id=0, pad_token_id=0))
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                        hidden_size=32, intermediate_size=64, vocab_size=VOCAB,
                                        max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
                                        pad_token_id=0))


def _config(stage: int, mode: str = "auto", tensor: int = 1) -> dict:
    zero = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_generation=mode)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": zero, "steps_per_print": 1000}
    if tensor > 1:
        cfg["tensor_parallel"] = {"autotp_size": tensor}
    return cfg


def _prompt(rank: int) -> torch.Tensor:
    return torch.randint(1, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(10 + rank))


def _greedy(generate, ids: torch.Tensor, new: int) -> list[int]:
    out = generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                   do_sample=False)
    return out[0, ids.shape[1]:].tolist()


class _GatherCounter:
    """Counts ZeRO-3 parameter all-gathers (partita.distributed.collectives is what the gatherer calls)."""

    def __init__(self) -> None:
        from partita.distributed import collectives

        self.count = 0
        self._collectives, self._original = collectives, collectives.all_gather_into_tensor

        def counted(*args, **kwargs):
            if kwargs.get("purpose") == "ZeRO-3 parameter all-gather":
                self.count += 1
            return self._original(*args, **kwargs)

        collectives.all_gather_into_tensor = counted

    def take(self) -> int:
        count, self.count = self.count, 0
        return count


def zero3_sessions(family: str) -> dict:
    import partita
    from partita.zero import GatheredParameters

    rank = int(os.environ["RANK"])
    ids, new = _prompt(rank), NEW[rank]
    reference = _build(family).eval()
    want = _greedy(reference.generate, ids, new)
    counter = _GatherCounter()
    model = _build(family)
    engine, _, _, _ = partita.initialize(model=model, config=_config(3))
    engine.eval()
    gatherer = engine.zero.gatherer
    units = sum(1 for params in gatherer.unit_params().values() if params)
    counter.take()
    out = {"want": want, "units": units}
    out["module"] = _greedy(engine.module.generate, ids, new)
    out["module_gathers"] = counter.take()
    out["module_mode"] = engine.generation_mode
    out["freed_after"] = gatherer.num_gathered()
    out["engine"] = _greedy(engine.generate, ids, new)
    out["engine_gathers"] = counter.take()
    with GatheredParameters(engine.module.parameters()):
        counter.take()
        out["trl"] = _greedy(engine.module.generate, ids, new)
        out["trl_gathers"] = counter.take()
        # A training forward and backward inside the block: release_all leaves held parameters whole.
        engine.train()
        batch = torch.randint(1, VOCAB, (1, 8), generator=torch.Generator().manual_seed(rank))
        engine.backward(engine(input_ids=batch, labels=batch).loss)
        sharded = [p for p in model.parameters() if gatherer.is_sharded_param(p)]
        out["held_after_backward"] = all(gatherer.is_gathered(p) for p in sharded)
        engine.step()
        engine.eval()
    out["freed_after_block"] = gatherer.num_gathered()
    out["holds_after"] = len(gatherer.holds)
    out["wrapped"] = "generate" in engine.module.__dict__
    out["state_dict_keys"] = sorted(engine.module.state_dict()) == sorted(_build(family).state_dict())
    engine.destroy()
    out["unwrapped"] = "generate" not in engine.module.__dict__
    return out


def zero3_streaming(family: str) -> dict:
    import partita

    rank = int(os.environ["RANK"])
    ids, new = _prompt(rank), NEW[rank]
    want = _greedy(_build(family).eval().generate, ids, new)
    counter = _GatherCounter()
    engine, _, _, _ = partita.initialize(model=_build(family), config=_config(3, mode="stream"))
    engine.eval()
    gatherer = engine.zero.gatherer
    units = sum(1 for params in gatherer.unit_params().values() if params)
    counter.take()
    prefetches = gatherer.eval_prefetch.prefetch_count
    got = _greedy(engine.module.generate, ids, new)  # rank 0 finishes early: synced_gpus keeps it forwarding
    out = {"want": want, "got": got, "mode": engine.generation_mode, "gathers": counter.take(), "units": units,
           "prefetches": gatherer.eval_prefetch.prefetch_count - prefetches, "freed_after": gatherer.num_gathered()}
    # "auto": rank 1 alone has too little free memory for the whole model; both ranks must stream.
    import logging

    from partita.zero import generation

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("partita").addHandler(handler)
    auto, _, _, _ = partita.initialize(model=_build(family), config=_config(3))
    auto.eval()
    if rank == 1:
        generation._free_bytes = lambda device: 1024
    out["auto_tokens"] = _greedy(auto.generate, ids, new)
    out["auto_mode"], out["auto_held"] = auto.generation_mode, auto._generation.held_units
    out["logged"] = [r for r in records if r.startswith("ZeRO-3 generate")]
    # 6 blocks; room on rank 1 for the root unit beside the streaming window (one block prefetched, the
    # largest unit and its buffer): the root is held for the call, the blocks stream.
    cfg = _config(3)
    block_numel = sum(p.numel() for p in _build(family).transformer.h[0].parameters())
    cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = block_numel
    out["partial_want"] = _greedy(_build(family, layers=6).eval().generate, ids, new)
    partial, _, _, _ = partita.initialize(model=_build(family, layers=6), config=cfg)
    partial.eval()
    units = [ps for ps in partial.zero.gatherer.unit_params().values() if ps]
    sizes = [sum(p.numel() * p.element_size() for p in ps) for ps in units]
    window = min(block_numel * 4, sum(sizes)) + 2 * max(sizes)
    if rank == 1:
        generation._free_bytes = lambda device: sizes[0] + window
        generation._reserve_bytes = lambda *args: 0
    counter.take()
    out["partial_tokens"] = _greedy(partial.generate, ids, new)
    out["partial_gathers"] = counter.take()
    out["partial_mode"], out["partial_held"] = partial.generation_mode, partial._generation.held_units
    out["partial_freed"] = partial.zero.gatherer.num_gathered()
    out["logged"] = [r for r in records if r.startswith("ZeRO-3 generate")]
    return out


def other_layouts(family: str) -> dict:
    import partita

    rank = int(os.environ["RANK"])
    ids = _prompt(rank)
    want = _greedy(_build(family).eval().generate, ids, NEW[rank])
    out = {"want": want}
    for stage in (1, 2):
        engine, _, _, _ = partita.initialize(model=_build(family), config=_config(stage))
        engine.eval()
        out[f"stage{stage}"] = _greedy(engine.module.generate, ids, NEW[rank])
        out[f"stage{stage}_engine"] = _greedy(engine.generate, ids, NEW[rank])
        if stage == 1:  # the wrapped module pickles and deep-copies; the copies generate as plain models
            copies = [pickle.loads(pickle.dumps(engine.module)), copy.deepcopy(engine.module)]
            out["copies"] = [_greedy(c.generate, ids, NEW[rank]) for c in copies]
            out["copies_detached"] = [c.__dict__["generate"]._sessions is None for c in copies]
        engine.destroy()
    # Tensor parallelism: both ranks hold halves, so both generate the same prompt (rank 0's) in lockstep.
    ids0 = _prompt(0)
    out["tp_want"] = _greedy(_build("gpt2").eval().generate, ids0, NEW[1])
    engine, _, _, _ = partita.initialize(model=_build("gpt2"), config=_config(3, tensor=2))  # llama here: 1 kv head
    engine.eval()
    out["tp"] = _greedy(engine.generate, ids0, NEW[1])
    return out


@pytest.fixture(scope="module")
def sessions() -> dict:
    return {family: run_distributed(zero3_sessions, 2, family, timeout=300) for family in ("gpt2", "llama")}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_zero3_greedy_tokens_equal_unsharded_through_every_entry_point(sessions, family) -> None:
    for rank, result in enumerate(sessions[family]):
        assert len(result["want"]) == len(result["module"]) == 4 if rank == 0 else 11
        assert result["module"] == result["want"], (rank, "engine.module.generate")
        assert result["engine"] == result["want"], (rank, "engine.generate")
        assert result["trl"] == result["want"], (rank, "GatheredParameters pattern")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_gather_once_runs_one_all_gather_per_unit_per_call_not_per_token(sessions, family) -> None:
    for result in sessions[family]:
        assert result["module_mode"] == "gather_once"
        # Ranks generated 4 and 11 tokens: the count does not depend on it, and no rank waited for the other.
        assert result["module_gathers"] == result["units"] == 3
        assert result["engine_gathers"] == result["units"]
        assert result["trl_gathers"] == 0  # the block gathered; the units' hooks did not free it
        assert result["freed_after"] == 0 and result["freed_after_block"] == 0 and result["holds_after"] == 0
        assert result["held_after_backward"]


def test_module_generate_wrapper_keeps_state_dict_and_is_undone_by_destroy(sessions) -> None:
    for result in sessions["gpt2"]:
        assert result["wrapped"] and result["unwrapped"] and result["state_dict_keys"]


@pytest.mark.parametrize("family", ["gpt2"])
def test_streaming_prefetches_and_syncs_ranks_that_finish_apart(family) -> None:
    run = run_distributed(zero3_streaming, 2, family, timeout=300)
    for rank, result in enumerate(run):
        assert result["mode"] == "stream"
        assert result["got"] == result["want"]
        # Every rank ran the longer rank's forwards (synced_gpus): one prefill + 10 decode steps, each unit once.
        assert result["gathers"] == 11 * result["units"], result
        assert result["prefetches"] >= 10 * (result["units"] - 1), result
        assert result["freed_after"] == 0
        assert result["auto_mode"] == "stream" and result["auto_held"] == 0 and result["auto_tokens"] == result["want"]
        # The root held (one gather for the call), the 6 blocks gathered by each of the 11 forwards.
        assert result["partial_mode"] == "stream" and result["partial_held"] == 1
        assert result["partial_gathers"] == 1 + 11 * 6 and result["partial_tokens"] == result["partial_want"]
        assert result["partial_freed"] == 0
    assert rank == 1 and result["logged"] == []  # rank 0 logs
    logged = run[0]["logged"]
    assert len(logged) == 2, logged
    assert logged[0].startswith("ZeRO-3 generate: streaming 3 of 3 units with prefetch, 0 held for the whole call"), logged
    assert logged[0].endswith("reserved for KV cache and activations; it fits here but not on another rank)"), logged
    assert logged[1].startswith("ZeRO-3 generate: streaming 6 of 7 units with prefetch, 1 held for the whole call"), logged


def test_stages_1_2_and_tensor_parallel_generate_the_unsharded_tokens() -> None:
    for result in run_distributed(other_layouts, 2, "llama", timeout=300):
        for key in ("stage1", "stage1_engine", "stage2", "stage2_engine"):
            assert result[key] == result["want"], key
        assert result["copies"] == [result["want"]] * 2 and result["copies_detached"] == [True, True]
        assert result["tp"] == result["tp_want"]


def gpt_sessions() -> dict:
    """The reference GPT (partita/models/gpt.py: a static KV cache, its own generate) at ZeRO-3."""
    import partita
    from partita.models.gpt import GPT, GPTConfig

    def build() -> GPT:
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32))

    rank = int(os.environ["RANK"])
    ids = torch.randint(0, 64, (2, PROMPT), generator=torch.Generator().manual_seed(rank))
    want = build().generate(ids, NEW[rank]).tolist()
    out = {"want": want}
    counter = _GatherCounter()
    for mode in ("gather_once", "stream"):
        engine, _, _, _ = partita.initialize(model=build(), config=_config(3, mode=mode))
        units = sum(1 for params in engine.zero.gatherer.unit_params().values() if params)
        counter.take()
        out[mode] = engine.generate(ids, NEW[rank]).tolist()
        out[f"{mode}_module"] = engine.module.generate(ids, max_new_tokens=NEW[rank]).tolist()
        out[f"{mode}_gathers"], out["units"] = counter.take(), units
        engine.destroy()
    return out


def test_reference_gpt_generates_the_unsharded_tokens_at_zero3() -> None:
    for rank, result in enumerate(run_distributed(gpt_sessions, 2, timeout=300)):
        for key in ("gather_once", "gather_once_module", "stream", "stream_module"):
            assert result[key] == result["want"], (rank, key)
        assert result["gather_once_gathers"] == 2 * result["units"]  # two calls, one gather of each unit each
        # Streaming: every rank runs the longer rank's 1 prefill + 10 decode steps per call (synced_gpus).
        assert result["stream_gathers"] == 2 * 11 * result["units"]
