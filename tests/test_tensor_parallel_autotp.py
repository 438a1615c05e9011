"""AutoTP (``tensor_parallel.autotp_size``) on Hugging Face models built from small configs, and
the errors of every bad tensor-parallel input.

Oracle: the same model (same seed) trained unsharded by plain torch SGD on the same batches;
the losses of 5 steps must agree (fp32, 1e-5 relative), and the split layers hold 1/tensor of
their parameters on each rank.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.harness import run_distributed

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

STEPS = 5
LR = 0.2
BATCH, SEQ, VOCAB = 2, 8, 96


def _hf_model(kind: str):
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg)
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
        return transformers.LlamaForCausalLM(cfg)
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0)
    return transformers.BertForMaskedLM(cfg)


def _batches():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (STEPS, BATCH, SEQ), generator=g)


def _config(tensor: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "gradient_clipping": 0.0,
        "tensor_parallel": {"autotp_size": tensor},
        "steps_per_print": 1000,
    }


def train_autotp(kinds: list[str]) -> dict:
    import partita

    out = {}
    for kind in kinds:
        model = _hf_model(kind)
        engine, *_ = partita.initialize(model=model, config=_config(2))
        losses = []
        for x in _batches():
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[kind] = {"losses": losses, "numel": {n: p.numel() for n, p in model.named_parameters()}}
    return out


def _reference(kind: str) -> list[float]:
    model = _hf_model(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for x in _batches():
        opt.zero_grad()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


SPLIT = {
    "gpt2": ["transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_proj.weight", "transformer.h.1.mlp.c_fc.weight"],
    "llama": ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
              "model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.gate_proj.weight"],
    "bert": ["bert.encoder.layer.0.attention.self.query.weight", "bert.encoder.layer.0.attention.output.dense.weight",
             "bert.encoder.layer.1.intermediate.dense.weight", "bert.encoder.layer.1.output.dense.weight"],
}


def test_hf_models_train_like_unsharded_under_autotp() -> None:
    kinds = ["gpt2", "llama", "bert"]
    per_rank = run_distributed(train_autotp, 2, kinds, timeout=300)
    for kind in kinds:
        ref = _reference(kind)
        full = {n: p.numel() for n, p in _hf_model(kind).named_parameters()}
        for rank_out in per_rank:
            got = rank_out[kind]["losses"]
            for a, b in zip(got, ref):
                assert abs(a - b) / abs(b) < 1e-5, (kind, got, ref)
            numel = rank_out[kind]["numel"]
            for name in SPLIT[kind]:
                assert numel[name] * 2 == full[name], (kind, name)
        assert ref[-1] < ref[0], kind  # the comparison is over real training


# ----------------------------------------------------------------------------- bad inputs


def _initialize_errors(cases: list[str]) -> dict[str, str]:
    return {case: _initialize_error(case) for case in cases}


def _initialize_error(case: str) -> str:
    import partita
    from partita.models.gpt import GPT, GPTConfig
    from partita.tensor_parallel import apply_tensor_parallel

    cfg = _config(2)
    try:
        if case == "heads":
            partita.initialize(model=GPT(GPTConfig(vocab_size=64, n_head=3, n_embd=24, n_layer=1)), config=cfg)
        elif case == "vocab":
            partita.initialize(model=GPT(GPTConfig(vocab_size=63, n_head=2, n_embd=16, n_layer=1)), config=cfg)
        elif case == "kv_heads":
            torch.manual_seed(0)
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
                vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=1))
            partita.initialize(model=model, config=cfg)
        elif case == "unknown_model":
            partita.initialize(model=torch.nn.Sequential(torch.nn.Linear(4, 4)), config=cfg)
        elif case == "bad_spec":
            partita.initialize(model=torch.nn.Sequential(torch.nn.Linear(4, 4)), config={
                **cfg, "tensor_parallel": {"autotp_size": 2, "partition_config": {
                    "layer_specs": [{"patterns": ["nothing_like_this"], "partition_type": "row"}]}}})
        elif case == "bad_plan":
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("gloo")
            apply_tensor_parallel(GPT(GPTConfig()), group=dist.group.WORLD, plan={"blocks.*.attn.qkvx": "column"})
        elif case == "wrong_type":
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("gloo")
            apply_tensor_parallel(GPT(GPTConfig()), group=dist.group.WORLD, plan={"blocks.0.ln_1": "column"})
    except (ValueError, NotImplementedError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


ERRORS = {
    "heads": "n_head = 3 does not divide by the tensor size 2 (each rank holds whole heads); set "
             "tensor_parallel.autotp_size to a divisor of 3",
    "vocab": "the vocabulary (63) does not divide by the tensor size 2; pad vocab_size to a multiple of 2 (e.g. 64)",
    "kv_heads": "num_key_value_heads = 1 does not divide by the tensor size 2",
    "unknown_model": "partita has no built-in plan for Sequential; give tensor_parallel.partition_config.layer_specs",
    "bad_spec": "layer_specs pattern 'nothing_like_this' matches no nn.Linear of Sequential",
    "bad_plan": "plan entry 'blocks.*.attn.qkvx' matches no module of GPT",
    "wrong_type": "style 'column' needs an torch.nn.modules.linear.Linear but blocks.0.ln_1 is a LayerNorm",
}


def test_every_bad_tensor_parallel_input_names_the_fix() -> None:
    per_rank = run_distributed(_initialize_errors, 2, list(ERRORS), timeout=180)
    for messages in per_rank:
        for case, expected in ERRORS.items():
            assert expected in messages[case], (case, messages[case])
