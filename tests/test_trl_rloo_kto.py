"""TRL's RLOOTrainer and KTOTrainer through partita (partita.integrations.hf.with_partita).

The assets (tiny Llama, WordLevel tokenizer, datasets) are tests/test_trl_trainers.py's. On 2 gloo
ranks at ZeRO-3 with a per-device batch of 2:

- ``with_partita(RLOOTrainer)`` (beta > 0: a reference engine) trains 2 steps, no hang, finite losses,
  rollouts generated from the sharded policy in a gathered-once session, the reference an
  inference-only engine;
- ``with_partita(KTOTrainer)`` with ``loss_type="apo_zero_unpaired"`` logs plain TRL's losses and
  learning rates (one process, batch 4: the same global batch) within 1e-5; the reference is an
  inference-only engine. With the default ``loss_type="kto"`` the KL estimate pairs each completion
  with another prompt *of the same per-device batch* (TRL rotates completions by one inside each
  batch of ``per_device_train_batch_size``), so 2 ranks of 2 and one process of 4 estimate it from
  different pairs and their losses differ by design after step 1; there the test checks step 1
  (policy == reference: every loss is 1 - sigmoid(0) = 0.5, the KL clamped at 0) and a finite step 2.

The logged learning rate is the one the step's update used, as the plain Trainer logs it (partita's
engine steps its schedule inside ``engine.step()``, before the Trainer reads it).
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
from tests.test_trl_trainers import _build_assets, _common, _datasets, _length_reward, _losses, _words, _wrap  # noqa: E402


def _rloo(paths: dict, out: str, stage: int | None):
    from transformers import AutoTokenizer
    from trl import RLOOConfig, RLOOTrainer

    cls, extra = _wrap(RLOOTrainer, stage)
    args = RLOOConfig(**_common(out, 2), max_steps=2, num_generations=2, max_completion_length=4, beta=0.1)
    tok = AutoTokenizer.from_pretrained(paths["tok"])
    trainer = cls(model=paths["lm"], reward_funcs=[_length_reward], args=args, train_dataset=_datasets()["grpo"],
                  processing_class=tok, **extra)
    trainer.train()
    return trainer


def _kto_dataset():
    from datasets import Dataset

    # Unpaired: a prompt, one completion, desirable or not (two of each: KTO's weights stay 1).
    return Dataset.from_list([{"prompt": _words(70 + i, 4), "completion": " " + _words(80 + i, 5),
                               "label": i % 2 == 0} for i in range(4)])


def _kto(paths: dict, out: str, batch: int, stage: int | None, loss_type: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    cls, extra = _wrap(KTOTrainer, stage)
    args = KTOConfig(**_common(out, batch), num_train_epochs=2, max_length=32, beta=0.1, loss_type=loss_type)
    trainer = cls(model=AutoModelForCausalLM.from_pretrained(paths["lm"]), args=args, train_dataset=_kto_dataset(),
                  processing_class=AutoTokenizer.from_pretrained(paths["tok"]), **extra)
    trainer.train()
    return trainer


def _lrs(trainer) -> list[float]:
    return [entry["learning_rate"] for entry in trainer.state.log_history if "loss" in entry]


def _on_ranks(paths: dict, out: str) -> dict:
    from partita.zero.freed import is_freed

    got: dict = {}
    rloo = _rloo(paths, os.path.join(out, "rloo"), 3)
    got["rloo"] = {"losses": _losses(rloo), "steps": rloo.state.global_step, "mode": rloo.engine.generation_mode,
                   "ref": type(rloo.ref_model).__name__,
                   "policy_sharded": all(is_freed(p) for p in rloo.model.parameters())}
    for loss_type in ("apo_zero_unpaired", "kto"):
        kto = _kto(paths, os.path.join(out, loss_type), 2, 3, loss_type)
        got[loss_type] = {"losses": _losses(kto), "lrs": _lrs(kto), "ref": type(kto.ref_model).__name__,
                          "kl": [entry["kl"] for entry in kto.state.log_history if "kl" in entry]}
    return got


def test_rloo_and_kto_through_partita_at_zero3(tmp_path) -> None:
    paths = _build_assets(str(tmp_path))
    r0, r1 = run_distributed(_on_ranks, 2, paths, str(tmp_path / "partita"), timeout=400)
    assert r0 == r1  # the Trainer logs the mean over ranks
    rloo = r0["rloo"]
    assert rloo["steps"] == 2 and len(rloo["losses"]) == 2 and all(math.isfinite(x) for x in rloo["losses"]), rloo
    assert rloo["mode"] == "gather_once" and rloo["ref"] == "ZeroInferenceEngine" and rloo["policy_sharded"], rloo

    plain = _kto(paths, str(tmp_path / "plain_kto"), 4, None, "apo_zero_unpaired")
    want_losses, want_lrs = _losses(plain), _lrs(plain)
    got = r0["apo_zero_unpaired"]
    assert len(want_losses) == 2 and len(got["losses"]) == 2, (got, want_losses)
    for ours, theirs in zip(got["losses"], want_losses):
        assert abs(ours - theirs) <= 1e-5 * abs(theirs) + 1e-6, (got["losses"], want_losses)
    assert got["lrs"] == pytest.approx(want_lrs, rel=1e-9) and want_lrs[0] == pytest.approx(5e-3), (got, want_lrs)
    assert got["ref"] == "ZeroInferenceEngine"
    kto = r0["kto"]
    assert kto["losses"][0] == pytest.approx(0.5, abs=1e-6) and kto["kl"][0] == 0.0, kto
    assert math.isfinite(kto["losses"][1]) and kto["losses"][1] < 0.5 and kto["ref"] == "ZeroInferenceEngine", kto
    assert torch.isfinite(torch.tensor(kto["kl"])).all()
