"""TRL with PEFT policies through partita (partita.integrations.hf.with_partita), on 2 gloo ranks.

The assets (tiny Llama, WordLevel tokenizer, datasets) are tests/test_trl_trainers.py's.

GRPO with a LoRA policy has no second reference model: TRL computes the reference log-probs from the
policy itself, with the adapters disabled (``peft_config=``: a new adapter) or with a frozen copy of
the adapter under the name ``"ref"`` (a ``PeftModel`` passed in with ``beta > 0``). At ZeRO-3 both
run on the sharded policy, so both must leave the sharded base and the frozen copy as they were. For
each, ``with_partita(GRPOTrainer)`` trains 2 steps at ZeRO-3 (no hang, finite losses, rollouts from the
sharded policy in a gathered-once session) and:

- the KL to the reference is exactly 0 at step 1 (the policy starts equal to its reference: LoRA's B
  starts at zero, or the "ref" copy equals the adapter) and positive after the update;
- after training, the adapter-disabled forward of the sharded policy equals the original whole
  model's logits, and the "ref" adapter's forward equals the PeftModel's before training: the
  reference is still the initial model.

``with_partita(SFTTrainer)`` on a ``PeftModel`` (built by the user, not by ``peft_config=``) at ZeRO 1,
2 and 3: ``save_model`` writes adapters that ``PeftModel.from_pretrained`` loads, equal to plain
TRL's (one process, the same global batch) within 1e-5 relative.
"""

from __future__ import annotations

import copy
import math
import os

import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")
pytest.importorskip("datasets")
os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402

from tests.harness import run_distributed  # noqa: E402
from tests.test_trl_trainers import _build_assets, _common, _datasets, _length_reward, _losses, _wrap  # noqa: E402

IDS = torch.randint(4, 62, (2, 10), generator=torch.Generator().manual_seed(7))


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])


def _peft_model(paths: dict):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(paths["lm"])
    torch.manual_seed(2)  # the adapters' A (B: _nonzero)
    return _nonzero(get_peft_model(base, _lora()))


def _nonzero(model):
    """LoRA's B starts at zero (the adapter then changes nothing): give it seeded values, so a forward
    with the adapter differs from the base's."""
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=generator))
    return model


def _grpo(paths: dict, out: str, model, peft_config=None):
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    cls, extra = _wrap(GRPOTrainer, 3)
    if peft_config is not None:
        extra["peft_config"] = peft_config
    args = GRPOConfig(**_common(out, 2), max_steps=2, num_generations=2, max_completion_length=4, beta=0.1)
    trainer = cls(model=model, reward_funcs=[_length_reward], args=args, train_dataset=_datasets()["grpo"],
                  processing_class=AutoTokenizer.from_pretrained(paths["tok"]), **extra)
    trainer.train()
    return trainer


def _summary(trainer) -> dict:
    from partita.zero.freed import is_freed

    base = [p for n, p in trainer.model.named_parameters() if "lora_" not in n]
    return {"losses": _losses(trainer), "steps": trainer.state.global_step, "ref_model": trainer.ref_model is None,
            "kl": [entry["kl"] for entry in trainer.state.log_history if "kl" in entry],
            "mode": trainer.engine.generation_mode, "base_sharded": all(is_freed(p) for p in base),
            "adapters": sorted(trainer.model.peft_config)}


@torch.no_grad()
def _logits(model, adapter: str | None) -> torch.Tensor:
    """The sharded policy's logits on IDS with the adapters disabled (None) or ``adapter`` active
    (TRL's own switch, trl.trainer.utils.use_adapter); every rank runs it (ZeRO-3 gathers)."""
    from trl.trainer.utils import use_adapter

    with use_adapter(model, adapter_name=adapter):
        return model(input_ids=IDS).logits.float()


def _grpo_on_ranks(paths: dict, out: str) -> dict:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from partita.integrations.hf import enable_zero3
    from tests.test_trl_trainers import _partita_config

    got: dict = {}
    whole = AutoModelForCausalLM.from_pretrained(paths["lm"]).eval()
    torch.manual_seed(0)
    start = _nonzero(get_peft_model(copy.deepcopy(whole), _lora())).eval()  # what the second run starts from
    with torch.no_grad():
        base_logits, start_logits = whole(input_ids=IDS).logits, start(input_ids=IDS).logits
    # Both bases load straight into ZeRO-3 shards (one zero.Init context for the process): the frozen base
    # stays sharded, and the reference passes run on it.
    with enable_zero3(_partita_config(3)):
        bases = [AutoModelForCausalLM.from_pretrained(paths["lm"]) for _ in range(2)]
    # peft_config=: TRL wraps the policy, the reference is the policy with its adapters disabled.
    trainer = _grpo(paths, os.path.join(out, "new_adapter"), bases[0], peft_config=_lora())
    got["new"] = _summary(trainer)
    got["new"]["disabled_equal"] = torch.equal(_logits(trainer.model, None), base_logits)
    got["new"]["trained"] = bool((_logits(trainer.model, "default") - base_logits).abs().max() > 0)
    # A PeftModel with beta > 0: TRL copies its adapter into a frozen "ref" adapter.
    torch.manual_seed(0)  # A: the same draws as for `start` (B: _nonzero's own generator)
    trainer = _grpo(paths, os.path.join(out, "peft_model"), _nonzero(get_peft_model(bases[1], _lora())))
    got["ref"] = _summary(trainer)
    got["ref"]["start_differs"] = not torch.equal(start_logits, base_logits)  # so ref_equal tells them apart
    got["ref"]["ref_equal"] = torch.equal(_logits(trainer.model, "ref"), start_logits)
    got["ref"]["disabled_equal"] = torch.equal(_logits(trainer.model, None), base_logits)
    got["ref"]["trained"] = bool((_logits(trainer.model, "default") - start_logits).abs().max() > 0)
    return got


def _sft(paths: dict, out: str, batch: int, stage: int | None):
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    cls, extra = _wrap(SFTTrainer, stage)
    args = SFTConfig(**_common(out, batch), num_train_epochs=2, max_length=32, packing=False)
    trainer = cls(model=_peft_model(paths), args=args, train_dataset=_datasets()["sft"],
                  processing_class=AutoTokenizer.from_pretrained(paths["tok"]), **extra)
    trainer.train()
    trainer.save_model(os.path.join(out, "adapters"))
    return trainer


def _on_ranks(paths: dict, out: str) -> dict:
    got = _grpo_on_ranks(paths, out)
    for stage in (1, 2, 3):
        got[f"sft{stage}"] = _losses(_sft(paths, os.path.join(out, f"sft{stage}"), 2, stage))
    return got


def _loaded_adapters(paths: dict, folder: str) -> dict:
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(paths["lm"]), folder)
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def test_trl_with_peft_policies_through_partita(tmp_path) -> None:
    paths = _build_assets(str(tmp_path))
    r0, r1 = run_distributed(_on_ranks, 2, paths, str(tmp_path / "partita"), timeout=400)
    assert r0 == r1
    for key, adapters in (("new", ["default"]), ("ref", ["default", "ref"])):
        got = r0[key]
        assert got["steps"] == 2 and len(got["losses"]) == 2 and all(math.isfinite(x) for x in got["losses"]), got
        assert got["ref_model"] and got["adapters"] == adapters and got["mode"] == "gather_once", got
        assert got["base_sharded"], key  # the frozen base stayed sharded through rollouts and reference passes
        assert got["kl"][0] == 0.0 and math.isfinite(got["kl"][1]) and got["kl"][1] > 0, got["kl"]
        assert got["disabled_equal"] and got["trained"], got
    assert r0["ref"]["start_differs"] and r0["ref"]["ref_equal"]  # the frozen "ref" copy: the adapter before training

    plain = _sft(paths, str(tmp_path / "plain_sft"), 4, None)
    want = _loaded_adapters(paths, str(tmp_path / "plain_sft" / "adapters"))
    assert len(want) == 8 and all(t.abs().sum() > 0 for t in want.values())
    for stage in (1, 2, 3):
        losses = r0[f"sft{stage}"]
        assert len(losses) == len(_losses(plain)) == 2
        for ours, theirs in zip(losses, _losses(plain)):
            assert abs(ours - theirs) <= 1e-5 * abs(theirs) + 1e-6, (stage, losses, _losses(plain))
        ours = _loaded_adapters(paths, str(tmp_path / "partita" / f"sft{stage}" / "adapters"))
        assert sorted(ours) == sorted(want), (stage, sorted(ours))
        for name, tensor in want.items():
            assert ours[name].shape == tensor.shape, (stage, name)
            assert float((ours[name] - tensor).norm()) <= 1e-5 * float(tensor.norm()), (stage, name)
