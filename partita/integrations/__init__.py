"""Bridges to other training frameworks. Each submodule imports its framework only when
imported itself, so ``import partita`` never needs them:

- :mod:`partita.integrations.hf`: the Hugging Face ``Trainer`` under partita ZeRO
  (``PartitaTrainer``; needs ``transformers`` and ``accelerate``).
"""
