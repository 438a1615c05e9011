"""Bridges to other training frameworks. Each submodule imports its framework only when
imported itself, so ``import partita`` never needs them:

- :mod:`partita.integrations.hf`: the Hugging Face ``Trainer`` under partita ZeRO
  (``PartitaTrainer``; needs ``transformers`` and ``accelerate``);
- :mod:`partita.integrations.hf_zero3`: transformers' own ZeRO-3 paths (``from_pretrained``
  into ``zero.Init`` shards, ``resize_token_embeddings``, ``generate(synced_gpus=...)``) on a
  partita ZeRO-3 model, switched on with ``enable_zero3(config)``, and ``save_pretrained`` of a
  ZeRO-3 model (needs ``transformers`` only).
"""
