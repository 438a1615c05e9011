"""The reference GPT (partita.models.gpt) and the training example's loop (examples/train_gpt.py)."""

from __future__ import annotations

import importlib.util
import math
import pathlib
import types

import pytest
import torch
import torch.nn.functional as F

from partita.models.gpt import GPT, GPTConfig

REPO = pathlib.Path(__file__).resolve().parents[1]


def small_config(**overrides) -> GPTConfig:
    fields = dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)
    fields.update(overrides)
    return GPTConfig(**fields)


def test_forward_shapes_and_loss_without_targets():
    torch.manual_seed(0)
    model = GPT(small_config())
    idx = torch.randint(0, 256, (3, 17))
    logits, loss = model(idx)
    assert logits.shape == (3, 17, 256)
    assert loss is None
    _, loss = model(idx, idx)
    assert loss.shape == () and loss.dtype == torch.float32


def test_loss_at_init_is_close_to_uniform():
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    idx = torch.randint(0, 256, (4, 128))
    _, loss = model(idx, torch.randint(0, 256, (4, 128)))
    assert abs(loss.item() - math.log(256)) < 0.05


def test_loss_is_fp32_cross_entropy_of_logits_in_bf16():
    torch.manual_seed(0)
    model = GPT(small_config()).to(torch.bfloat16)
    idx = torch.randint(0, 256, (2, 8))
    logits, loss = model(idx, idx)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    expected = F.cross_entropy(logits.float().view(-1, 256), idx.view(-1))
    assert loss.item() == expected.item()


def test_attention_is_causal():
    torch.manual_seed(0)
    model = GPT(small_config()).eval()
    idx = torch.randint(0, 256, (1, 10))
    changed = idx.clone()
    changed[0, 6:] = (changed[0, 6:] + 1) % 256
    a, _ = model(idx)
    b, _ = model(changed)
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=0)
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_sequence_longer_than_block_size_is_refused():
    model = GPT(small_config(block_size=8))
    with pytest.raises(ValueError, match="block_size is 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_tied_embedding_and_head_share_one_parameter():
    model = GPT(small_config())
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.lm_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    names = [name for name, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "lm_head.weight" not in names  # yielded once
    keys = model.state_dict().keys()
    assert "tok_emb.weight" in keys and "lm_head.weight" in keys  # plain keys, both aliases


def test_state_dict_keys_are_plain_and_params_carry_no_extra_attributes():
    model = GPT(small_config(n_layer=1))
    assert list(model.state_dict()) == [
        "tok_emb.weight", "pos_emb.weight",
        "blocks.0.ln_1.weight", "blocks.0.ln_1.bias",
        "blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias",
        "blocks.0.attn.proj.weight", "blocks.0.attn.proj.bias",
        "blocks.0.ln_2.weight", "blocks.0.ln_2.bias",
        "blocks.0.mlp.fc.weight", "blocks.0.mlp.fc.bias",
        "blocks.0.mlp.proj.weight", "blocks.0.mlp.proj.bias",
        "ln_f.weight", "ln_f.bias", "lm_head.weight",
    ]  # fmt: skip
    plain = set(vars(torch.nn.Parameter(torch.zeros(1))))
    for param in model.parameters():
        assert set(vars(param)) == plain


def test_init_follows_gpt2():
    torch.manual_seed(0)
    config = GPTConfig(n_layer=8, n_embd=256, n_head=4)
    model = GPT(config)
    residual_std = 0.02 / math.sqrt(2 * 8)
    assert model.blocks[0].attn.proj.weight.std().item() == pytest.approx(residual_std, rel=0.02)
    assert model.blocks[7].mlp.proj.weight.std().item() == pytest.approx(residual_std, rel=0.02)
    assert model.blocks[0].mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert model.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert model.blocks[3].attn.qkv.bias.abs().max().item() == 0.0
    assert model.ln_f.weight.min().item() == 1.0


@pytest.mark.parametrize("bias", [True, False])
def test_parameter_count_and_flops_formula(bias):
    config = small_config(bias=bias, n_layer=3, n_embd=48, block_size=40)
    model = GPT(config)
    d, L, V, T = 48, 3, 256, 40
    b = 1 if bias else 0
    # ln_1, qkv, attn proj, ln_2, fc, mlp proj
    per_block = (d + b * d) + (3 * d * d + b * 3 * d) + (d * d + b * d) + (d + b * d) + (4 * d * d + b * 4 * d) + (4 * d * d + b * d)
    total = V * d + T * d + L * per_block + (d + b * d)
    assert model.num_parameters() == total
    assert model.num_parameters(exclude_position_embedding=True) == total - T * d
    assert model.flops_per_token() == 6 * (total - T * d) + 12 * L * d * T
    assert model.flops_per_token(seq_len=10) == 6 * (total - T * d) + 12 * L * d * 10


def test_presets_match_their_published_shapes():
    assert (GPTConfig.gpt2_124m().n_embd, GPTConfig.gpt2_124m().n_layer, GPTConfig.gpt2_124m().vocab_size) == (768, 12, 50304)
    big = GPTConfig.gpt_1_3b()
    assert (big.n_embd, big.n_layer, big.n_head, big.vocab_size, big.block_size) == (2048, 24, 16, 50304, 2048)
    with torch.device("meta"):  # no memory: only shapes
        assert GPT(big).num_parameters() == 1_315_819_520  # "1.3 B"
        assert GPT(GPTConfig.gpt2_124m()).num_parameters() == 124_475_904  # "124 M"
        assert GPT(GPTConfig.gpt_125m()).num_parameters() == 125_262_336  # 124 M + 1024 more positions
        assert GPT(GPTConfig.gpt_7b()).num_parameters() == 6_658_596_864  # "~7 B" (tied embedding)
        scaled = GPTConfig.gpt_scaled(4, 512)
        assert (scaled.n_head, scaled.block_size, GPT(scaled).num_parameters()) == (4, 2048, 39_414_784)


def test_optimizer_param_groups_cover_each_trainable_parameter_once():
    model = GPT(small_config())
    model.pos_emb.weight.requires_grad_(False)
    decay, no_decay = model.optimizer_param_groups(0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    ids = [id(p) for p in decay["params"] + no_decay["params"]]
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert len(ids) == len(set(ids)) and set(ids) == trainable
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    # 2 layers: qkv, attn proj, fc, mlp proj each; plus the tied embedding.
    assert len(decay["params"]) == 2 * 4 + 1


def test_bad_config_is_refused_with_the_values():
    with pytest.raises(ValueError, match=r"n_embd \(30\) must be divisible by n_head \(4\)"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="n_layer must be a positive int, got 0"):
        GPTConfig(n_layer=0)


# ------------------------------------------------------------------ the example, on plain torch
#
# The example's loop is checked against a stand-in engine built from plain torch (AdamW, clipping,
# accumulation, LambdaLR), so a failure here points at the loop, not at partita's engine. The
# stand-in lives only in this test.


class _TorchEngine:
    """Single-process stand-in for partita's engine: the subset of its API the example uses."""

    def __init__(self, model, optimizer, scheduler, config: dict) -> None:
        self.module, self.optimizer, self.lr_scheduler = model, optimizer, scheduler
        self.device = torch.device("cpu")
        self.topology = types.SimpleNamespace(rank=0, data_rank=0, data_size=1, data_group=None)
        self._micro = config["train_micro_batch_size_per_gpu"]
        self._accum = config.get("gradient_accumulation_steps", 1)
        self._clip = config.get("gradient_clipping", 1.0)
        self.micro_steps = 0
        self.global_steps = 0

    def __call__(self, *args):
        return self.module(*args)

    def train_batch_size(self) -> int:
        return self._micro * self._accum

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._micro

    def gradient_accumulation_steps(self) -> int:
        return self._accum

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self._accum == 0

    def backward(self, loss):
        (loss / self._accum).backward()

    def step(self) -> None:
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if boundary:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self._clip)
            self.optimizer.step()
            self.lr_scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.global_steps += 1

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def eval(self):
        self.module.eval()

    def train(self):
        self.module.train()

    def destroy(self) -> None:
        self.destroyed = True


def _torch_initialize(*, model, model_parameters, training_data, config):
    from partita.data import ResumableDistributedSampler

    params = config["optimizer"]["params"]
    optimizer = torch.optim.AdamW(model_parameters, lr=params["lr"], betas=tuple(params["betas"]), eps=params["eps"])
    warmup = config["scheduler"]["params"]["warmup_num_steps"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    sampler = ResumableDistributedSampler(training_data, num_replicas=1, rank=0, seed=0)
    loader = torch.utils.data.DataLoader(
        training_data, batch_size=config["train_micro_batch_size_per_gpu"], sampler=sampler, drop_last=True
    )
    return _TorchEngine(model, optimizer, scheduler, config), optimizer, loader, scheduler


def _load_example():
    spec = importlib.util.spec_from_file_location("train_gpt_example", REPO / "examples" / "train_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_config_fits_schedule_to_steps():
    example = _load_example()
    config = example.load_json_config(str(REPO / "examples" / "configs" / "zero2.json"), steps=50)
    assert config["scheduler"]["params"]["total_num_steps"] == 50
    assert config["scheduler"]["params"]["warmup_num_steps"] == 30
    config = example.load_json_config(str(REPO / "examples" / "configs" / "zero2.json"), steps=20)
    assert config["scheduler"]["params"]["warmup_num_steps"] == 2


def test_example_trains_with_a_plain_torch_engine(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("PARTITA_CACHE", str(tmp_path))
    example = _load_example()
    monkeypatch.setattr(example.partita, "initialize", _torch_initialize)
    torch.manual_seed(0)
    config = str(REPO / "examples" / "configs" / "zero1.json")  # accumulation 2: exercises the boundary
    summary = example.main(["--steps", "10", "--config", config, "--eval-batches", "2"])
    out = capsys.readouterr().out
    assert summary["steps"] == 10
    # Below ln(256) already at init: the tied embedding favours repeating the current byte,
    # and source code repeats bytes (indentation) a lot.
    assert 4.8 < summary["first_loss"] < math.log(256) + 0.05
    assert summary["last_loss"] < summary["first_loss"] - 0.5
    assert summary["val_loss_after"] < summary["val_loss_before"] - 0.5
    assert summary["tokens_per_s"] > 0 and summary["peak_memory_mib"] > 0
    assert "done: 10 steps" in out and "val loss" in out


def _run_example_on_this_rank(cache: str, config: str) -> dict:
    import os

    os.environ["PARTITA_CACHE"] = cache
    return _load_example().main(["--steps", "12", "--config", config, "--eval-batches", "1"])


def test_example_trains_on_two_ranks_with_partita(tmp_path):
    from tests.harness import run_distributed

    config = str(REPO / "examples" / "configs" / "zero2.json")
    summaries = run_distributed(_run_example_on_this_rank, 2, str(tmp_path), config, timeout=240)
    # Validation losses are all-reduced, so both ranks report the same numbers.
    assert summaries[0]["val_loss_before"] == summaries[1]["val_loss_before"]
    assert summaries[0]["val_loss_after"] == summaries[1]["val_loss_after"]
    assert summaries[0]["steps"] == summaries[1]["steps"] == 12
    assert summaries[0]["val_loss_after"] < summaries[0]["val_loss_before"] - 0.8
