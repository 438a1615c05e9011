"""The reference GPT's KV-cached generation equals recomputing the whole prefix every token.

Oracle: the model's own training forward (no cache) on the growing sequence, argmax of the last
position, token for token (fp32). Tensor-parallel ranks (gloo) must produce the unsharded model's
tokens; refused layouts must say why, word for word.
"""

from __future__ import annotations

import pytest
import torch

from partita.models.gpt import GPT, GPTConfig
from partita.models.gpt_generate import generation_mode
from tests.harness import run_distributed

VOCAB, BLOCK = 64, 32


def _gpt(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=BLOCK, n_layer=2, n_head=4, n_embd=32, **overrides))


def _prompts(batch: int = 3, length: int = 5, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def uncached_greedy(model: GPT, prompt: torch.Tensor, new: int) -> torch.Tensor:
    """The oracle: the whole sequence through the training forward for every new token."""
    seq = prompt
    with generation_mode(model):
        for _ in range(new):
            logits, _ = model(seq)
            seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq


@pytest.mark.parametrize("moe_every", [0, 2], ids=["dense", "moe"])
def test_cached_greedy_generation_equals_recomputing_the_prefix(moe_every: int) -> None:
    model = _gpt(moe_every=moe_every, moe_experts=4)
    prompt = _prompts()
    out = model.generate(prompt, 12)
    assert out.shape == (3, 17) and out.dtype == torch.long
    assert torch.equal(out[:, :5], prompt)
    assert torch.equal(out, uncached_greedy(model, prompt, 12))


@pytest.mark.parametrize("moe_every", [0, 2], ids=["dense", "moe"])
def test_decode_step_logits_equal_the_full_forward_last_position(moe_every: int) -> None:
    model = _gpt(moe_every=moe_every, moe_experts=4)
    seq = _prompts(length=9)
    prompt, rest = seq[:, :4], seq[:, 4:]
    cache = model.new_kv_cache(BLOCK)
    with generation_mode(model):
        prefill, _ = model(prompt, kv_cache=cache)
        torch.testing.assert_close(prefill, model(prompt)[0], rtol=0, atol=1e-5)
        position = torch.tensor([4])
        for i in range(rest.size(1)):
            step = model.decode_step(rest[:, i:i + 1], position, cache)
            full, _ = model(seq[:, :5 + i])
            assert step.shape == (3, VOCAB)
            torch.testing.assert_close(step, full[:, -1], rtol=0, atol=1e-5)
            position += 1


def test_moe_generation_routes_without_dropping_so_rows_do_not_depend_on_their_batch() -> None:
    model = _gpt(moe_every=2, moe_experts=4)  # drop_tokens=True, capacity_factor 1: eval forwards drop
    prompts = _prompts(batch=4, length=8)
    batched = model.generate(prompts, 6)
    alone = torch.cat([model.generate(prompts[i:i + 1], 6) for i in range(4)])
    assert torch.equal(batched, alone)
    moe = model.blocks[1].mlp.moe
    assert moe.drop_tokens is True and model.training  # restored after generate
    with torch.no_grad():  # and eval forwards of the model itself still drop (DeepSpeed's behaviour)
        model.eval()
        together = model(prompts)[0]
        apart = torch.cat([model(prompts[i:i + 1])[0] for i in range(4)])
    assert (together - apart).abs().max() > 1e-3


def test_the_cache_is_static_across_steps_and_calls() -> None:
    model = _gpt()
    cache = model.new_kv_cache(20)
    first = model.generate(_prompts(), 8, kv_cache=cache)
    key = cache[0].key
    assert key.shape == (3, 4, 20, 8)  # (batch, heads, max_len, head_dim)
    assert cache.nbytes() == 2 * 2 * 3 * 4 * 20 * 8 * 4
    again = model.generate(_prompts(), 8, kv_cache=cache)
    assert cache[0].key.data_ptr() == key.data_ptr()  # reused buffers: a captured decode graph stays valid
    assert torch.equal(first, again)


def test_sampling_is_reproducible_with_a_seeded_generator_and_top_k_1_is_greedy() -> None:
    model = _gpt()
    prompt = _prompts()

    def sample(seed: int, **options) -> torch.Tensor:
        return model.generate(prompt, 10, do_sample=True, generator=torch.Generator().manual_seed(seed), **options)

    assert torch.equal(sample(7, temperature=2.0), sample(7, temperature=2.0))
    assert not torch.equal(sample(7, temperature=2.0), sample(8, temperature=2.0))
    assert torch.equal(sample(7, top_k=1), model.generate(prompt, 10))
    top3 = sample(9, top_k=3, temperature=5.0)
    with generation_mode(model):  # every sampled token is among its step's 3 most likely
        logits, _ = model(top3[:, :-1])
    allowed = logits[:, 4:].topk(3, dim=-1).indices
    assert (allowed == top3[:, 5:].unsqueeze(-1)).any(-1).all()


def test_eos_rows_keep_emitting_it_and_the_loop_stops_when_all_finished() -> None:
    model = _gpt()
    prompt = _prompts()
    free = model.generate(prompt, 12)
    eos = int(free[0, 5 + 2])
    out = model.generate(prompt, 12, eos_token_id=eos)
    ended = []
    for row in range(3):
        hits = (free[row, 5:] == eos).nonzero()
        end = int(hits[0]) + 1 if len(hits) else 12  # new tokens up to and including the first eos
        ended.append(end)
        assert torch.equal(out[row, :5 + end], free[row, :5 + end])
        assert (out[row, 5 + end:] == eos).all()
    assert out.shape[1] == 5 + max(ended)
    one = model.generate(prompt[:1], 12, eos_token_id=[VOCAB - 1, eos])  # a list of ids, HF style
    assert one.shape[1] == 5 + ended[0] and one[0, -1] == eos


def test_hugging_face_calling_shape() -> None:
    model = _gpt()
    prompt = _prompts()
    hf = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4)
    assert torch.equal(hf, model.generate(prompt, 4))


def test_bad_inputs_are_refused_with_the_fix() -> None:
    model = _gpt()
    prompt = _prompts(length=20)
    with pytest.raises(ValueError, match=r"cannot generate 13 tokens after a prompt of 20: prompt \+ max_new_tokens = 33 "
                                         r"exceeds block_size 32 \(the position embedding has block_size rows\); ask for at "
                                         r"most 12 new tokens or shorten the prompt to at most 19 tokens"):
        model.generate(prompt, 13)
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0
    with pytest.raises(ValueError, match=r"attention_mask has zeros \(padded prompts\): the reference GPT's generate does "
                                         r"not support padding; generate prompts of one length per call"):
        model.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=2)
    with pytest.raises(ValueError, match="give the prompt once: idx"):
        model.generate(prompt, 2, input_ids=prompt)
    with pytest.raises(ValueError, match=r"needs the prompt token ids as a \(batch, seq >= 1\) LongTensor"):
        model.generate(prompt.float(), 2)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int, got 0"):
        model.generate(prompt, 0)
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        model.generate(prompt, 2, do_sample=True, temperature=0)
    with pytest.raises(ValueError, match=r"kv_cache has max_len 8 < prompt \+ max_new_tokens = 22"):
        model.generate(prompt, 2, kv_cache=model.new_kv_cache(8))
    with pytest.warns(UserWarning, match="temperature and top_k have no effect with do_sample=False"):
        model.generate(prompt, 1, top_k=5)


# ---------------------------------------------------------------------------- on gloo ranks
def _tensor_parallel_generation(new: int) -> dict:
    import torch.distributed as dist

    from partita.tensor_parallel import apply_tensor_parallel
    from partita.tensor_parallel.apply import Style
    from partita.tensor_parallel.plans import fork_attention_rng, gpt_plan

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    prompt = _prompts(batch=2, length=4)
    result = {}
    # dropout > 0: tensor parallelism wraps attend for its dropout stream, which generate accepts
    reference = _gpt(dropout=0.1)
    result["reference"] = reference.generate(prompt, new)
    sharded = _gpt(dropout=0.1)
    apply_tensor_parallel(sharded, group=group, plan=gpt_plan(sharded, sequence_parallel=False))
    fork_attention_rng(sharded, rank)
    assert sharded.lm_head.weight.shape[0] == VOCAB // size  # the head gives a vocabulary shard
    result["vocab_parallel_head"] = sharded.generate(prompt, new)
    # Ranks sampling with differently seeded generators still continue with one token.
    result["sampled"] = sharded.generate(prompt, new, do_sample=True, temperature=3.0,
                                         generator=torch.Generator().manual_seed(100 + rank))
    whole_head = _gpt(dropout=0.1)
    styles = {k: v for k, v in gpt_plan(whole_head, sequence_parallel=False).styles.items() if k != "lm_loss"}
    styles.update({"tok_emb": Style("replicate"), "lm_head": Style("replicate")})
    apply_tensor_parallel(whole_head, group=group, plan=styles)
    result["whole_vocab_head"] = whole_head.generate(prompt, new)
    if size == 2:
        result["refusals"] = _sequence_parallel_refusals(group)
        result["synced"] = _synced_gpus(rank)
    dist.barrier()
    return result


def _sequence_parallel_refusals(group) -> dict:
    from partita.distributed.topology import build_topology
    from partita.sequence.apply import apply_sequence_parallel
    from partita.sequence.config import SequenceParallelConfig
    from partita.tensor_parallel import apply_tensor_parallel
    from partita.tensor_parallel.plans import gpt_plan

    messages = {}
    tp_sp = _gpt()
    apply_tensor_parallel(tp_sp, group=group, plan=gpt_plan(tp_sp, sequence_parallel=True), sequence_parallel=True)
    ulysses = _gpt()
    apply_sequence_parallel(ulysses, build_topology(device_type="cpu", sizes={"sequence": 2}), SequenceParallelConfig())
    for name, model in (("tensor_sequence_parallel", tp_sp), ("ulysses", ulysses)):
        try:
            model.generate(_prompts(batch=2, length=4), 2)
            messages[name] = "no error"
        except NotImplementedError as error:
            messages[name] = str(error)
    return messages


def _synced_gpus(rank: int) -> dict:
    """Rank 0 wants 2 tokens, rank 1 wants 5: with synced_gpus both run the same forwards."""
    model = _gpt()
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    new = 2 if rank == 0 else 5
    out = model.generate(_prompts(batch=2, length=4), new, synced_gpus=True)
    synced_forwards = len(forwards)
    return {"tokens": out, "forwards": synced_forwards, "alone": model.generate(_prompts(batch=2, length=4), new)}


def test_tensor_parallel_2_generates_the_unsharded_tokens_and_refuses_sequence_parallelism() -> None:
    per_rank = run_distributed(_tensor_parallel_generation, 2, 6, timeout=240)
    for result in per_rank:
        for case in ("vocab_parallel_head", "whole_vocab_head"):
            assert torch.equal(result[case], result["reference"]), case
    assert torch.equal(per_rank[0]["sampled"], per_rank[1]["sampled"])
    for result in per_rank:
        assert result["refusals"]["tensor_sequence_parallel"] == (
            "generate with tensor_parallel.sequence_parallel is not supported (blocks.0.ln_1 runs on sequence shards): "
            "sequence parallelism splits every sequence across the tensor ranks, and a decode step has one token; build "
            "the model for generation with sequence_parallel false (same weights)")
        assert result["refusals"]["ulysses"] == (
            "generate with blocks.0.attn.attend replaced (sequence parallelism: Ulysses or ring attention; or sparse "
            "attention) is not supported: the KV cache runs the model's own dense causal attention on whole sequences, "
            "and sequence parallelism splits each sequence across ranks while a decode step has one token; generate "
            "with a model built without sequence_parallel_size / sparse_attention (same weights)")
    synced = [r["synced"] for r in per_rank]
    assert synced[0]["forwards"] == synced[1]["forwards"] == 5  # the prefill and the 4 steps rank 1 needs
    for r, new in zip(synced, (2, 5)):
        assert r["tokens"].shape == (2, 4 + new) and torch.equal(r["tokens"], r["alone"])


def test_tensor_parallel_4_generates_the_unsharded_tokens() -> None:
    per_rank = run_distributed(_tensor_parallel_generation, 4, 4, timeout=240)
    for result in per_rank:
        assert torch.equal(result["vocab_parallel_head"], result["reference"])
        assert torch.equal(result["whole_vocab_head"], result["reference"])
        assert torch.equal(result["sampled"], per_rank[0]["sampled"])
