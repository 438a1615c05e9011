"""Train with the Hugging Face ``Trainer`` (or any subclass) under partita ZeRO: :class:`PartitaTrainer`
and :func:`with_partita`.

transformers' own DeepSpeed path (``TrainingArguments(deepspeed=...)``) imports the
``deepspeed`` package itself (``transformers.integrations.deepspeed``, accelerate's
``DeepSpeedPlugin``), so ``import partita as deepspeed`` in a training script cannot redirect
it. ``PartitaTrainer`` is a ``Trainer`` that takes the same DeepSpeed-style config as
``partita_config=`` instead and hands the model to a partita engine:

    trainer = PartitaTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                             partita_config="ds_config.json")
    trainer.train()

What changes inside the Trainer (everything else, logging, callbacks, evaluation, data
loading and sharding across ranks, is the Trainer's own):

- the engine is built where the Trainer builds its optimizer, from the config with ``"auto"``
  filled from ``TrainingArguments`` (:func:`partita.integrations.hf_config.resolve_trainer_config`)
  and the Trainer's weight-decay param groups (biases and norms get none);
- each micro-batch runs ``engine(**inputs)``, ``engine.backward(loss)``, ``engine.step()``: the
  engine reduces gradients, clips, steps and schedules at the accumulation boundary, so the
  Trainer's own optimizer and scheduler objects are thin views that do nothing on ``step()``
  (the DeepSpeed integration works the same way). The Trainer's ``lr_scheduler_type`` schedule
  is built over partita's optimizer, unless the config has a ``scheduler`` section;
- the model is never wrapped in DDP and no autocast is added: the engine reduces gradients and
  the config's ``bf16``/``fp16`` section sets the precision;
- ``save_model`` gathers the whole weights (every ZeRO stage) and writes them with
  ``save_pretrained`` (``from_pretrained`` loads them); checkpoints add a partita checkpoint
  (``engine.save_checkpoint``) to the Trainer's checkpoint folder, and
  ``train(resume_from_checkpoint=...)`` resumes from it (weights, optimizer, scheduler, step).

Any ``Trainer`` subclass trains the same way through ``with_partita(TrainerClass)`` (TRL's
``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``, ``RLOOTrainer``, ``KTOTrainer``, ``RewardTrainer``; ``PartitaTrainer`` is
``with_partita(Trainer)``): the subclass's own methods run first and partita's replace the
Trainer's beneath them. Models the Trainer prepares for evaluation only
(``accelerator.prepare_model(m, evaluation_mode=True)``: TRL's reference and reward models) become
inference-only engines at ZeRO-3 and frozen copies on the device at stages 0-2
(:mod:`partita.integrations.trl_support`); generation (GRPO's rollouts) goes through
``engine.generate``, gathered once per call at ZeRO-3, or with ``use_vllm=True`` through vLLM, whose
weight sync then reads partita's weight stream (:mod:`partita.integrations.trl_weight_sync`);
``save_model`` of a PEFT model writes its adapters (:func:`partita.integrations.peft_support.save_adapters`).

A model built inside ``partita.zero.Init(config_dict_or_path=...)`` can be passed as is.
transformers' own ZeRO-3 utilities (``from_pretrained`` into shards, ``resize_token_embeddings``,
``generate`` with ``synced_gpus``) run on partita once :func:`enable_zero3` is on
(:mod:`partita.integrations.hf_zero3`, re-exported here with its :func:`save_pretrained`).
Limits: an epoch whose micro-batch count is not a multiple of ``gradient_accumulation_steps``
is refused at its last partial window (the engine steps only at full windows);
``num_items_in_batch`` token weighting across micro-batches is not used (each micro-batch's
loss is its own mean, as in DeepSpeed).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from transformers import Trainer
from transformers.optimization import get_scheduler

from partita.integrations.hf_config import resolve_trainer_config
from partita.integrations.hf_zero3 import HfZero3, enable_zero3, save_pretrained
from partita.zero.freed import is_freed

__all__ = ["HfZero3", "PartitaTrainer", "enable_zero3", "save_pretrained", "with_partita"]

logger = logging.getLogger("partita")

# The Trainer methods PartitaTrainer replaces (tested with transformers 5.24). Some are private:
# if a transformers release renames one, fail here instead of training with its default.
_REPLACED = ("create_optimizer", "create_scheduler", "training_step", "save_model", "_wrap_model",
             "_clip_grad_norm", "_get_grad_norm", "_move_model_to_device", "_save_optimizer_and_scheduler",
             "_load_optimizer_and_scheduler", "_load_from_checkpoint", "create_accelerator_and_postprocess")
_missing = [name for name in _REPLACED if not hasattr(Trainer, name)]
if _missing:
    import transformers

    raise ImportError(
        f"partita.integrations.hf needs a transformers Trainer with {', '.join(_missing)} (transformers "
        f"{transformers.__version__} lacks them); install transformers>=5.24"
    )


class PartitaTrainer(Trainer):
    """A ``transformers.Trainer`` whose model trains in a partita engine.

    Args:
        partita_config: the DeepSpeed-style config (dict or JSON path); ``"auto"`` values take
            the ``TrainingArguments``' ones.
        *args, **kwargs: ``Trainer``'s; ``optimizers=`` is refused (the config builds them) and
            so is ``TrainingArguments(deepspeed=...)``.
    """

    def __init__(self, *args: Any, partita_config: dict | str | os.PathLike | None = None, **kwargs: Any) -> None:
        # A with_partita(TrainerClass) subclass sets the config before TrainerClass.__init__ runs
        # (TRL's trainers build and prepare their reference models there) and calls this without it.
        if partita_config is not None or not hasattr(self, "_partita_config"):
            if partita_config is None:
                raise TypeError(f"{type(self).__name__}() needs partita_config= (a DeepSpeed-style config dict or "
                                "JSON path)")
            self._partita_config = partita_config
            self.engine = None
        _refuse_optimizers(type(self).__name__, kwargs.get("optimizers"))
        super().__init__(*args, **kwargs)
        if self.args.deepspeed:
            raise ValueError(
                "TrainingArguments(deepspeed=...) makes transformers import the deepspeed package itself; "
                f"pass the config to {type(self).__name__}(partita_config=...) and leave deepspeed unset"
            )

    # ------------------------------------------------------------------ models the Trainer only evaluates
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # TRL's trainers prepare their reference (and GRPO's reward) models with
        # accelerator.prepare_model(model, evaluation_mode=True) inside their __init__; with DeepSpeed
        # they build a DeepSpeed inference engine there instead. Answer that call with partita's
        # (partita/integrations/trl_support.py) before the model is moved whole onto the device.
        plain = self.accelerator.prepare_model

        def prepare_model(model: Any, device_placement: Any = None, evaluation_mode: bool = False, **kw: Any) -> Any:
            # The Trainer's own evaluation prepares the policy (self.model) this way too: that one stays.
            if evaluation_mode and isinstance(model, torch.nn.Module) and model is not getattr(self, "model", None):
                return self._prepare_frozen_model(model)
            return plain(model, device_placement=device_placement, evaluation_mode=evaluation_mode, **kw)

        self.accelerator.prepare_model = prepare_model

    def _prepare_frozen_model(self, model: torch.nn.Module) -> Any:
        from partita.integrations.trl_support import prepare_frozen_model

        # The batch sizes and precision are checked against the TrainingArguments now, not at train().
        config = resolve_trainer_config(self._partita_config, self.args, world_size=self.args.world_size, max_steps=1)
        return prepare_frozen_model(model, config, device=self.args.device,
                                    sync_ref_model=bool(getattr(self.args, "sync_ref_model", False)))

    def _move_model_to_device(self, model: Any, device: Any) -> None:
        # A model built under partita.zero.Init holds shards, not storage: Module.to would copy
        # from nothing (torch crashes on "cpu" -> "cpu:0"). It is on its device already, and
        # partita.initialize places every other model itself.
        if any(is_freed(p) for p in model.parameters()):
            return
        super()._move_model_to_device(model, device)

    # ------------------------------------------------------------------ the engine
    def create_optimizer(self, model: Any = None) -> Any:
        if self.engine is None:
            self.engine = self._build_engine()
        self.optimizer = _EngineOptimizer(self.engine)
        return self.optimizer

    def _build_engine(self) -> Any:
        import partita

        max_steps = self.state.max_steps
        config = resolve_trainer_config(self._partita_config, self.args, world_size=self.args.world_size,
                                        max_steps=max_steps)
        schedule = None
        if config.get("scheduler") is None:
            args = self.args

            def schedule(optimizer: torch.optim.Optimizer) -> Any:  # the Trainer's own schedule
                return get_scheduler(
                    args.lr_scheduler_type, optimizer=optimizer, num_warmup_steps=args.get_warmup_steps(max_steps),
                    num_training_steps=max_steps, scheduler_specific_kwargs=args.lr_scheduler_kwargs,
                )

        decay = set(self.get_decay_parameter_names(self.model))
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        engine, _, _, _ = partita.initialize(
            model=self.model, model_parameters=[g for g in groups if g["params"]], config=config,
            lr_scheduler=schedule,
        )
        return engine

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        if self.lr_scheduler is None:
            self.lr_scheduler = _EngineScheduler(self.engine)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        # Training goes through the engine (no DDP: it reduces gradients itself); evaluation runs
        # the model directly (ZeRO-3's hooks gather parameters for an eval forward too).
        if training and self.engine is not None:
            return self.engine
        return super()._wrap_model(model, training=training, dataloader=dataloader)

    # ------------------------------------------------------------------ one micro-batch
    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        engine = self.engine
        if self.accelerator.gradient_state.sync_gradients and not engine.is_gradient_accumulation_boundary():
            raise NotImplementedError(
                f"the Trainer ends an accumulation window after {engine.micro_steps % engine.gradient_accumulation_steps() + 1} "
                f"micro-batches, but gradient_accumulation_steps is {engine.gradient_accumulation_steps()} (the epoch's "
                "micro-batch count is not a multiple of it); partita steps only at full windows: pick a dataset size, "
                "batch size and accumulation that divide, or set dataloader_drop_last=True"
            )
        engine.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(engine, inputs)  # the micro-batch's mean; the engine divides by accumulation
        engine.backward(loss)
        boundary_lrs = engine.get_lr() if engine.is_gradient_accumulation_boundary() else None
        engine.step()
        if boundary_lrs is not None and isinstance(self.lr_scheduler, _EngineScheduler):
            self.lr_scheduler.hold(boundary_lrs)
        return loss.detach() / engine.gradient_accumulation_steps()

    def _clip_grad_norm(self, model: Any) -> float | None:
        return self.engine.get_global_grad_norm()  # the engine clipped at its step (config gradient_clipping)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> float | None:
        return self.engine.get_global_grad_norm()

    # ------------------------------------------------------------------ saving and resuming
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        from partita.zero.export import consolidated_16bit_state_dict

        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self.engine.finish_pending_step()
        if _is_peft_model(self.model) and self._save_adapters(output_dir):
            if self.args.push_to_hub and not _internal_call:
                self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
            return
        state = consolidated_16bit_state_dict(self.engine.module, self.engine.zero)  # every rank gathers
        self._save(output_dir, state_dict=state)  # the writing rank calls save_pretrained
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_adapters(self, output_dir: str) -> bool:
        """A PEFT model's adapters in PEFT's format (partita/integrations/peft_support.py), plus the
        tokenizer and arguments as ``Trainer._save`` writes them; False when that module is absent
        (then the whole gathered state goes through PeftModel.save_pretrained, which keeps the
        adapters' keys)."""
        try:
            from partita.integrations.peft_support import save_adapters
        except ImportError:
            return False
        save_adapters(self.model, output_dir, engine=self.engine)  # every rank: it gathers
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        return True

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self.engine.save_checkpoint(output_dir, tag=_TAG)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path, _ = self.engine.load_checkpoint(checkpoint, tag=_TAG)
        if path is None:
            raise FileNotFoundError(f"{checkpoint} holds no partita checkpoint (tag {_TAG!r}) to resume from")

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if os.path.isdir(os.path.join(resume_from_checkpoint, _TAG)):
            return  # the engine's load_checkpoint restores the weights with the optimizer state
        super()._load_from_checkpoint(resume_from_checkpoint, model)


# The partita checkpoint inside each Trainer checkpoint folder (checkpoint-<step>/partita/).
_TAG = "partita"

# Methods a subclass handed to with_partita must leave to partita: an override would train, clip,
# schedule or save outside the engine. (training_step and _load_optimizer_and_scheduler may be
# overridden when they call super(), as TRL's trainers do.)
_PARTITA_OWNS = ("create_optimizer", "create_scheduler", "_wrap_model", "_clip_grad_norm", "_get_grad_norm",
                 "_move_model_to_device", "save_model", "_save_optimizer_and_scheduler", "_load_from_checkpoint",
                 "create_accelerator_and_postprocess")
_SUBCLASSES: dict[type, type] = {}


def with_partita(trainer_class: type) -> type:
    """A subclass of ``trainer_class`` (``transformers.Trainer`` or any subclass: TRL's
    ``SFTTrainer``, ``DPOTrainer``, ``GRPOTrainer``, ``RewardTrainer``, your own) that trains
    through a partita engine, as :class:`PartitaTrainer` does; it takes ``partita_config=`` besides
    the class's own arguments. The same class gives the same subclass (cached), named
    ``"Partita" + trainer_class.__name__``.

    ``trainer_class``'s own methods run first (its ``compute_loss``, ``training_step``, logging,
    data handling); partita's replace the Trainer's underneath them. Models the class prepares
    for evaluation only (TRL's reference and reward models) become inference-only engines at
    ZeRO-3 (partita/integrations/trl_support.py).

    Raises:
        TypeError: ``trainer_class`` is not a Trainer subclass, or overrides a method partita
            must own (the message names it).
    """
    if trainer_class is Trainer or trainer_class is PartitaTrainer:
        return PartitaTrainer
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise TypeError(f"with_partita expects a transformers.Trainer subclass, got {trainer_class!r}")
    cached = _SUBCLASSES.get(trainer_class)
    if cached is not None:
        return cached
    if issubclass(trainer_class, PartitaTrainer):
        return trainer_class  # already trains through partita
    for klass in trainer_class.__mro__[: trainer_class.__mro__.index(Trainer)]:
        owned = sorted(set(vars(klass)) & set(_PARTITA_OWNS))
        if owned:
            raise TypeError(
                f"with_partita({trainer_class.__name__}): {klass.__name__} overrides {', '.join(owned)}, which partita "
                "replaces to train through its engine (building the optimizer, wrapping, clipping, saving); move that "
                "logic elsewhere (a callback, compute_loss, or training_step calling super())"
            )

    def __init__(self: Any, *args: Any, partita_config: dict | str | os.PathLike, **kwargs: Any) -> None:
        _refuse_optimizers(type(self).__name__, kwargs.get("optimizers"))
        self._partita_config = partita_config  # read by PartitaTrainer, also inside trainer_class.__init__
        self.engine = None
        trainer_class.__init__(self, *args, **kwargs)
        from partita.integrations.trl_support import unwrap_reward_models
        from partita.integrations.trl_weight_sync import install_weight_sync

        unwrap_reward_models(self)  # GRPO/RLOO call a reward model only if it is an nn.Module
        install_weight_sync(self)  # use_vllm=True: vLLM gets whole weights from partita, not ZeRO-3 shards

    name = f"Partita{trainer_class.__name__}"
    # Method order: trainer_class's overrides, then PartitaTrainer's, then Trainer's (C3 places
    # PartitaTrainer right above Trainer, below every class of trainer_class's own hierarchy).
    subclass = type(name, (trainer_class, PartitaTrainer), {
        "__init__": __init__, "__module__": __name__, "__qualname__": name,
        "__doc__": f"``{trainer_class.__module__}.{trainer_class.__qualname__}`` training through a partita engine "
                   "(partita.integrations.hf.with_partita); takes partita_config= besides its own arguments.",
    })
    __init__.__qualname__ = f"{name}.__init__"
    _SUBCLASSES[trainer_class] = subclass
    return subclass


def _refuse_optimizers(name: str, optimizers: Any) -> None:
    if optimizers is not None and any(o is not None for o in optimizers):
        raise ValueError(
            f"{name} builds the optimizer and scheduler from partita_config; drop optimizers=(...) "
            "and describe them in the config's \"optimizer\"/\"scheduler\" sections (or the TrainingArguments)"
        )


def _is_peft_model(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


class _EngineOptimizer:
    """The Trainer's view of partita's optimizer: the engine steps inside ``training_step``, so
    the Trainer's ``optimizer.step()``/``zero_grad()`` do nothing; ``param_groups`` are live."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    @property
    def param_groups(self) -> list[dict]:
        return self._engine.optimizer.param_groups

    def step(self, closure: Any = None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


class _EngineScheduler:
    """The Trainer's view of the schedule the engine steps at each applied update.

    The engine steps its schedule inside ``engine.step()``, before the Trainer's loop reads
    ``get_last_lr()`` for the step's log ("get learning rate before update") and calls ``step()``.
    So ``training_step`` holds the rates the update used (:meth:`hold`) and this view answers them
    until the Trainer's ``step()``, as a plain Trainer's scheduler would; then the engine's current ones."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._held: list[float] | None = None

    def hold(self, lrs: list[float]) -> None:
        self._held = list(lrs)

    def step(self, *args: Any, **kwargs: Any) -> None:
        self._held = None

    def get_last_lr(self) -> list[float]:
        return list(self._held) if self._held is not None else self._engine.get_lr()
