"""GRPO with ``use_vllm=True`` (colocated) through partita: TRL's own weight sync, fed by partita.

vLLM is not installed here, so each rank's ``vllm.LLM`` is :class:`_FakeLLM`: it loads a whole copy of
the model from the path TRL gives it, ``load_weights`` copies what it receives into that copy (an unknown
name, a wrong shape or dtype fails, as in vLLM) and records it, and ``generate`` samples from the copy and
returns its per-token log-probs, as vLLM's ``processed_logprobs`` do. Everything else is TRL's
(``VLLMGeneration.sync_weights`` / ``generate``, the trainer's loop); partita replaces only the weight
read (partita/integrations/trl_weight_sync.py).

On 2 gloo ranks at ZeRO-3, 2 GRPO steps (no hang, finite losses), for a plain policy and for a LoRA
policy on a base loaded straight into ZeRO-3 shards:

- each step synced once; the names are the policy's ``named_parameters()`` (plain) or the base model's
  (LoRA: merged, adapters not sent), as TRL's own sync names them;
- the rollouts' log-probs (from the synced copy) equal the sharded policy's within 1e-4 at every step
  (TRL logs the largest difference): the generator got the policy's current weights;
- ``with_partita(RLOOTrainer)`` (plain policy) syncs through the same ``VLLMGeneration``: once per step,
  the policy's names;
- a sync after training hands out exactly what ``engine.save_16bit_model`` writes (plain) or
  ``peft_support.merged_state_dict`` gives (LoRA: ``merge_and_unload`` of the unsharded model), bit for
  bit, on every rank; the LoRA policy is left unmerged.
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")
pytest.importorskip("datasets")
os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402

from tests.harness import run_distributed  # noqa: E402
from tests.test_trl_trainers import (_build_assets, _common, _datasets, _length_reward, _losses,  # noqa: E402
                                     _partita_config, _wrap)


class _FakeSamplingParams:
    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs


class _FakeLLM:
    """The part of ``vllm.LLM`` TRL's colocated generation uses (see the module doc)."""

    def __init__(self, model: str, **kwargs) -> None:
        from transformers import AutoModelForCausalLM

        self.net = AutoModelForCausalLM.from_pretrained(model).eval()
        self.params = dict(self.net.named_parameters())
        self.syncs: list[list[tuple[str, torch.Tensor]]] = []
        self._open: list | None = None
        runner = SimpleNamespace(model=self)
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=SimpleNamespace(model_runner=runner)),
                                          model_config=SimpleNamespace(max_model_len=64))
        _FAKES.append(self)

    def load_weights(self, weights) -> None:
        if self._open is None:
            self._open = []
            self.syncs.append(self._open)
        for name, tensor in weights:
            target = self.params[name]  # KeyError: a name vLLM's model does not have
            assert tensor.shape == target.shape and tensor.dtype == target.dtype, (name, tensor.shape, target.shape)
            target.data.copy_(tensor)
            self._open.append((name, tensor.detach().clone()))

    def reset_prefix_cache(self) -> None:  # TRL's last call of a sync
        self._open = None

    @torch.no_grad()
    def generate(self, prompts, sampling_params, use_tqdm=False):
        max_tokens = sampling_params.kwargs["max_tokens"]
        outputs = []
        for prompt in prompts:
            ids = torch.tensor([prompt["prompt_token_ids"]])
            seq = self.net.generate(ids, do_sample=True, top_k=0, max_new_tokens=max_tokens, pad_token_id=0)
            completion = seq[0, ids.shape[1]:].tolist()
            logps = torch.log_softmax(self.net(seq).logits[0, ids.shape[1] - 1:-1].float(), dim=-1)
            per_token = [{tok: SimpleNamespace(logprob=float(logps[i, tok]), rank=1)} for i, tok in enumerate(completion)]
            outputs.append(SimpleNamespace(prompt_token_ids=prompt["prompt_token_ids"],
                                           outputs=[SimpleNamespace(token_ids=completion, logprobs=per_token)]))
        return outputs


_FAKES: list[_FakeLLM] = []


def _fake_vllm() -> None:
    import trl.generation.vllm_generation as vllm_generation

    vllm_generation.is_vllm_available = lambda: True
    vllm_generation.LLM = _FakeLLM
    vllm_generation.SamplingParams = _FakeSamplingParams


def _grpo(paths: dict, out: str, model, peft_config=None, *, rloo: bool = False):
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    cls, extra = _wrap(RLOOTrainer if rloo else GRPOTrainer, 3)
    if peft_config is not None:
        extra["peft_config"] = peft_config
    args = (RLOOConfig if rloo else GRPOConfig)(**_common(out, 2), max_steps=2, num_generations=2,
                                                max_completion_length=4, beta=0.1, use_vllm=True,
                                                vllm_mode="colocate")
    trainer = cls(model=model, reward_funcs=[_length_reward], args=args, train_dataset=_datasets()["grpo"],
                  processing_class=AutoTokenizer.from_pretrained(paths["tok"]), **extra)
    trainer.train()
    return trainer


def _summary(trainer, fake: _FakeLLM) -> dict:
    logs = trainer.state.log_history
    return {"losses": _losses(trainer), "steps": trainer.state.global_step, "syncs": len(fake.syncs),
            "names": [[n for n, _ in sync] for sync in fake.syncs],
            "logp_diff": [e["sampling/sampling_logp_difference/max"] for e in logs
                          if "sampling/sampling_logp_difference/max" in e],
            "changed": any(not torch.equal(a, b) for (_, a), (_, b) in zip(*fake.syncs[:2]))}


def _after_sync(trainer, fake: _FakeLLM) -> list[tuple[str, torch.Tensor]]:
    trainer.vllm_generation.sync_weights()  # every rank: the stream's gathers are collectives
    return fake.syncs[-1]


def _on_ranks(paths: dict, out: str) -> dict:
    import torch.distributed as dist
    from peft import LoraConfig
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from partita.integrations.hf import enable_zero3
    from partita.integrations.peft_support import merged_state_dict

    _fake_vllm()
    got: dict = {}
    trainer = _grpo(paths, os.path.join(out, "plain"), paths["lm"])
    fake = _FAKES[-1]
    got["plain"] = _summary(trainer, fake)
    got["plain"]["policy_names"] = [n for n, _ in trainer.model.named_parameters()]
    sent = _after_sync(trainer, fake)
    trainer.engine.save_16bit_model(os.path.join(out, "plain16"))
    saved = load_file(os.path.join(out, "plain16", "model.safetensors"))  # every rank reads rank 0's file
    got["plain"]["equal_saved"] = sorted(n for n, t in sent if torch.equal(t, saved[n])) == sorted(saved)

    # RLOO syncs through the same VLLMGeneration (it logs no log-prob difference).
    trainer = _grpo(paths, os.path.join(out, "rloo"), paths["lm"], rloo=True)
    fake = _FAKES[-1]
    got["rloo"] = _summary(trainer, fake)
    got["rloo"]["policy_names"] = [n for n, _ in trainer.model.named_parameters()]
    sent = _after_sync(trainer, fake)
    trainer.engine.save_16bit_model(os.path.join(out, "rloo16"))
    saved = load_file(os.path.join(out, "rloo16", "model.safetensors"))
    got["rloo"]["equal_saved"] = sorted(n for n, t in sent if torch.equal(t, saved[n])) == sorted(saved)

    with enable_zero3(_partita_config(3)):
        base = AutoModelForCausalLM.from_pretrained(paths["lm"])  # straight into shards
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    trainer = _grpo(paths, os.path.join(out, "lora"), base, peft_config=lora)
    fake = _FAKES[-1]
    got["lora"] = _summary(trainer, fake)
    got["lora"]["policy_names"] = list(fake.params)
    sent = _after_sync(trainer, fake)
    merged = merged_state_dict(trainer.engine)  # rank 0 only
    merged = [merged] if dist.get_rank() == 0 else [None]
    dist.broadcast_object_list(merged, src=0)
    got["lora"]["equal_merged"] = [n for n, t in sent if torch.equal(t, merged[0][n])] == list(fake.params)
    got["lora"]["unmerged"] = all(not getattr(m, "merged_adapters", []) for m in trainer.model.modules())
    return got


def test_grpo_use_vllm_syncs_partita_weights_at_zero3(tmp_path) -> None:
    paths = _build_assets(str(tmp_path))
    r0, r1 = run_distributed(_on_ranks, 2, paths, str(tmp_path / "partita"), timeout=400)
    for rank in (r0, r1):
        for key in ("plain", "lora"):
            got = rank[key]
            assert got["steps"] == 2 and len(got["losses"]) == 2 and all(math.isfinite(x) for x in got["losses"]), got
            assert got["syncs"] == 2 and got["changed"], (key, got["syncs"])  # one per step, the second trained
            assert all(names == got["policy_names"] for names in got["names"]), (key, got["names"][0])
            assert len(got["logp_diff"]) == 2 and max(got["logp_diff"]) < 1e-4, (key, got["logp_diff"])
        rloo = rank["rloo"]
        assert rloo["steps"] == 2 and all(math.isfinite(x) for x in rloo["losses"]) and rloo["equal_saved"], rloo
        assert rloo["syncs"] == 2 and rloo["changed"] and all(n == rloo["policy_names"] for n in rloo["names"])
        assert rank["plain"]["equal_saved"] and rank["lora"]["equal_merged"] and rank["lora"]["unmerged"], (
            rank["plain"]["equal_saved"], rank["lora"]["equal_merged"], rank["lora"]["unmerged"])
    assert not any("lora_" in n for n in r0["lora"]["policy_names"])


def test_use_vllm_with_a_trl_lacking_the_weight_read_is_refused() -> None:
    from partita.config import ConfigError
    from partita.integrations.trl_weight_sync import install_weight_sync

    trainer = SimpleNamespace(vllm_generation=SimpleNamespace())
    with pytest.raises(ConfigError, match=r"use_vllm=True: this TRL .* without VLLMGeneration._iter_named_params.*"
                                          r"set use_vllm=False"):
        install_weight_sync(trainer)
    install_weight_sync(SimpleNamespace())  # no vLLM: nothing to do


def test_weights_before_the_engine_exists_are_the_model_own(tmp_path) -> None:
    """Before train() builds the engine (an evaluate() first) the weights come from the model itself:
    a plain policy's parameters, or a LoRA policy's merge (peft's merge_and_unload of a copy), untouched."""
    import copy

    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from partita.integrations.trl_weight_sync import generator_weights

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True))
    sent = [(n, t.clone()) for n, t in generator_weights(SimpleNamespace(engine=None, model=model))]
    assert [n for n, _ in sent] == [n for n, _ in model.named_parameters()]  # the tied head once, as TRL sends it
    assert all(torch.equal(t, model.get_parameter(n)) for n, t in sent)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # B starts at zero: make the merge change the base weights
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    before = {k: v.clone() for k, v in peft_model.state_dict().items()}
    merged = dict(copy.deepcopy(peft_model).merge_and_unload().named_parameters())
    sent = [(n, t.clone()) for n, t in generator_weights(SimpleNamespace(engine=None, model=peft_model))]
    assert [n for n, _ in sent] == list(merged)
    assert all(torch.equal(t, merged[n]) for n, t in sent)
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], before[
        "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"])  # the merge changed it
    assert all(torch.equal(v, before[k]) for k, v in peft_model.state_dict().items())  # restored bit for bit
