"""``init_inference`` with tensor parallelism and with training checkpoints, on gloo ranks.

Oracle: the unsharded model in plain PyTorch (eval mode), built from the same seed, or holding the
checkpoint's weights as ``partita checkpoint consolidate`` writes them (an independent reader of
the same files). Greedy tokens must be equal token for token.

Two launches: 2 ranks train a tiny Llama (grouped-query attention) 2 steps and save it at
ZeRO-3 x data 2 and at tensor 2 x data 1 (plus a ``save_16bit_model`` export), the MoE GPT at
expert-parallel 2 x data 2 and test_pipe_checkpoint's model at pipeline 2; then 4 ranks run
every tensor-parallel generation (GPT-2, Llama with GQA, the reference GPT at tp 2 and 4; Llama
and GPT-2 through DeepSpeed's injection_policy; BERT's logits), load each checkpoint at tp 1, 2
and 4, and collect the refusals that need a process group.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.harness import run_distributed

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB, NEW = 96, 6
KINDS = ("gpt2", "llama", "gpt")


def build(kind: str, seed: int = 0, ep_size: int = 1) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "llama":  # 8 query heads, 4 key/value heads: GQA that tp 4 still divides
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=64))
    if kind == "llama_kv2":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64))
    if kind == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64))
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=None))
    from partita.models.gpt import GPT, GPTConfig

    if kind == "gpt_moe":  # 4 experts in every second block; ep: the ranks they are spread over
        return GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32, moe_every=2, moe_experts=4,
                             moe_ep_size=ep_size, moe_drop_tokens=False))
    return GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32))


def prompt() -> torch.Tensor:
    return torch.randint(1, 60, (2, 5), generator=torch.Generator().manual_seed(1))


def greedy(model, **kwargs) -> list:
    x = prompt()
    extra = {} if isinstance(model, torch.nn.Module) and not hasattr(model, "generation_config") else {
        "attention_mask": torch.ones_like(x), "pad_token_id": 0}
    return model.generate(x, max_new_tokens=NEW, **{"do_sample": False, **extra, **kwargs}).tolist()


# ------------------------------------------------------------------------------ launch 1: save


def _train_config(stage: int, tensor: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
            "zero_optimization": {"stage": stage}, "tensor_parallel": {"autotp_size": tensor}, "steps_per_print": 1000}


def save_checkpoints(root: str) -> None:
    import partita

    batches = torch.randint(0, VOCAB, (2, 4, 8), generator=torch.Generator().manual_seed(5))
    for name, stage, tensor in (("zero3", 3, 1), ("tensor2", 1, 2)):
        model = build("llama")
        engine, *_ = partita.initialize(model=model, config=_train_config(stage, tensor))
        data = engine.topology.data_rank
        for x in batches:
            x = x[2 * data:2 * data + 2]
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
        engine.save_checkpoint(os.path.join(root, name))
        if name == "zero3":
            engine.save_16bit_model(os.path.join(root, "export16"))
    # An expert-parallel checkpoint: the MoE GPT's experts spread over both ranks (ep 2 x data 2).
    model = build("gpt_moe", ep_size=2)
    engine, *_ = partita.initialize(model=model, config=_train_config(2, 1))
    x = batches[0][2 * engine.topology.data_rank:][:2] % 64
    engine.backward(engine(x, torch.roll(x, -1, dims=1))[1])
    engine.step()
    engine.save_checkpoint(os.path.join(root, "experts2"))
    # A pipeline checkpoint (2 stages, keys carry each layer's global index): test_pipe_checkpoint's model.
    from tests.test_pipe_checkpoint import _engine, _train

    pipe = _engine(2, 1)
    _train(pipe, range(1))
    pipe.save_checkpoint(os.path.join(root, "pipe2"))


# ------------------------------------------------------------------------------ launch 2: generate


def generate_everything(root: str) -> dict:
    import partita
    from partita.config import ConfigError

    out: dict = {}
    for kind in KINDS:
        for tp in (2, 4):
            engine = partita.init_inference(build(kind), tensor_parallel={"tp_size": tp}, dtype=torch.float32)
            out[(kind, tp)] = greedy(engine)
            if kind == "llama":
                out[("numel", tp)] = engine.module.model.layers[0].self_attn.k_proj.weight.numel()
    policies = {"llama": {"LlamaDecoderLayer": ("self_attn.o_proj", "mlp.down_proj")},
                "gpt2": {"GPT2Block": ("attn.c_proj", "mlp.c_proj")}}
    for kind, policy in policies.items():  # DeepSpeed's user-specified split instead of the built-in plan
        out[("policy", kind)] = greedy(partita.init_inference(build(kind), tensor_parallel={"tp_size": 2},
                                                              injection_policy=policy, dtype=torch.float32))
    # Sampling: ranks seeded differently; a tensor group must still draw the same tokens.
    import torch.distributed as dist

    model = build("llama")
    torch.manual_seed(100 + dist.get_rank())
    sampler = partita.init_inference(model, tensor_parallel={"tp_size": 2}, dtype=torch.float32)
    out["sampled"] = greedy(sampler, do_sample=True, top_k=0, temperature=1.0)
    # int8 weights of this rank's shards, and weights streamed from host memory, under tp 2.
    int8 = partita.init_inference(build("llama"), tensor_parallel={"tp_size": 2}, dtype=torch.int8)
    out["int8"] = (type(int8.module.model.layers[0].self_attn.o_proj.weight).__module__, len(greedy(int8)[0]))
    streamed = partita.init_inference(build("llama"), tensor_parallel={"tp_size": 2}, dtype=torch.float32,
                                      zero={"stage": 3, "offload_param": {"device": "cpu"}})
    out["streamed"] = greedy(streamed)
    for tp in (2, 4):  # BERT has no generate: its forward's logits
        out[("bert", tp)] = partita.init_inference(build("bert"), tensor_parallel={"tp_size": tp}, dtype=torch.float32)(
            prompt()).logits
    for name in ("zero3", "tensor2", "consolidated_zero3", "export16"):
        for tp in ((1, 2, 4) if name in ("zero3", "tensor2") else (2,)):
            engine = partita.init_inference(build("llama", seed=7), checkpoint=os.path.join(root, name),
                                            tensor_parallel={"tp_size": tp}, dtype=torch.float32)
            out[(name, tp)] = greedy(engine)
    out[("experts2", 1)] = greedy(partita.init_inference(build("gpt_moe", seed=7), checkpoint=os.path.join(root, "experts2"),
                                                         dtype=torch.float32))
    errors = {}
    for case, kwargs in {"kv_heads": {"tp_size": 4}, "world": {"tp_size": 3}}.items():
        try:
            partita.init_inference(build("llama_kv2"), tensor_parallel=kwargs, dtype=torch.float32)
        except ConfigError as error:
            errors[case] = str(error)
    try:
        partita.init_inference(build("gpt_moe"), tensor_parallel={"tp_size": 2}, dtype=torch.float32)
    except ConfigError as error:
        errors["moe"] = str(error)
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from partita.checkpoint.consolidate import consolidate

    root = tmp_path_factory.mktemp("init_inference")
    run_distributed(save_checkpoints, 2, str(root), timeout=300)
    for name in ("zero3", "tensor2", "pipe2", "experts2"):  # the oracle's weights: an independent reader of the same files
        tag = (root / name / "latest").read_text().strip()
        consolidate(root / name / tag, root / f"consolidated_{name}")
    return root, run_distributed(generate_everything, 4, str(root), timeout=400)


def _eval(model):
    return model.eval()


@pytest.mark.parametrize("kind", KINDS)
def test_tp2_and_tp4_greedy_tokens_equal_the_unsharded_model(runs, kind) -> None:
    _, per_rank = runs
    want = greedy(_eval(build(kind)))
    for rank, out in enumerate(per_rank):
        for tp in (2, 4):
            assert out[(kind, tp)] == want, (kind, tp, rank)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_deepspeeds_injection_policy_at_tp2_gives_the_unsharded_tokens(runs, kind) -> None:
    _, per_rank = runs
    want = greedy(_eval(build(kind)))
    assert all(out[("policy", kind)] == want for out in per_rank)


def test_a_tensor_group_samples_the_same_tokens_whatever_each_rank_was_seeded_with(runs) -> None:
    _, per_rank = runs
    sampled = [out["sampled"] for out in per_rank]
    assert sampled[0] == sampled[1] and sampled[2] == sampled[3]  # tensor groups: ranks {0, 1} and {2, 3}
    assert sampled[0] != sampled[2]  # the replicas kept their own seeds (100 and 102)


def test_int8_and_streamed_weights_work_under_tp2(runs) -> None:
    _, per_rank = runs
    want = greedy(_eval(build("llama")))
    for out in per_rank:
        module, length = out["int8"]
        assert module.startswith("torchao") and length == 5 + NEW
        assert out["streamed"] == want  # streaming moves the same weights: the same tokens


def test_bert_logits_under_tp2_and_tp4_match_the_unsharded_model(runs) -> None:
    _, per_rank = runs
    want = _eval(build("bert"))(prompt()).logits
    for out in per_rank:
        for tp in (2, 4):  # the row-parallel sums add in another order: fp32 rounding only
            torch.testing.assert_close(out[("bert", tp)], want, rtol=1e-5, atol=1e-5)


def test_llama_gqa_key_projection_is_split_across_the_tensor_ranks(runs) -> None:
    _, per_rank = runs
    whole = build("llama").model.layers[0].self_attn.k_proj.weight.numel()
    assert per_rank[0][("numel", 2)] * 2 == whole and per_rank[0][("numel", 4)] * 4 == whole


def test_a_pipeline_checkpoint_loads_into_the_plain_sequential_of_its_layers(runs) -> None:
    from partita.checkpoint.consolidate import load_consolidated
    from tests.test_pipe_checkpoint import _reference_layers

    import partita

    root, _ = runs
    want = _reference_layers()
    want.load_state_dict(load_consolidated(root / "consolidated_pipe2"), strict=True)
    fresh = _reference_layers()
    engine = partita.init_inference(fresh, checkpoint=root / "pipe2", dtype=torch.float32)
    x = prompt() % 11  # the pipeline model's vocabulary
    assert torch.equal(engine(x), want(x)) and not torch.equal(_reference_layers()(x), want(x))


def test_an_expert_parallel_checkpoint_loads_with_all_experts_on_one_rank(runs) -> None:
    from partita.checkpoint.consolidate import load_consolidated

    root, per_rank = runs
    model = build("gpt_moe", seed=7)
    model.load_state_dict(load_consolidated(root / "consolidated_experts2"), strict=True)
    want = greedy(_eval(model))
    assert want != greedy(_eval(build("gpt_moe", seed=7)))
    assert all(out[("experts2", 1)] == want for out in per_rank)


def test_a_truncated_checkpoint_file_is_named(runs, tmp_path) -> None:
    import shutil

    import partita
    from partita.checkpoint.errors import CheckpointCorruptError

    root, _ = runs
    tag = (root / "zero3" / "latest").read_text().strip()
    copy = shutil.copytree(root / "zero3" / tag, tmp_path / tag)
    with open(copy / "rank00001.safetensors", "r+b") as handle:
        handle.truncate(100)
    with pytest.raises(CheckpointCorruptError, match=r"^checkpoint .* is damaged: .*rank00001\.safetensors"):
        partita.init_inference(build("llama"), checkpoint=copy, dtype=torch.float32)


def _checkpoint_reference(root, name: str) -> list:
    from partita.checkpoint.consolidate import load_consolidated

    model = build("llama", seed=7)
    model.load_state_dict(load_consolidated(root / f"consolidated_{name}"), strict=True)
    return greedy(_eval(model))


@pytest.mark.parametrize("name", ["zero3", "tensor2"])
def test_a_training_checkpoint_loads_at_tp_1_2_and_4_and_generates_its_tokens(runs, name) -> None:
    root, per_rank = runs
    want = _checkpoint_reference(root, name)
    assert want != greedy(_eval(build("llama", seed=7))), "the checkpoint's weights must differ from a fresh model's"
    for rank, out in enumerate(per_rank):
        for tp in (1, 2, 4):
            assert out[(name, tp)] == want, (name, tp, rank)


@pytest.mark.parametrize("name", ["consolidated_zero3", "export16"])
def test_safetensors_weights_load_at_tp2(runs, name) -> None:
    root, per_rank = runs
    want = _checkpoint_reference(root, "zero3")
    assert all(out[(name, 2)] == want for out in per_rank)


def test_tp_sizes_that_do_not_fit_are_config_errors_naming_the_fix(runs) -> None:
    _, per_rank = runs
    errors = per_rank[0]["errors"]
    assert errors["kv_heads"] == (
        "tensor_parallel.tp_size = 4 does not divide num_key_value_heads = 2 of LlamaForCausalLM (each rank holds "
        "whole heads); valid tp_size values for this model: [1, 2]")
    assert errors["world"] == (
        "tensor_parallel.tp_size = 3 does not divide the 4 launched process(es); launch a multiple of 3 processes "
        "(partita run --nproc 3 / torchrun --nproc-per-node 3) or set tp_size to a divisor of 4")
    assert errors["moe"] == (
        "tensor_parallel.tp_size = 2: tensor parallelism of the reference GPT with MoE blocks (GPTConfig.moe_every) is "
        "not implemented: spread the experts with moe_ep_size instead, or set tensor_parallel.tp_size to 1")
