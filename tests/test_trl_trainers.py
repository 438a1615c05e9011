"""TRL's trainers through partita (partita.integrations.hf.with_partita).

A tiny Llama (hidden 32, 2 layers, vocab 64) and a WordLevel tokenizer built offline, saved once
and loaded by every process. On 2 gloo ranks with a per-device batch of 2, against TRL's own
trainer in this process with a batch of 4 (the same global batch: the dataset is one global
batch, so every step sees all of it whatever the sampler's order):

- ``with_partita(SFTTrainer)`` and ``with_partita(DPOTrainer)`` log the plain trainer's losses
  at ZeRO-2 and ZeRO-3 (2 steps: the second checks the update);
- ``with_partita(RewardTrainer)`` at ZeRO-3: its loss equals the plain trainer's;
- ``with_partita(SFTTrainer)`` with a LoRA ``peft_config`` at ZeRO-3: the losses, and the adapters
  ``save_model`` writes (PEFT's files, whole), equal the plain trainer's;
- DPO's reference model at ZeRO-3 is an inference-only engine (no optimizer, sharded, frozen);
  under a bf16 config it is cast to bf16 before sharding and its logits equal the whole bf16 model's;
- ``with_partita(GRPOTrainer)`` trains 2 steps at ZeRO-3 with rollouts generated from the
  sharded policy in one gathered-once session per call, a reference engine (beta > 0), a reward
  function and a sharded reward model, no hang, finite losses.

Every sample has the same token count, so each rank's per-micro-batch token mean equals the
global one (partita does not weight micro-batches by num_items_in_batch; see partita/integrations/hf.py).
"""

from __future__ import annotations

import math
import os

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")
os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402

from tests.harness import run_distributed  # noqa: E402

WORDS = [f"w{i}" for i in range(58)]
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
LR, EPS = 5e-3, 1e-6


def _build_assets(root: str) -> dict:
    """The tokenizer, a causal LM and a reward model (score head), saved under ``root``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (AutoModelForSequenceClassification, LlamaConfig, LlamaForCausalLM,
                              PreTrainedTokenizerFast)

    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                  unk_token="<unk>")
    paths = {name: os.path.join(root, name) for name in ("tok", "lm", "rm")}
    tok.save_pretrained(paths["tok"])
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(paths["lm"])
    torch.manual_seed(1)
    config.num_labels = 1
    AutoModelForSequenceClassification.from_config(config).save_pretrained(paths["rm"])
    return paths


def _words(seed: int, n: int) -> str:
    gen = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=gen).tolist())


def _datasets() -> dict:
    from datasets import Dataset

    return {
        "sft": Dataset.from_list([{"text": _words(i, 10)} for i in range(4)]),
        # TRL joins prompt and completion as strings: the completions start with the separator.
        "dpo": Dataset.from_list([{"prompt": _words(10 + i, 4), "chosen": " " + _words(20 + i, 5),
                                   "rejected": " " + _words(30 + i, 5)} for i in range(4)]),
        "rm": Dataset.from_list([{"chosen": _words(40 + i, 8), "rejected": _words(50 + i, 8)} for i in range(4)]),
        "grpo": Dataset.from_list([{"prompt": _words(60 + i, 4)} for i in range(4)]),
    }


def _common(out: str, batch: int) -> dict:
    return dict(output_dir=out, per_device_train_batch_size=batch, learning_rate=LR, adam_epsilon=EPS,
                max_grad_norm=1.0, logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True,
                disable_tqdm=True, bf16=False)


def _partita_config(stage: int) -> dict:
    return {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, "steps_per_print": 1000}


def _losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _wrap(cls, stage):
    from partita.integrations.hf import with_partita

    return (cls, {}) if stage is None else (with_partita(cls), {"partita_config": _partita_config(stage)})


def _sft(paths: dict, out: str, batch: int, stage: int | None, *, lora: bool = False):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    cls, extra = _wrap(SFTTrainer, stage)
    if lora:
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                          init_lora_weights="gaussian")
        torch.manual_seed(2)  # the adapters' initial weights
    args = SFTConfig(**_common(out, batch), num_train_epochs=2, max_length=32, packing=False)
    trainer = cls(model=AutoModelForCausalLM.from_pretrained(paths["lm"]), args=args,
                  train_dataset=_datasets()["sft"], processing_class=AutoTokenizer.from_pretrained(paths["tok"]),
                  **extra)
    trainer.train()
    if lora:
        trainer.save_model(os.path.join(out, "adapters"))
    return trainer


def _dpo(paths: dict, out: str, batch: int, stage: int | None):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    cls, extra = _wrap(DPOTrainer, stage)
    args = DPOConfig(**_common(out, batch), num_train_epochs=2, max_length=32, beta=0.1)
    trainer = cls(model=AutoModelForCausalLM.from_pretrained(paths["lm"]),
                  ref_model=AutoModelForCausalLM.from_pretrained(paths["lm"]), args=args,
                  train_dataset=_datasets()["dpo"], processing_class=AutoTokenizer.from_pretrained(paths["tok"]),
                  **extra)
    trainer.train()
    return trainer


def _reward(paths: dict, out: str, batch: int, stage: int | None):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    cls, extra = _wrap(RewardTrainer, stage)
    args = RewardConfig(**_common(out, batch), max_steps=1, max_length=32)
    trainer = cls(model=AutoModelForSequenceClassification.from_pretrained(paths["rm"], num_labels=1), args=args,
                  train_dataset=_datasets()["rm"], processing_class=AutoTokenizer.from_pretrained(paths["tok"]),
                  **extra)
    trainer.train()
    return trainer


def _length_reward(completions, **kwargs) -> list[float]:
    return [float(len(c.split())) for c in completions]


def _grpo(paths: dict, out: str, stage: int | None):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    cls, extra = _wrap(GRPOTrainer, stage)
    args = GRPOConfig(**_common(out, 2), max_steps=2, num_generations=2, max_completion_length=4, beta=0.1)
    # A reward function and a reward model (prepared like the reference: an inference-only engine at ZeRO-3).
    rewards = [_length_reward, AutoModelForSequenceClassification.from_pretrained(paths["rm"], num_labels=1)]
    tok = AutoTokenizer.from_pretrained(paths["tok"])
    trainer = cls(model=paths["lm"], reward_funcs=rewards, reward_processing_classes=[None, tok], args=args,
                  train_dataset=_datasets()["grpo"], processing_class=tok, **extra)
    trainer.train()
    return trainer


def _bf16_reference(paths: dict) -> dict:
    """A reference engine under a bf16 config: cast to bf16 before sharding, logits of the whole bf16 model."""
    import copy

    from transformers import AutoModelForCausalLM

    from partita.integrations.trl_support import prepare_frozen_model

    model = AutoModelForCausalLM.from_pretrained(paths["lm"])
    whole = copy.deepcopy(model).to(torch.bfloat16).eval()
    ids = torch.randint(4, 62, (2, 12), generator=torch.Generator().manual_seed(5))
    engine = prepare_frozen_model(model, {**_partita_config(3), "bf16": {"enabled": True}}, device=torch.device("cpu"))
    with torch.no_grad():
        got, want = engine(input_ids=ids).logits, whole(input_ids=ids).logits
    return {"dtypes": sorted({str(p.dtype) for p in engine.parameters()}), "equal": torch.equal(got, want),
            "type": type(engine).__name__}


def _on_ranks(paths: dict, out: str) -> dict:
    from partita.zero.freed import is_freed
    from partita.zero.inference_engine import ZeroInferenceEngine

    got: dict = {}
    for stage in (2, 3):
        got[f"sft{stage}"] = _losses(_sft(paths, os.path.join(out, f"sft{stage}"), 2, stage))
        dpo = _dpo(paths, os.path.join(out, f"dpo{stage}"), 2, stage)
        got[f"dpo{stage}"] = _losses(dpo)
        ref = dpo.ref_model
        got[f"dpo{stage}_ref"] = {
            "type": type(ref).__name__, "inference": isinstance(ref, ZeroInferenceEngine),
            "no_optimizer": getattr(ref, "optimizer", None) is None,
            "frozen": not any(p.requires_grad for p in ref.parameters()),
            "sharded": all(is_freed(p) for p in ref.parameters()),
            "training": ref.training if isinstance(ref, torch.nn.Module) else ref.module.training,
        }
    got["bf16_ref"] = _bf16_reference(paths)
    got["lora3"] = _losses(_sft(paths, os.path.join(out, "lora3"), 2, 3, lora=True))
    got["rm3"] = _losses(_reward(paths, os.path.join(out, "rm3"), 2, 3))
    grpo = _grpo(paths, os.path.join(out, "grpo3"), 3)
    got["grpo3"] = _losses(grpo)
    got["grpo3_steps"] = grpo.state.global_step
    got["grpo3_mode"] = grpo.engine.generation_mode
    got["grpo3_ref"] = type(grpo.ref_model).__name__
    rm = grpo.reward_funcs[1]
    got["grpo3_rm"] = {"type": type(rm).__name__, "sharded": all(is_freed(p) for p in rm.parameters()),
                       "engines": [type(e).__name__ for e in grpo._partita_frozen_engines],
                       "logged": [e["rewards/rm/mean"] for e in grpo.state.log_history
                                  if "rewards/rm/mean" in e]}
    return got


def test_trl_trainers_through_partita_match_plain_trl(tmp_path) -> None:
    paths = _build_assets(str(tmp_path))
    r0, r1 = run_distributed(_on_ranks, 2, paths, str(tmp_path / "partita"), timeout=400)
    plain = {
        "sft": _losses(_sft(paths, str(tmp_path / "plain_sft"), 4, None)),
        "dpo": _losses(_dpo(paths, str(tmp_path / "plain_dpo"), 4, None)),
        "rm": _losses(_reward(paths, str(tmp_path / "plain_rm"), 4, None)),
        "lora": _losses(_sft(paths, str(tmp_path / "plain_lora"), 4, None, lora=True)),
    }
    assert len(plain["sft"]) == len(plain["dpo"]) == 2 and len(plain["rm"]) == 1, plain
    for key, want in (("sft2", "sft"), ("sft3", "sft"), ("dpo2", "dpo"), ("dpo3", "dpo"), ("rm3", "rm"),
                      ("lora3", "lora")):
        assert r0[key] == r1[key], key  # the Trainer logs the mean over ranks
        assert len(r0[key]) == len(plain[want]), (key, r0[key], plain[want])
        for got, ref in zip(r0[key], plain[want]):
            assert abs(got - ref) <= 1e-5 * abs(ref) + 1e-6, (key, r0[key], plain[want])
    assert plain["dpo"][0] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference at step 1
    assert r0["dpo3_ref"] == {"type": "ZeroInferenceEngine", "inference": True, "no_optimizer": True, "frozen": True,
                              "sharded": True, "training": False}
    assert r0["dpo2_ref"] == {"type": "LlamaForCausalLM", "inference": False, "no_optimizer": True, "frozen": True,
                              "sharded": False, "training": False}
    assert r0["bf16_ref"] == {"dtypes": ["torch.bfloat16"], "equal": True, "type": "ZeroInferenceEngine"}, r0["bf16_ref"]
    assert r0["grpo3_steps"] == 2 and len(r0["grpo3"]) == 2 and all(math.isfinite(x) for x in r0["grpo3"]), r0
    assert r0["grpo3_mode"] == "gather_once" and r0["grpo3_ref"] == "ZeroInferenceEngine"
    rm = r0["grpo3_rm"]  # the reward model ran sharded (its module, the engine kept), every step
    assert rm["type"] == "LlamaForSequenceClassification" and rm["sharded"] and rm["engines"] == ["ZeroInferenceEngine"]
    assert len(rm["logged"]) == 2 and all(math.isfinite(x) for x in rm["logged"]), rm
    # save_model of a LoRA model at ZeRO-3 writes PEFT's adapter files, whole: the plain trainer's adapters.
    from safetensors.torch import load_file

    ours = load_file(str(tmp_path / "partita" / "lora3" / "adapters" / "adapter_model.safetensors"))
    theirs = load_file(str(tmp_path / "plain_lora" / "adapters" / "adapter_model.safetensors"))
    assert sorted(ours) == sorted(theirs) and len(ours) == 8, sorted(ours)
    for name, want in theirs.items():
        assert ours[name].shape == want.shape and want.abs().sum() > 0, name
        assert float((ours[name] - want).norm()) <= 1e-5 * float(want.norm()), name


def test_with_partita_builds_one_named_subclass_per_trainer(tmp_path) -> None:
    from transformers import Trainer
    from trl import DPOTrainer, SFTTrainer

    from partita.integrations.hf import PartitaTrainer, with_partita

    sft = with_partita(SFTTrainer)
    assert sft is with_partita(SFTTrainer) and sft.__name__ == "PartitaSFTTrainer"
    assert issubclass(sft, SFTTrainer) and issubclass(sft, PartitaTrainer)
    # TRL's own overrides run first, partita's replace the Trainer's underneath them.
    mro = sft.__mro__
    assert mro.index(SFTTrainer) < mro.index(PartitaTrainer) < mro.index(Trainer)
    assert with_partita(Trainer) is PartitaTrainer and with_partita(sft) is sft
    assert with_partita(DPOTrainer) is not sft
    with pytest.raises(TypeError, match=r"with_partita expects a transformers.Trainer subclass"):
        with_partita(dict)
    with pytest.raises(TypeError, match=r"PartitaTrainer\(\) needs partita_config="):
        PartitaTrainer(args=None)

    class Mine(Trainer):
        def create_optimizer(self, model=None):
            return None

    with pytest.raises(TypeError, match=r"with_partita\(Mine\): Mine overrides create_optimizer"):
        with_partita(Mine)


def test_frozen_models_refuse_sync_ref_model_at_zero3_and_stay_whole_below() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from partita.config import ConfigError
    from partita.integrations.trl_support import frozen_model_config, prepare_frozen_model

    config = {**_partita_config(3), "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}, "bf16": {"enabled": True},
              "scheduler": {"type": "WarmupLR"}, "checkpoint": {"save_on_signal": True}}
    config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    assert frozen_model_config(config) == {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                                           "bf16": {"enabled": True}}
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ConfigError, match=r"sync_ref_model=True is not supported with a partita ZeRO-3 config"):
        prepare_frozen_model(model, config, device=torch.device("cpu"), sync_ref_model=True)
    frozen = prepare_frozen_model(model, {**config, "zero_optimization": {"stage": 2}}, device=torch.device("cpu"),
                                  sync_ref_model=True)
    assert frozen is model and not frozen.training and {p.dtype for p in frozen.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in frozen.parameters())
