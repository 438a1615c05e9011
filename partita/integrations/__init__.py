"""Bridges to other training frameworks. Each submodule imports its framework only when
imported itself, so ``import partita`` never needs them:

- :mod:`partita.integrations.hf`: any Hugging Face ``Trainer`` subclass under partita ZeRO,
  ``with_partita(TrainerClass)`` (``PartitaTrainer`` is ``with_partita(Trainer)``; needs
  ``transformers`` and ``accelerate``);
- :mod:`partita.integrations.trl_support`: what TRL's trainers (SFT, DPO, GRPO, Reward) need beyond
  a Trainer: reference and reward models as inference-only engines, rollouts from the ZeRO-3 policy;
- :mod:`partita.integrations.peft_support`: PEFT adapters under every ZeRO stage (whole, non-empty
  adapter saves in PEFT's format, merges);
- :mod:`partita.integrations.hf_zero3`: transformers' own ZeRO-3 paths (``from_pretrained``
  into ``zero.Init`` shards, ``resize_token_embeddings``, ``generate(synced_gpus=...)``) on a
  partita ZeRO-3 model, switched on with ``enable_zero3(config)``, and ``save_pretrained`` of a
  ZeRO-3 model (needs ``transformers`` only).
"""
