"""Autotuning: ``partita tune`` runs short trials of a training script over micro-batch size x
ZeRO stage x activation checkpointing x optimizer offload and keeps the fastest that fits.

- :mod:`partita.autotune.config`: the ``autotuning`` section (DeepSpeed's keys);
- :mod:`partita.autotune.space`: the trials and each trial's config override;
- :mod:`partita.autotune.trial_env`: the hooks that make a script a trial (kept import-light:
  ``initialize`` and the step logger import it);
- :mod:`partita.autotune.runner`: one trial as a separate ``partita run`` launch;
- :mod:`partita.autotune.tuner`: pruning by the memory estimate, ordering, early stopping,
  the CSV and the best config; :mod:`partita.autotune.cli`: the command.
"""
