"""DeepSpeed's training-loop schedules that reach the model through ``forward``'s keyword arguments.

- :mod:`.progressive_layer_drop`: progressive layer dropping (``"progressive_layer_drop"``), the
  keep probability theta(t) passed as ``progressive_layer_drop=True, pld_theta=<theta>``.
- :mod:`.curriculum`: the legacy curriculum learning (top-level ``"curriculum_learning"``), its
  difficulty passed as ``curriculum_seqlen=<difficulty>`` for ``curriculum_type`` "seqlen".
- :mod:`.forward_kwargs`: the one object the engine asks for those keyword arguments each forward.

DeepSpeed 0.19 removed both features (0.19.8 refuses the config blocks); partita keeps them with
the semantics of DeepSpeed 0.18.9, the last release that had them. The DeepSpeed import paths
(``deepspeed.runtime.progressive_layer_drop``, ``deepspeed.runtime.data_pipeline.curriculum_scheduler``)
re-export these classes.
"""
