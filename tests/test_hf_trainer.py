"""The Hugging Face Trainer under partita ZeRO (partita.integrations.hf.PartitaTrainer).

A GPT-2 built from a small config inside ``partita.zero.Init`` trains with ``PartitaTrainer``
on 2 gloo ranks at ZeRO-3: the Trainer's logged loss per step and the weights it saves with
``save_model`` (read back with ``from_pretrained``) equal a plain-torch loop on the same global
batches (AdamW, the Trainer's weight-decay groups, linear schedule, clipping), and the loss
falls; ``train(resume_from_checkpoint=...)`` from the step-2 checkpoint repeats steps 3-4
exactly. The config's ``"auto"`` values come from the TrainingArguments; disagreements are errors.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
os.environ["HF_HUB_OFFLINE"] = "1"

import torch  # noqa: E402

from tests.harness import run_distributed  # noqa: E402

SEQ, SAMPLES, MICRO, EPOCHS, LR, WD = 16, 8, 2, 2, 5e-3, 0.01
# Adam's eps well above the rounding noise of gradients that are zero in exact arithmetic (the
# key bias of attention): with 1e-8, Adam turns that noise into full-size steps of either sign.
EPS = 1e-6
CONFIG = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "steps_per_print": 1000,
}


def _gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=96, n_positions=SEQ, resid_pdrop=0.0,
                      embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def _dataset() -> list[dict]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (SAMPLES, SEQ), generator=gen)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _training_args(out_dir: str, **kw):
    from transformers import TrainingArguments

    settings = dict(
        output_dir=out_dir, per_device_train_batch_size=MICRO, num_train_epochs=EPOCHS, learning_rate=LR,
        weight_decay=WD, max_grad_norm=1.0, adam_epsilon=EPS, logging_steps=1, save_strategy="no", report_to=[], seed=0,
        use_cpu=True, disable_tqdm=True,
    )
    return TrainingArguments(**{**settings, **kw})


class _RecordingCollator:
    """Stacks samples and remembers each micro-batch, so the test knows the Trainer's data order."""

    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []

    def __call__(self, samples: list[dict]) -> dict:
        batch = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
        self.batches.append(batch["input_ids"].clone())
        return batch


def _train_with_partita(out_dir: str) -> dict:
    import torch.distributed as dist
    from transformers import GPT2LMHeadModel

    import partita.zero
    from partita.integrations.hf import PartitaTrainer

    args = _training_args(out_dir, save_strategy="steps", save_steps=2)
    torch.manual_seed(0)
    with partita.zero.Init(config_dict_or_path={"zero_optimization": CONFIG["zero_optimization"]}):
        model = GPT2LMHeadModel(_gpt2_config())
    collator = _RecordingCollator()
    trainer = PartitaTrainer(model=model, args=args, train_dataset=_dataset(), data_collator=collator,
                             partita_config=CONFIG)
    trainer.train()
    trainer.save_model(os.path.join(out_dir, "final"))
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    lrs = [entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry]
    norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    # Resume a fresh model from the checkpoint after step 2 and train the rest again.
    torch.manual_seed(1)  # other initial weights: the checkpoint must bring the trained ones
    again = PartitaTrainer(model=GPT2LMHeadModel(_gpt2_config()), args=_training_args(os.path.join(out_dir, "again")),
                           train_dataset=_dataset(), data_collator=_RecordingCollator(), partita_config=CONFIG)
    again.train(resume_from_checkpoint=os.path.join(out_dir, "checkpoint-2"))
    again.save_model(os.path.join(out_dir, "resumed"))
    resumed = [entry["loss"] for entry in again.state.log_history if "loss" in entry]
    return {"rank": dist.get_rank(), "losses": losses, "lrs": lrs, "norms": norms, "batches": collator.batches,
            "resumed_losses": resumed, "resumed_step": again.state.global_step,
            "saved": sorted(os.listdir(os.path.join(out_dir, "checkpoint-2")))}


def _plain_torch(global_batches: list[torch.Tensor]) -> tuple[list[float], list[float], dict]:
    """The same training as a plain loop: one process, the global batch, torch's AdamW."""
    from transformers import GPT2LMHeadModel, Trainer
    from transformers.optimization import get_scheduler

    torch.manual_seed(0)
    model = GPT2LMHeadModel(_gpt2_config())
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = list(model.named_parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for n, p in named if n in decay], "weight_decay": WD},
         {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}], lr=LR, eps=EPS)
    scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=0,
                              num_training_steps=len(global_batches))
    losses, norms = [], []
    for ids in global_batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses, norms, {n: t.detach().clone() for n, t in model.state_dict().items()}


def test_partita_trainer_zero3_matches_a_plain_torch_loop(tmp_path) -> None:
    from transformers import GPT2LMHeadModel

    ranks = run_distributed(_train_with_partita, 2, str(tmp_path), timeout=300)
    r0, r1 = ranks
    steps = SAMPLES // (2 * MICRO) * EPOCHS
    assert len(r0["losses"]) == steps and r0["losses"] == r1["losses"]
    # Each step's global batch: rank 0's micro-batch then rank 1's (the Trainer's sharding).
    assert len(r0["batches"]) == len(r1["batches"]) == steps
    global_batches = [torch.cat([a, b]) for a, b in zip(r0["batches"], r1["batches"])]
    assert sorted(map(tuple, torch.cat(global_batches[:2]).tolist())) == sorted(
        map(tuple, torch.stack([s["input_ids"] for s in _dataset()]).tolist()))  # an epoch sees every sample once
    ref_losses, ref_norms, ref_weights = _plain_torch(global_batches)
    for got, want in zip(r0["losses"], ref_losses):
        assert abs(got - want) < 1e-5 * abs(want), (r0["losses"], ref_losses)
    for got, want in zip(r0["norms"], ref_norms):
        assert abs(got - want) < 1e-4 * abs(want), (r0["norms"], ref_norms)
    assert r0["losses"][-1] < r0["losses"][0] - 0.05  # it learns
    # The Trainer's linear schedule: each log has the rate its update used, as the plain Trainer logs it.
    assert r0["lrs"][:2] == pytest.approx([LR, LR * (steps - 1) / steps]), r0["lrs"]
    saved = GPT2LMHeadModel.from_pretrained(str(tmp_path / "final"))
    for name, tensor in saved.state_dict().items():
        want = ref_weights[name]
        assert float((tensor - want).norm()) <= 1e-5 * float(want.norm()) + 1e-7, name
    # train(resume_from_checkpoint=) continues exactly: the same last two losses and weights.
    assert {"partita", "latest", "model.safetensors", "trainer_state.json"} <= set(r0["saved"]), r0["saved"]
    assert r0["resumed_step"] == steps and r0["resumed_losses"] == r0["losses"]  # steps 1-2 come from the saved state
    resumed = GPT2LMHeadModel.from_pretrained(str(tmp_path / "resumed"))
    for name, tensor in resumed.state_dict().items():
        assert torch.equal(tensor, saved.state_dict()[name]), name


def test_trainer_config_fills_auto_and_refuses_disagreements(tmp_path) -> None:
    from partita.integrations.hf_config import resolve_trainer_config

    args = _training_args(str(tmp_path), gradient_accumulation_steps=2, bf16=False)
    cfg = resolve_trainer_config(CONFIG, args, world_size=2, max_steps=10)
    assert cfg["train_micro_batch_size_per_gpu"] == MICRO and cfg["gradient_accumulation_steps"] == 2
    assert cfg["train_batch_size"] == MICRO * 2 * 2 and cfg["gradient_clipping"] == 1.0
    assert cfg["optimizer"]["params"] == {"lr": LR, "betas": [0.9, 0.999], "eps": EPS, "weight_decay": WD}
    assert CONFIG["optimizer"]["params"]["lr"] == "auto"  # the caller's dict is not modified
    no_optimizer = {k: v for k, v in CONFIG.items() if k != "optimizer"}
    assert resolve_trainer_config(no_optimizer, args, world_size=1, max_steps=10)["optimizer"] == {
        "type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": EPS, "weight_decay": WD}}
    warm = {**CONFIG, "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_max_lr": "auto", "warmup_num_steps": "auto", "total_num_steps": "auto"}}}
    sched = resolve_trainer_config(warm, _training_args(str(tmp_path), warmup_steps=0.3), world_size=1,
                                   max_steps=10)["scheduler"]["params"]
    assert sched == {"warmup_max_lr": LR, "warmup_num_steps": 3, "total_num_steps": 10}
    with pytest.raises(ValueError, match=r"train_micro_batch_size_per_gpu=8 disagrees with TrainingArguments "
                                         r"\(per_device_train_batch_size gives 2\)"):
        resolve_trainer_config({**CONFIG, "train_micro_batch_size_per_gpu": 8}, args, world_size=2, max_steps=10)
    with pytest.raises(ValueError, match=r"optimizer.params.lr=0.1 disagrees"):
        resolve_trainer_config({**CONFIG, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, args,
                               world_size=2, max_steps=10)
    with pytest.raises(NotImplementedError, match=r"TrainingArguments\(optim='sgd'\) has no partita equivalent"):
        resolve_trainer_config(no_optimizer, _training_args(str(tmp_path), optim="sgd"), world_size=1, max_steps=1)


def test_partita_trainer_refuses_optimizers_given_to_it(tmp_path) -> None:
    from transformers import GPT2LMHeadModel

    from partita.integrations.hf import PartitaTrainer

    model = GPT2LMHeadModel(_gpt2_config())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"PartitaTrainer builds the optimizer and scheduler from partita_config"):
        PartitaTrainer(model=model, args=_training_args(str(tmp_path)), partita_config=CONFIG, optimizers=(opt, None))
