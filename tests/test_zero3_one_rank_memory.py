"""ZeRO-3 at one rank: a gathered frozen unit shares its shard's storage instead of copying it.

At world size 1 a frozen parameter's shard (partita/zero/frozen_params.py) is its whole value.
Gathering used to copy it (the unit's pieces into a send buffer, then into the parameter's own
storage), so every gathered frozen unit existed twice, the root's embedding and LM head for the
whole step: LoRA on Llama-3-8B at ZeRO-3 on one H200 peaked 0.76 GiB above DeepSpeed's (issue 29),
whose one-rank gather aliases ``param.data`` to its shard. Now (frozen_params [Note: one rank]):

- inside the forward (and the checkpointed recomputation) every frozen weight's data is its shard's;
- gathering the root unit (embedding, final norm, LM head, all frozen) allocates 0 bytes, where
  the copy allocated twice the unit's bytes (measured with torch.profiler's memory timeline);
- freeing leaves every shard whole with its initial values, and training a LoRA model through
  3 steps gives the losses and adapters of single-process peft + torch AdamW on the same weights.
"""

from __future__ import annotations

import torch

from tests.harness import run_distributed

VOCAB, SEQ, BATCH, STEPS, LR, DECAY, CLIP = 64, 8, 2, 3, 1e-2, 0.1, 1.0
TARGETS = ["q_proj", "v_proj", "down_proj"]


def _config() -> dict:
    return {"train_batch_size": BATCH, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": DECAY}},
            "gradient_clipping": CLIP, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "steps_per_print": 1000}


def _lora_model(under_init: bool):
    from peft import LoraConfig
    from transformers import LlamaConfig, LlamaForCausalLM

    import partita
    from partita.integrations import peft_support

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    if under_init:
        with partita.zero.Init(config_dict_or_path=_config()):
            base = LlamaForCausalLM(config)
    else:
        base = LlamaForCausalLM(config)
    model = peft_support.get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    # Non-reentrant checkpointing: each block's frozen weights are gathered again for the recomputation.
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _batches() -> torch.Tensor:
    return torch.randint(0, VOCAB, (STEPS, BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _bytes_created(fn) -> int:
    """Bytes of tensor storage allocated while ``fn`` runs (torch.profiler's memory timeline)."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action, MemoryProfile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    timeline = MemoryProfile(prof.profiler.kineto_results).timeline
    return sum(size for _, action, _, size in timeline if action is Action.CREATE)


def _one_rank() -> dict:
    import partita
    from partita.distributed.init import init_distributed

    init_distributed()
    model = _lora_model(under_init=True)
    adapters = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = partita.initialize(model=model, config=_config(), model_parameters=adapters)
    gatherer = engine.zero.gatherer
    frozen = gatherer.frozen
    names = {p: n for n, p in model.named_parameters()}
    initial = {names[p]: frozen.shard(p).clone() for p in frozen.params}
    shares: dict[str, list[bool]] = {}

    def record(module, args, output=None) -> None:
        for param in module.parameters(recurse=False):
            if param in frozen:
                shares.setdefault(names[param], []).append(param.data_ptr() == frozen.shard(param).data_ptr())

    for module in model.modules():
        if any(p in frozen for p in module.parameters(recurse=False)):
            module.register_forward_hook(record)  # forward and recomputation
    root = model  # the gatherer's root unit: embedding, final norm and LM head (every one frozen)
    root_params = gatherer.unit_params()[root]
    out = {"root_names": sorted(names[p] for p in root_params),
           "root_bytes": sum(p.numel() * p.element_size() for p in root_params),
           "root_gather_bytes": _bytes_created(lambda: gatherer.gather_unit(root)),
           "root_shared": [p.data_ptr() == frozen.shard(p).data_ptr() for p in root_params]}
    gatherer.release_unit(root)
    losses = []
    for batch in _batches():
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    out["losses"] = losses
    out["shares"] = shares
    out["gathered_after"] = gatherer.num_gathered()
    out["shard_bytes_after"] = {names[p]: frozen.shard(p).untyped_storage().nbytes() for p in frozen.params}
    out["frozen_bytes"] = {names[p]: p.numel() * p.element_size() for p in frozen.params}
    out["frozen_unchanged"] = [n for p in frozen.params if torch.equal(frozen.shard(p), initial[n := names[p]])]
    out["adapters"] = {names[p]: v.clone() for p, v in zip(adapters, _whole_adapters(engine, adapters))}
    return out


def _whole_adapters(engine, adapters) -> list[torch.Tensor]:
    import partita

    with partita.zero.GatheredParameters(adapters):
        return [p.detach().clone() for p in adapters]


def _reference() -> dict:
    model = _lora_model(under_init=False)
    adapters = {n: p for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(adapters.values(), lr=LR, weight_decay=DECAY)
    losses = []
    for batch in _batches():
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(adapters.values(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "adapters": {n: p.detach().clone() for n, p in adapters.items()}}


def test_one_rank_frozen_units_share_their_shards_and_train_as_peft() -> None:
    got = run_distributed(_one_rank, 1)[0]
    assert got["root_names"] == ["base_model.model.lm_head.weight", "base_model.model.model.embed_tokens.weight",
                                 "base_model.model.model.norm.weight"]
    # The copy allocated the send buffer and the parameters' storages: 2 x the unit's bytes.
    assert got["root_bytes"] == (2 * VOCAB * 32 + 32) * 4
    assert got["root_gather_bytes"] == 0
    assert got["root_shared"] == [True, True, True]
    # Every frozen weight that ran (2 blocks' 7 linears and 2 norms, the embedding, norm, LM head) shared.
    assert len(got["shares"]) == 2 * 9 + 3
    assert {name: all(s) for name, s in got["shares"].items()} == {name: True for name in got["shares"]}
    assert got["gathered_after"] == 0
    assert got["shard_bytes_after"] == got["frozen_bytes"]  # freeing never emptied a shard
    assert sorted(got["frozen_unchanged"]) == sorted(got["frozen_bytes"])
    ref = _reference()
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
    assert sorted(got["adapters"]) == sorted(ref["adapters"])
    for name, value in ref["adapters"].items():
        torch.testing.assert_close(got["adapters"][name], value, rtol=1e-5, atol=1e-5)
